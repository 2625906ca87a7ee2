"""What a user sees when vLLM dies under load: a fault run of `art serve` (beside load_test.py).

It starts `art serve` on 127.0.0.1 with a tiny random llama (or --base-model), sends
--requests chat completions (at most --concurrency at once, each --max-tokens long, no client
retries), and --kill-after seconds in SIGKILLs vLLM's server process, as an OOM kill would.
The supervisor restarts it; requests in flight wait for the restart and are sent again once,
new ones wait too, and what cannot be served in time gets a 503 that says the engine restarted.
It probes `/health` every 50 ms throughout and prints: requests succeeded / failed with a 503
that names the restart / failed otherwise (the goal: 0), the seconds from the kill to the first
completion served by the new engine, and the slowest `/health` answer.

    python benchmarks/engine_kill.py
    python benchmarks/engine_kill.py --requests 200 --concurrency 32 --kill-after 3
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load_test import start_server  # noqa: E402  (the same server start as the load test)

from art_core import EngineConfig, ModelConfig, RemoteBackend, TrainableModel  # noqa: E402


def vllm_server_pid(server_pid: int) -> int:
    """vLLM's API server: the watchdog's child, the watchdog a child of `art serve`."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    for watchdog in children.get(server_pid, []):
        cmd = Path(f"/proc/{watchdog}/cmdline").read_bytes()
        if b"_watchdog" in cmd and children.get(watchdog):
            return min(children[watchdog])
    raise SystemExit("no vLLM process found under the server")


async def run(args: argparse.Namespace) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="art-kill-"))
    api_key = secrets.token_hex(16)
    proc, url = start_server(tmp, api_key)
    base_model = args.base_model
    if base_model is None:
        from art_core.testing.tiny import build_tiny_model

        base_model = str(build_tiny_model(tmp / "tiny-llama", "llama"))
    backend = RemoteBackend(url, api_key=api_key, progress_bar=False)
    model = TrainableModel(name="kill-tiny", project="faults", base_model=base_model,
                           config=ModelConfig(engine=EngineConfig(max_model_len=1024)))
    try:
        await model.register(backend)
        client = model.openai_client(max_retries=0)  # a client retry would hide a failure
        sem = asyncio.Semaphore(args.concurrency)
        killed_at: list[float] = []
        served_after: list[float] = []
        counts = {"ok": 0, "503 engine restarted": 0, "other": 0}
        others: list[str] = []

        async def one(i: int) -> None:
            async with sem:
                try:
                    await client.chat.completions.create(
                        model=model.name, max_tokens=args.max_tokens, temperature=1.0,
                        messages=[{"role": "user", "content": f"Tell me about {i}."}])
                    counts["ok"] += 1
                    if killed_at and not served_after:
                        served_after.append(time.perf_counter() - killed_at[0])
                except openai.APIStatusError as e:
                    if e.status_code == 503 and "restart" in str(e):
                        counts["503 engine restarted"] += 1
                    else:
                        counts["other"] += 1
                        others.append(f"{type(e).__name__}: {e}")
                except Exception as e:  # noqa: BLE001 - a failure is a data point here
                    counts["other"] += 1
                    others.append(f"{type(e).__name__}: {e}")

        async def kill() -> None:
            await asyncio.sleep(args.kill_after)
            pid = vllm_server_pid(proc.pid)
            os.kill(pid, signal.SIGKILL)
            killed_at.append(time.perf_counter())
            print(f"killed vLLM (pid {pid}) at {args.kill_after:.1f} s", flush=True)

        health: list[float] = []
        stop = asyncio.Event()

        async def probe() -> None:
            async with httpx.AsyncClient(timeout=5) as c:
                while not stop.is_set():
                    t0 = time.perf_counter()
                    await c.get(url + "/health")
                    health.append(time.perf_counter() - t0)
                    await asyncio.sleep(0.05)

        prober = asyncio.ensure_future(probe())
        t0 = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(kill(), *(one(i) for i in range(args.requests))),
                               args.timeout)
        stop.set()
        await prober
        print(f"{args.requests} requests, concurrency {args.concurrency}, max_tokens "
              f"{args.max_tokens}, {time.perf_counter() - t0:.1f} s wall")
        print("  ".join(f"{k} {v}" for k, v in counts.items()))
        if served_after:
            print(f"serving again {served_after[0]:.1f} s after the kill")
        print(f"/health: {len(health)} probes, slowest {max(health) * 1000:.0f} ms")
        for err in others[:5]:
            print(f"  other error: {err}")
        print(f"failed otherwise: {counts['other']}")
        return 1 if counts["other"] else 0
    finally:
        await backend.close()
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-model", help="base model (default: a tiny random llama)")
    p.add_argument("--requests", type=int, default=120, help="requests to send (bounded)")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight at once")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per completion")
    p.add_argument("--kill-after", type=float, default=2.0, help="seconds before the kill")
    p.add_argument("--timeout", type=float, default=600.0, help="give up after this (s)")
    args = p.parse_args()
    if not 1 <= args.requests <= 10_000 or not 1 <= args.concurrency <= 1024:
        p.error("--requests must be 1..10000 and --concurrency 1..1024")
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
