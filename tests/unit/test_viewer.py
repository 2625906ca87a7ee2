"""`art view` on a real run directory (real training steps on the tiny model, no vLLM): the JSON
routes, what is refused (404 for bad names and paths, nothing outside the run directory), and
the page in a real headless Chromium: steps listed, a group opened, its trajectories shown."""

from __future__ import annotations

import json
import os
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from art_core.observe.viewer import make_server
from art_core.storage import ModelDir
from tests.support.browser import Browser, find_chromium
from tests.support.runs import agent_groups, make_backend, tokenizer, train_steps

REPO = Path(__file__).resolve().parents[2]
SCREENSHOT = Path(os.environ.get("ART_VIEW_SCREENSHOT",
                                 REPO / ".art" / "screenshots" / "art-view-group.png"))


@pytest.fixture(scope="module")
async def run_dir(tiny_models, tmp_path_factory) -> Path:
    """Two trained steps with val groups, then a journaled step 3 still "training"; plus a
    secret outside the run directory and symlinks pointing at it."""
    root = tmp_path_factory.mktemp("viewer-run")
    backend, model = await make_backend(root, tiny_models["llama"], loggers=[])
    await train_steps(backend, model, steps=2)
    md = ModelDir(root, "demo", "agent")
    md.journal_groups(3, agent_groups(tokenizer(backend, model), 2))  # not trained yet
    await backend.close()
    outside = tmp_path_factory.mktemp("outside")
    (outside / "models").mkdir()
    secret = outside / "journal"
    secret.mkdir()
    (secret / "0001.jsonl").write_text(md.journal.joinpath("0001.jsonl").read_text())
    (outside / "secret.txt").write_text("TOP SECRET")
    (root / "demo" / "models" / "leak").symlink_to(outside)  # a model dir pointing outside
    (md.journal / "0009.jsonl").symlink_to(secret / "0001.jsonl")  # a step pointing outside
    return root


@pytest.fixture(scope="module")
def server(run_dir: Path) -> Iterator[str]:
    srv = make_server(run_dir, 0)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def get(url: str, method: str = "GET") -> tuple[int, bytes]:
    req = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_binds_loopback_only(server: str) -> None:
    assert server.startswith("http://127.0.0.1:")


def test_api_lists_models_steps_groups_and_trajectories(server: str) -> None:
    status, body = get(server + "/api/models")
    assert status == 200
    models = json.loads(body)
    assert [(m["project"], m["name"]) for m in models] == [("demo", "agent")]  # no "leak"
    assert models[0]["steps"] == 2 and models[0]["checkpoints"] == [0, 1, 2]

    summary = json.loads(get(server + "/api/models/demo/agent")[1])
    train = summary["splits"]["train"]
    assert [r["step"] for r in train] == [1, 2, 3]
    assert [r.get("pending", False) for r in train] == [False, False, True]
    assert train[0]["reward_mean"] == pytest.approx(1.5 / 5) and "loss" in train[0]
    assert [r["step"] for r in summary["splits"]["val"]] == [1, 2]

    step = json.loads(get(server + "/api/models/demo/agent/train/1")[1])
    assert [g["trained"] for g in step["groups"]] == [True, False]  # the all-zero group: no signal
    assert step["groups"][0]["rewards"] == [1.0, 0.0, 0.5]
    assert step["groups"][0]["exceptions"][0]["type"] == "TimeoutError"

    group = json.loads(get(server + "/api/models/demo/agent/train/1/0")[1])
    best = group["trajectories"][0]
    assert best["reward"] == 1.0
    assert best["ruler"] == ["RULER judge [listwise]: score 1.000: Called the tool and answered "
                             "with its result."]
    arts = [m.get("_art") for m in best["messages"]]
    assert [a["trained"] if a else None for a in arts] == [None, None, True, None, True]
    assert arts[2]["step"] == 0 and arts[2]["latency_s"] == 0.25
    assert best["messages"][3] == {"role": "tool", "tool_call_id": "call_Paris",
                                   "content": '{"temperature": 21, "city": "Paris"}'}
    zero = json.loads(get(server + "/api/models/demo/agent/train/1/1")[1])
    assert not any(m.get("_art", {}).get("trained") for t in zero["trajectories"]
                   for m in t["messages"])


