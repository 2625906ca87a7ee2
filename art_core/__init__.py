"""art_core: the data model, models, gathering, backends and the trainer.

The public API is listed in `__all__`. Heavy parts (torch, vLLM, the gateway) load lazily, so
`import art_core` on a client machine is fast and needs no GPU stack.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from art_core.config import EngineConfig, LoraConfig, ModelConfig, SFTConfig, TrainConfig

# after the subpackage is imported, so `art_core.distill` is the function, not the package
from art_core.distill import distill
from art_core.gather import GatherError, gather_trajectories, gather_trajectory_groups
from art_core.model import DEFAULT_BASE_MODEL, Backend, Endpoint, Model, TrainableModel, TrainResult
from art_core.pipeline import PipelineResult, PipelineTrainer
from art_core.recording import MessageRecorder, Recorder, ToolEvent, current_recorder, recording
from art_core.sampling import SignalGroups, gather_signal_groups, shuffled_passes, signal_rule
from art_core.trajectory import (
    History,
    RolloutError,
    SampledTurn,
    Trajectory,
    TrajectoryGroup,
    read_groups_jsonl,
    write_groups_jsonl,
)

__version__ = "0.1.0"

# name -> module that defines it, imported on first access
_LAZY = {
    "LocalBackend": "art_core.backend.local",
    "RemoteBackend": "art_core.backend.remote",
}

if TYPE_CHECKING:
    from art_core.backend.local import LocalBackend
    from art_core.backend.remote import RemoteBackend


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'art_core' has no attribute {name!r}")


__all__ = [
    "DEFAULT_BASE_MODEL",
    "Backend",
    "Endpoint",
    "EngineConfig",
    "GatherError",
    "History",
    "LocalBackend",
    "LoraConfig",
    "MessageRecorder",
    "Model",
    "ModelConfig",
    "PipelineResult",
    "PipelineTrainer",
    "Recorder",
    "RemoteBackend",
    "RolloutError",
    "SFTConfig",
    "SampledTurn",
    "SignalGroups",
    "TrainConfig",
    "TrainResult",
    "ToolEvent",
    "TrainableModel",
    "Trajectory",
    "TrajectoryGroup",
    "current_recorder",
    "distill",
    "gather_signal_groups",
    "gather_trajectories",
    "gather_trajectory_groups",
    "read_groups_jsonl",
    "recording",
    "shuffled_passes",
    "signal_rule",
    "write_groups_jsonl",
]
