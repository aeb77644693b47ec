"""bench/async_rollout.py's JSON: the per-round ratio spread, and a quick run marked as a smoke run.

The bench is a script, not a package: loaded by path, as ``make bench`` runs it.
"""

from __future__ import annotations

import doctest
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("async_rollout", ROOT / "bench" / "async_rollout.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_ratio_is_taken_per_round_and_reported_with_its_spread(bench: ModuleType) -> None:
    # Round 2 ran on a slower machine: both runs slowed, and the pair's ratio holds.
    spread = bench.ratio_spread([150.0, 75.0, 90.0, 120.0, 200.0], [100.0, 50.0, 100.0, 100.0, 100.0])
    assert spread == {"rounds": [1.5, 1.5, 0.9, 1.2, 2.0], "median": 1.5, "min": 0.9, "max": 2.0}
    # The ratio of the medians (what the bench reported before) would have said 1.2 here.
    assert bench.ratio_spread([3.0], [4.0]) == {"rounds": [0.75], "median": 0.75, "min": 0.75, "max": 0.75}


def test_the_spread_refuses_unpaired_rounds(bench: ModuleType) -> None:
    with pytest.raises(ValueError, match=r"one sync run per async run.*got 2 async and 1 sync"):
        bench.ratio_spread([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="at least one round"):
        bench.ratio_spread([], [])


def test_a_quick_run_prints_its_headline_figures_as_smoke_figures(bench: ModuleType) -> None:
    figures = {
        "quick": True,
        "rounds": 1,
        "throughput": {"sync": {"tokens_per_second": 100.0}},
        "async_over_sync_tokens_per_second": 0.87,
        "async_over_sync_spread": {"rounds": [0.87], "median": 0.87, "min": 0.87, "max": 0.87},
        "reward_gain_async": 0.0,
        "replica_replace_seconds": None,
        "targets": {"async_over_sync_tokens_per_second": 1.5},
    }
    marked = bench.as_smoke_run(figures)
    assert marked["quick"] is True and "proves only that the bench runs" in marked["smoke_run"]
    assert marked["smoke_async_over_sync_tokens_per_second"] == 0.87
    assert marked["smoke_async_over_sync_spread"]["median"] == 0.87
    assert marked["smoke_reward_gain_async"] == 0.0
    # No headline figure under its result name, and no targets to hold a smoke run against.
    assert not set(bench.HEADLINE_KEYS) & set(marked) and "targets" not in marked
    assert marked["rounds"] == 1 and marked["throughput"] == figures["throughput"]  # the rest as is


def test_the_docstring_example_holds(bench: ModuleType) -> None:
    """The example is the 2026-12-05 run's rounds (docs/benchmarks.md)."""
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner()
    for test in finder.find(bench.ratio_spread, "ratio_spread", globs={"ratio_spread": bench.ratio_spread}):
        runner.run(test)
    results = runner.summarize(verbose=False)
    assert results.attempted == 1 and results.failed == 0
