"""`init_chat_model(model)`: a LangChain chat model pointed at a model our backend serves."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from art_core.model import Model

if TYPE_CHECKING:
    from langchain_openai import ChatOpenAI

RL_DEFAULTS: dict[str, Any] = {
    # Sample from the model's own distribution: GRPO's importance ratios assume the rollout
    # policy is the model, so no temperature or nucleus reshaping by default.
    "temperature": 1.0,
    "top_p": 1.0,
    # Usage survives streaming only when asked for (FIELD-NOTES, langchain pitfalls).
    "stream_usage": True,
    # Chat Completions, always: a model name containing "codex" would switch ChatOpenAI to
    # the Responses API, which our gateway does not record.
    "use_responses_api": False,
    # A retried request is a second sample; the gateway already waits while training runs.
    "max_retries": 2,
    "timeout": 600.0,
}


def init_chat_model(model: Model, **kwargs: Any) -> ChatOpenAI:
    """A `ChatOpenAI` for `model` (registered with a backend): its gateway URL and key, and the
    name that always follows the latest step (`"name@3"` in `model=` pins one). `kwargs` override
    the RL defaults (`RL_DEFAULTS`) and pass through to ChatOpenAI.
    """
    from langchain_openai import ChatOpenAI

    if model.base_url is None:
        raise RuntimeError(f"model {model.name!r} has no endpoint yet: "
                           "await model.register(backend) first")
    options = {**RL_DEFAULTS, **kwargs}
    options.setdefault("model", model.name)
    return ChatOpenAI(base_url=model.base_url, api_key=model.api_key or "none", **options)
