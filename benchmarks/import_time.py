"""How long `import art_core, art_core.cli` takes on a client, in fresh interpreters.

tests/unit/test_imports.py checks that nothing heavy (torch, vLLM, litellm, ...) is imported,
which is what keeps the import fast; the time itself is measured here, not bounded in a test
(a shared machine's stall would fail it at random).

    python benchmarks/import_time.py --runs 7
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

PROBE = """
import json, time
t = time.perf_counter()
import art_core, art_core.cli
print(json.dumps(time.perf_counter() - t))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=7, help="fresh interpreters (default: %(default)s)")
    args = p.parse_args()
    times = [json.loads(subprocess.run([sys.executable, "-c", PROBE], capture_output=True,
                                       text=True, check=True).stdout.strip().splitlines()[-1])
             for _ in range(args.runs)]
    print(f"import art_core, art_core.cli: median {statistics.median(times):.3f} s, "
          f"max {max(times):.3f} s over {len(times)} fresh interpreters")


if __name__ == "__main__":
    main()
