"""Runs inside vLLM's worker, mixed in by `--worker-extension-cls` (vLLM's extension point for
RL weight updates), for merged serving (`EngineConfig.serve_merged`).

`art_load_merged(base_dir, adapter_dir, dtype)`, called through vLLM's `/collective_rpc`:
the worker reads the adapter (a few MB), streams base + LoRA tensor by tensor
(`art_core.inference.merge.merged_weights`) into its own in-place reload, and returns
`{"loaded": number of tensors}`. Before this, the trainer's process wrote the whole merged
checkpoint to disk and vLLM read it back: measured on SmolLM2-135M, 0.7-1.6 s for the merge
and write alone, against ~0.1 s for the fused merge here (the whole load is now 0.37-0.46 s,
most of it vLLM re-packing its oneDNN weights).

This module is imported by vLLM, in its worker: keep its imports light and inside the method.
"""

from __future__ import annotations

from typing import Any


class MergedLoraWorker:
    """Methods added to vLLM's worker class (their names must not clash with the worker's)."""

    def art_load_merged(self: Any, base_dir: str, adapter_dir: str, dtype: str | None
                        ) -> dict[str, int]:
        from art_core.inference.merge import merged_weights

        # checked before vLLM starts its reload: a bad adapter leaves the served weights alone
        weights = merged_weights(base_dir, adapter_dir, dtype)
        count = 0

        def counted() -> Any:
            nonlocal count
            for item in weights:
                count += 1
                yield item

        self.reload_weights(weights_iterator=counted(), is_checkpoint_format=True)
        return {"loaded": count}
