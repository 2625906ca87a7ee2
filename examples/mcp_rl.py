"""MCP·RL on CPU: teach the embedded SmolLM2-135M to run a stock room through an MCP server.

The server (`mcp_server_inventory.py`, five tools over SQLite) starts once per rollout with a
fresh database, so every rollout's outcome can be read back and checked: the reward is
verified (`expected` stock in each scenario), not judged. Each step runs groups of rollouts on
training scenarios, one GRPO step on a LoRA, and at the end the held-out scenarios are run again:

    python examples/mcp_rl.py

The same run from the command line, for any server and scenario file:

    art mcp-train --scenarios examples/data/inventory_scenarios.jsonl \\
        --examples examples/data/inventory_examples.json --max-turns 4 --held-out 12 \\
        --groups-per-step 6 --eval-rollouts 4 --reward examples/mcp_server_inventory.py:reward \\
        -- python examples/mcp_server_inventory.py

Run it again with the same --path to continue from the last step on the same scenarios.
`--credit turn` rewards each turn with the progress it made on the stock and trains with
per-turn credit (docs/mcp.md, "A reward per turn"); `--seed` picks the held-out split.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any, Literal

from art_core import TrainableModel, TrainConfig
from art_core.sampling import DEFAULT_BUDGET
from art_mcp import AgentConfig, McpTrainResult, ServerSpec, WorkedExample, train_mcp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from mcp_server_inventory import reward, turn_reward  # noqa: E402  (the verifiable reward, next to the server)

SERVER = ServerSpec(command=[sys.executable, str(HERE / "mcp_server_inventory.py")])
SCENARIOS = HERE / "data" / "inventory_scenarios.jsonl"
EXAMPLES = HERE / "data" / "inventory_examples.json"
"""Two solved tasks shown before each task. Without them the 135M model solves about 1 task in
10 and most groups score alike (nothing for GRPO to compare); with them about 1 in 4, and its
usual mistake is to copy an example (move the glue to E2, or complete at once), which RL fixes."""


async def run(path: str = ".art", steps: int = 4, groups_per_step: int = 6,
              rollouts_per_group: int = 4, eval_rollouts: int = 4, held_out: int | float = 12,
              max_turns: int = 4, learning_rate: float = 1e-3, seed: int = 0,
              train_config: TrainConfig | None = None, oversample: float | None = DEFAULT_BUDGET,
              credit: Literal["episode", "turn"] = "episode",
              backend: Any = None) -> McpTrainResult:
    """Train for `steps` steps; `backend` defaults to a LocalBackend on `path`. `seed` picks
    the held-out split and the draw; `train_config` replaces the one made from
    `learning_rate` (benchmarks/demo_variants.py --task mcp runs the losses through it).
    `credit="turn"`: each turn is rewarded with the progress it made on the stock
    (`turn_reward`) and credited with what followed it (`TrainConfig(advantage="turn")`)."""
    train_config = train_config or TrainConfig(learning_rate=learning_rate)
    if credit == "turn":
        train_config = train_config.model_copy(update={"advantage": "turn"})
    return await train_mcp(
        SERVER, model=TrainableModel(name="inventory-agent", project="mcp"), backend=backend,
        path=path, scenarios=SCENARIOS, held_out=held_out, reward=reward, steps=steps,
        groups_per_step=groups_per_step, rollouts_per_group=rollouts_per_group,
        eval_rollouts=eval_rollouts,
        agent=AgentConfig(max_turns=max_turns, examples=WorkedExample.load(EXAMPLES)),
        train_config=train_config, seed=seed, oversample=oversample,
        turn_reward=turn_reward if credit == "turn" else None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--path", default=".art")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--groups-per-step", type=int, default=6)
    p.add_argument("--rollouts-per-group", type=int, default=4)
    p.add_argument("--eval-rollouts", type=int, default=4)
    p.add_argument("--held-out", type=int, default=12, help="held-out scenarios")
    p.add_argument("--seed", type=int, default=0, help="the held-out split and the draw")
    p.add_argument("--credit", choices=["episode", "turn"], default="episode",
                   help="turn: a reward per turn (its progress on the stock), per-turn credit")
    a = p.parse_args()
    asyncio.run(run(a.path, a.steps, a.groups_per_step, a.rollouts_per_group, a.eval_rollouts,
                    a.held_out, seed=a.seed, credit=a.credit))


if __name__ == "__main__":
    main()
