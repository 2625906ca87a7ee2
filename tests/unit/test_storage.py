"""The run directory: atomic checkpoints, journal, history, retention (no engine needed)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from art_core.storage import ModelDir, append_jsonl
from art_core.trajectory import Trajectory, TrajectoryGroup


def make_dir(tmp_path, steps=(0, 1, 2, 3), rewards=None) -> ModelDir:
    md = ModelDir(tmp_path, "proj", "model")
    for s in steps:
        tmp = md.temp_checkpoint(s)
        (tmp / "adapter_config.json").write_text("{}")
        md.commit_checkpoint(tmp, s)
    for s, r in (rewards or {}).items():
        md.append_history({"step": s, "reward_mean": r})
    return md


def test_steps_ignore_partial_checkpoints_until_cleaned(tmp_path):
    md = make_dir(tmp_path, steps=(0, 1))
    partial = md.temp_checkpoint(2)  # a save killed half-way
    (md.checkpoints / "0007").mkdir()  # a step-named directory without adapter: not complete
    assert md.steps() == [0, 1] and partial.exists()
    assert md.remove_partial_checkpoints() == [partial]
    assert not partial.exists() and md.latest_step() == 1


def test_commit_refuses_to_overwrite(tmp_path):
    md = make_dir(tmp_path, steps=(0,))
    with pytest.raises(FileExistsError):
        md.commit_checkpoint(md.temp_checkpoint(0), 0)


def test_journal_and_interrupted_steps(tmp_path):
    md = make_dir(tmp_path, steps=(0, 1))
    group = TrajectoryGroup(trajectories=[Trajectory(messages=[{"role": "user", "content": "x"}],
                                                     reward=1.0)])
    md.journal_groups(1, [group])  # step 1 completed
    md.journal_groups(2, [group, group])  # step 2 never did
    assert md.interrupted_steps() == [2]
    assert md.journaled(2) == [group, group]
    assert md.journaled(5) is None


def delete(md: ModelDir, metric: str = "reward_mean") -> list[int]:
    deleted = md.deletable_steps(metric)
    for step in deleted:
        md.remove_checkpoint(step)
    return deleted


@pytest.mark.parametrize(
    ("rewards", "kept"),
    [
        # history row of step k holds the rewards of rollouts sampled by checkpoint k-1
        ({1: 0.1, 2: 0.9, 3: 0.2}, {1, 3}),
        ({1: 0.9, 2: 0.1, 3: 0.2}, {0, 3}),
        ({1: 0.1, 2: 0.2, 3: 0.3, 4: 0.99}, {3}),  # best is the latest itself
        ({}, {3}),  # no metric recorded: only the latest
    ],
)
def test_delete_checkpoints_keeps_latest_and_best(tmp_path, rewards, kept):
    md = make_dir(tmp_path, rewards=rewards)
    deleted = delete(md)
    assert set(md.steps()) == kept
    assert set(deleted) == {0, 1, 2, 3} - kept


def test_history_appends_rows(tmp_path):
    md = make_dir(tmp_path, steps=(0,))
    md.append_history({"step": 1, "loss": 0.5})
    md.append_history({"step": 2, "loss": 0.25})
    assert [r["step"] for r in md.read_history()] == [1, 2]
    assert json.loads(md.history.read_text().splitlines()[1])["loss"] == 0.25


def test_a_torn_history_line_loses_only_itself(tmp_path, caplog):
    # a process killed mid-append leaves half a row; every other row must stay readable and the
    # next row must not be glued onto the torn one
    md = make_dir(tmp_path, rewards={1: 0.9, 2: 0.1})
    with md.history.open("a") as f:
        f.write('{"step": 3, "reward_me')
    md.append_history({"step": 3, "reward_mean": 0.2})
    assert [r["step"] for r in md.read_history()] == [1, 2, 3]
    assert "is not a complete JSON line" in caplog.text
    assert delete(md) == [1, 2]  # best (step 1 -> checkpoint 0) kept


def test_appends_from_threads_each_keep_a_line_of_their_own(tmp_path):
    # the pipeline appends completed groups from worker threads; a row whose write was half
    # visible to another appender once made that one start a line of its own (an empty line)
    path = tmp_path / "rows.jsonl"
    pad = "x" * 200_000  # large rows: a write takes long enough to be seen half done

    def append(worker: int) -> None:
        for i in range(40):
            append_jsonl(path, {"worker": worker, "i": i, "pad": pad})

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(append, range(4)))
    lines = path.read_text().split("\n")
    assert lines[-1] == "" and all(lines[:-1]), "an empty or missing line"
    rows = [json.loads(line) for line in lines[:-1]]
    assert sorted((r["worker"], r["i"]) for r in rows) == [(w, i) for w in range(4)
                                                          for i in range(40)]


@pytest.mark.parametrize(("project", "name"), [("../x", "m"), ("p", "a/b"), ("p", "..")])
def test_names_are_validated_before_they_become_paths(tmp_path, project, name):
    with pytest.raises(ValueError, match="invalid"):
        ModelDir(tmp_path, project, name)
