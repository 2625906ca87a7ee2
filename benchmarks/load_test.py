"""Do rollouts keep flowing while the server trains? A bounded load test of `art serve`.

It starts `art serve` on 127.0.0.1 (or uses --url, which must be a loopback address), registers
a model (a tiny random llama built in a temp dir, or --base-model), rolls out one group to
train on, then fires --requests short chat completions (at most --concurrency at once, each
with --max-tokens) through the served OpenAI API while one training step runs: half at once,
then a training step starts, and the other half is sent the moment the gateway's gate closes
for training. Those wait at the gate and are served by the new step; none should fail. It prints completed /
failed / p50 / p99 latency and exits non-zero if any request failed.

    python benchmarks/load_test.py                           # tiny model, own server
    python benchmarks/load_test.py --base-model default      # the embedded SmolLM2-135M
    python benchmarks/load_test.py --url http://127.0.0.1:7999 --api-key $ART_API_KEY

Every loop is bounded by --requests and by --timeout; traffic goes to loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from art_core import (
    EngineConfig,
    ModelConfig,
    RemoteBackend,
    TrainableModel,
    TrainConfig,
    Trajectory,
    TrajectoryGroup,
)
from art_core.protocol import is_loopback_host


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(root: Path, api_key: str, timeout: float = 120.0
                 ) -> tuple[subprocess.Popen[bytes], str]:
    """`art serve` in a subprocess on a free loopback port; waits for /health."""
    import httpx

    port = free_port()
    log = (root / "server.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "art_core.cli", "serve", "--path", str(root / "run"),
         "--port", str(port), "--log-level", "warning"],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        env={**os.environ, "ART_API_KEY": api_key})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"art serve exited ({proc.returncode}); see {root / 'server.log'}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("art serve did not start in time")


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, int(round(q / 100 * len(ordered) + 0.5)) - 1))
    return ordered[k]


async def one_rollout(model: TrainableModel, client: Any, i: int, max_tokens: int
                      ) -> tuple[float, int | None, str | None, Trajectory | None]:
    """(latency s, serving step, error, trajectory) of one short chat completion."""
    msgs = [{"role": "user", "content": f"Tell me about the number {i}."}]
    t0 = time.perf_counter()
    try:
        r = await client.chat.completions.create(model=model.name, messages=msgs,
                                                 max_tokens=max_tokens, temperature=1.0)
    except Exception as e:  # a failure is a data point here, not a crash
        return time.perf_counter() - t0, None, f"{type(e).__name__}: {e}", None
    latency = time.perf_counter() - t0
    return latency, r.model_extra.get("art_step"), None, to_trajectory(msgs, r, float(i % 4))


def to_trajectory(msgs: list[dict[str, Any]], r: Any, reward: float) -> Trajectory:
    """A trainable trajectory from a gateway response (its exact sampled tokens)."""
    t = Trajectory(messages=list(msgs), reward=reward)
    t.add_completion(r)
    return t


async def run(args: argparse.Namespace) -> int:
    proc = None
    tmp = Path(tempfile.mkdtemp(prefix="art-load-"))
    api_key = args.api_key or os.environ.get("ART_API_KEY") or None
    if args.url:
        host = urlsplit(args.url).hostname or ""
        if not is_loopback_host(host):
            raise SystemExit(f"--url must be a loopback address (127.0.0.1, localhost, ::1), "
                             f"not {host!r}: this load test only targets this machine")
        url = args.url
    else:
        api_key = api_key or secrets.token_hex(16)
        proc, url = start_server(tmp, api_key)
    base_model = args.base_model
    if base_model is None:
        from art_core.testing.tiny import build_tiny_model

        base_model = str(build_tiny_model(tmp / "tiny-llama", "llama"))
    backend = RemoteBackend(url, api_key=api_key, progress_bar=False)
    model = TrainableModel(name=args.name, project="load-test", base_model=base_model,
                           config=ModelConfig(engine=EngineConfig(max_model_len=1024)))
    try:
        t0 = time.perf_counter()
        await model.register(backend)
        print(f"registered {model.name} on {url} in {time.perf_counter() - t0:.1f} s "
              f"(step {await model.get_step()})")
        client = model.openai_client(max_retries=0)  # a retried request would hide a failure
        warm = await asyncio.gather(*(one_rollout(model, client, i, args.max_tokens)
                                      for i in range(4)))
        group = TrajectoryGroup(trajectories=[t for *_, t in warm if t is not None])

        sem = asyncio.Semaphore(args.concurrency)
        done = asyncio.Event()
        finished = 0

        async def bounded(i: int) -> tuple[float, int | None, str | None, Trajectory | None]:
            nonlocal finished
            async with sem:
                result = await one_rollout(model, client, i, args.max_tokens)
            finished += 1
            if finished >= min(8, args.requests):
                done.set()
            return result

        first_wave = (args.requests + 1) // 2
        rollouts: list[asyncio.Task[Any]] = []

        def second_wave(event: dict[str, Any]) -> None:
            # the gate has closed for training: these requests must wait, not fail
            if event.get("phase") == "paused" and len(rollouts) == first_wave:
                rollouts.extend(asyncio.create_task(bounded(i))
                                for i in range(first_wave, args.requests))

        async def train_while_loaded() -> tuple[float, int]:
            await asyncio.wait_for(done.wait(), args.timeout)  # start under load
            t = time.perf_counter()
            res = await backend.train(model, [group], TrainConfig(learning_rate=1e-3),
                                      progress=second_wave)
            return time.perf_counter() - t, res.step

        t_load = time.perf_counter()
        rollouts.extend(asyncio.create_task(bounded(i)) for i in range(first_wave))
        train_s, step = await asyncio.wait_for(train_while_loaded(), args.timeout)
        second_wave({"phase": "paused"})  # in case the step ended before that event came
        results = await asyncio.wait_for(asyncio.gather(*rollouts), args.timeout)
        wall = time.perf_counter() - t_load

        latencies = [lat for lat, _, err, _ in results if err is None]
        errors = [err for _, _, err, _ in results if err is not None]
        by_step: dict[Any, int] = {}
        for _, s, err, _ in results:
            if err is None:
                by_step[s] = by_step.get(s, 0) + 1
        print(f"rollouts: {len(results)} sent ({first_wave} at once, the rest while the gate "
              f"was closed for training), concurrency {args.concurrency}, max_tokens "
              f"{args.max_tokens}, {wall:.1f} s wall")
        print(f"training step -> {step} in {train_s:.1f} s under load; completions per serving "
              f"step: {dict(sorted(by_step.items(), key=lambda kv: str(kv[0])))}")
        print(f"completed {len(latencies)}  failed {len(errors)}")
        if latencies:
            print(f"latency p50 {statistics.median(latencies):.2f} s  p99 "
                  f"{percentile(latencies, 99):.2f} s  max {max(latencies):.2f} s")
        for err in errors[:5]:
            print(f"  error: {err}")
        return 1 if errors else 0
    finally:
        await backend.close()
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="an `art serve` already running on this machine")
    p.add_argument("--api-key", help="its API key (default: $ART_API_KEY)")
    p.add_argument("--base-model", help="base model (default: a tiny random llama)")
    p.add_argument("--name", default="load-tiny", help="model name to register")
    p.add_argument("--requests", type=int, default=64, help="rollouts to send (bounded)")
    p.add_argument("--concurrency", type=int, default=64, help="rollouts in flight at once")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per completion")
    p.add_argument("--timeout", type=float, default=600.0, help="give up after this (s)")
    args = p.parse_args()
    if not 1 <= args.requests <= 10_000 or not 1 <= args.concurrency <= 1024:
        p.error("--requests must be 1..10000 and --concurrency 1..1024")
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
