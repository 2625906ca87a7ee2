"""`art plot`: curves from every model's history.jsonl, a summary, and clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from art_core.cli import app
from art_core.observe.plot import PlotError, plot_curves, read_curves, summary

runner = CliRunner()


def write_history(root: Path, project: str, name: str, rows: list[dict | str]) -> None:
    d = root / project / "models" / name
    d.mkdir(parents=True)
    (d / "history.jsonl").write_text(
        "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


@pytest.fixture
def run(tmp_path: Path) -> Path:
    write_history(tmp_path, "demo", "a", [{"step": s, "reward_mean": s / 10, "loss": 0.5 - s}
                                          for s in (1, 2, 3)])
    write_history(tmp_path, "other", "b", [
        {"step": 1, "reward_mean": 0.2},
        '{"step": 2, "reward_mea',          # a line being appended: skipped
        {"step": 3, "reward_mean": float("nan")},  # not finite: skipped
        {"step": 4, "reward_mean": True},   # not a number: skipped
        {"step": 5, "reward_mean": 0.9},
    ])
    return tmp_path


def test_read_curves_per_metric_and_model(run):
    curves = read_curves(run, ["reward_mean", "loss"])
    assert curves["reward_mean"] == {"demo/a": [(1, 0.1), (2, 0.2), (3, 0.3)],
                                     "other/b": [(1, 0.2), (5, 0.9)]}
    assert curves["loss"] == {"demo/a": [(1, -0.5), (2, -1.5), (3, -2.5)], "other/b": []}
    assert summary({"reward_mean": curves["reward_mean"]}) == [
        "demo/a  reward_mean: 0.100 -> 0.300 (max 0.300 at step 3), 3 steps",
        "other/b  reward_mean: 0.200 -> 0.900 (max 0.900 at step 5), 2 steps",
    ]


@pytest.mark.parametrize(("setup", "metrics", "needle"), [
    ("missing", ["reward_mean"], "does not exist"),
    ("empty", ["reward_mean"], "no history.jsonl under"),
    ("run", ["nope"], "has the metric 'nope'; available: loss, reward_mean"),
])
def test_errors_name_the_problem(run, tmp_path, setup, metrics, needle):
    root = {"missing": tmp_path / "nowhere", "empty": tmp_path / "demo" / "models" / "a",
            "run": run}[setup]
    with pytest.raises(PlotError, match=needle):
        read_curves(root, metrics)


def test_plot_writes_a_png(run, tmp_path):
    out = plot_curves(read_curves(run, ["reward_mean", "loss"]), tmp_path / "x" / "c.png", "t")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000


@pytest.mark.parametrize(("args", "code", "expected"), [
    ([], 0, ["demo/a  reward_mean: 0.100 -> 0.300", "demo/a  loss:", "plot: "]),
    (["-m", "reward_mean", "--out", "{tmp}/r.png"], 0, ["other/b  reward_mean", "r.png"]),
    (["-m", "entropy"], 1, ["error: no model under", "available: loss, reward_mean"]),
])
def test_art_plot_command(run, tmp_path, args, code, expected):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    result = runner.invoke(app, ["plot", "--path", str(run), *args])
    assert result.exit_code == code, result.output
    for needle in expected:
        assert needle in result.output
    if code == 0:
        written = Path(result.output.split("plot: ")[-1].strip())
        assert written.exists() and written.suffix == ".png"


def test_a_long_title_fits_the_figure_and_bands_are_drawn():
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from art_core.observe.plot import figure

    title = "art demo: a LangGraph agent on SmolLM2-135M learns to answer with a tool, " * 2
    curves = {"held-out success rate": {"agent": [(0, 0.4), (4, 0.8)]},
              "train reward": {"agent": [(1, 0.3), (2, 0.5)]}}
    bands = {"held-out success rate": {"agent": [(0, 0.3, 0.5), (4, 0.7, 0.9)]}}
    fig = figure(curves, title, bands)
    fig.canvas.draw()
    box = fig.bbox
    (sup,) = [t for t in fig.texts if t.get_text()]
    extent = sup.get_window_extent()
    assert box.x0 <= extent.x0 and extent.x1 <= box.x1 and extent.y1 <= box.y1  # not cut
    first = fig.axes[0]
    assert len(first.collections) == 1  # the shaded interval
    assert first.collections[0].get_paths()[0].get_extents().y1 == pytest.approx(0.9)
    assert not fig.axes[1].collections  # no band asked for there
    plt.close(fig)
