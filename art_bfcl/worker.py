"""BFCL's own data loading, tool conversion and AST checker, served over JSON lines.

Runs in the side environment `.venv-bfcl` (scripts/setup.sh --dev), never in the training one:
`bfcl-eval` pins numpy 1.26.4 and imports a dozen provider SDKs with its checker. Started as
`.venv-bfcl/bin/python -I art_bfcl/worker.py` (`-I`: only that environment's packages);
it imports nothing of this repository. One JSON request per line on stdin, one JSON answer per
line on stdout:

    {"op": "version"}                      -> {"ok": true, "version": "2026.3.23", "registry": ...}
    {"op": "load", "category": "multiple"} -> {"ok": true, "items": [{"id", "messages", "tools",
                                               "functions", "ground_truth"}, ...]}
    {"op": "check", "category": ..., "id": ..., "message": {"content", "tool_calls"}}
                                           -> {"ok": true, "valid": bool, "error": [...],
                                               "error_type": str | null, "matched": int,
                                               "expected": int}

Multi-turn (`multi_turn.py`, imported from this file's folder): {"op": "mt_load", "category"}
-> items with their user turns, tools and ground truth; {"op": "mt_execute", "id", "session",
"calls": [{name: arguments}]} -> {"decoded", "results"}; {"op": "mt_check", "id", "turns"}
-> {"valid", "turns_passed", "n_turns", "error_type", "error"}; {"op": "mt_close", "session"}.

Every step is BFCL's own code, as its generation and evaluation run an OpenAI-compatible
Chat Completions model in function-calling mode:
1. `load_dataset_entry(category)` gives the prompt (the first turn of `question`) and the
   functions with BFCL's language hint; its OpenAI handler's `_compile_tools` converts them
   into OpenAI tools ("dict" -> "object", "float" -> "number" + format, "tuple" -> "array",
   "." in names -> "_").
2. A check rebuilds the assistant message as a `ChatCompletion`, parses it with the handler's
   `_parse_query_response_FC` (tool calls, else the text), and scores it with
   `eval_runner._evaluate_single_ast_entry`: the handler's `decode_ast`, the format check and
   `ast_checker`, against the entry without the hint and its `possible_answer`, as
   `bfcl evaluate` does; an `irrelevance` entry with `_evaluate_single_relevance_entry`
   (valid when the response decodes to no call). `matched`: how many of the `expected` calls
   (the ground truth's) a call of the response passes alone, paired one to one as the parallel
   checker pairs them (a partial credit for an answer that fails).
Any failure is answered as {"ok": false, "error": "..."}; the worker keeps serving.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import tempfile
import traceback
from importlib.metadata import version
from typing import Any

# BFCL writes result/score/lock folders under its project root at import: keep them out of
# the environment's site-packages. The OpenAI client its handler builds is never used.
os.environ.setdefault("BFCL_PROJECT_ROOT", os.path.join(tempfile.gettempdir(), "bfcl-root"))
os.environ.setdefault("OPENAI_API_KEY", "unused")
# BFCL's modules may print (progress, warnings): the protocol owns the real stdout.
PROTOCOL_OUT, sys.stdout = sys.stdout, sys.stderr

from bfcl_eval.constants.enums import Language, ReturnFormat  # noqa: E402
from bfcl_eval.constants.model_config import MODEL_CONFIG_MAPPING  # noqa: E402
from bfcl_eval.eval_checker.eval_runner import (  # noqa: E402
    _evaluate_single_ast_entry,
    _evaluate_single_relevance_entry,
)
from bfcl_eval.model_handler.api_inference.openai_completion import (  # noqa: E402
    OpenAICompletionsHandler,
)
from bfcl_eval.utils import load_dataset_entry, load_ground_truth_entry  # noqa: E402
from openai.types.chat import ChatCompletion  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # -I leaves the script's folder out
from multi_turn import MultiTurn  # noqa: E402

# BFCL scores a model through its registry entry: the handler that parses its responses, and
# whether its tools had "." in function names replaced by "_" (OpenAI's API forbids "."). Ours
# is an OpenAI-compatible Chat Completions endpoint in function-calling mode, which BFCL runs
# with OpenAICompletionsHandler; this is the registry's entry of that kind in 2026.3.23.
REGISTRY = "openbmb/MiniCPM-SALA-FC"
CATEGORIES = ("simple_python", "multiple", "parallel", "parallel_multiple", "irrelevance")
"""The single-turn Python categories this worker scores: BFCL's non-live AST set, and
`irrelevance` (no offered function fits: the right answer is no call; no ground truth)."""


class Bfcl:
    def __init__(self) -> None:
        config = MODEL_CONFIG_MAPPING.get(REGISTRY)
        if config is None or config.model_handler is not OpenAICompletionsHandler or not (
                config.is_fc_model and config.underscore_to_dot):
            raise RuntimeError(f"bfcl-eval {version('bfcl-eval')}: registry entry {REGISTRY!r} "
                               "is not an OpenAI Chat Completions function-calling model")
        self.handler = OpenAICompletionsHandler(
            model_name=config.model_name, temperature=0, registry_name=REGISTRY,
            is_fc_model=True)
        self.model_dir = REGISTRY.replace("/", "_")  # what `bfcl evaluate` passes the checker
        self.checked: dict[str, dict[str, tuple[dict, list]]] = {}  # category -> id -> entry

    def version(self) -> dict[str, Any]:
        return {"version": version("bfcl-eval"), "registry": REGISTRY}

    def load(self, category: str) -> dict[str, Any]:
        _known(category)
        items = []
        for entry in load_dataset_entry(category):  # as `bfcl generate`: with the language hint
            functions = copy.deepcopy(entry["function"])
            tools = self.handler._compile_tools({}, entry)["tools"]
            items.append({"id": entry["id"], "messages": entry["question"][0], "tools": tools,
                          "functions": functions,
                          "ground_truth": self._entries(category)[entry["id"]][1]})
        return {"items": items}

    def _entries(self, category: str) -> dict[str, tuple[dict, list]]:
        if category not in self.checked:
            prompts = load_dataset_entry(category, include_prereq=False,
                                         include_language_specific_hint=False)
            truth = {} if "irrelevance" in category else {
                t["id"]: t["ground_truth"] for t in load_ground_truth_entry(category)}
            self.checked[category] = {p["id"]: (p, truth.get(p["id"], [])) for p in prompts}
        return self.checked[category]

    def check(self, category: str, item_id: str, message: dict[str, Any]) -> dict[str, Any]:
        _known(category)
        entries = self._entries(category)
        if item_id not in entries:
            raise KeyError(f"no item {item_id!r} in BFCL category {category!r}")
        prompt, truth = entries[item_id]
        response = ChatCompletion.model_validate({
            "id": "check", "object": "chat.completion", "created": 0, "model": REGISTRY,
            "choices": [{"index": 0, "finish_reason": "stop", "message": {
                "role": "assistant", "content": message.get("content"),
                "tool_calls": message.get("tool_calls") or None}}],
            "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}})
        result = self.handler._parse_query_response_FC(response)["model_responses"]
        if "irrelevance" in category:  # BFCL's relevance rule: valid when nothing decodes to a call
            verdict = _evaluate_single_relevance_entry(
                self.handler, item_id, result, prompt, self.model_dir, category)
        else:
            verdict = _evaluate_single_ast_entry(
                self.handler, item_id, result, truth, prompt, self.model_dir, category,
                language=Language.PYTHON, return_format=ReturnFormat.PYTHON)
        valid = bool(verdict["valid"])
        return {"valid": valid, "error": verdict.get("error", []),
                "error_type": verdict.get("error_type"),
                "matched": len(truth) if valid else self._matched(item_id, result, truth, prompt),
                "expected": len(truth)}

    def _matched(self, item_id: str, result: Any, truth: list, prompt: dict) -> int:
        """How many of the possible answers' calls a call of the response matches, one to one:
        BFCL's parallel checker's pairing (each expected call takes the first unpaired call that
        passes its per-call check), counted instead of all-or-nothing."""
        calls = result if isinstance(result, list) else []
        free, matched = list(range(len(calls))), 0
        for expected in truth:
            for k in free:
                one = _evaluate_single_ast_entry(
                    self.handler, item_id, [calls[k]], [expected], prompt, self.model_dir,
                    "parallel", language=Language.PYTHON, return_format=ReturnFormat.PYTHON)
                if one["valid"]:
                    free.remove(k)
                    matched += 1
                    break
        return matched


def _known(category: str) -> None:
    if category not in CATEGORIES:
        raise ValueError(f"unknown category {category!r}; this worker scores {list(CATEGORIES)}")


def serve(inp: Any, out: Any) -> None:
    bfcl = Bfcl()
    multi = MultiTurn(bfcl.handler)
    for line in inp:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            op = req.get("op")
            if op == "version":
                answer = bfcl.version()
            elif op == "load":
                answer = bfcl.load(req["category"])
            elif op == "check":
                answer = bfcl.check(req["category"], req["id"], req.get("message") or {})
            elif op == "mt_load":
                answer = multi.load(req["category"])
            elif op == "mt_execute":
                answer = multi.execute(req["id"], req["session"], req.get("calls") or [])
            elif op == "mt_check":
                answer = multi.check(req["id"], req["turns"])
            elif op == "mt_close":
                answer = multi.close(req["session"])
            else:
                raise ValueError(f"unknown op {op!r}: version, load, check, mt_load, "
                                 "mt_execute, mt_check or mt_close")
            answer = {"ok": True, **answer}
        except Exception as e:  # noqa: BLE001 - any failure is the request's answer
            tail = traceback.format_exception_only(type(e), e)[-1].strip()
            answer = {"ok": False, "error": tail}
        out.write(json.dumps(answer, default=str) + "\n")
        out.flush()


if __name__ == "__main__":
    serve(sys.stdin, PROTOCOL_OUT)
