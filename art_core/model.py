"""`Model` (any OpenAI-compatible endpoint) and `TrainableModel` (a LoRA we train on a base).

A `TrainableModel` is registered with a backend (`LocalBackend` or `RemoteBackend`), which fills
in the endpoint; from then on `model.openai_client()` talks to the gateway, where the name
`"<name>"` always means the latest checkpoint and `"<name>@<step>"` pins one.
"""

from __future__ import annotations

import asyncio
import re
import weakref
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator

from art_core.config import ModelConfig

if TYPE_CHECKING:
    from pathlib import Path

    from openai import AsyncOpenAI

    from art_core.config import SFTConfig, TrainConfig
    from art_core.trajectory import Trajectory, TrajectoryGroup

_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")
DEFAULT_BASE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"

# API keys of the endpoints models were registered with in this process, by base URL, so that a
# recorder which only sees a client's URL (zero-change capture) can read the gateway's ledger.
_ENDPOINT_KEYS: dict[str, str | None] = {}
_CLIENTS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple[Any, ...], Any]] = \
    weakref.WeakKeyDictionary()
"""`Model.openai_client`'s clients, per event loop (a client is bound to the loop it runs in)."""


def endpoint_api_key(base_url: str) -> str | None:
    """The API key for `base_url`: a registered model's key for that URL, else $ART_API_KEY."""
    import os

    key = _ENDPOINT_KEYS.get(base_url.rstrip("/"))
    return key if key is not None else os.environ.get("ART_API_KEY") or None


def validate_name(value: str, what: str = "name") -> str:
    """Check a name that becomes a path component: letters, digits, '-', '_', '.'; not '..'."""
    if not isinstance(value, str) or not _NAME.fullmatch(value) or set(value) == {"."}:
        raise ValueError(
            f"invalid {what} {value!r}: use 1-128 letters, digits, '-', '_' or '.', "
            "with no path separators and not only dots"
        )
    return value


class Endpoint(BaseModel):
    """Where a registered model is served (OpenAI-compatible)."""

    base_url: str
    api_key: str | None = None


class TrainResult(BaseModel):
    """What one training step produced."""

    step: int = Field(description="The new checkpoint step, now served under the model's name.")
    metrics: dict[str, float] = Field(default_factory=dict)


class Backend(Protocol):
    """What `LocalBackend` and `RemoteBackend` both implement, so user code switches between
    them in one line."""

    async def register(self, model: TrainableModel) -> Endpoint: ...

    async def get_step(self, model: TrainableModel) -> int: ...

    async def train(self, model: TrainableModel, groups: list[TrajectoryGroup],
                    config: TrainConfig | None = None, *, request_id: str | None = None,
                    keep_serving: bool | None = None) -> TrainResult: ...

    async def train_sft(self, model: TrainableModel,
                        data: list[Trajectory | TrajectoryGroup] | str | Path,
                        config: SFTConfig | None = None, *,
                        request_id: str | None = None) -> TrainResult: ...

    async def log(self, model: TrainableModel, groups: list[TrajectoryGroup],
                  split: str = "val") -> None: ...

    async def delete_checkpoints(self, model: TrainableModel,
                                 best_checkpoint_metric: str = "reward_mean") -> list[int]: ...

    async def close(self) -> None: ...


class Model(BaseModel):
    """Any model behind an OpenAI-compatible endpoint (used for inference only)."""

    model_config = ConfigDict(extra="forbid")

    name: str
    base_url: str | None = None
    api_key: str | None = None

    def openai_client(self, **kwargs: Any) -> AsyncOpenAI:
        """An `AsyncOpenAI` client for this model's endpoint: one per event loop, endpoint and
        settings, reused (a new client builds an SSL context and a connection pool, 20-200 ms;
        rollouts ask for one per call). Closing it is allowed: the next call makes a new one."""
        from openai import AsyncOpenAI

        if self.base_url is None:
            raise RuntimeError(
                f"model {self.name!r} has no endpoint yet: await model.register(backend) first"
            )
        kwargs.setdefault("timeout", 600.0)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop yet: the client binds to the one it is first used in
            return AsyncOpenAI(base_url=self.base_url, api_key=self.api_key or "none", **kwargs)
        clients = _CLIENTS.setdefault(loop, {})
        key = (self.base_url, self.api_key, repr(sorted(kwargs.items())))
        client = clients.get(key)
        if client is None or client.is_closed():
            client = clients[key] = AsyncOpenAI(base_url=self.base_url,
                                                api_key=self.api_key or "none", **kwargs)
        return client


