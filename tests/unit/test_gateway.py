"""Gateway logic that needs no engine: the gate, name resolution, the bounded ledger."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from art_core.inference.engine import VLLMEngine
from art_core.inference.gateway import Gateway, GatewayError, ServedModel


def gateway_with_model(tmp_path: Path) -> Gateway:
    gw = Gateway(drain_timeout_s=5)
    engine = VLLMEngine(str(tmp_path), served_name="base-model")
    engine.adapters = {"m@0": "x", "m@1": "y"}  # as if loaded
    gw.add_engine(engine)
    gw.models["m"] = ServedModel("m", engine, checkpoints={0: tmp_path, 1: tmp_path}, latest=1)
    return gw


@pytest.mark.parametrize(
    ("requested", "upstream", "step"),
    [("m", "m@1", 1), ("m@0", "m@0", 0), ("m@1", "m@1", 1), ("base-model", "base-model", None)],
)
async def test_resolve(tmp_path, requested, upstream, step):
    route = await gateway_with_model(tmp_path).resolve(requested)
    assert (route.upstream, route.step) == (upstream, step)


@pytest.mark.parametrize(
    ("requested", "status", "needle"),
    [("nope", 404, "does not exist"), ("m@7", 404, "no step 7"), ("m@x", 400, "invalid step"),
     ("", 400, "required"), (None, 400, "required"), (3, 400, "string")],
)
async def test_resolve_errors(tmp_path, requested, status, needle):
    with pytest.raises(GatewayError) as e:
        await gateway_with_model(tmp_path).resolve(requested)
    assert e.value.status == status and needle in e.value.message


async def test_pause_waits_for_running_requests_then_holds_new_ones(tmp_path):
    gw = gateway_with_model(tmp_path)
    gw.enter()  # a request in flight
    pause = asyncio.create_task(gw.pause())
    await asyncio.sleep(0.05)
    assert not pause.done(), "pause must wait for the running request"
    waiting = asyncio.create_task(gw.wait_gate())
    gw.exit()
    await asyncio.wait_for(pause, 1)
    await asyncio.sleep(0.05)
    assert gw.paused and not waiting.done(), "new requests wait while paused"
    gw.resume()
    await asyncio.wait_for(waiting, 1)


async def test_pause_gives_up_waiting_after_the_drain_timeout(tmp_path):
    gw = gateway_with_model(tmp_path)
    gw.drain_timeout_s = 0.1
    gw.enter()  # a request whose client vanished and never finishes
    await asyncio.wait_for(gw.pause(), 1)
    assert gw.paused and gw.in_flight == 1


async def test_gate_timeout_is_a_clear_503(tmp_path):
    gw = gateway_with_model(tmp_path)
    gw.gate_timeout_s = 0.05
    await gw.pause()
    with pytest.raises(GatewayError) as e:
        await gw.wait_gate()
    assert e.value.status == 503 and "training" in e.value.message


def test_ledger_is_bounded(tmp_path):
    gw = gateway_with_model(tmp_path)
    gw.ledger.size = 3
    for i in range(5):
        gw.ledger.add({"id": f"r{i}"})
    assert list(gw.ledger) == ["r2", "r3", "r4"]
