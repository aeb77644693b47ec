"""Reliability figures: fuzzed manifests, a hung collective, and the e2e scenarios, as one JSON line.

Runs, each as the test suites do:

* the manifest fuzzer (tests/fuzz) in this process, with more cases than the suite's 250;
* tests/integration/test_stall.py (a hung collective under a 2 s stall timeout) and the e2e
  suite (e2e/: examples to Succeeded and deletion, SIGKILL + retry + resume, suspend/resume,
  SIGTERM/SIGKILL of ``hybridflow run`` with leaked-process counting) through pytest, each
  scenario appending what it measured to a JSON-lines file this script sums.

Figures: ``scenarios``/``scenarios_passed`` (pytest test outcomes), ``fuzz_cases``,
``fuzz_disagreements`` (admission and the spec disagree), ``fuzz_operator_crashes`` (a builder
raised on an accepted manifest), ``duplicate_children``, ``orphaned_children`` (children left
after deleting the RLHFJob), ``lost_or_repeated_steps`` (metrics steps against 1..total),
``leaked_processes`` (processes of a SIGKILLed ``hybridflow run`` alive 30 s later) and
``stall_detection_seconds`` (call to WorkerStalledError; the formula: the stall timeout, 2 s,
plus one ``ray.wait`` poll). ``--quick`` (CI, right before ``make e2e`` runs every scenario) runs
50 fuzz cases instead of 2000 and one e2e scenario, the demo example to Succeeded.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
QUICK_SCENARIO = "e2e/test_e2e.py::test_applying_an_example_trains_to_succeeded_and_deleting_removes_every_child[grpo-tiny]"


def fuzz(cases: int) -> dict[str, int]:
    os.environ["HYBRIDFLOW_FUZZ_CASES"] = str(cases)
    sys.path[:0] = [str(ROOT / "tests" / "fuzz"), str(ROOT / "tests")]  # its helpers and the kube package
    import test_manifests  # type: ignore[import-not-found]

    try:
        test_manifests.test_fuzzed_manifests_are_accepted_everywhere_or_rejected_everywhere()
    except Exception as error:  # a failing case is a figure, not a crash of the benchmark
        print(f"fuzz: {str(error)[:2000]}", file=sys.stderr)
    return dict(test_manifests.TALLY)


def pytest_run(args: list[str], results: Path) -> tuple[int, int]:
    """(tests run, tests passed) of one pytest run whose scenarios append to ``results``."""
    env = {**os.environ, "HYBRIDFLOW_E2E_RESULTS": str(results), "RAY_AUTH_MODE": "disabled"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    print(done.stdout[-3000:], file=sys.stderr)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    counts = {word: int(number) for number, word in re.findall(r"(\d+) (passed|failed|error)", summary)}
    total = counts.get("passed", 0) + counts.get("failed", 0) + counts.get("error", 0)
    return total, counts.get("passed", 0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        default=os.environ.get("HYBRIDFLOW_BENCH_QUICK") == "1",
        help="50 fuzz cases and one e2e scenario (CI)",
    )
    args = parser.parse_args()
    began = time.monotonic()
    tally = fuzz(50 if args.quick else 2000)
    with tempfile.TemporaryDirectory(prefix="hybridflow-e2e-bench-") as scratch:
        results = Path(scratch) / "results.jsonl"
        stall_run = pytest_run(["tests/integration/test_stall.py"], results)
        e2e_run = pytest_run([QUICK_SCENARIO] if args.quick else ["e2e"], results)
        lines: list[dict[str, Any]] = (
            [json.loads(line) for line in results.read_text().splitlines()] if results.exists() else []
        )

    def total(key: str) -> int:
        return int(sum(line.get(key, 0) for line in lines))

    stall = [line["stall_detection_seconds"] for line in lines if "stall_detection_seconds" in line]
    figures = {
        "scenarios": stall_run[0] + e2e_run[0],
        "scenarios_passed": stall_run[1] + e2e_run[1],
        "fuzz_cases": tally["cases"],
        "fuzz_accepted": tally["accepted"],
        "fuzz_disagreements": tally["disagreements"],
        "fuzz_operator_crashes": tally["operator_crashes"],
        "duplicate_children": total("duplicate_children"),
        "orphaned_children": total("orphaned_children"),
        "lost_or_repeated_steps": total("lost_or_repeated_steps"),
        "leaked_processes": total("leaked_processes"),
        "stall_detection_seconds": max(stall) if stall else None,
        "stall_timeout_seconds": 2.0,
        "wall_seconds": round(time.monotonic() - began, 1),
    }
    print(json.dumps(figures))
    return 0 if figures["scenarios"] and figures["scenarios"] == figures["scenarios_passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
