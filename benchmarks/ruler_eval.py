"""Does a RULER judge rank answers the way we know they should be ranked, in each judging mode?

The set (`benchmarks/data/ruler_eval.jsonl`, one group per line) has 44 groups of 4-5 answers of
known quality: 28 questions with correct > correct-with-a-false-side-claim > partly correct >
wrong > off-topic answers, 4 multi-turn chats, and 12 multi-turn tool-using trajectories (right
tool and answer > the same with a needless extra call > partial > wrong arguments or an answer
that ignores the tool result > off-topic). Each group is shown to the judge in a shuffled order.
For every mode (`ruler.MODES`) and group we compute the rank correlation between the judge's
scores and the known quality (Spearman's rho, average ranks for ties; Kendall's tau-b), and print
per mode: the mean over groups with a 95% bootstrap interval, the same by kind of group, how many
groups failed (`RulerError`; a failed group counts as 0, no better than chance) and the wall
time per group. 1.0 is a perfect ranking; a judge that gives every answer the same score gets 0.

    python benchmarks/ruler_eval.py --judge openai/gpt-4o-mini --api-key $OPENAI_API_KEY
    python benchmarks/ruler_eval.py --judge openai/SmolLM2 --api-base http://127.0.0.1:8000/v1
    python benchmarks/ruler_eval.py --local      # the embedded SmolLM2 through our gateway
    python benchmarks/ruler_eval.py --dry-run    # an oracle judge on a local scripted server

`--dry-run` checks the plumbing, not a model: the oracle knows the answers, so anything below
1.0 there means the ids, order, de-duplication or aggregation of some mode got mixed up.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import ruler
from ruler import robust
from ruler.prompt import build_judge_messages, dedupe
from ruler.testing import Reply

DATA = Path(__file__).resolve().parent / "data" / "ruler_eval.jsonl"
EVAL_MODES = ("listwise", *robust.LOGPROB_MODES)


def load_data(path: Path = DATA) -> list[dict[str, Any]]:
    """The groups of the set: id, kind, context messages, tools, answers with their quality."""
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def build_groups(seed: int = 0, path: Path = DATA) -> list[dict[str, Any]]:
    """Each group's conversations in a shuffled order, with the known quality of each."""
    groups = []
    for n, g in enumerate(load_data(path)):
        order = list(range(len(g["answers"])))
        random.Random(seed + n).shuffle(order)
        answers = [g["answers"][k] for k in order]
        groups.append({
            "id": g["id"],
            "kind": g["kind"],
            "tools": g.get("tools"),
            "lists": [[*g["context"], *a["messages"]] for a in answers],
            "quality": [a["quality"] for a in answers],
        })
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


def bootstrap_ci(values: Sequence[float], seed: int = 0, n: int = 5000) -> tuple[float, float]:
    """95% percentile-bootstrap interval of the mean of `values` (resampling groups)."""
    if not values:
        return (float("nan"), float("nan"))
    rng = random.Random(seed)
    means = sorted(sum(rng.choices(values, k=len(values))) / len(values) for _ in range(n))
    return means[int(0.025 * n)], means[int(0.975 * n) - 1]


# --- the oracle judge: knows every answer's quality, answers in whatever mode it is asked ------

_TRAJECTORY = re.compile(r'<trajectory id="([^"]+)">\n(.*?)\n</trajectory>', re.DOTALL)


def make_oracle(path: Path = DATA) -> Callable[[dict[str, Any]], Reply]:
    """A `ScriptedJudge` responder that scores each answer by its known quality, in every mode.

    It indexes the exact prompts RULER builds for each group (listwise blocks, one-answer and
    pairwise prompts), so a prompt it cannot find means RULER sent something unexpected.
    """
    listwise: dict[str, float] = {}
    prompts: dict[str, Any] = {}
    for g in build_groups(0, path):
        top = max(g["quality"])
        unique, index = dedupe(g["lists"])
        quality = [g["quality"][index.index(u)] / top for u in range(len(unique))]
        ids = [str(n) for n in range(1, len(unique) + 1)]
        judge_messages = build_judge_messages(unique, ids, ruler.DEFAULT_RUBRIC, g["tools"])
        for (_, block), q in zip(_TRAJECTORY.findall(judge_messages[1]["content"]), quality,
                                 strict=True):
            listwise[block] = q
        for mode in robust.LOGPROB_MODES:
            p = robust.plan(mode, unique, ruler.DEFAULT_RUBRIC)
            for k, request in enumerate(p.requests):
                value = (quality[p.pairs[k][0]], quality[p.pairs[k][1]]) if p.pairs else quality[k]
                assert prompts.setdefault(request[-1]["content"], value) == value, "ambiguous"

    def respond(body: dict[str, Any]) -> Reply:
        content = body["messages"][-1]["content"]
        if content in prompts:
            value = prompts[content]
            if content.endswith(robust.QUESTIONS["pairwise"]):
                qa, qb = value
                p_a = 0.5 if qa == qb else 0.9 if qa > qb else 0.1
                return Reply(top_logprobs={"A": math.log(p_a), "B": math.log(1 - p_a)})
            if content.endswith(robust.QUESTIONS["digits"]):
                return Reply(top_logprobs={str(round(9 * value)): 0.0})
            p_yes = (1 + 8 * value) / 10  # 0.1 .. 0.9, monotone in quality
            return Reply(top_logprobs={"Yes": math.log(p_yes), "No": math.log(1 - p_yes)})
        scores = [{"trajectory_id": i, "explanation": "oracle", "score": listwise[block]}
                  for i, block in _TRAJECTORY.findall(body["messages"][1]["content"])]
        return Reply(json.dumps({"scores": scores}))

    return respond