@pytest.mark.parametrize("path", [
    "/api/models/demo/nope", "/api/models/nope/agent",
    "/api/models/demo/leak", "/api/models/demo/leak/train/1",  # a symlink out of the run dir
    "/api/models/demo/agent/train/9",  # a journal file that is a symlink out of the run dir
    "/api/models/demo/agent/train/abc", "/api/models/demo/agent/train/-1",
    "/api/models/demo/agent/train/7", "/api/models/demo/agent/train/1/2",
    "/api/models/demo/agent/train/1/x", "/api/models/demo/agent/journal/1",
    "/api/models/demo/agent/checkpoints/0", "/api/models/demo/agent/val/1/0/extra",
    "/api/models/demo/%2E%2E/agent", "/api/models/..%2F..%2Fetc/passwd",
    "/api/models/demo/agent/..%2F..%2F..%2F..%2Fsecret.txt/1",
    "/../../etc/passwd", "/static/../viewer.py", "/viewer.html", "/api", "/api/model",
    "/api/models/demo/agent/model.json", "/api/models/demo/agent/history.jsonl",
])
def test_bad_paths_are_404(server: str, path: str) -> None:
    status, body = get(server + path)
    assert status == 404, (path, status, body[:200])
    assert b"SECRET" not in body and b"Paris" not in body


def test_only_get_and_head(server: str) -> None:
    assert get(server + "/api/models", "POST")[0] == 405
    assert get(server + "/api/models", "DELETE")[0] == 405
    status, body = get(server + "/api/models", "HEAD")
    assert status == 200 and body == b""


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    binary = find_chromium()
    if binary is None:
        pytest.skip("no chromium on this machine: apt-get install -y chromium")
    b = Browser(binary)
    yield b
    b.close()


def test_page_lists_steps_opens_a_group_and_shows_trajectories(server: str,
                                                                browser: Browser) -> None:
    browser.goto(server + "/")
    browser.wait_for("document.querySelectorAll('a.model').length === 1")
    assert "agent" in browser.eval("document.querySelector('a.model').textContent")
    browser.eval("document.querySelector('a.model').click()")
    steps = browser.wait_for(
        "(() => { const r = [...document.querySelectorAll('table.steps[data-split=train] "
        "a.step-link')].map(a => a.textContent.trim()); return r.length === 3 && r; })()")
    assert steps == ["step 1", "step 2", "step 3"]
    assert browser.eval("document.querySelectorAll('table.steps[data-split=val] tr.step')"
                        ".length") == 2
    assert "pending" in browser.eval("document.querySelector('table.steps').textContent")

    browser.eval("document.querySelector('table.steps[data-split=train] a.step-link').click()")
    cards = browser.wait_for("(() => { const c = document.querySelectorAll('.card.group'); "
                             "return c.length === 2 && [...c].map(x => x.textContent); })()")
    assert "trained" in cards[0] and "1 failed" in cards[0]
    assert "not trained" in cards[1]

    browser.eval("document.querySelector('.card.group').click()")
    texts = browser.wait_for("(() => { const t = document.querySelectorAll('#trajectories "
                             ".traj'); return t.length === 3 && [...t].map(x => x.innerText); "
                             "})()")
    assert "reward 1" in texts[0] and "reward 0" in texts[1] and "reward 0.500" in texts[2]
    assert "Called the tool and answered with its result." in texts[0]
    assert "lookup" in texts[0] and '"temperature": 21' in texts[0]  # tool call and result
    assert "It is 21 degrees in Paris." in texts[0]
    assert texts[0].count("TRAINED") + texts[0].count("trained") >= 2  # both sampled turns
    assert "TimeoutError" in browser.eval("document.querySelector('#content').innerText")
    # side by side: the three columns share one row
    tops = browser.eval("[...document.querySelectorAll('#trajectories .traj')]"
                        ".map(x => Math.round(x.getBoundingClientRect().top))")
    assert len(set(tops)) == 1
    shot = browser.screenshot(SCREENSHOT)
    assert shot.stat().st_size > 10_000


