"""RULER: relative scoring of a group of trajectories by an LLM judge (through litellm).

The algorithm, plainly:

1. Take the trajectories of one group (rollouts of the same scenario). Drop exact duplicates:
   each distinct conversation is judged once and its copies get the same score.
2. Find the longest common prefix of their messages (system prompt, task...). Send it once as
   shared context, then each trajectory's remainder under its own id "1".."N", with the tools the
   agent was offered and a rubric (`DEFAULT_RUBRIC` rewards reaching the goal, efficiency and
   partial progress, and keeps score gaps proportional to quality gaps).
3. Ask the judge (any litellm model) for JSON: per id an explanation and a score in [0, 1],
   requested as structured output (json_schema; on an HTTP 400, json_object mode, then none).
4. Validate the answer ourselves: every id exactly once, every score a finite number in [0, 1].
   An invalid answer is sent back to the judge with what was wrong, a timeout is retried, both
   at most `max_retries` times; then `RulerError` says what went wrong on each attempt.
5. Cache the answer on disk, keyed by the exact request, so re-scoring the same group is free.
6. `score_group` returns a copy of the group: reward = judge score, the old reward kept as
   `metrics["independent_reward"]`, `ruler_*` metrics (latency, tokens, cost, retries, cache
   hit), the explanation appended to `logs`.

Small and local judges (the embedded SmolLM2, a local vLLM) cannot be trusted to write that JSON:
for them `mode="yesno"`, `"digits"` or `"pairwise"` asks one short question per trajectory (or
pair) and reads the rating from the judge's token probabilities (`ruler.robust`), so no answer
can be malformed. `mode="auto"` (the default) uses `LOCAL_DEFAULT_MODE` when the judge is local
(a loopback `api_base`, or SmolLM2) and the listwise JSON prompt above otherwise.

Per turn (`score_turns`, `turn_hook`; ruler/turns.py): the group is ranked after each turn, and
each turn is rewarded with the change it made to its trajectory's standing (for
`TrainConfig(advantage="turn")`).

Why relative: judges are far more consistent at ranking attempts side by side than at giving an
absolute grade, and GRPO only uses rewards relative to the group's mean anyway.

    groups = await art_core.gather_trajectory_groups(
        scenarios, after_each=ruler.hook("openai/judge", api_base=URL, swallow_exceptions=True))

`import ruler` does not import litellm; that happens on the first judge call.
"""

from __future__ import annotations

from ruler.prompt import DEFAULT_RUBRIC
from ruler.scoring import (
    LOCAL_DEFAULT_MODE,
    MODES,
    NEUTRAL_SCORE,
    RulerError,
    RulerResult,
    hook,
    score,
    score_group,
)
from ruler.turns import score_turns, turn_hook

__all__ = [
    "DEFAULT_RUBRIC",
    "LOCAL_DEFAULT_MODE",
    "MODES",
    "NEUTRAL_SCORE",
    "RulerError",
    "RulerResult",
    "hook",
    "score",
    "score_group",
    "score_turns",
    "turn_hook",
]
