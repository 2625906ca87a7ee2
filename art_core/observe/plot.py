"""Training curves as a picture and a summary: `art plot` and the demo's plot.

Every model keeps one row of metrics per step in `<path>/<project>/models/<name>/history.jsonl`.
`art plot` reads them all and draws the chosen metrics against the step, one subplot per metric
and one line per model, and prints first -> last (max) per model. matplotlib is the `plot`
extra and is imported only when a picture is drawn.
"""

from __future__ import annotations

import math
from pathlib import Path

from art_core.storage import read_jsonl

Curve = list[tuple[int, float]]


class PlotError(ValueError):
    """Nothing to plot: no history, or a metric that no row has."""


def find_histories(root: str | Path) -> dict[str, Path]:
    """'project/name' -> its history.jsonl, for every model under a run directory."""
    root = Path(root)
    if not root.is_dir():
        raise PlotError(f"run directory {root} does not exist")
    found = {f"{h.parents[2].name}/{h.parent.name}": h
             for h in sorted(root.glob("*/models/*/history.jsonl"))}
    if not found:
        raise PlotError(f"no history.jsonl under {root}: train a model there first "
                        "(or pass --path)")
    return found


def _rows(history: Path) -> list[dict]:
    return [r for r in read_jsonl(history) if isinstance(r.get("step"), int)]


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def read_curves(root: str | Path, metrics: list[str]) -> dict[str, dict[str, Curve]]:
    """metric -> model -> [(step, value)]. A metric no model has is an error naming those there."""
    rows = {label: _rows(h) for label, h in find_histories(root).items()}
    curves = {metric: {label: [(r["step"], float(r[metric])) for r in model_rows
                               if _number(r.get(metric))]
                       for label, model_rows in rows.items()}
              for metric in metrics}
    for metric, by_model in curves.items():
        if not any(by_model.values()):
            available = sorted({k for model_rows in rows.values() for r in model_rows
                                for k, v in r.items() if k != "step" and _number(v)})
            raise PlotError(f"no model under {root} has the metric {metric!r}; "
                            f"available: {', '.join(available) or 'none'}")
    return curves


def summary(curves: dict[str, dict[str, Curve]]) -> list[str]:
    """One line per metric and model: first -> last (max at step) over n steps."""
    lines = []
    for metric, by_model in curves.items():
        for label, curve in by_model.items():
            if curve:
                top_step, top = max(curve, key=lambda p: p[1])
                lines.append(f"{label}  {metric}: {curve[0][1]:.3f} -> {curve[-1][1]:.3f} "
                             f"(max {top:.3f} at step {top_step}), {len(curve)} steps")
    return lines


Band = list[tuple[int, float, float]]  # (step, low, high): e.g. a 95% interval


def plot_curves(curves: dict[str, dict[str, Curve]], out: str | Path, title: str = "",
                bands: dict[str, dict[str, Band]] | None = None) -> Path:
    """Draw metric -> model -> curve to a PNG (one subplot per metric); returns its path.
    `bands` (same keys) shade an interval around a curve, e.g. a held-out rate's 95% CI."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotError("plotting needs matplotlib: pip install 'art-agents[plot]'") from None
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig = figure(curves, title, bands)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def figure(curves: dict[str, dict[str, Curve]], title: str = "",
           bands: dict[str, dict[str, Band]] | None = None):  # -> matplotlib Figure
    """The figure `plot_curves` saves. A long title is wrapped to the figure's width (a title
    on the first axes was cut at the right edge)."""
    import textwrap

    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(len(curves), 1, figsize=(6.5, 2.6 * len(curves) + 0.6),
                             sharex=True, squeeze=False)
    for ax, (metric, by_model) in zip(axes[:, 0], curves.items(), strict=True):
        for label, curve in by_model.items():
            if curve:
                (line,) = ax.plot([s for s, _ in curve], [v for _, v in curve], marker="o",
                                  ms=3, label=label)
                band = (bands or {}).get(metric, {}).get(label)
                if band:
                    ax.fill_between([s for s, _, _ in band], [lo for _, lo, _ in band],
                                    [hi for _, _, hi in band], color=line.get_color(),
                                    alpha=0.15, label=f"{label}, 95% interval")
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    axes[-1, 0].set_xlabel("step")
    axes[-1, 0].xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    if title:
        fig.suptitle(textwrap.fill(title, 70), fontsize="medium")
    fig.tight_layout()
    return fig
