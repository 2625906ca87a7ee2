"""BFCL (the Berkeley Function Calling Leaderboard) through our gateway, scored by BFCL's own
checker, in one place that benchmarks and examples both import: the worker in the side
environment (`worker.py`, with the multi-turn replay `multi_turn.py`), its client
(`checker.py`), the single-turn split, rollouts and tables (`tasks.py`) and the multi-turn
episode (`multi_turn_rollout.py`).

The training environment never imports `bfcl_eval` (its numpy pin): everything of BFCL's runs
in `.venv-bfcl`'s worker process; this package imports only the standard library and, lazily,
art_core.
"""

from art_bfcl.checker import (
    BFCL_VERSION,
    BfclUnavailable,
    BfclWorker,
    Item,
    MultiTurnItem,
    MultiTurnVerdict,
    Verdict,
    unavailable_reason,
)
from art_bfcl.multi_turn_rollout import (
    MAX_STEPS,
    ground_truth_episode,
    held_out_ids,
    multi_turn_episode,
    multi_turn_report,
)
from art_bfcl.tasks import (
    CATEGORIES,
    OPEN_CATEGORIES,
    Attempt,
    CategoryResult,
    Prompting,
    Split,
    evaluate,
    make_split,
    summarize,
    table,
)

__all__ = [
    "BFCL_VERSION", "CATEGORIES", "MAX_STEPS", "Attempt", "BfclUnavailable", "BfclWorker",
    "CategoryResult", "Item", "MultiTurnItem", "MultiTurnVerdict", "OPEN_CATEGORIES",
    "Prompting", "Split",
    "Verdict", "evaluate", "ground_truth_episode", "held_out_ids", "make_split", "multi_turn_episode",
    "multi_turn_report", "summarize",
    "table", "unavailable_reason",
]
