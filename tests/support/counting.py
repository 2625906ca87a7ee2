"""A stand-in for a TrainableModel in tests of the loops (art_core/loop.py): it counts steps and
keeps the scenarios of what it was asked to train (each trajectory's metadata["scenario"])."""

from __future__ import annotations

from typing import Any

from art_core import TrajectoryGroup
from art_core.model import TrainResult


class CountingModel:
    """Stands in for a TrainableModel: counts steps, keeps what it was asked to train."""

    def __init__(self, step: int = 0) -> None:
        self.step, self.trained = step, []

    async def get_step(self) -> int:
        return self.step

    async def train(self, groups: list[TrajectoryGroup], config: Any = None) -> TrainResult:
        self.step += 1
        self.trained.append([g.trajectories[0].metadata["scenario"] for g in groups])
        return TrainResult(step=self.step, metrics={"reward_mean": 0.5, "loss": 0.1})
