"""``hybridflow report`` and the progress display of ``hybridflow run``, on files written here."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from hybridflow.cli import main
from hybridflow.metrics.progress import ProgressDisplay
from hybridflow.metrics.run_report import ReportError, load_records, render_report
from hybridflow.metrics.step_report import StepReport

pytestmark = pytest.mark.unit


def write_run(output_dir: Path, steps: int = 20) -> None:
    output_dir.mkdir(parents=True, exist_ok=True)
    lines = []
    for step in range(1, steps + 1):
        record = {
            "step": step,
            "reward/mean": step / steps,
            "kl/actor_ref": 0.001 * step,
            "perf/step_seconds": 2.0,
            "perf/tokens_per_second": 500.0,
            "timing/generate": 1.5,
            "timing/update": 0.5,
        }
        lines.append(json.dumps(record))
    (output_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    checkpoint = output_dir / "checkpoints" / "step_000020"
    checkpoint.mkdir(parents=True)
    (checkpoint / "controller.json").write_text(json.dumps({"step": 20}), encoding="utf-8")
    (output_dir / "checkpoints" / "latest").write_text("step_000020", encoding="utf-8")


def test_report_has_curves_breakdown_and_checkpoint(tmp_path: Path) -> None:
    write_run(tmp_path / "run")
    text = render_report(tmp_path / "run", rows=5)
    assert "20 steps recorded (steps 1-20)" in text
    assert "reward: 0.050 -> 1.000" in text
    table = text.split("learning curves:")[1].split("step breakdown")[0].strip().splitlines()
    assert table[0].split() == ["step", "reward", "kl", "tok/s", "step", "s"]
    assert [row.split()[0] for row in table[1:]] == ["1", "6", "11", "15", "20"]
    section = text.split("step breakdown")[1].split("last checkpoint")[0]
    breakdown = {line.split()[0]: line.split()[1:] for line in section.splitlines()[1:] if line.strip()}
    assert breakdown["generate"] == ["1.500", "75.0%"] and breakdown["update"] == ["0.500", "25.0%"]
    assert "last checkpoint: step 20:" in text


def test_report_command_writes_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_run(tmp_path / "run")
    assert main(["report", str(tmp_path / "run"), "--plot", str(tmp_path / "curves.png")]) == 0
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "plot:" in capsys.readouterr().out


def test_report_errors_name_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(tmp_path)]) == 2
    assert f"{tmp_path}/metrics.jsonl: no such file" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\nnot json\n', encoding="utf-8")
    with pytest.raises(ReportError, match=r"metrics.jsonl:2: not JSON"):
        load_records(tmp_path)


def report(step: int) -> StepReport:
    return StepReport(
        step, 10, {"reward/mean": 0.25, "kl/actor_ref": 0.0125, "perf/tokens_per_second": 812.4}, 65.0, None
    )


def test_plain_lines_when_not_a_terminal() -> None:
    stream = io.StringIO()
    with ProgressDisplay(stream, total_steps=10) as display:
        display.line("data: 256 prompts")
        display.update(report(3))
    assert stream.getvalue().splitlines() == [
        "data: 256 prompts",
        "step 3/10 | reward 0.250 | kl 0.0125 | 812 tok/s | ETA 1m05s",
    ]


def test_a_job_without_a_kl_term_prints_no_kl() -> None:
    stream = io.StringIO()
    with ProgressDisplay(stream, total_steps=10) as display:
        display.update(StepReport(3, 10, {"reward/mean": 0.25, "perf/tokens_per_second": 812.4}, 65.0, None))
    assert stream.getvalue().splitlines() == ["step 3/10 | reward 0.250 | 812 tok/s | ETA 1m05s"]


def test_live_bar_on_a_terminal_shows_step_reward_kl_throughput_eta() -> None:
    stream = io.StringIO()
    with ProgressDisplay(stream, total_steps=10, live=True) as display:
        display.update(report(3))
    out = stream.getvalue()
    for text in ("3/10", "reward 0.250", "kl 0.0125", "812 tok/s", "ETA 1m05s"):
        assert text in out
