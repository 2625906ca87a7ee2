"""BFCL multi-turn (`multi_turn_base`) through BFCL's own code, in the side environment.

Imported only by `worker.py` in `.venv-bfcl`; imports nothing of this repository. What BFCL's
`inference_multi_turn_FC` and `_evaluate_single_multi_turn_entry` do, split so that our gateway
serves the model in between:

1. load: `load_dataset_entry("multi_turn_base")` gives each entry's user turns, its API
   classes with their `initial_config`, and its function docs (minus `excluded_function`);
   the OpenAI handler's `_compile_tools` converts the docs into tools.
2. execute (per model step): the step's tool calls, as the handler's `_parse_query_response_FC`
   gives them (`[{name: arguments}]`), are decoded by its `decode_execute` into call strings and
   run by `execute_multi_turn_func_call` on the rollout's own instances (BFCL keys instances by
   model name and entry id in a module's globals: each rollout is a fresh `session` name).
   A step whose calls do not decode, or that has none, ends the user turn, as in BFCL.
3. check: each turn's steps decoded as BFCL's evaluation does (undecodable or empty steps
   skipped) and `multi_turn_checker` on fresh instances (a fresh model name per check): the
   official all-or-nothing verdict, and, checked on each prefix of turns, the number of turns
   that pass in a row from the first (the per-turn training signal).

BFCL `eval`s the decoded call strings against its API classes (its own safety list refuses
`kill`, `exit` and the like): one more reason this runs in the worker's process, not the
trainer's.
"""

from __future__ import annotations

import copy
import itertools
import re
from typing import Any

from bfcl_eval.constants.default_prompts import MAXIMUM_STEP_LIMIT
from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils
from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import multi_turn_checker
from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_utils import (
    execute_multi_turn_func_call,
    is_empty_execute_response,
)
from bfcl_eval.utils import load_dataset_entry, load_ground_truth_entry

CATEGORIES = ("multi_turn_base",)
"""The multi-turn categories scored here: the base one (no missing functions or parameters,
no long context)."""


class MultiTurn:
    def __init__(self, handler: Any) -> None:
        self.handler = handler
        self.entries: dict[str, dict[str, Any]] = {}  # id -> BFCL's entry (with ground truth)
        self._checks = itertools.count()

    def load(self, category: str) -> dict[str, Any]:
        if category not in CATEGORIES:
            raise ValueError(f"unknown multi-turn category {category!r}; scored: "
                             f"{list(CATEGORIES)}")
        truth = {t["id"]: t["ground_truth"] for t in load_ground_truth_entry(category)}
        items = []
        for entry in load_dataset_entry(category):
            entry["ground_truth"] = truth[entry["id"]]
            self.entries[entry["id"]] = entry
            tools = self.handler._compile_tools({}, copy.deepcopy(entry))["tools"]
            items.append({"id": entry["id"], "turns": entry["question"], "tools": tools,
                          "classes": entry["involved_classes"],
                          "ground_truth": entry["ground_truth"]})
        return {"items": items, "max_steps": MAXIMUM_STEP_LIMIT}

    def _entry(self, item_id: str) -> dict[str, Any]:
        if item_id not in self.entries:
            raise KeyError(f"no multi-turn item {item_id!r} loaded (load its category first)")
        return self.entries[item_id]

    def execute(self, item_id: str, session: str, calls: list[dict[str, str]]
                ) -> dict[str, Any]:
        """One model step's tool calls ([{name: arguments JSON}]) on the session's instances:
        {"decoded": [call strings] or None, "results": [strings]}; None: the turn ends."""
        entry = self._entry(item_id)
        decoded = decode(self.handler, calls)
        if decoded is None:
            return {"decoded": None, "results": []}
        results, _ = execute_multi_turn_func_call(
            decoded, entry["initial_config"], entry["involved_classes"], session, item_id,
            long_context=False, is_evaL_run=False)
        return {"decoded": decoded, "results": [str(r) for r in results]}

    def check(self, item_id: str, turns: list[list[list[dict[str, str]]]]) -> dict[str, Any]:
        """BFCL's verdict on the model's steps per user turn, and how many turns pass in a row
        from the first."""
        entry = self._entry(item_id)
        truth = entry["ground_truth"]
        if len(turns) != len(truth):  # BFCL: force-terminated (or a turn never asked)
            return {"valid": False, "turns_passed": 0, "n_turns": len(truth),
                    "error_type": "multi_turn:force_terminated",
                    "error": f"{len(turns)} turns answered of {len(truth)}"}
        decoded = [[d for d in (decode(self.handler, step) for step in turn) if d]
                   for turn in turns]
        verdict = self._checker(entry, decoded, truth)
        if verdict["valid"]:
            passed = len(truth)
        else:  # the first turn that fails: checked on prefixes (a turn's state depends on all
            passed = 0  # the turns before it)
            while passed < len(truth) - 1 and self._checker(
                    entry, decoded[:passed + 1], truth[:passed + 1])["valid"]:
                passed += 1
        return {"valid": bool(verdict["valid"]), "turns_passed": passed, "n_turns": len(truth),
                "error_type": verdict.get("error_type"),
                "error": str(verdict.get("error_message", ""))[:500]}

    def _checker(self, entry: dict[str, Any], decoded: list[list[list[str]]],
                 truth: list[list[str]]) -> dict[str, Any]:
        name = f"art_check_{next(self._checks)}"  # fresh instances for every check
        try:
            return multi_turn_checker(decoded, truth, entry, "multi_turn_base", name)
        finally:
            forget(name)
            forget(name + "_ground_truth")

    def close(self, session: str) -> dict[str, Any]:
        return {"forgotten": forget(session)}


def decode(handler: Any, calls: list[dict[str, str]]) -> list[str] | None:
    """BFCL's `decode_execute` of one step's calls; None when they do not decode or are
    empty (BFCL ends the turn, and its evaluation skips the step)."""
    if not calls:
        return None
    try:
        decoded = handler.decode_execute(calls, has_tool_call_tag=False)
    except Exception:  # noqa: BLE001 - BFCL treats any decoding failure this way
        return None
    return None if is_empty_execute_response(decoded) else [str(d) for d in decoded]


def forget(model_name: str) -> int:
    """Drop the API instances BFCL keeps for `model_name` (live and `_eval`); how many."""
    prefixes = tuple(re.sub(r"[-./:]", "_", f"{name}_") for name in
                     (model_name, model_name + "_eval"))
    space = vars(multi_turn_utils)
    gone = [k for k in space if k.endswith("_instance") and k.startswith(prefixes)]
    for k in gone:
        del space[k]
    return len(gone)
