"""Each example in examples/ runs its smallest setting (`--cpu-smoke`: the embedded model, tiny
steps) on the session's engine: rollouts through the gateway, real training steps."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from art_core import TrainableModel

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"examples_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["game_2048", "email_agent", "ruler_rewards"])
def test_example_cli_documents_its_settings(name):
    out = subprocess.run([sys.executable, str(EXAMPLES / f"{name}.py"), "--help"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert "--cpu-smoke" in out


def test_2048_game_rules():
    game = load("game_2048").Game(0)
    game.board = [[2, 2, 4, 0], [0, 0, 0, 0], [0, 0, 0, 0], [2, 0, 0, 2]]
    assert game.move("left") and game.board[0][:2] == [4, 4] and game.board[3][0] == 4
    assert game.score == 8
    game.board = [[2, 4, 2, 4], [4, 2, 4, 2], [2, 4, 2, 4], [4, 2, 4, 2]]
    assert game.stuck() and not game.move("left")


def test_email_inbox_answers_each_question_from_one_email():
    inbox = load("email_agent").Inbox(0)
    for q in inbox.questions:
        assert q.answer in inbox.read(q.email_id)
        hits = [h["id"] for h in json.loads(inbox.search(q.text))]
        assert q.email_id in hits
    assert inbox.search('") * NEAR(') == "[]"  # FTS5 syntax in keywords is only words


@pytest.mark.engine
@pytest.mark.parametrize("name", ["game_2048", "email_agent", "ruler_rewards"])
async def test_example_cpu_smoke_trains(backend, smollm2_path, name):
    module = load(name)
    model = TrainableModel(name=f"ex-{name.replace('_', '-')}", project="examples")
    await model.register(backend)
    cfg = module.CPU_SMOKE
    means = await module.train(model, cfg)
    assert await model.get_step() == len(means) >= 1
    if name == "game_2048":  # the forced tool makes every turn a move
        traj = await module.rollout(model, 7, cfg)
        assert traj.metrics["moves"] >= 1 and traj.turns
    elif name == "email_agent":
        inbox = module.Inbox(0)
        traj = await module.rollout(model, inbox, inbox.questions[0], cfg)
        names = [c["function"]["name"] for m in traj.messages for c in m.get("tool_calls") or []]
        assert names and set(names) <= {"search_inbox", "read_email", "answer"}
