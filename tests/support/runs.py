"""A real run directory for the observability tests, without vLLM: a `LocalBackend` whose engine
is a stand-in (training needs only sleep / wake / load_adapter from it), the real trainer on the
tiny random llama, and groups shaped like an agent's (tool calls, RULER explanations, failures).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from art_core import (
    EngineConfig,
    LocalBackend,
    TrainableModel,
    TrainConfig,
    Trajectory,
    TrajectoryGroup,
)
from art_core.observe.base import Logger
from art_core.observe.loggers import Loggers
from art_core.storage import ModelDir
from art_core.trajectory import RolloutError

CONFIG = TrainConfig(learning_rate=1e-2, bf16=False)


class StubEngine:
    """Stands in for the vLLM engine: registration and the backend's train path only start it,
    ask what it runs with, sleep, wake, load and unload."""

    def __init__(self, served_name: str) -> None:
        self.served_name = served_name
        self.adapters: dict[str, Path] = {}
        self.config = EngineConfig()
        self.dtype = "float32"
        self.max_lora_rank = 8
        self.state = "ready"
        self.loads: list[str] = []
        self.serve_merged, self.merged = False, None

    def start(self) -> None: ...

    def sleep(self) -> None: ...

    def wake_up(self) -> None: ...

    def stop(self) -> None: ...

    def load_adapter(self, name: str, path: Path, *, latest: bool = False) -> None:
        self.loads.append(name)
        self.adapters[name] = Path(path)

    def upstream_name(self, name: str | None = None) -> str:
        return name or self.served_name

    def unload_adapter(self, name: str) -> None:
        self.adapters.pop(name, None)

    def prompt_logprobs(self, name: str, token_ids: list[int]) -> list[float] | None:
        return None  # no model behind it: the served-policy check is skipped


async def make_backend(root: Path, base: Path, name: str = "agent", project: str = "demo",
                       loggers: list[Logger] | None = None) -> tuple[LocalBackend, TrainableModel]:
    """A LocalBackend on `root` with model `project/name` at step 0, ready to train."""
    backend = LocalBackend(root)
    # exactly the loggers given: a developer's WANDB_* / LANGFUSE_* must not reach the tests
    backend.loggers = Loggers(backend.root, loggers, from_env=False)
    model = TrainableModel(name=name, project=project, base_model=str(base))
    engine = StubEngine(model.base_model)
    backend._engines[model.base_model] = engine  # type: ignore[assignment]
    backend.gateway.add_engine(engine)  # type: ignore[arg-type]
    await model.register(backend)  # the real registration, on the stand-in engine
    return backend, model


def tokenizer(backend: LocalBackend, model: TrainableModel) -> Any:
    return backend.trainers.get(model).tokenizer


def agent_trajectory(tok: Any, city: str, answer: str, reward: float, step: int,
                     explanation: str) -> Trajectory:
    """system, user, assistant tool call (sampled), tool result, assistant answer (sampled)."""
    call = {"id": f"call_{city}", "type": "function",
            "function": {"name": "lookup", "arguments": json.dumps({"city": city})}}
    p1 = tok.encode(f"What is the weather in {city}?")
    c1 = tok.encode(f'<tool_call> {{"name": "lookup", "arguments": {{"city": "{city}"}}}}')
    tool_text = f'{{"temperature": 21, "city": "{city}"}}'
    p2 = p1 + c1 + tok.encode(tool_text)
    c2 = tok.encode(answer)
    return Trajectory(
        messages=[{"role": "system", "content": "You are a helpful assistant."},
                  {"role": "user", "content": f"What is the weather in {city}?"},
                  {"role": "assistant", "content": None, "tool_calls": [call]},
                  {"role": "tool", "tool_call_id": call["id"], "content": tool_text},
                  {"role": "assistant", "content": answer}],
        tools=[{"type": "function", "function": {"name": "lookup", "parameters": {}}}],
        turns=[{"message_index": 2, "prompt_token_ids": p1, "completion_token_ids": c1,
                "logprobs": [-1.0] * len(c1), "step": step, "response_id": f"r1-{city}-{reward}",
                "started_at": 1_700_000_000.0 + step, "latency_s": 0.25,
                "finish_reason": "tool_calls"},
               {"message_index": 4, "prompt_token_ids": p2, "completion_token_ids": c2,
                "logprobs": [-1.5] * len(c2), "step": step, "response_id": f"r2-{city}-{reward}",
                "started_at": 1_700_000_000.5 + step, "latency_s": 0.5,
                "finish_reason": "stop"}],
        reward=reward, metrics={"tool_calls": 1, "ruler_score": reward},
        metadata={"city": city},
        logs=[f"RULER judge [listwise]: score {reward:.3f}: {explanation}"])


def agent_groups(tok: Any, step: int) -> list[TrajectoryGroup]:
    """Two groups: one with reward variance (trained) and one all-zero (no signal)."""
    good = TrajectoryGroup(
        trajectories=[
            agent_trajectory(tok, "Paris", "It is 21 degrees in Paris.", 1.0, step,
                             "Called the tool and answered with its result."),
            agent_trajectory(tok, "Paris", "No idea.", 0.0, step, "Ignored the tool result."),
            agent_trajectory(tok, "Paris", "Warm, I think.", 0.5, step, "Vague answer."),
        ],
        exceptions=[RolloutError(type="TimeoutError", message="tool lookup timed out",
                                 traceback="Traceback ...\nTimeoutError: tool lookup timed out")],
        metadata={"scenario": "paris"})
    zero = TrajectoryGroup(trajectories=[
        agent_trajectory(tok, "Rome", "Cold.", 0.0, step, "Wrong."),
        agent_trajectory(tok, "Rome", "Hot.", 0.0, step, "Also wrong."),
    ], metadata={"scenario": "rome"})
    return [good, zero]


async def train_steps(backend: LocalBackend, model: TrainableModel, steps: int = 2,
                      val: bool = True) -> list[dict[str, float]]:
    """Train `steps` real steps on agent groups (and log a val group after each)."""
    tok = tokenizer(backend, model)
    out = []
    for _ in range(steps):
        step = await model.get_step()
        result = await backend.train(model, agent_groups(tok, step), CONFIG)
        out.append(result.metrics)
        if val:
            await model.log(agent_groups(tok, result.step)[:1], split="val")
    return out


# ---- probes of a run directory (the fault tests) --------------------------------------------

def model_dir(backend: LocalBackend, model: TrainableModel) -> ModelDir:
    return ModelDir(backend.root, model.project, model.name)


def journal_files(md: ModelDir) -> list[str]:
    return sorted(p.name for p in md.journal.iterdir()) if md.journal.exists() else []


def temp_dirs(md: ModelDir) -> list[str]:
    return [p.name for p in md.checkpoints.iterdir() if p.name.startswith(".tmp")]


def groups_for(backend: LocalBackend, model: TrainableModel, step: int = 0
               ) -> list[TrajectoryGroup]:
    """One group with reward variance: the cheapest step that trains."""
    return agent_groups(tokenizer(backend, model), step)[:1]


def bare_backend(root: Path, base_model: str) -> tuple[LocalBackend, StubEngine]:
    """A LocalBackend with a StubEngine for `base_model` and nothing registered yet."""
    backend = LocalBackend(root)
    backend.loggers = Loggers(backend.root, [], from_env=False)
    engine = StubEngine(base_model)
    backend._engines[base_model] = engine  # type: ignore[assignment]
    backend.gateway.add_engine(engine)  # type: ignore[arg-type]
    return backend, engine


def contents(root: Path) -> dict[str, bytes]:
    """Every file under `root` (engine logs aside) and what it holds."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and "logs" not in p.relative_to(root).parts}


def adapter_tensors(checkpoint: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(checkpoint / "adapter_model.safetensors"))
