"""``hybridflow make-tiny`` run in the test process: the command's own code, without a new interpreter.

A new interpreter costs about 7 CPU-s of imports on a suite that is CPU-bound; the tests that are
about the command itself (test_run_job, e2e) run it as a user does.
"""

from __future__ import annotations

from pathlib import Path

from hybridflow.cli import main

__all__ = ["make_tiny"]


def make_tiny(model_dir: Path, data_dir: Path, prompts: int) -> None:
    """The tiny model and tokenizer in ``model_dir``, ``prompts`` toy prompts in ``data_dir``."""
    argv = [
        "make-tiny",
        "--model-dir",
        str(model_dir),
        "--data-dir",
        str(data_dir),
        "--prompts",
        str(prompts),
    ]
    if main(argv) != 0:
        raise RuntimeError(f"hybridflow {' '.join(argv)} failed")
