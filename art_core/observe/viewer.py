"""`art view`: a read-only local web page to browse a run directory.

It reads the files the backend writes, on every request (so it follows a run that is still
training): for each model `<project>/models/<name>/`, history.jsonl (metrics per step), the
journal (the groups each step trained on) and the groups of other splits logged with
`model.log(..., split="val")`. The page (static/viewer.html) lists models and steps with their
reward, a step's groups, and a group's trajectories side by side.

Safety: it binds 127.0.0.1 only and serves GET/HEAD on a fixed set of routes; every name in a
URL is validated (the same rule as model names) and must be one of the models or splits found,
steps and group numbers are plain integers, and a path that resolves outside the run directory
(a symlink) is refused. Anything else is a 404.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from art_core.model import validate_name
from art_core.sampling import signal_rule
from art_core.storage import ModelDir, read_jsonl
from art_core.trajectory import TrajectoryGroup, continues, split_reason

log = logging.getLogger(__name__)

_STEP = re.compile(r"\d{1,9}")


class NotFound(Exception):
    """The URL names nothing in the run directory."""


def locate(path: str | Path) -> tuple[Path, str | None, str | None]:
    """(run directory, project, model name) for what a user may point at: a LocalBackend's
    path, a project directory (`<path>/<project>`, which holds `models/`) or a model directory
    (`<path>/<project>/models/<name>`, the one the demo prints). project/name are None when
    the whole run is meant."""
    p = Path(path).resolve()
    if (p / "models").is_dir() and not (p / "history.jsonl").exists():
        return p.parent, p.name, None
    if p.parent.name == "models" and ((p / "checkpoints").is_dir() or (p / "model.json").exists()
                                      or (p / "history.jsonl").exists()):
        return p.parent.parent.parent, p.parent.parent.name, p.name
    return p, None, None


class RunView:
    """Read-only queries on a run directory (the `path` of a LocalBackend), or on one project
    or model of it."""

    def __init__(self, root: str | Path, project: str | None = None,
                 name: str | None = None) -> None:
        self.root = Path(root).resolve()
        self.only = (project, name)

    # ---- lookup ----------------------------------------------------------------------------

    def model_dirs(self) -> list[ModelDir]:
        """Every model directory under the root: <project>/models/<name>/ (never the base-model
        cache of ART_HOME, which may sit inside a run directory: `.art/home`)."""
        from art_core.base_models import art_home

        cache = art_home().resolve()
        project, name = self.only
        found = []
        for d in sorted(self.root.glob("*/models/*")):
            if d.parent.parent.resolve() == cache or d.name.startswith("."):
                continue
            if (project and d.parent.parent.name != project) or (name and d.name != name):
                continue
            if d.is_dir() and _inside(d, self.root):
                try:
                    found.append(ModelDir(self.root, d.parent.parent.name, d.name))
                except ValueError:
                    continue  # a directory whose name is not a valid model name: not ours
        return found

    def model(self, project: str, name: str) -> ModelDir:
        try:
            md = ModelDir(self.root, validate_name(project), validate_name(name))
        except ValueError:
            raise NotFound(f"no model {project}/{name}") from None
        if not md.path.is_dir() or not _inside(md.path, self.root):
            raise NotFound(f"no model {project}/{name}")
        return md

    def splits(self, md: ModelDir) -> list[str]:
        """"train" (the journal) and every split logged with model.log (a directory of steps)."""
        out = ["train"] if md.journal.is_dir() else []
        for d in sorted(md.path.iterdir()):
            if d.is_dir() and d.name not in ("checkpoints", "journal") and \
                    any(p.stem.isdigit() for p in d.glob("*.jsonl")):
                out.append(d.name)
        return out

    def _steps_file(self, md: ModelDir, split: str, step: str | int) -> Path:
        if split not in self.splits(md) or not _STEP.fullmatch(str(step)):
            raise NotFound(f"no split {split!r} step {step!r}")
        base = md.journal if split == "train" else md.split_dir(split)
        path = base / f"{int(step):04d}.jsonl"
        if not path.is_file() or not _inside(path, self.root):
            raise NotFound(f"no step {step} in split {split}")
        return path

    def _groups(self, md: ModelDir, split: str, step: str | int) -> list[TrajectoryGroup]:
        path = self._steps_file(md, split, step)
        groups = []
        for row in read_jsonl(path):  # a line being written is skipped, not an error
            try:
                groups.append(TrajectoryGroup.model_validate(row))
            except ValueError:
                log.warning("%s: a line is not a trajectory group; skipped", path)
        return groups

    # ---- API -------------------------------------------------------------------------------

    def models(self) -> list[dict[str, Any]]:
        out = []
        for md in self.model_dirs():
            info = md.read_model_json() or {}
            history = md.read_history()
            out.append({"project": md.path.parent.parent.name, "name": md.path.name,
                        "base_model": info.get("base_model"), "steps": len(history),
                        "checkpoints": md.steps(),
                        "reward_mean": history[-1].get("reward_mean") if history else None})
        return out

    def model_summary(self, project: str, name: str) -> dict[str, Any]:
        md = self.model(project, name)
        splits: dict[str, list[dict[str, Any]]] = {}
        for split in self.splits(md):
            base = md.journal if split == "train" else md.split_dir(split)
            history = md.read_history() if split == "train" else \
                read_jsonl(base / "history.jsonl")
            by_step: dict[int, dict[str, Any]] = {}
            for row in history:
                if isinstance(row.get("step"), int):
                    by_step[row["step"]] = row  # the last row of a step wins (a replay)
            rows = []
            for p in sorted(base.glob("*.jsonl")):
                if not p.stem.isdigit() or not _inside(p, self.root):
                    continue
                step = int(p.stem)
                metrics = by_step.get(step)
                if metrics is None:  # journaled, not trained yet (or interrupted): from groups
                    from art_core.observe.base import group_metrics

                    metrics = group_metrics(self._groups(md, split, step))
                    metrics["pending"] = True
                rows.append({"step": step, **_finite(metrics)})
            splits[split] = rows
        return {"project": project, "name": name, "model": md.read_model_json(),
                "checkpoints": md.steps(), "splits": splits}

    def _trains(self, md: ModelDir, split: str, step: str | int) -> Callable[[TrajectoryGroup],
                                                                             bool]:
        """Whether the step trained a group, by the trainer's rule for the step's credit (its
        history row's `advantage`; rows written before it was recorded: per-turn where the
        turn estimator's statistic is there). Groups of other splits are never trained."""
        if split != "train":
            return lambda group: False
        row = md.history_row(int(step)) or {}
        turn = row.get("advantage") == "turn" or "turn_advantage_abs_mean" in row
        return signal_rule("turn" if turn else "group")

    def step_groups(self, project: str, name: str, split: str, step: str) -> dict[str, Any]:
        md = self.model(project, name)
        groups = self._groups(md, split, step)
        trains = self._trains(md, split, step)
        rows = []
        for i, g in enumerate(groups):
            rewards = g.rewards
            rows.append({
                "index": i, "rewards": rewards, "trajectories": len(g.trajectories),
                "exceptions": [{"type": e.type, "message": e.message} for e in g.exceptions],
                "metadata": g.metadata, "trained": trains(g),
                "reward_mean": sum(rewards) / len(rewards) if rewards else None,
                "scenario": _first_user_text(g),
            })
        return {"split": split, "step": int(step), "groups": rows}

    def group(self, project: str, name: str, split: str, step: str, index: str) -> dict[str, Any]:
        md = self.model(project, name)
        groups = self._groups(md, split, step)
        if not _STEP.fullmatch(index) or int(index) >= len(groups):
            raise NotFound(f"no group {index}")
        g = groups[int(index)]
        trained = self._trains(md, split, step)(g)
        return {
            "split": split, "step": int(step), "index": int(index), "trained": trained,
            "metadata": g.metadata,
            "exceptions": [e.model_dump() for e in g.exceptions],
            "trajectories": [_trajectory_view(t, trained) for t in g.trajectories],
        }


def _inside(path: Path, root: Path) -> bool:
    """True when `path` (symlinks resolved) is within `root`."""
    try:
        return path.resolve().is_relative_to(root)
    except OSError:
        return False


def _finite(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items()
            if not (isinstance(v, float) and not math.isfinite(v))}


def _first_user_text(g: TrajectoryGroup) -> str:
    for t in g.trajectories:
        for m in t.messages:
            if m.get("role") == "user" and isinstance(m.get("content"), str):
                return m["content"][:200]
    return ""


def _history_view(h: Any, trained: bool) -> dict[str, Any]:
    """Messages with, per assistant message, whether it was sampled (and trained) and how."""
    turns = {t.message_index: t for t in h.turns}
    messages = []
    previous = None
    for i, m in enumerate(h.messages):
        view = dict(m)
        turn = turns.get(i)
        if m.get("role") == "assistant":
            split = turn is not None and previous is not None and not continues(turn, previous)
            view["_art"] = {
                "sampled": turn is not None, "trained": trained and turn is not None,
                # a new training sequence starts here, and why (None: it extends the one before)
                "split": split_reason(turn) if split and turn else None,
                "step": turn.step if turn else None,
                "latency_s": turn.latency_s if turn else None,
                "prompt_tokens": len(turn.prompt_token_ids) if turn else None,
                "completion_tokens": len(turn.completion_token_ids) if turn else None,
                "finish_reason": turn.finish_reason if turn else None,
                "reward": turn.reward if turn else None,  # this turn's own (per-turn credit)
            }
            previous = turn or previous
        messages.append(view)
    return {"messages": messages, "tools": [t.get("function", {}).get("name") for t in
                                            h.tools or []]}


def _trajectory_view(t: Any, trained: bool) -> dict[str, Any]:
    ruler = [line for line in t.logs if line.startswith("RULER")]
    return {
        "reward": t.reward, "metrics": t.metrics, "metadata": t.metadata,
        "logs": t.logs, "ruler": ruler, **_history_view(t, trained),
        "additional": [_history_view(h, trained) for h in t.additional_histories],
    }


class _Handler(BaseHTTPRequestHandler):
    view: RunView
    server_version = "art-view"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the stdlib's name)
        log.debug("view: " + format, *args)

    def do_HEAD(self) -> None:  # noqa: N802 (the stdlib's name)
        self._serve(head=True)

    def do_GET(self) -> None:  # noqa: N802
        self._serve(head=False)

    def _serve(self, head: bool) -> None:
        path = urlsplit(self.path).path
        try:
            if path in ("/", "/index.html"):
                page = resources.files("art_core.observe").joinpath("static/viewer.html").read_bytes()
                return self._send(200, page, "text/html; charset=utf-8", head)
            parts = [unquote(p) for p in path.split("/")[1:]]
            if parts[:2] != ["api", "models"] or any(p in ("", ".", "..") for p in parts[2:]):
                raise NotFound(path)
            args = parts[2:]
            routes = {0: self.view.models, 2: self.view.model_summary,
                      4: self.view.step_groups, 5: self.view.group}
            if len(args) not in routes:
                raise NotFound(path)
            body = json.dumps(routes[len(args)](*args)).encode()
            self._send(200, body, "application/json", head)
        except NotFound as e:
            self._send(404, json.dumps({"error": f"not found: {e}"}).encode(),
                       "application/json", head)
        except Exception as e:  # a file mid-write, an unreadable file: say so, keep serving
            log.exception("view: %s", path)
            self._send(500, json.dumps({"error": f"{type(e).__name__}: {e}"}).encode(),
                       "application/json", head)

    def _send(self, status: int, body: bytes, ctype: str, head: bool) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def send_error(self, code: int, message: str | None = None,
                   explain: str | None = None) -> None:
        """Other methods (POST, ...) and malformed requests: no stdlib HTML page."""
        if code == HTTPStatus.NOT_IMPLEMENTED:
            code = HTTPStatus.METHOD_NOT_ALLOWED
        self._send(code, json.dumps({"error": message or ""}).encode(), "application/json",
                   head=False)


def make_server(root: str | Path, port: int = 0) -> ThreadingHTTPServer:
    """A viewer server for `root` on 127.0.0.1:`port` (0: any free port); not yet serving."""
    if not Path(root).is_dir():
        raise FileNotFoundError(f"run directory {root} does not exist")
    handler = type("Handler", (_Handler,), {"view": RunView(*locate(root))})
    server = ThreadingHTTPServer(("127.0.0.1", port), handler)
    server.daemon_threads = True
    return server


def serve(root: str | Path, port: int = 8090) -> None:
    """Serve the viewer until interrupted."""
    server = make_server(root, port)
    print(f"art view: http://127.0.0.1:{server.server_address[1]}/  (run dir {root}; Ctrl+C "
          "stops)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
