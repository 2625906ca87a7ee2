"""Weights & Biases logger: one W&B run per model, metrics at the model's step, trajectories as
a table per step, checkpoints optionally as artifacts.

- Run: project WANDB_PROJECT (or the argument, else the model's art project), name and id the
  model's name, `resume="allow"`: a restarted training script continues the same run.
- Metrics: `train/<metric>` and `val/<metric>` with `training_step` as their x axis (W&B's own
  step only grows, and a val log comes after the train log of the same step).
- Tables: `<split>/trajectories`, one row per trajectory (group, reward, messages, metrics,
  RULER's explanation); `<split>/failed_rollouts` when rollouts failed.
- Checkpoints (`log_checkpoints=True`): the step's adapter directory as an artifact
  `<model>-lora`, aliases `step-<n>` and `latest`.

`wandb` is imported on the first step, never at `import art_core`. Offline mode
(WANDB_MODE=offline) writes the run under `dir` (default ./wandb) for `wandb sync` later.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from art_core.observe.base import Logger, StepRecord

TABLE_COLUMNS = ["step", "group", "trajectory", "reward", "messages", "metrics", "ruler",
                 "metadata"]


def run_id(model: str) -> str:
    """A W&B run id from a model name (W&B ids allow letters, digits, '-' and '_')."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", model)


def format_messages(messages: list[dict[str, Any]]) -> str:
    """A conversation as readable text: one block per message, tool calls and results shown."""
    blocks = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = "\n".join(str(c.get("text", c)) for c in content)
        head = m.get("role", "?") + (f" ({m['tool_call_id']})" if m.get("tool_call_id") else "")
        lines = [f"[{head}]", str(content) if content is not None else ""]
        for call in m.get("tool_calls") or []:
            fn = call.get("function", {})
            lines.append(f"-> {fn.get('name')}({fn.get('arguments')})")
        blocks.append("\n".join(line for line in lines if line))
    return "\n\n".join(blocks)


class WandbLogger(Logger):
    """Logs steps to Weights & Biases (see the module docstring)."""

    name = "wandb"

    def __init__(self, project: str | None = None, entity: str | None = None, *,
                 log_checkpoints: bool = False, dir: str | Path | None = None,
                 mode: str | None = None, init_timeout_s: float = 60.0) -> None:
        """`mode`: "online", "offline" or None (WANDB_MODE decides)."""
        self.project, self.entity = project, entity
        self.log_checkpoints = log_checkpoints
        self.dir = str(dir) if dir is not None else None
        self.mode = mode
        self.init_timeout_s = init_timeout_s
        self.runs: dict[tuple[str, str], Any] = {}
        self._failed_init: set[tuple[str, str]] = set()

    def _run(self, record: StepRecord) -> Any:
        key = (record.project, record.model)
        if key in self.runs:
            return self.runs[key]
        if key in self._failed_init:
            return None  # init failed once (warned): do not wait on it again every step
        import wandb

        try:
            run = wandb.init(
                project=self.project or record.project, entity=self.entity,
                name=record.model, id=run_id(record.model), resume="allow",
                config={"art_project": record.project, "model": record.model,
                        "base_model": record.base_model},
                dir=self.dir, mode=self.mode, reinit="create_new",  # one run per model
                settings=wandb.Settings(init_timeout=self.init_timeout_s, silent=True,
                                        console="off"),
            )
        except Exception:
            self._failed_init.add(key)
            raise
        run.define_metric("training_step")
        run.define_metric("*", step_metric="training_step")
        self.runs[key] = run
        return run

    def log_step(self, record: StepRecord) -> None:
        run = self._run(record)
        if run is None:
            return
        import wandb

        data: dict[str, Any] = {"training_step": record.step}
        data.update({f"{record.split}/{k}": v for k, v in record.metrics.items()})
        table = wandb.Table(columns=TABLE_COLUMNS)
        for gi, group in enumerate(record.groups):
            for ti, t in enumerate(group.trajectories):
                ruler = "\n".join(line for line in t.logs if line.startswith("RULER"))
                table.add_data(record.step, gi, ti, t.reward, format_messages(t.messages),
                               json.dumps(t.metrics), ruler, json.dumps(t.metadata))
        data[f"{record.split}/trajectories"] = table
        failed = [(gi, e) for gi, g in enumerate(record.groups) for e in g.exceptions]
        if failed:
            exc = wandb.Table(columns=["step", "group", "type", "message", "traceback"])
            for gi, e in failed:
                exc.add_data(record.step, gi, e.type, e.message, e.traceback)
            data[f"{record.split}/failed_rollouts"] = exc
        run.log(data)
        if self.log_checkpoints and record.split == "train" and record.checkpoint is not None \
                and Path(record.checkpoint).is_dir():
            artifact = wandb.Artifact(f"{run_id(record.model)}-lora", type="model",
                                      metadata={"step": record.step,
                                                "base_model": record.base_model})
            artifact.add_dir(str(record.checkpoint))
            run.log_artifact(artifact, aliases=[f"step-{record.step}", "latest"])

    def close(self) -> None:
        runs, self.runs = list(self.runs.values()), {}
        errors = []
        for run in runs:
            try:
                run.finish()
            except Exception as e:  # finish the others anyway
                errors.append(e)
        if errors:
            raise errors[0]
