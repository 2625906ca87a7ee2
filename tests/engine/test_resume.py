"""Resume: SIGKILL a process in the middle of a training step, then continue on the same directory.

A worker process registers a tiny model, trains step 1, journals step 2 and is killed while step 2
trains. Then: its vLLM processes are gone too (no orphans), step 1 is the latest complete checkpoint, a
half-written checkpoint is cleaned up, the journaled groups of step 2 are intact and can be
trained again.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from art_core import TrainableModel
from tests.support.engine import tiny_config

pytestmark = pytest.mark.engine

WORKER = textwrap.dedent("""
    import asyncio, sys
    from art_core import LocalBackend, TrainableModel, TrainConfig, Trajectory, TrajectoryGroup
    from art_core import EngineConfig, ModelConfig

    root, base = sys.argv[1], sys.argv[2]

    async def rollout(model, i):
        t = Trajectory(messages=[{"role": "user", "content": f"count {i}"}])
        r = await model.openai_client().chat.completions.create(
            model=model.name, messages=t.messages, max_tokens=16, temperature=1.0)
        t.add_completion(r)
        t.reward = float(i % 3)
        return t

    async def main():
        backend = LocalBackend(root)
        model = TrainableModel(name="resume", project="resume", base_model=base,
                               config=ModelConfig(engine=EngineConfig(max_model_len=1024)))
        await model.register(backend)
        print("VLLM_PID", backend._engines[base]._proc.pid, flush=True)
        group = TrajectoryGroup(trajectories=await asyncio.gather(
            *[rollout(model, i) for i in range(6)]))
        await model.train([group])
        print("STEP1_DONE", flush=True)
        big = [TrajectoryGroup(trajectories=await asyncio.gather(
            *[rollout(model, i) for i in range(24)])) for _ in range(2)]
        # one sequence per micro-batch and no bf16: a slow step, so the kill lands inside it
        await model.train(big, TrainConfig(micro_batch_size=1, bf16=False))
        print("STEP2_DONE", flush=True)

    asyncio.run(main())
""")


def _group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group: vLLM's server, engine core, workers."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


async def test_sigkill_mid_step_then_resume(backend, run_root, tiny_models, tmp_path):
    base = str(tiny_models["llama"])
    md_path = run_root / "resume" / "models" / "resume"
    log = (tmp_path / "worker.log").open("w+")
    proc = subprocess.Popen([sys.executable, "-c", WORKER, str(run_root), base],
                            stdout=subprocess.PIPE, stderr=log, text=True)
    vllm_pid = None
    try:
        deadline = time.monotonic() + 300
        for line in proc.stdout:  # type: ignore[union-attr]
            if line.startswith("VLLM_PID"):
                vllm_pid = int(line.split()[1])
            if line.startswith("STEP1_DONE"):
                break
            assert time.monotonic() < deadline
        else:
            log.seek(0)
            pytest.fail(f"worker ended before step 1:\n{log.read()[-3000:]}")
        journal = md_path / "journal" / "0002.jsonl"
        while not journal.exists():  # the step journals its groups before it trains
            assert proc.poll() is None, "worker exited before journaling step 2"
            time.sleep(0.01)
        time.sleep(0.3)  # inside the step now
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert vllm_pid is not None
    for _ in range(300):  # the watchdog takes vLLM's whole process group down with its parent
        if not _group_members(vllm_pid):
            break
        time.sleep(0.1)
    assert not _group_members(vllm_pid), "vLLM processes outlived the killed process"

    ckpts = md_path / "checkpoints"
    assert not (ckpts / "0002").exists(), "the step was not interrupted: make it slower"
    # a half-written checkpoint, as a kill during the save would leave it
    (ckpts / ".tmp-0002").mkdir(exist_ok=True)
    (ckpts / ".tmp-0002" / "adapter_model.safetensors").write_bytes(b"partial")

    model = TrainableModel(name="resume", project="resume", base_model=base, config=tiny_config())
    await model.register(backend)
    assert await model.get_step() == 1
    assert not (ckpts / ".tmp-0002").exists()
    md = backend._dir(model)
    assert md.interrupted_steps() == [2]
    journaled = md.journaled(2)
    assert journaled is not None and [len(g) for g in journaled] == [24, 24]
    results = await backend.replay_interrupted(model)
    assert [r.step for r in results] == [2]
    assert await model.get_step() == 2 and md.interrupted_steps() == []
    r = await model.openai_client().chat.completions.create(
        model=model.name, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert r.model == "resume@2"
