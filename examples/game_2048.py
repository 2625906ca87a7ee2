"""2048: ART's classic first example. An agent plays the game through a tool and learns from
the score it reaches.

    python examples/game_2048.py               # GPU: Qwen2.5-3B-Instruct, 60 steps
    python examples/game_2048.py --cpu-smoke   # any laptop: the embedded SmolLM2, 2 tiny steps

Each turn the model sees the board and calls `make_move(direction)`. The tool is forced
(`tool_choice="required"`), so the gateway holds every reply to a valid call with a direction
from the enum: even a 135M model always makes a legal-looking move. A move that changes
nothing ends the game. Rollouts of one group play the same seeded game; the reward (ART's) grows
with the largest tile and the board's total, and winning (a 2048 tile) is worth 2.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
from dataclasses import dataclass

import art_core as art

WIN = 2048
TOOLS = [{"type": "function", "function": {
    "name": "make_move", "description": "Slide all tiles of the board in one direction.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["direction"],
                   "properties": {"direction": {"enum": ["left", "right", "up", "down"]}}}}}]
SYSTEM = ("You play 2048 on a 4x4 board. Sliding merges equal neighbouring tiles into their sum; "
          "a new 2 or 4 appears after each move. Reach 2048. Call make_move once per turn.")


@dataclass
class Config:
    base_model: str
    steps: int
    groups_per_step: int  # distinct games per step
    rollouts_per_group: int  # plays of the same game, compared by GRPO
    max_moves: int
    learning_rate: float
    max_model_len: int = 4096


GPU = Config("Qwen/Qwen2.5-3B-Instruct", steps=60, groups_per_step=6, rollouts_per_group=8,
             max_moves=120, learning_rate=1e-5, max_model_len=16384)
CPU_SMOKE = Config(art.DEFAULT_BASE_MODEL, steps=2, groups_per_step=1, rollouts_per_group=4,
                   max_moves=3, learning_rate=1e-3)


# ---- the game ---------------------------------------------------------------------------------

class Game:
    """A 4x4 2048 board with its own seeded random generator."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.board = [[0] * 4 for _ in range(4)]
        self.score = 0
        self.spawn()
        self.spawn()

    def spawn(self) -> None:
        empty = [(r, c) for r in range(4) for c in range(4) if not self.board[r][c]]
        if empty:
            r, c = self.rng.choice(empty)
            self.board[r][c] = 2 if self.rng.random() < 0.9 else 4

    def _slide_left(self, row: list[int]) -> list[int]:
        tiles, out = [v for v in row if v], []
        while tiles:
            if len(tiles) > 1 and tiles[0] == tiles[1]:
                out.append(tiles[0] * 2)
                self.score += tiles[0] * 2
                tiles = tiles[2:]
            else:
                out.append(tiles.pop(0))
        return out + [0] * (4 - len(out))

    def move(self, direction: str) -> bool:
        """Apply a move; False (and no change) when it moves nothing."""
        b = self.board
        if direction in ("up", "down"):
            b = [list(col) for col in zip(*b, strict=True)]  # transpose
        if direction in ("right", "down"):
            b = [row[::-1] for row in b]
        b = [self._slide_left(row) for row in b]
        if direction in ("right", "down"):
            b = [row[::-1] for row in b]
        if direction in ("up", "down"):
            b = [list(col) for col in zip(*b, strict=True)]
        if b == self.board:
            return False
        self.board = b
        self.spawn()
        return True

    @property
    def max_tile(self) -> int:
        return max(max(row) for row in self.board)

    def stuck(self) -> bool:
        return all(not Game._copy(self).move(d) for d in ("left", "right", "up", "down"))

    @staticmethod
    def _copy(game: Game) -> Game:
        g = Game.__new__(Game)
        g.rng, g.board, g.score = random.Random(0), [row[:] for row in game.board], 0
        return g

    def render(self) -> str:
        return "\n".join(" ".join(f"{v or '.':>4}" for v in row) for row in self.board)


def reward(game: Game) -> float:
    """ART's 2048 reward: largest tile and board total on log scales; 2 for a win."""
    if game.max_tile >= WIN:
        return 2.0
    total = sum(map(sum, game.board))
    max_part = (math.log2(game.max_tile) - 1) / (math.log2(WIN) - 1)
    total_part = (math.log2(total) - 1) / (math.log2(WIN * 16) - 1)
    return max_part + 0.2 * total_part


# ---- the rollout and the loop -----------------------------------------------------------------

async def rollout(model: art.TrainableModel, seed: int, cfg: Config) -> art.Trajectory:
    game = Game(seed)
    client = model.openai_client()
    traj = art.Trajectory(tools=TOOLS, messages=[
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"The board:\n{game.render()}\nYour move?"}])
    moves = 0
    while moves < cfg.max_moves and game.max_tile < WIN:
        response = await client.chat.completions.create(
            model=model.name, messages=traj.messages, tools=TOOLS, tool_choice="required",
            max_tokens=48, temperature=1.0)
        message = traj.add_completion(response)  # the call + its exact sampled tokens
        if not message.get("tool_calls"):  # cut off: no move
            break
        call = message["tool_calls"][0]
        direction = json.loads(call["function"]["arguments"])["direction"]
        moves += 1
        if not game.move(direction):
            traj.metrics["invalid_move"] = True
            break
        stuck = game.stuck()
        result = f"The board:\n{game.render()}" + ("\nNo move left." if stuck else "")
        traj.messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
        if stuck:
            break
    traj.reward = reward(game)
    traj.metrics.update(max_tile=game.max_tile, score=game.score, moves=moves)
    return traj


async def train(model: art.TrainableModel, cfg: Config, seed: int = 0) -> list[float]:
    """The RL loop; returns the mean reward of each step."""
    means = []
    start = await model.get_step()
    for step in range(start, start + cfg.steps):
        seeds = [seed + step * cfg.groups_per_step + g for g in range(cfg.groups_per_step)]
        groups = await art.gather_trajectory_groups(
            [rollout(model, s, cfg) for _ in range(cfg.rollouts_per_group)] for s in seeds)
        result = await model.train(groups, art.TrainConfig(learning_rate=cfg.learning_rate))
        means.append(result.metrics["reward_mean"])
        tiles = [t.metrics["max_tile"] for g in groups for t in g]
        print(f"step {result.step}: mean reward {means[-1]:.3f}, best tile {max(tiles)}")
    return means


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny run on the embedded model")
    parser.add_argument("--path", default=".art", help="where runs and checkpoints are stored")
    args = parser.parse_args()
    cfg = CPU_SMOKE if args.cpu_smoke else GPU
    async with art.LocalBackend(args.path) as backend:
        model = art.TrainableModel(
            name="2048-smoke" if args.cpu_smoke else "2048-agent", project="examples",
            base_model=cfg.base_model,
            config=art.ModelConfig(engine=art.EngineConfig(max_model_len=cfg.max_model_len)))
        await model.register(backend)
        await train(model, cfg)


if __name__ == "__main__":
    asyncio.run(main())
