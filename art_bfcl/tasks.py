"""BFCL items as tasks for a model behind an OpenAI-compatible endpoint: the prompt sent, the
fixed train/held-out split, one attempt scored by BFCL's checker, and the per-category table.

How an item is asked (`Prompting`): the item's own messages and the OpenAI tools BFCL's
handler makes of its functions, as BFCL's OpenAI handler sends them; then, our choices, all
documented in docs/bfcl.md:
- `tool_choice="required"`: SmolLM2-135M makes no unforced tool call (FIELD-NOTES), and a
  forced choice makes our gateway hold the call to the tool's JSON schema (strict tool calls,
  art_core/inference/tool_calls.py). BFCL's leaderboard leaves the choice to the model.
- `parallel_tool_calls`: whether the grammar admits more than one call (BFCL's handler sends
  nothing, and OpenAI's API default is true).
- `irrelevance` items (no offered function fits) are asked with `tool_choice="auto"`: whether to
  call is what they test, and a forced call would fail them all.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from art_bfcl.checker import BFCL_VERSION, BfclWorker, Item, Verdict

CATEGORIES = ("simple_python", "multiple", "parallel")
"""BFCL's single-turn Python categories this project trains and reports: one function, one
call (simple_python, 400 items); one of 2-4 functions (multiple, 200); several calls of one
function (parallel, 200)."""

OPEN_CATEGORIES = ("irrelevance",)
"""Categories asked with the choice left to the model (`tool_choice="auto"`): BFCL's
`irrelevance` (240 items) offers functions none of which fits, and passes a response that makes
no call, so a model that learned to call everywhere fails it."""


@dataclass(frozen=True)
class Prompting:
    """How an item is asked, the same before and after training (see the module docstring).
    `tool_choice` is for items with a right call; `OPEN_CATEGORIES` are always asked "auto"."""

    tool_choice: str = "required"
    parallel: str = "always"  # "always" | "never" | "category" (only in parallel categories)
    temperature: float = 0.0  # BFCL generates at 0.001
    max_tokens: int = 256

    def request(self, item: Item) -> dict[str, Any]:
        """The keyword arguments of `chat.completions.create` for `item` (all but `model`)."""
        parallel = {"always": True, "never": False,
                    "category": "parallel" in item.category}[self.parallel]
        choice = "auto" if item.category in OPEN_CATEGORIES else self.tool_choice
        return {"messages": item.messages, "tools": item.tools, "tool_choice": choice,
                "parallel_tool_calls": parallel, "temperature": self.temperature,
                "max_tokens": self.max_tokens}


# ---- the split ---------------------------------------------------------------------------


@dataclass
class Split:
    """Which items train and which are held out, per category; saved in the run directory."""

    bfcl_version: str
    seed: int
    held_out: dict[str, list[str]]
    train: dict[str, list[str]]

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1) + "\n")
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> Split:
        try:
            return cls(**json.loads(path.read_text()))
        except (ValueError, TypeError) as e:
            raise ValueError(f"{path}: not a saved BFCL split ({e})") from None


def make_split(items: Iterable[Item], held_out: dict[str, int], seed: int = 0,
               train: dict[str, int] | None = None) -> Split:
    """Per category, the first `held_out[c]` items in an order fixed by `seed` (a hash of the
    seed and the item's id, so it does not depend on the order the data comes in) are held
    out; the next `train[c]` (default: all the rest) train."""
    by_cat: dict[str, list[str]] = {}
    for it in items:
        by_cat.setdefault(it.category, []).append(it.id)
    out_held, out_train = {}, {}
    for cat, n in held_out.items():
        ids = sorted(by_cat.get(cat, []),
                     key=lambda i: hashlib.sha256(f"{seed}:{i}".encode()).hexdigest())
        if n >= len(ids):
            raise ValueError(f"category {cat!r} has {len(ids)} items: cannot hold out {n} "
                             "and train on the rest")
        rest = ids[n:]
        out_held[cat] = ids[:n]
        out_train[cat] = rest[:train[cat]] if train and cat in train else rest
    return Split(bfcl_version=BFCL_VERSION, seed=seed, held_out=out_held, train=out_train)


# ---- one attempt -------------------------------------------------------------------------


@dataclass
class Attempt:
    """One response to one item and BFCL's verdict on it."""

    item: Item
    message: dict[str, Any]
    verdict: Verdict
    response: Any = field(default=None, repr=False)


async def attempt(client: Any, model: str, item: Item, checker: BfclWorker,
                  prompting: Prompting) -> Attempt:
    """Ask `model` the item once and score the answer with BFCL's checker."""
    response = await client.chat.completions.create(model=model, **prompting.request(item))
    msg = response.choices[0].message
    message = {"role": "assistant", "content": msg.content,
               "tool_calls": [{"id": c.id, "type": "function",
                               "function": {"name": c.function.name,
                                            "arguments": c.function.arguments}}
                              for c in msg.tool_calls or []]}
    return Attempt(item, message, checker.check(item, message), response)


async def evaluate(client: Any, model: str, items: Sequence[Item], checker: BfclWorker,
                   prompting: Prompting, concurrency: int = 16) -> list[Attempt]:
    """One attempt per item, `concurrency` at a time, in the items' order."""
    gate = asyncio.Semaphore(concurrency)

    async def one(item: Item) -> Attempt:
        async with gate:
            return await attempt(client, model, item, checker, prompting)

    return list(await asyncio.gather(*(one(it) for it in items)))


# ---- the table ---------------------------------------------------------------------------


@dataclass
class CategoryResult:
    category: str
    items: int
    passed: int
    errors: Counter = field(default_factory=Counter)  # BFCL's error_type -> count

    @property
    def accuracy(self) -> float:
        return self.passed / self.items if self.items else 0.0

    @property
    def interval(self) -> tuple[float, float]:
        from art_core.observe.base import wilson

        return wilson(self.passed, self.items)


GOAL = ("simple_python", "multiple")
"""The categories whose held-out accuracy examples/bfcl_rl.py must raise beyond noise (issue 30),
also reported as one row."""


def summarize(outcomes: Iterable[tuple[str, Verdict]],
              combined: Sequence[str] = GOAL) -> list[CategoryResult]:
    """Per category (in order of first appearance), then the `combined` categories as one row
    (when two or more of them occur), then "all" (when there are several categories)."""
    rows: dict[str, CategoryResult] = {}
    both = "+".join(combined)
    seen: set[str] = set()
    for category, verdict in outcomes:
        seen.add(category)
        for key in (category, both if category in combined else None, "all"):
            if key is None:
                continue
            r = rows.setdefault(key, CategoryResult(key, 0, 0))
            r.items += 1
            r.passed += verdict.valid
            if not verdict.valid:
                r.errors[verdict.error_type or "unknown"] += 1
    out = [r for k, r in rows.items() if k not in ("all", both)]
    if len(seen & set(combined)) > 1:
        out.append(rows[both])
    return out + [rows["all"]] if len(seen) > 1 else out


def table(rows: Sequence[CategoryResult] | dict[str, Sequence[CategoryResult]]) -> str:
    """Items, passed, accuracy with its 95% Wilson interval, and the checker's commonest errors,
    per category; a dict of labelled row sets (e.g. "step 0", "step 12") adds a label column."""
    sections = rows if isinstance(rows, dict) else {"": rows}
    width = max(len(k) for k in sections)
    pad = (lambda text: f"{text:<{width}}  ") if width else (lambda text: "")
    lines = [f"{pad('')}{'category':<22} {'items':>5} {'passed':>6} {'accuracy':>8} "
             f"{'95% interval':>13}  BFCL checker errors"]
    for label, section in sections.items():
        for r in section:
            lo, hi = r.interval
            errs = ", ".join(f"{k} {v}" for k, v in r.errors.most_common(3))
            more = len(r.errors) - 3
            errs += f", +{more} more" if more > 0 else ""
            lines.append(f"{pad(label)}{r.category:<22} {r.items:>5} {r.passed:>6} "
                         f"{100 * r.accuracy:>7.1f}% "
                         f"{f'[{100 * lo:.0f}%, {100 * hi:.0f}%]':>13}  {errs or '-'}")
    return "\n".join(lines)
