"""BFCL (the Berkeley Function Calling Leaderboard) through our gateway, scored by BFCL's own
checker: the worker in the side environment (`worker.py`), its client (`checker.py`), and the
split, rollouts and tables that `benchmarks/bfcl_eval.py` and `examples/bfcl_rl.py` share
(`tasks.py`)."""
