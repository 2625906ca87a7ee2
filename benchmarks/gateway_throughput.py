"""Gateway overhead: the same batch of requests sent directly to vLLM and through the gateway.

Rounds alternate (direct, gateway, direct, ...) so drift in machine load hits both alike. Every
request generates exactly --max-tokens tokens (`ignore_eos`), and both paths send the identical
body the gateway sends upstream (logprobs + token ids), so the ratio isolates the gateway's own
cost: parsing, recording, relaying. The last line is `ratio: <gateway/direct>`.

    .venv/bin/python benchmarks/gateway_throughput.py [--concurrency 8] [--rounds 4] [--tiny]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time

import httpx

from art_core import LocalBackend, TrainableModel
from art_core.config import EngineConfig, ModelConfig


async def batch(client: httpx.AsyncClient, url: str, model: str, n: int, max_tokens: int
                ) -> tuple[int, float]:
    body = {"messages": [{"role": "user", "content": "Write a long story about the sea."}],
            "max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True,
            "logprobs": True, "return_token_ids": True}

    async def one(i: int) -> int:
        r = await client.post(url, json={**body, "model": model, "seed": i})
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]

    t0 = time.perf_counter()
    tokens = await asyncio.gather(*[one(i) for i in range(n)])
    return sum(tokens), time.perf_counter() - t0


async def run(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as root:
        base = None
        if args.tiny:
            from art_core.testing.tiny import build_tiny_model

            base = str(build_tiny_model(f"{root}/tiny", "llama"))
        model = TrainableModel(name="bench", project="bench",
                               **({"base_model": base} if base else {}),
                               config=ModelConfig(engine=EngineConfig(max_model_len=2048)))
        async with LocalBackend(root) as backend:
            await model.register(backend)
            engine = backend.gateway.models[model.name].engine
            direct_url = f"{engine.base_url}/v1/chat/completions"
            gateway_url = f"{model.base_url}/chat/completions"
            upstream = f"{model.name}@0"  # the adapter the gateway routes "bench" to
            print(f"base {model.base_model}, {args.concurrency} concurrent x {args.max_tokens} "
                  f"tokens, {args.rounds} rounds each, through LoRA {upstream}")
            async with httpx.AsyncClient(timeout=600) as client:
                await batch(client, direct_url, upstream, args.concurrency, 8)  # warm up
                await batch(client, gateway_url, model.name, args.concurrency, 8)
                rates: dict[str, list[float]] = {"direct": [], "gateway": []}
                for r in range(args.rounds):
                    for kind, url, name in (("direct", direct_url, upstream),
                                            ("gateway", gateway_url, model.name)):
                        tokens, dt = await batch(client, url, name, args.concurrency,
                                                 args.max_tokens)
                        rates[kind].append(tokens / dt)
                        print(f"round {r} {kind:>7}: {tokens} tokens in {dt:.2f} s = "
                              f"{tokens / dt:.1f} tok/s")
            direct = statistics.mean(rates["direct"])
            gateway = statistics.mean(rates["gateway"])
            print(f"direct: {direct:.1f} tok/s, gateway: {gateway:.1f} tok/s")
            print(f"ratio: {gateway / direct:.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--tiny", action="store_true", help="tiny random model instead of SmolLM2")
    asyncio.run(run(p.parse_args()))


if __name__ == "__main__":
    main()
