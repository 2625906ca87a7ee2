"""What a large tool set costs a request: `--tools` synthetic functions (30 by default, about
BFCL multi-turn's 28-32 per request) offered to the embedded model through the gateway.

Per mode, two requests alone and then `--requests` at once; printed per mode: the first's and
the second's latency (their difference is what is paid once per tool set: the prompt's prefill
before vLLM's prefix cache holds it, and for a forced call the compile of its call grammar),
the median latency of the concurrent ones, their prompt tokens, and sampled tok/s over the
batch. Modes:

- auto: `tool_choice` left to the model (no grammar; vLLM's hermes parser reads the text);
- required: a forced call of one of the tools (the gateway's strict-call grammar, compiled by
  vLLM's structured-output backend and cached by grammar);
- required, new set: the same, with the tool names changed so prompt and grammar are new;
- required after auto: a third set asked once with auto first (its prompt cached), then
  forced: the first forced request pays the grammar alone;
- one tool: a forced call with only one tool offered (the grammar's size alone).

    .venv/bin/python benchmarks/many_tools.py [--tools 30] [--requests 8] [--max-tokens 64]

No bound is asserted: these are measurements (say the CPU when quoting them).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from typing import Any

from art_core import LocalBackend, TrainableModel

KINDS = ({"type": "string", "maxLength": 24}, {"type": "integer"},
         {"type": "boolean"}, {"type": "string", "enum": ["low", "medium", "high"]})


def tools(n: int, tag: str = "") -> list[dict[str, Any]]:
    """`n` functions of 1-3 parameters each, named `<verb>_<noun><tag>`."""
    verbs = ("get", "set", "list", "move", "copy", "delete", "find", "send")
    nouns = ("file", "ticket", "stock", "flight", "message", "car", "order", "note")
    out = []
    for i in range(n):
        name = f"{verbs[i % len(verbs)]}_{nouns[(i // len(verbs)) % len(nouns)]}{tag}{i}"
        params = {f"arg{j}": dict(KINDS[(i + j) % len(KINDS)]) for j in range(1 + i % 3)}
        out.append({"type": "function", "function": {
            "name": name, "description": f"Do {name.replace('_', ' ')} for the user.",
            "parameters": {"type": "object", "properties": params,
                           "required": list(params), "additionalProperties": False}}})
    return out


async def ask(client: Any, model: str, tool_set: list[dict[str, Any]], choice: str,
              max_tokens: int) -> tuple[float, int, int]:
    """(latency s, prompt tokens, completion tokens) of one request."""
    t0 = time.perf_counter()
    r = await client.chat.completions.create(
        model=model, tools=tool_set, tool_choice=choice, max_tokens=max_tokens,
        temperature=1.0, messages=[{"role": "user", "content":
                                    "Move the car order for me, priority high."}])
    return time.perf_counter() - t0, r.usage.prompt_tokens, r.usage.completion_tokens


async def mode(client: Any, model: str, tool_set: list[dict[str, Any]], choice: str,
               n: int, max_tokens: int) -> dict[str, float]:
    first, _, _ = await ask(client, model, tool_set, choice, max_tokens)
    second, _, _ = await ask(client, model, tool_set, choice, max_tokens)
    t0 = time.perf_counter()
    rows = await asyncio.gather(*(ask(client, model, tool_set, choice, max_tokens)
                                  for _ in range(n)))
    wall = time.perf_counter() - t0
    return {"first_s": first, "second_s": second, "median_s": statistics.median(r[0] for r in rows),
            "prompt_tokens": statistics.median(r[1] for r in rows),
            "tok_s": sum(r[2] for r in rows) / wall}


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tools", type=int, default=30)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        async with LocalBackend(tmp) as backend:
            model = TrainableModel(name="many-tools", project="bench")
            await model.register(backend)
            client = model.openai_client()
            print(f"{a.tools} tools, {a.requests} requests at once, max_tokens {a.max_tokens}")
            print(f"{'mode':<22} {'first (s)':>9} {'second (s)':>10} {'median (s)':>10} "
                  f"{'prompt tok':>10} {'tok/s':>7}")
            cases = [("auto", tools(a.tools), "auto"),
                     ("required", tools(a.tools), "required"),
                     ("required, new set", tools(a.tools, "x"), "required"),
                     ("required after auto", tools(a.tools, "z"), "required"),
                     ("one tool", tools(1, "y"), "required")]
            for label, tool_set, choice in cases:
                if label == "required after auto":
                    await ask(client, model.name, tool_set, "auto", a.max_tokens)
                m = await mode(client, model.name, tool_set, choice, a.requests, a.max_tokens)
                print(f"{label:<22} {m['first_s']:>9.2f} {m['second_s']:>10.2f} "
                      f"{m['median_s']:>10.2f} "
                      f"{m['prompt_tokens']:>10.0f} {m['tok_s']:>7.1f}", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
