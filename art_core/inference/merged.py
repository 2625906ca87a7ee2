"""Merged serving's state on one engine (`EngineConfig.serve_merged`): which step is merged into
vLLM's weights, and the delta LoRAs that serve every other name beside it.

- merge(name, path): vLLM's worker adds the step's W + BA to the base weights in place
  (/collective_rpc to art_core/inference/vllm_worker.py), then vLLM's prefix cache is dropped;
  every delta is unloaded first, since each was the difference from the weights before.
- delta(name, path): any other adapter (None: the base) is served as a runtime LoRA of its
  difference from the merged weights (`merge.write_delta`, rank r_k + r_n), written to a
  temporary directory and loaded under `<name>~<merged name>`, a fresh vLLM name per merged
  step, so that no prefix-cache block of another step is reused.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from art_core.inference.vllm_args import EngineError

Post = Callable[[str, dict[str, Any] | None], dict[str, Any]]


class MergedWeights:
    def __init__(self, model_path: str, dtype: str | None, post: Post) -> None:
        self.model_path, self.dtype, self._post = model_path, dtype, post
        self.name: str | None = None  # the adapter merged into vLLM's weights
        self.path = ""
        self.deltas: dict[str, str] = {}  # served name -> vLLM LoRA name
        self._root: Path | None = None

    def merge(self, name: str, path: str) -> list[str]:
        """Merge adapter `path` into vLLM's weights; the names whose deltas were dropped (the
        step merged before is one of them: it is served as a delta when asked for)."""
        from art_core.inference.merge import MergeError, merged_weights

        try:  # checked here too, so that a bad adapter is an EngineError that names it
            merged_weights(self.model_path, path, self.dtype).close()
        except MergeError as e:
            raise EngineError(f"cannot merge {name} into {self.model_path}: {e}") from None
        previous = self.name
        dropped = self.drop_deltas() if previous != name else []  # not a restart
        out = self._post("/collective_rpc", {"method": "art_load_merged", "kwargs": {
            "base_dir": self.model_path, "adapter_dir": path, "dtype": self.dtype}})
        results = out.get("results") or [None]
        if not all(isinstance(r, dict) and r.get("loaded") for r in results):
            raise EngineError(f"vLLM loaded no merged weights for {name}: {out}")
        self._post("/reset_prefix_cache", None)  # cached KV blocks came from the old weights
        self.name, self.path = name, path
        return dropped + ([previous] if previous not in (None, name) else [])

    def delta(self, name: str, path: str | None) -> None:
        """Serve `name` (adapter `path`; None: the base) as a LoRA of its difference from the
        merged weights; with nothing merged (its restore failed), the adapter itself."""
        from art_core.inference.merge import MergeError, write_delta

        if self.name is None:
            self._post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
            self.deltas[name] = name
            return
        upstream = self.deltas.get(name) or f"{name}~{self.name}"
        if self._root is None:
            self._root = Path(tempfile.mkdtemp(prefix="art-deltas-"))
        out = self._root / upstream.replace("/", "_")
        if not (out / "adapter_model.safetensors").is_file():
            try:
                write_delta(self.path, path, out)
            except MergeError as e:
                raise EngineError(f"cannot serve {name} beside the merged {self.name}: {e}"
                                  ) from None
        self._post("/v1/load_lora_adapter", {"lora_name": upstream, "lora_path": str(out)})
        self.deltas[name] = upstream

    def drop_deltas(self) -> list[str]:
        """Unload every delta and forget it; the names it served."""
        import httpx

        for upstream in self.deltas.values():
            # vLLM restarting: it comes back without them
            with contextlib.suppress(EngineError, httpx.HTTPError):
                self._post("/v1/unload_lora_adapter", {"lora_name": upstream})
            if self._root is not None:
                shutil.rmtree(self._root / upstream.replace("/", "_"), ignore_errors=True)
        names = list(self.deltas)
        self.deltas.clear()
        return names

    def forget(self, name: str) -> str:
        """Forget `name`'s delta and its files (built again if asked for); the vLLM name to
        unload."""
        upstream = self.deltas.pop(name, name)
        if self._root is not None and upstream != name:
            shutil.rmtree(self._root / upstream.replace("/", "_"), ignore_errors=True)
        return upstream

    def lost(self) -> None:
        """The merged step could not be merged again after a restart: vLLM has the base."""
        self.name = None
        self.deltas.clear()

    def close(self) -> None:
        """vLLM stopped: nothing is loaded; a new start builds the deltas again."""
        self.deltas.clear()
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None
