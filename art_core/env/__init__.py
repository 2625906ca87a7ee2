"""Environments people already have, turned into rollouts: TRL-style tool environment classes
(`tool_rollout`) and reset/step environments (`step_rollout`, with shims for gymnasium,
TextArena, OpenEnv and reasoning-gym; `OpenEnvSocket` speaks OpenEnv's protocol without its
package), and agent programs we do not own (`harness_rollout`: a
base URL per rollout). No third-party package is imported here: the shims duck-type the
libraries' objects."""

from art_core.env.harness import HarnessError, HarnessRollout, build_trajectory, harness_rollout
from art_core.env.openenv import OpenEnvSocket
from art_core.env.steps import (
    EnvFailed,
    GymnasiumText,
    OpenEnvText,
    ReasoningGymText,
    Step,
    TextArenaText,
    step_rollout,
)
from art_core.env.tools import EnvError, tool_methods, tool_rollout, tool_schemas

__all__ = [
    "EnvError",
    "EnvFailed",
    "GymnasiumText",
    "HarnessError",
    "HarnessRollout",
    "OpenEnvSocket",
    "OpenEnvText",
    "ReasoningGymText",
    "Step",
    "TextArenaText",
    "build_trajectory",
    "harness_rollout",
    "step_rollout",
    "tool_methods",
    "tool_rollout",
    "tool_schemas",
]
