"""The interface both backends implement, so user code switches between them in one line."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from pydantic import BaseModel, Field

from art_core.trajectory import TrajectoryGroup

if TYPE_CHECKING:
    from art_core.config import TrainConfig
    from art_core.model import TrainableModel


def check_groups(groups: Any) -> list[TrajectoryGroup]:
    """The `groups` argument of `train`: a non-empty list of TrajectoryGroup (or one group)."""
    if isinstance(groups, TrajectoryGroup):
        groups = [groups]
    groups = list(groups)
    if not groups:
        raise ValueError("train() needs at least one TrajectoryGroup")
    for i, g in enumerate(groups):
        if not isinstance(g, TrajectoryGroup):
            raise TypeError(f"groups[{i}] is a {type(g).__name__}, not a TrajectoryGroup")
    return groups


class Endpoint(BaseModel):
    """Where a registered model is served (OpenAI-compatible)."""

    base_url: str
    api_key: str | None = None


class TrainResult(BaseModel):
    """What one training step produced."""

    step: int = Field(description="The new checkpoint step, now served under the model's name.")
    metrics: dict[str, float] = Field(default_factory=dict)


class Backend(Protocol):
    async def register(self, model: TrainableModel) -> Endpoint: ...

    async def get_step(self, model: TrainableModel) -> int: ...

    async def train(
        self,
        model: TrainableModel,
        groups: list[TrajectoryGroup],
        config: TrainConfig | None = None,
    ) -> TrainResult: ...

    async def delete_checkpoints(
        self, model: TrainableModel, best_checkpoint_metric: str = "reward_mean"
    ) -> list[int]: ...

    async def close(self) -> None: ...
