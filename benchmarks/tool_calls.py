"""How often the embedded model (SmolLM2-135M) makes a valid tool call with the right argument,
with the gateway's strict-tool enforcement (forced tool_choice) and without it ("auto").

Task: "What is the capital of <country>?" with one tool, lookup_capital(country). A try counts
as *valid* when the response carries a parsed call whose arguments match the schema, and as
*right* when the argument names the asked country (case and surrounding spaces ignored).

    .venv/bin/python benchmarks/tool_calls.py [--tries-per-country 4] [--temperature 1.0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time

from art_core import LocalBackend, TrainableModel

COUNTRIES = ["France", "Peru", "Japan", "Kenya", "Canada", "Spain", "Egypt", "Chile",
             "Norway", "India", "Brazil", "Italy", "Mexico", "Greece", "Poland", "Ghana"]
PARAMS = {"type": "object", "properties": {"country": {"type": "string", "maxLength": 16}},
          "required": ["country"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {
    "name": "lookup_capital", "description": "Look up the capital city of a country.",
    "parameters": PARAMS}}]
SYSTEM = "Answer with the lookup_capital tool."


def score(response: object, country: str) -> tuple[bool, bool]:
    """(valid call, right argument) of one response."""
    calls = response.choices[0].message.tool_calls or []
    if len(calls) != 1 or calls[0].function.name != "lookup_capital":
        return False, False
    try:
        args = json.loads(calls[0].function.arguments)
    except ValueError:
        return False, False
    if not isinstance(args, dict) or set(args) != {"country"} or not isinstance(
            args["country"], str):
        return False, False
    return True, args["country"].strip().lower() == country.lower()


async def run(model: TrainableModel, tool_choice: str, tries: int, temperature: float
              ) -> tuple[int, int, int]:
    client = model.openai_client()

    async def one(country: str, seed: int) -> tuple[bool, bool]:
        r = await client.chat.completions.create(
            model=model.name, tools=TOOLS, tool_choice=tool_choice, max_tokens=128,
            temperature=temperature, seed=seed,
            messages=[{"role": "system", "content": SYSTEM},
                      {"role": "user", "content": f"What is the capital of {country}?"}])
        return score(r, country)

    results = await asyncio.gather(*[one(c, s) for c in COUNTRIES for s in range(tries)])
    return len(results), sum(v for v, _ in results), sum(r for _, r in results)


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tries-per-country", type=int, default=4)
    p.add_argument("--temperature", type=float, default=1.0)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        async with LocalBackend(tmp) as backend:
            model = TrainableModel(name="toolbench", project="bench")
            await model.register(backend)
            print(f"{'tool_choice':<12} {'tries':>5} {'valid call':>11} {'right arg':>10} "
                  f"{'seconds':>8}")
            for choice in ("auto", "required"):
                t0 = time.perf_counter()
                n, valid, right = await run(model, choice, args.tries_per_country,
                                            args.temperature)
                print(f"{choice:<12} {n:>5} {valid:>5}/{n:<5} {right:>4}/{n:<5} "
                      f"{time.perf_counter() - t0:>8.1f}", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
