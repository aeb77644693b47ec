"""Faults on purpose on one machine: SIGTERM (preemption) and SIGKILL of ``hybridflow run``.

The ``hybridflow run`` scenario is one chain on one checkpoint directory, each run a fresh
process with its own embedded Ray, as a user (or the operator's next attempt) runs it:

1. SIGTERM after the first step: the run checkpoints the step it finished and exits 143;
2. the rerun resumes at the following step; SIGKILL once it printed step 3: every process the
   run started (GCS, raylet, agents, workers) is gone shortly after, none is left behind;
3. the rerun resumes from the newest complete checkpoint and finishes.

Every step appears once in the metrics, and the final parameters equal an uninterrupted run's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch
import yaml
from test_e2e import lost_or_repeated

# Four fresh `hybridflow run` processes on 2 shared cores: minutes, hence e2e/ and not make test.
pytestmark = pytest.mark.timeout(1800)

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "hybridflow.cli"]
EXIT_PREEMPTED = 143


# --------------------------------------------------------------------------- hybridflow run chain


def manifest(tiny: Path, out: Path) -> Path:
    doc = yaml.safe_load((ROOT / "examples" / "grpo-tiny.yaml").read_text())
    spec = doc["spec"]
    spec["models"] = {"actor": {"path": str(tiny / "model")}}
    spec["data"]["trainFiles"] = [str(tiny / "data" / "target_char.jsonl")]
    spec["rollout"]["maxResponseTokens"] = 8
    spec["training"]["totalSteps"] = 4
    spec["checkpoint"].update(intervalSteps=2, keepLast=3)
    spec["outputDir"] = str(out)
    path = out.with_suffix(".yaml")
    path.write_text(yaml.safe_dump(doc))
    return path


class Run:
    """One ``hybridflow run`` process whose output lines are read as they come."""

    def __init__(self, path: Path) -> None:
        env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(
            [*CLI, "run", str(path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        self.lines: list[str] = []

    def wait_for(self, text: str, timeout_seconds: float = 300) -> None:
        assert self.process.stdout is not None
        deadline = time.monotonic() + timeout_seconds
        for line in self.process.stdout:
            self.lines.append(line)
            if text in line:
                return
            if time.monotonic() > deadline:
                break
        raise AssertionError(f"{text!r} never came; output:\n{self.output[-4000:]}")

    def finish(self, timeout_seconds: float = 300) -> int:
        assert self.process.stdout is not None
        self.lines.extend(self.process.stdout)
        return self.process.wait(timeout_seconds)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def started_processes(self) -> list[psutil.Process]:
        return psutil.Process(self.process.pid).children(recursive=True)


def still_alive(processes: list[psutil.Process], wait_seconds: float = 30.0) -> list[str]:
    """Those of ``processes`` still running after ``wait_seconds`` (zombies count as gone)."""
    deadline = time.monotonic() + wait_seconds
    while True:
        alive = []
        for process in processes:
            try:
                if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                    alive.append(f"{process.pid} {' '.join(process.cmdline())[:100]}")
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def metrics(out: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def actor_parameters(checkpoint: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    single = checkpoint.parent / f"{checkpoint.name}.pt"
    dcp_to_torch_save(str(checkpoint / "actor"), str(single))
    state = torch.load(single, weights_only=False)
    return {k: v for k, v in state["model"].items() if isinstance(v, torch.Tensor)}


@pytest.fixture(scope="module")
def uninterrupted(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    out = tmp_path_factory.mktemp("straight") / "job"
    run = Run(manifest(tiny, out))
    assert run.finish() == 0, run.output[-3000:]
    yield out


def test_preempted_then_killed_run_resumes_to_the_uninterrupted_result(
    tiny: Path, tmp_path: Path, uninterrupted: Path, figures: dict[str, object]
) -> None:
    out = tmp_path / "job"
    path = manifest(tiny, out)

    first = Run(path)
    first.wait_for("step 1/4")
    first.process.send_signal(signal.SIGTERM)
    assert first.finish() == EXIT_PREEMPTED, first.output[-3000:]
    stopped_at = max(int(m["step"]) for m in metrics(out))
    assert f"checkpoint step_{stopped_at:06d} written" in first.output
    assert (out / "checkpoints" / f"step_{stopped_at:06d}" / "controller.json").is_file()
    assert stopped_at < 4, "the SIGTERM came too late to test anything"

    second = Run(path)
    second.wait_for(f"resumed from {out / 'checkpoints' / f'step_{stopped_at:06d}'} (step {stopped_at})")
    for step in range(stopped_at + 1, 4):  # the following step, not the same one again; then on to 3
        second.wait_for(f"step {step}/4")
    started = second.started_processes()
    assert any("raylet" in " ".join(p.cmdline()) for p in started), [p.cmdline()[:2] for p in started]
    second.process.kill()
    second.finish()
    leaked = still_alive(started)
    figures["leaked_processes"] = len(leaked)
    assert leaked == []  # Ray's agents and workers die with the driver

    third = Run(path)
    assert third.finish() == 0, third.output[-3000:]
    assert "resumed from" in third.output and "step 4/4" in third.output

    records = metrics(out)
    figures["lost_or_repeated_steps"] = lost_or_repeated([int(m["step"]) for m in records], 4)
    assert [int(m["step"]) for m in records] == [1, 2, 3, 4]  # no step lost or repeated
    for straight, resumed in zip(metrics(uninterrupted), records, strict=True):
        assert straight["reward/mean"] == resumed["reward/mean"]
        assert straight["actor/policy_loss"] == resumed["actor/policy_loss"]
    expected = actor_parameters(uninterrupted / "checkpoints" / "step_000004")
    actual = actor_parameters(out / "checkpoints" / "step_000004")
    assert expected.keys() == actual.keys() and expected
    for name, tensor in expected.items():
        assert torch.equal(tensor, actual[name]), name
