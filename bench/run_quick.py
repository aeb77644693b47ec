"""Run one bench in its quick mode and fail unless its last output line is one JSON object.

``make bench-smoke`` calls this once per bench (one Makefile line each), so CI notices a bench
that no longer starts, crashes, or stops printing its figures. Quick mode is the environment
variable ``HYBRIDFLOW_BENCH_QUICK=1``, which each bench reads to pick small sizes; the figures of
a quick run prove only that the bench works, not the targets. The bench's own output passes
through unchanged.

Usage: ``python bench/run_quick.py bench/<name>.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python bench/run_quick.py bench/<name>.py", file=sys.stderr)
        return 2
    script = argv[0]
    env = {**os.environ, "HYBRIDFLOW_BENCH_QUICK": "1"}
    done = subprocess.run([sys.executable, script], env=env, stdout=subprocess.PIPE, text=True, check=False)
    sys.stdout.write(done.stdout)
    if done.returncode != 0:
        print(f"{script}: exited with status {done.returncode}", file=sys.stderr)
        return 1
    lines = done.stdout.strip().splitlines()
    last = lines[-1] if lines else ""
    try:
        figures = json.loads(last)
    except json.JSONDecodeError:
        figures = None
    if not isinstance(figures, dict):
        print(f"{script}: the last line printed is not one JSON object: {last[:200]!r}", file=sys.stderr)
        return 1
    print(f"{script}: quick run printed {len(figures)} figures", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
