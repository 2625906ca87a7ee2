"""Does a RULER judge rank answers the way we know they should be ranked?

Eight questions, each with four answers of known quality: correct (3) > partly correct (2) >
wrong (1) > off-topic (0). Each question is one group, shown to the judge in a shuffled order
(so a judge that favours a position gains nothing). For every group we compute the rank
correlation between the judge's scores and the known quality (Spearman's rho with average ranks
for ties, Kendall's tau-b), then print the means and how many groups failed validation
(`RulerError`). 1.0 is a perfect ranking; 0 is no better than chance; a judge that gives every
answer the same score gets 0.

    python benchmarks/ruler_eval.py --judge openai/gpt-4o-mini --api-key $OPENAI_API_KEY
    python benchmarks/ruler_eval.py --judge openai/SmolLM2 --api-base http://127.0.0.1:8000/v1
    python benchmarks/ruler_eval.py --dry-run    # an oracle judge on a local scripted server

`--dry-run` checks the plumbing, not a model: the oracle knows the answers, so anything below
1.0 there means the ids, order or de-duplication got mixed up.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import sys
import time
from collections.abc import Sequence
from typing import Any

import ruler

SYSTEM = "You are a helpful assistant. Answer the user's question correctly and concisely."

# (question, correct, partly correct, wrong, off-topic)
QUESTIONS = [
    (
        "What is the capital of Australia?",
        "The capital of Australia is Canberra.",
        "It is a planned city in the Australian Capital Territory, not Sydney, but I forget its name.",
        "The capital of Australia is Sydney.",
        "I really enjoy baking sourdough bread on weekends.",
    ),
    (
        "What is 12 multiplied by 13?",
        "12 x 13 = 156.",
        "12 x 13 = 12 x 10 + 12 x 3 = 120 + 36, which I make about 150.",
        "12 x 13 = 1213.",
        "The Pacific is the largest ocean on Earth.",
    ),
    (
        "At what temperature does water boil at sea level, in degrees Celsius?",
        "Water boils at 100 degrees Celsius at sea level.",
        "Somewhere between 90 and 110 degrees Celsius.",
        "Water boils at 50 degrees Celsius at sea level.",
        "My favourite colour is green.",
    ),
    (
        "Who wrote the novel Pride and Prejudice?",
        "Pride and Prejudice was written by Jane Austen.",
        "An English novelist of the early 19th century; I think her first name was Jane.",
        "Pride and Prejudice was written by Charles Dickens.",
        "Cats sleep between 13 and 16 hours a day.",
    ),
    (
        "What is the chemical symbol for gold?",
        "The chemical symbol for gold is Au.",
        "It comes from the Latin word for gold, aurum, but I don't remember the symbol itself.",
        "The chemical symbol for gold is Go.",
        "Football is played with eleven players per team.",
    ),
    (
        "Which is the largest planet in our solar system?",
        "Jupiter is the largest planet in the solar system.",
        "One of the gas giants; either Saturn or Jupiter.",
        "Mars is the largest planet in the solar system.",
        "Remember to drink enough water every day.",
    ),
    (
        "How do I reverse a list `xs` in Python?",
        "Use `xs.reverse()` to reverse it in place, or `xs[::-1]` to get a reversed copy.",
        "Loop over the indices from the end and build a new list; I don't recall a built-in.",
        "Call `xs.sort()`; that reverses the list.",
        "The Mona Lisa was painted by Leonardo da Vinci.",
    ),
    (
        "How many sides does a hexagon have?",
        "A hexagon has six sides.",
        "More than a pentagon's five; I think it is six or seven.",
        "A hexagon has eight sides.",
        "Tokyo is a very large city.",
    ),
]
QUALITY = [3, 2, 1, 0]  # correct, partly correct, wrong, off-topic


def build_groups(seed: int = 0) -> list[tuple[list[list[dict[str, Any]]], list[int]]]:
    """For each question: the shuffled conversations and the known quality of each."""
    groups = []
    for n, (question, *answers) in enumerate(QUESTIONS):
        order = list(range(len(answers)))
        random.Random(seed + n).shuffle(order)
        lists = [
            [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": question},
                {"role": "assistant", "content": answers[k]},
            ]
            for k in order
        ]
        groups.append((lists, [QUALITY[k] for k in order]))
    return groups


def _ranks(xs: Sequence[float]) -> list[float]:
    """1-based ranks; tied values share the average of their ranks."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    ranks = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Spearman's rho: the Pearson correlation of the ranks. 0 when either side is constant."""
    rx, ry = _ranks(xs), _ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    vx = sum((a - mx) ** 2 for a in rx)
    vy = sum((b - my) ** 2 for b in ry)
    return cov / math.sqrt(vx * vy) if vx and vy else 0.0