def test_art_view_command_serves_the_run_and_refuses_a_missing_dir(run_dir: Path,
                                                                    tmp_path: Path) -> None:
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "art_core.cli", "view"]
    missing = subprocess.run([*cmd, str(tmp_path / "nope")], capture_output=True, text=True,
                             timeout=60)
    assert missing.returncode == 1 and "does not exist" in missing.stderr
    proc = subprocess.Popen([*cmd, str(run_dir), "--port", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        url = line.split("art view: ", 1)[1].split()[0].rstrip("/")
        assert url.startswith("http://127.0.0.1:")
        status, body = get(url + "/api/models")
        assert status == 200 and json.loads(body)[0]["name"] == "agent"
        status, page = get(url + "/")
        assert status == 200 and b"<title>art view</title>" in page
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.parametrize("second_prompt,split", [
    pytest.param([1, 2, 3, 4, 5, 6], None, id="extends: one sequence"),
    pytest.param([1, 2, 9, 6], "rewritten_history", id="rewritten: a new sequence"),
])
def test_the_view_marks_where_a_new_training_sequence_starts(second_prompt, split):
    from art_core.observe.viewer import _history_view
    from art_core.trajectory import SampledTurn, Trajectory

    turns = [SampledTurn(message_index=1, prompt_token_ids=[1, 2, 3], completion_token_ids=[4, 5],
                         logprobs=[-1.0, -1.0]),
             SampledTurn(message_index=3, prompt_token_ids=second_prompt,
                         completion_token_ids=[7], logprobs=[-1.0], spliced=False,
                         splice_reason="rewritten_history")]
    t = Trajectory(messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                             {"role": "user", "content": "q2"}, {"role": "assistant", "content": "b"}],
                   turns=turns)
    marks = [m["_art"]["split"] for m in _history_view(t, True)["messages"] if "_art" in m]
    assert marks == [None, split]


def test_a_project_or_model_directory_opens_its_run_and_the_model_cache_is_never_listed(
        run_dir: Path, monkeypatch, tmp_path) -> None:
    from art_core.observe.viewer import RunView, locate

    assert locate(run_dir) == (run_dir.resolve(), None, None)
    assert locate(run_dir / "demo") == (run_dir.resolve(), "demo", None)
    # the path the demo prints its checkpoints under
    assert locate(run_dir / "demo" / "models" / "agent") == (run_dir.resolve(), "demo", "agent")
    assert [m["name"] for m in RunView(*locate(run_dir / "demo" / "models" / "agent")).models()
            ] == ["agent"]
    # ART_HOME inside a run directory (.art/home): its converted base models are not a project
    cache = tmp_path / "run"
    cache.mkdir()
    (cache / "home" / "models" / "SmolLM2-135M-Instruct").mkdir(parents=True)
    (cache / "home" / "models" / "SmolLM2-135M-Instruct" / "config.json").write_text("{}")
    (cache / "demo" / "models" / "agent").mkdir(parents=True)
    monkeypatch.setenv("ART_HOME", str(cache / "home"))
    assert [(m["project"], m["name"]) for m in RunView(cache).models()] == [("demo", "agent")]


def test_the_view_shows_each_turns_own_reward():
    from art_core.observe.viewer import _history_view
    from art_core.trajectory import SampledTurn, Trajectory

    t = Trajectory(messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                             {"role": "user", "content": "q2"}, {"role": "assistant", "content": "b"}],
                   turns=[SampledTurn(message_index=i, prompt_token_ids=[1], completion_token_ids=[2],
                                      logprobs=[-1.0]) for i in (1, 3)])
    t.set_turn_reward(1, 0.25)
    rewards = [m["_art"]["reward"] for m in _history_view(t, True)["messages"] if "_art" in m]
    assert rewards == [None, 0.25]


def equal_rewards_earned_at_different_turns():
    from art_core.trajectory import SampledTurn, Trajectory, TrajectoryGroup

    trajectories = []
    for first in (1.0, 0.0):  # both end at 1.0: one earned it at its first turn, one at its last
        t = Trajectory(
            messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                      {"role": "user", "content": "q2"}, {"role": "assistant", "content": "b"}],
            turns=[SampledTurn(message_index=i, prompt_token_ids=[1], completion_token_ids=[2],
                               logprobs=[-1.0]) for i in (1, 3)], reward=1.0)
        t.set_turn_reward(0, first)
        trajectories.append(t)
    return TrajectoryGroup(trajectories=trajectories)


@pytest.mark.parametrize(("row", "trained"), [
    ({"kind": "rl", "advantage": "turn"}, True),  # per-turn credit trains this group
    ({"kind": "rl", "advantage": "group"}, False),  # episode credit: equal rewards, no signal
    ({"kind": "rl", "turn_advantage_abs_mean": 0.5}, True),  # a row from before "advantage"
    ({"kind": "rl"}, False),
])
def test_the_trained_mark_follows_the_credit_the_step_used(tmp_path, row, trained):
    from art_core.observe.viewer import RunView

    md = ModelDir(tmp_path, "demo", "agent")
    md.journal_groups(1, [equal_rewards_earned_at_different_turns()])
    md.append_history({"step": 1, **row})
    view = RunView(tmp_path)
    assert view.step_groups("demo", "agent", "train", "1")["groups"][0]["trained"] is trained
    assert view.group("demo", "agent", "train", "1", "0")["trained"] is trained
