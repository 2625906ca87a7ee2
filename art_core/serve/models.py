"""The model operations of `art serve` (art_core/serve/app.py): register, latest step, checkpoint
lists, deletion, downloads.

- Register and delete change a model, so they take the model's lock (`ArtServer._lock`): never
  while a step of that model is saving. Registration runs as a task of its own, shielded, so a
  client that goes away does not cut it in half.
- Read-only calls (step, checkpoint lists, downloads) only list the checkpoint directory.
- What a client may make the host load or run is the operator's choice (`_check_allowed`):
  `--allow-base-model PATTERN` limits the base models, and `engine.extra_args` /
  `engine.chat_template` from a client are refused unless the server allows engine args.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from art_core.backend.local import LocalBackend
from art_core.model import TrainableModel
from art_core.serve.errors import ApiError, validation_message
from art_core.storage import OPTIMIZER, STEP_RECORD, ModelDir

INTERNAL_FILES = frozenset({OPTIMIZER, STEP_RECORD})


class ModelOperations:
    """A part of `ArtServer`, which sets up the state below and provides the helpers
    `_lock`, `_spawn`, `_model_dir` and `_client_error`."""

    backend: LocalBackend
    models: dict[tuple[str, str], TrainableModel]  # registered in this process
    _names: dict[str, str]  # served name -> its project
    base_models: tuple[str, ...]  # glob patterns; empty: any base model
    allow_engine_args: bool
    _lock: Callable[[str, str], asyncio.Lock]
    _spawn: Callable[[Awaitable[Any]], asyncio.Task[Any]]
    _model_dir: Callable[[str, str], ModelDir]
    _client_error: Callable[[BaseException, str], ApiError]

    async def register(self, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object (a TrainableModel)")
        spec = {k: v for k, v in body.items() if k not in ("base_url", "api_key")}
        try:
            model = TrainableModel.model_validate(spec)
        except ValidationError as e:
            raise ApiError(400, validation_message(e, "model")) from None
        self._check_allowed(model)
        key = (model.project, model.name)
        # The gateway serves models by name alone, so one name belongs to one project.
        owner = self._names.setdefault(model.name, model.project)
        if owner != model.project:
            raise ApiError(409, f"model name {model.name!r} is already served for project "
                           f"{owner!r}; served names are unique across projects",
                           "name_conflict")
        try:
            # a task of its own, shielded: a client that goes away does not cut it in half
            await asyncio.shield(self._spawn(self._register(model)))
        except Exception as e:
            if key not in self.models:
                self._names.pop(model.name, None)
            raise self._client_error(e, "register") from None
        steps = self._model_dir(*key).steps()
        return {"name": model.name, "project": model.project, "base_model": model.base_model,
                "step": steps[-1] if steps else 0}

    def _check_allowed(self, model: TrainableModel) -> None:
        """Refuse what the operator did not allow clients to make this host load or run."""
        if self.base_models and not any(fnmatch.fnmatchcase(model.base_model, pattern)
                                        for pattern in self.base_models):
            raise ApiError(403, f"base_model {model.base_model!r} is not allowed on this server;"
                           f" allowed: {list(self.base_models)} (art serve --allow-base-model)",
                           "base_model_not_allowed")
        engine = model.config.engine
        refused = [f for f, v in (("engine.extra_args", engine.extra_args),
                                  ("engine.chat_template", engine.chat_template)) if v]
        if refused and not self.allow_engine_args:
            raise ApiError(403, f"{' and '.join(refused)} pass vLLM flags or server file paths; "
                           "this server refuses them from clients (start it with "
                           "--allow-engine-args to allow them)", "engine_args_not_allowed")

    async def _register(self, model: TrainableModel) -> None:
        async with self._lock(model.project, model.name):
            await self.backend.register(model)
            self.models[(model.project, model.name)] = model

    def get_step(self, project: str, name: str) -> dict[str, Any]:
        md = self._existing(project, name)
        steps = md.steps()
        if not steps:
            raise ApiError(404, f"model {project}/{name} has no checkpoint: register it",
                           "model_not_found")
        return {"step": steps[-1]}

    def list_checkpoints(self, project: str, name: str) -> dict[str, Any]:
        md = self._existing(project, name)
        steps = md.steps()
        metrics: dict[int, dict[str, float]] = {}
        with contextlib.suppress(OSError, ValueError):
            for row in md.read_history():
                if isinstance(row.get("step"), int):
                    metrics[row["step"]] = {k: float(v) for k, v in row.items() if k != "step"
                                            and isinstance(v, int | float)
                                            and not isinstance(v, bool)}
        return {"latest": steps[-1] if steps else None,
                "checkpoints": [{"step": s, "metrics": metrics.get(s, {})} for s in steps]}

    async def delete_checkpoints(self, project: str, name: str, metric: str) -> dict[str, Any]:
        if not isinstance(metric, str) or not 0 < len(metric) <= 128:
            raise ApiError(400, "best_checkpoint_metric must be a metric name (1-128 chars)")
        self._existing(project, name)
        model = self.models.get((project, name)) or TrainableModel(name=name, project=project)
        async with self._lock(project, name):  # never while a step of this model is saving
            deleted = await self.backend.delete_checkpoints(model, metric)
        return {"deleted": deleted}

    def checkpoint_files(self, project: str, name: str, step: str) -> tuple[Path, list[Path]]:
        md = self._existing(project, name)
        s = self._parse_step(step)
        if s not in md.steps():
            raise ApiError(404, f"model {project}/{name} has no checkpoint {s}; steps: "
                           f"{md.steps()}", "checkpoint_not_found")
        d = md.checkpoint(s)
        # the peft adapter a user takes home; the optimizer state and step record stay here
        files = sorted(p for p in d.iterdir() if p.is_file() and not p.is_symlink()
                       and p.name not in INTERNAL_FILES)
        return d, files

    # ---- helpers ---------------------------------------------------------------------------

    def _existing(self, project: str, name: str) -> ModelDir:
        md = self._model_dir(project, name)
        if not md.path.is_dir():
            raise ApiError(404, f"model {project}/{name} does not exist on this server: "
                           "register it first", "model_not_found")
        return md

    @staticmethod
    def _parse_step(step: str) -> int:
        if not step.isdigit() or len(step) > 9:
            raise ApiError(400, f"invalid step {step!r}: a non-negative integer", "invalid_step")
        return int(step)