def kendall(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Kendall's tau-b (ties allowed). 0 when either side is constant."""
    concordant = discordant = ties_x = ties_y = 0
    for i in range(len(xs)):
        for j in range(i + 1, len(xs)):
            dx, dy = xs[i] - xs[j], ys[i] - ys[j]
            if dx == 0 and dy == 0:
                continue
            if dx == 0:
                ties_x += 1
            elif dy == 0:
                ties_y += 1
            elif (dx > 0) == (dy > 0):
                concordant += 1
            else:
                discordant += 1
    denominator = math.sqrt((concordant + discordant + ties_x) * (concordant + discordant + ties_y))
    return (concordant - discordant) / denominator if denominator else 0.0


_TRAJECTORY = re.compile(r'<trajectory id="([^"]+)">\n(.*?)\n</trajectory>', re.DOTALL)


def oracle(body: dict[str, Any]) -> str:
    """The dry-run judge: scores each answer by its known quality (for `ruler.testing`)."""
    quality = {a: QUALITY[k] for _, *answers in QUESTIONS for k, a in enumerate(answers)}
    scores = []
    for trajectory_id, text in _TRAJECTORY.findall(body["messages"][1]["content"]):
        contents = [json.loads(line).get("content") for line in text.splitlines()]
        q = max((quality.get(c, 0) for c in contents), default=0)
        scores.append(
            {"trajectory_id": trajectory_id, "explanation": f"quality {q}", "score": q / 3}
        )
    return json.dumps({"scores": scores})


async def evaluate(
    judge: str, *, concurrency: int = 4, seed: int = 0, **score_kwargs: Any
) -> dict[str, Any]:
    """Score every group with `judge`; return the mean correlations and the failures."""
    slots = asyncio.Semaphore(concurrency)

    async def one(lists: list[list[dict[str, Any]]]) -> list[float] | str:
        async with slots:
            try:
                return (await ruler.score(lists, judge, **score_kwargs)).scores
            except ruler.RulerError as e:
                return str(e)

    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm  # noqa: F401  imported before the clock starts: the import alone takes seconds

    groups = build_groups(seed)
    started = time.perf_counter()
    outcomes = await asyncio.gather(*(one(lists) for lists, _ in groups))
    rhos, taus, failures = [], [], []
    for (question, *_), (_, truth), outcome in zip(QUESTIONS, groups, outcomes, strict=True):
        if isinstance(outcome, str):
            failures.append(f"{question}: {outcome}")
            continue
        rhos.append(spearman(truth, outcome))
        taus.append(kendall(truth, outcome))
    return {
        "spearman": sum(rhos) / len(rhos) if rhos else float("nan"),
        "kendall": sum(taus) / len(taus) if taus else float("nan"),
        "groups": len(groups),
        "failed": len(failures),
        "failures": failures,
        "seconds": time.perf_counter() - started,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--judge", default="openai/judge", help="litellm model string")
    parser.add_argument("--api-base", help="base URL of an OpenAI-compatible server (…/v1)")
    parser.add_argument("--api-key", help="API key for the judge (a local server takes any)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per judge call")
    parser.add_argument("--max-retries", type=int, default=3, help="retries of invalid answers")
    parser.add_argument("--concurrency", type=int, default=4, help="groups judged at once")
    parser.add_argument("--seed", type=int, default=0, help="seed of the answer shuffling")
    parser.add_argument("--no-cache", action="store_true", help="always call the judge")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="judge with a built-in oracle on a local scripted server",
    )
    parser.add_argument(
        "--local",
        action="store_true",
        help="judge with the embedded SmolLM2 served by a LocalBackend started here",
    )
    args = parser.parse_args(argv)

    kwargs: dict[str, Any] = {
        "timeout": args.timeout,
        "max_retries": args.max_retries,
        "cache": not args.no_cache,
    }
    if args.api_key:
        kwargs["api_key"] = args.api_key
    if args.api_base:
        kwargs["api_base"] = args.api_base

    def run() -> dict[str, Any]:
        return asyncio.run(
            evaluate(args.judge, concurrency=args.concurrency, seed=args.seed, **kwargs)
        )

    if args.local:
        summary = run_with_local_judge(args, kwargs, run)
    elif args.dry_run:
        from ruler.testing import ScriptedJudge

        with ScriptedJudge(oracle) as server:
            args.judge = "openai/oracle"
            kwargs.update(api_base=server.api_base, api_key="x", num_retries=0)
            summary = run()
    else:
        summary = run()

    for failure in summary["failures"]:
        print(f"FAILED {failure}")
    print(
        f"judge: {args.judge}  groups: {summary['groups']}  failed: {summary['failed']}  "
        f"time: {summary['seconds']:.1f} s"
    )
    print(f"mean spearman: {summary['spearman']:.3f}  mean kendall: {summary['kendall']:.3f}")
    return 0 if summary["failed"] < summary["groups"] else 1


def run_with_local_judge(args: argparse.Namespace, kwargs: dict[str, Any], run: Any
                         ) -> dict[str, Any]:
    """Serve SmolLM2 through our own gateway (a LocalBackend in a temp dir) and judge with it."""
    import tempfile

    from art_core import LocalBackend, TrainableModel

    async def start(root: str) -> tuple[LocalBackend, TrainableModel]:
        backend = LocalBackend(root)
        judge = TrainableModel(name="judge", project="ruler-eval")
        await judge.register(backend)
        return backend, judge

    with tempfile.TemporaryDirectory() as root:
        backend, judge = asyncio.run(start(root))
        try:
            args.judge = f"openai/{judge.name}"
            kwargs.update(api_base=judge.base_url, api_key="none", temperature=0.0, max_tokens=400)
            return run()
        finally:
            asyncio.run(backend.close())


if __name__ == "__main__":
    sys.exit(main())
