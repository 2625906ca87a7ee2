"""art_mcp: record MCP tool sessions into trajectories, MCP·RL (train on a server's tools) and
AutoRL (train from a task description; `art_mcp.autorl`), which share `art_mcp.loop`.

    from art_mcp import connect, ServerSpec, run_agent
    async with connect(ServerSpec(command=["python", "server.py"])) as session:
        traj = await run_agent(model, session, "Add 5 pens to the stock.")

`import art_mcp` does not import `mcp`, litellm or torch; they load on first use.
"""

from __future__ import annotations

from art_mcp.agent import (
    COMPLETE_TASK,
    AgentConfig,
    WorkedExample,
    action_schema,
    agent_messages,
    run_agent,
)
from art_mcp.autorl import AutoRLResult, autorl
from art_mcp.functions import FunctionSession, function_tool
from art_mcp.scenarios import (
    Scenario,
    ScenarioError,
    generate_scenarios,
    load_scenarios,
    save_scenarios,
    split_scenarios,
)
from art_mcp.session import RecordingSession, ServerGone, ServerSpec, connect, openai_tool
from art_mcp.train import (
    EvalStats,
    McpTrainResult,
    RolloutContext,
    TurnReward,
    evaluate,
    rollout,
    train_mcp,
)

__all__ = [
    "COMPLETE_TASK",
    "AgentConfig",
    "AutoRLResult",
    "EvalStats",
    "FunctionSession",
    "McpTrainResult",
    "RecordingSession",
    "RolloutContext",
    "Scenario",
    "ScenarioError",
    "ServerGone",
    "ServerSpec",
    "TurnReward",
    "WorkedExample",
    "action_schema",
    "agent_messages",
    "autorl",
    "connect",
    "evaluate",
    "function_tool",
    "generate_scenarios",
    "load_scenarios",
    "openai_tool",
    "rollout",
    "run_agent",
    "save_scenarios",
    "split_scenarios",
    "train_mcp",
]
