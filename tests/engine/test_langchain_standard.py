"""LangChain's own standard tests for chat models (`langchain-tests`' ChatModelIntegrationTests)
against a plain `ChatOpenAI` on our gateway, serving the embedded SmolLM2-135M: a change that
breaks LangChain users fails here.

Capabilities are declared as an OpenAI-compatible text endpoint has them: tool calling with
`tool_choice` (the gateway enforces forced calls), structured output and JSON mode (vLLM's
guided decoding), usage metadata; no images, audio or PDFs. Tests that fail only because a
135M model does not give the answer the test expects are marked xfail with that reason; a
failure of the protocol is a bug to fix, never an xfail.
"""

from __future__ import annotations

from typing import Any

import pytest

from art_core import TrainableModel

pytest.importorskip("langchain_tests")

from langchain_openai import ChatOpenAI  # noqa: E402
from langchain_tests.integration_tests import ChatModelIntegrationTests  # noqa: E402

pytestmark = pytest.mark.engine

ENDPOINT: dict[str, str] = {}
# Slow with a 135M model and covered by faster tests, so `nightly` (tests/conftest.py marks
# them: overriding a standard test is only allowed for an xfail): a free answer that runs to
# max_tokens (~30 s; test_invoke and the message-history tests send the same requests), and a
# pydantic.v1 schema made a forced tool call (~60 s; test_tool_choice and the pydantic v2
# structured-output tests cover that path), and the async twins of the structured-output and
# tool-calling tests (~10 s each: the gateway gets the same requests as from their sync
# twins; LangChain's async client is covered by test_ainvoke, test_astream and test_abatch).
# Also nightly, each ~5-9 s and the same request to the gateway as a test that stays: the
# pydantic and TypedDict schemas of structured output (LangChain sends each as the JSON
# schema test_structured_output[json_schema] sends), tool calling in LangChain's v1 output
# format (a client-side rendering of test_tool_calling[model0]'s answer), a runnable bound as a
# tool and few-shot tool-call examples (forced calls, as test_tool_choice, after a tool
# history, as test_tool_message_histories_*)
NIGHTLY = ("test_conversation", "test_structured_output_pydantic_2_v1",
           "test_structured_output_async", "test_tool_calling_async",
           "test_structured_output[pydantic]", "test_structured_output[typeddict]",
           "test_tool_calling[model1]", "test_bind_runnables_as_tools",
           "test_structured_few_shot_examples")
MODEL_ANSWER = "the 135M model's answer, not the protocol: it does not follow the instruction"


@pytest.fixture(scope="module", autouse=True)
async def served(backend, smollm2_path) -> TrainableModel:
    model = TrainableModel(name="lc-standard", project="langchain")
    await model.register(backend)
    ENDPOINT.update(base_url=model.base_url or "", name=model.name)
    return model


class TestChatOpenAIOnTheGateway(ChatModelIntegrationTests):
    @property
    def chat_model_class(self) -> type[ChatOpenAI]:
        return ChatOpenAI

    @property
    def chat_model_params(self) -> dict[str, Any]:
        # stream_usage: ChatOpenAI asks for usage in streams only from api.openai.com unless
        # told; max_tokens 256: room for a structured answer's strings (capped by the grammar)
        return {"model": ENDPOINT["name"], "base_url": ENDPOINT["base_url"], "api_key": "none",
                "temperature": 0.0, "max_tokens": 256, "timeout": 300, "max_retries": 0,
                "stream_usage": True}

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def has_structured_output(self) -> bool:
        return True

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def supports_image_inputs(self) -> bool:
        return False

    @property
    def supports_image_tool_message(self) -> bool:
        return False

    @property
    def supports_anthropic_inputs(self) -> bool:
        return False

    @property
    def returns_usage_metadata(self) -> bool:
        return True

    @pytest.mark.nightly  # each runs to max_tokens: ~40 s for a known model failure
    @pytest.mark.xfail(reason=MODEL_ANSWER + " (it answers without calling the tool it is "
                       "offered unforced)", strict=False)
    @pytest.mark.parametrize("model", [{}, {"output_version": "v1"}], indirect=True)
    def test_agent_loop(self, model: Any) -> None:
        super().test_agent_loop(model)

    @pytest.mark.nightly  # each runs to max_tokens: ~40 s for a known model failure
    @pytest.mark.xfail(reason=MODEL_ANSWER + " (it fills a JSON string until max_tokens, so "
                       "the JSON never closes)", strict=False)
    def test_json_mode(self, model: Any) -> None:
        super().test_json_mode(model)

    @pytest.mark.nightly  # each runs to max_tokens: ~40 s for a known model failure
    @pytest.mark.xfail(reason=MODEL_ANSWER + " (it fills a JSON string until max_tokens, so "
                       "the JSON never closes)", strict=False)
    def test_structured_output_optional_param(self, model: Any) -> None:
        super().test_structured_output_optional_param(model)

    @property
    def supported_usage_metadata_details(self) -> dict[str, list[str]]:
        return {"invoke": [], "stream": []}  # no cached or reasoning token counts from vLLM