# --- evaluation ----------------------------------------------------------------------------------


async def evaluate(
    judge: str,
    modes: Sequence[str] = EVAL_MODES,
    *,
    concurrency: int = 4,
    seed: int = 0,
    path: Path = DATA,
    **score_kwargs: Any,
) -> dict[str, dict[str, Any]]:
    """Score every group with `judge` in each mode; per mode the correlations and failures."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm  # noqa: F401  imported before the clock starts: the import alone takes seconds

    groups = build_groups(seed, path)
    results = {}
    slots = asyncio.Semaphore(concurrency)
    for mode in modes:

        async def one(g: dict[str, Any], mode: str = mode) -> list[float] | str:
            async with slots:
                try:
                    result = await ruler.score(g["lists"], judge, tools=g["tools"], mode=mode,
                                               **score_kwargs)
                    return result.scores
                except ruler.RulerError as e:
                    return str(e)

        started = time.perf_counter()
        outcomes = await asyncio.gather(*(one(g) for g in groups))
        seconds = time.perf_counter() - started
        rhos, taus, failures, by_kind, per_group = [], [], [], {}, []
        for g, outcome in zip(groups, outcomes, strict=True):
            per_group.append({"id": g["id"], "quality": g["quality"], "scores": outcome})
            failed = isinstance(outcome, str)
            if failed:
                failures.append(f"{mode} {g['id']}: {outcome}")
            rho = 0.0 if failed else spearman(g["quality"], outcome)
            rhos.append(rho)
            taus.append(0.0 if failed else kendall(g["quality"], outcome))
            by_kind.setdefault(g["kind"], []).append(rho)
        results[mode] = {
            "spearman": statistics.fmean(rhos),
            "ci": bootstrap_ci(rhos, seed),
            "kendall": statistics.fmean(taus),
            "by_kind": {k: statistics.fmean(v) for k, v in by_kind.items()},
            "groups": len(groups),
            "failed": len(failures),
            "failures": failures,
            "seconds": seconds,
            "per_group": per_group,
        }
    return results


def report(judge: str, results: dict[str, dict[str, Any]]) -> str:
    """The per-mode table."""
    kinds = sorted({k for r in results.values() for k in r["by_kind"]})
    lines = [f"judge: {judge}  (failed groups count as spearman 0; s/group = wall time / groups)",
             f"{'mode':<9} {'groups':>6} {'failed':>6}  {'spearman [95% CI]':<24}{'kendall':>8}"
             + "".join(f"{k:>7}" for k in kinds) + f"{'s/group':>9}"]
    for mode, r in results.items():
        lo, hi = r["ci"]
        lines.append(
            f"{mode:<9} {r['groups']:>6} {r['failed']:>6}  "
            f"{r['spearman']:>6.3f} [{lo:6.3f}, {hi:6.3f}]   {r['kendall']:>8.3f}"
            + "".join(f"{r['by_kind'].get(k, float('nan')):>7.3f}" for k in kinds)
            + f"{r['seconds'] / r['groups']:>9.2f}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--judge", default="openai/judge", help="litellm model string")
    parser.add_argument("--api-base", help="base URL of an OpenAI-compatible server (…/v1)")
    parser.add_argument("--api-key", help="API key for the judge (a local server takes any)")
    parser.add_argument("--modes", default=",".join(EVAL_MODES), help="comma-separated modes")
    parser.add_argument("--data", type=Path, default=DATA, help="the JSONL set")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per judge call")
    parser.add_argument("--max-retries", type=int, default=3, help="retries of invalid answers")
    parser.add_argument("--concurrency", type=int, default=4, help="groups judged at once")
    parser.add_argument("--seed", type=int, default=0, help="seed of the answer shuffling")
    parser.add_argument("--no-cache", action="store_true", help="always call the judge")
    parser.add_argument("--out", type=Path, help="write every group's scores here (JSON)")
    parser.add_argument("--dry-run", action="store_true",
                        help="judge with a built-in oracle on a local scripted server")
    parser.add_argument("--local", action="store_true",
                        help="judge with the embedded SmolLM2 served by a LocalBackend started here")
    args = parser.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        ruler.scoring.resolve_mode(m, args.judge, {})  # fail on a typo before anything starts

    kwargs: dict[str, Any] = {"timeout": args.timeout, "max_retries": args.max_retries,
                              "cache": not args.no_cache}
    if args.api_key:
        kwargs["api_key"] = args.api_key
    if args.api_base:
        kwargs["api_base"] = args.api_base

    def run() -> dict[str, dict[str, Any]]:
        return asyncio.run(evaluate(args.judge, modes, concurrency=args.concurrency,
                                    seed=args.seed, path=args.data, **kwargs))

    if args.local:
        results = run_with_local_judge(args, kwargs, run)
    elif args.dry_run:
        from ruler.testing import ScriptedJudge

        with ScriptedJudge(make_oracle(args.data)) as server:
            args.judge = "openai/oracle"
            kwargs.update(api_base=server.api_base, api_key="x", num_retries=0)
            results = run()
    else:
        results = run()

    for r in results.values():
        for failure in r["failures"]:
            print(f"FAILED {failure[:300]}")
    print(report(args.judge, results))
    if args.out:
        args.out.write_text(json.dumps({"judge": args.judge, "results": results}, indent=1))
    return 0 if all(r["failed"] < r["groups"] for r in results.values()) else 1


def run_with_local_judge(args: argparse.Namespace, kwargs: dict[str, Any], run: Any
                         ) -> dict[str, dict[str, Any]]:
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