class TrainableModel(Model):
    """A LoRA adapter trained with GRPO on `base_model`; stored under `<path>/<project>/models/<name>/`."""

    # name and project become path components: validate them on assignment too, not only at init
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    project: str = "default"
    base_model: str = Field(
        default=DEFAULT_BASE_MODEL,
        description="Hugging Face id or local directory; the default is the embedded SmolLM2-135M.",
    )
    config: ModelConfig = Field(default_factory=ModelConfig)

    _backend: Backend | None = PrivateAttr(default=None)

    @field_validator("name")
    @classmethod
    def _valid_name(cls, v: str) -> str:
        return validate_name(v, "model name")

    @field_validator("project")
    @classmethod
    def _valid_project(cls, v: str) -> str:
        return validate_name(v, "project name")

    @property
    def backend(self) -> Backend:
        if self._backend is None:
            raise RuntimeError(f"model {self.name!r} is not registered: await model.register(backend)")
        return self._backend

    async def register(self, backend: Backend) -> None:
        """Attach to a backend: it starts (or reuses) the engine and creates step 0 if new."""
        endpoint = await backend.register(self)
        self.base_url, self.api_key = endpoint.base_url, endpoint.api_key
        if endpoint.base_url:
            _ENDPOINT_KEYS[endpoint.base_url.rstrip("/")] = endpoint.api_key
        self._backend = backend

    async def get_step(self) -> int:
        """The latest complete checkpoint step."""
        return await self.backend.get_step(self)

    async def train(
        self, groups: list[TrajectoryGroup], config: TrainConfig | None = None, *,
        request_id: str | None = None, keep_serving: bool | None = None,
    ) -> TrainResult:
        """One GRPO step on `groups` (short form of `backend.train(model, groups, config)`).

        `request_id` (1-64 letters, digits, '-', '_') makes the call idempotent: sent again
        after a crash or a lost connection, it returns the step it committed instead of
        training twice. `keep_serving`: inference goes on during the step (dedicated devices)
        or waits for it (False: one device); None lets the backend choose from its hardware."""
        return await self.backend.train(self, groups, config=config, request_id=request_id,
                                        keep_serving=keep_serving)

    async def train_sft(
        self, data: list[Trajectory | TrajectoryGroup] | str | Path,
        config: SFTConfig | None = None, *, request_id: str | None = None,
    ) -> TrainResult:
        """One supervised fine-tuning step on `data`: trajectories or groups (e.g. a stronger
        model's best rollouts), or a JSONL file in the OpenAI fine-tuning chat format
        (`{"messages": [...], "tools": [...]}` per line). Token cross-entropy on the assistant
        turns, on the same LoRA and checkpoint chain as `train`: RL continues from it.
        `request_id` as in `train`."""
        return await self.backend.train_sft(self, data, config=config, request_id=request_id)

    async def log(self, groups: list[TrajectoryGroup], split: str = "val") -> None:
        """Record groups not trained on (e.g. validation rollouts) at the current step: in the
        run directory (`art view` shows them) and in W&B / Langfuse when configured."""
        await self.backend.log(self, groups, split=split)

    async def delete_checkpoints(self, best_checkpoint_metric: str = "reward_mean") -> list[int]:
        """Delete all checkpoints but the latest and the best by `best_checkpoint_metric`."""
        return await self.backend.delete_checkpoints(self, best_checkpoint_metric)
