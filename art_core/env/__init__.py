"""Environments people already have, turned into rollouts: TRL-style tool environment classes
(`tool_rollout`). Each third-party package is imported lazily, in its own shim."""

from art_core.env.tools import EnvError, tool_methods, tool_rollout, tool_schemas

__all__ = ["EnvError", "tool_methods", "tool_rollout", "tool_schemas"]
