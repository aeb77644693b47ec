"""``hybridflow report`` and the progress display of ``hybridflow run``, on files written here."""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from hybridflow.checkpoint.exports import Artifact, export_directory, record_artifact
from hybridflow.cli import main
from hybridflow.metrics.progress import ProgressDisplay
from hybridflow.metrics.run_report import ReportError, load_records, render_report
from hybridflow.metrics.step_report import StepReport
from hybridflow.metrics.writer import progress_line

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


def test_report_lists_each_evaluation_and_keeps_step_0_out_of_the_training_steps(tmp_path: Path) -> None:
    write_run(tmp_path / "run", steps=4)
    path = tmp_path / "run" / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    evaluation = {0: (0.125, 0.25), 2: (0.5, 0.375), 4: (0.75, 0.625)}
    for record in records:
        if record["step"] in evaluation:
            greedy, sampled = evaluation[record["step"]]
            record.update({"val/greedy/reward/mean": greedy, "val/sampled/reward/mean": sampled})
    records.insert(0, {"step": 0, "val/greedy/reward/mean": 0.125, "val/sampled/reward/mean": 0.25})
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")

    text = render_report(tmp_path / "run")

    assert "4 steps recorded (steps 1-4)" in text and "reward: 0.250 -> 1.000" in text
    table = text.split("validation (spec.data.valFiles):")[1].split("step breakdown")[0].strip().splitlines()
    assert table[0].split() == ["step", "greedy", "sampled"]
    assert [row.split() for row in table[1:]] == [
        ["0", "0.125", "0.250"],
        ["2", "0.500", "0.375"],
        ["4", "0.750", "0.625"],
    ]
    write_run(tmp_path / "plain", steps=4)
    assert "validation" not in render_report(tmp_path / "plain")


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


# Two steps of a PPO run on this machine's CPU (tests/integration/test_run_job.py), timing/* and
# perf/step_seconds as written; the first step compiled, the second saved a checkpoint and an export.
PPO_STEPS: tuple[dict[str, float], ...] = (
    {
        "perf/step_seconds": 0.737,
        "timing/weight_sync": 0.041,
        "timing/generate": 0.066,
        "timing/reward": 0.030,
        "timing/old_log_probs": 0.032,
        "timing/ref_log_probs": 0.032,
        "timing/values": 0.033,
        "timing/advantages": 0.002,
        "timing/critic_update": 0.159,
        "timing/actor_update": 0.234,
        "timing/compile": 0.100,
        "timing/other": 0.009,
    },
    {
        "perf/step_seconds": 0.324,
        "timing/weight_sync": 0.026,
        "timing/generate": 0.052,
        "timing/reward": 0.003,
        "timing/old_log_probs": 0.039,
        "timing/ref_log_probs": 0.019,
        "timing/values": 0.031,
        "timing/advantages": 0.002,
        "timing/critic_update": 0.063,
        "timing/actor_update": 0.081,
        "timing/other": 0.008,
        "timing/checkpoint": 0.284,
        "export/seconds": 1.5,
    },
)


def breakdown(text: str) -> dict[str, list[str]]:
    section = text.split("step breakdown (mean over steps):\n")[1].split("\n\n")[0]
    return {line.split()[0]: line.split()[1:] for line in section.splitlines()[1:] if line.strip()}


def write_records(output_dir: Path, records: Sequence[dict[str, float]]) -> None:
    output_dir.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"step": step, **record}) for step, record in enumerate(records, start=1)]
    (output_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")


def test_the_shares_of_the_step_phases_add_up_to_the_step(tmp_path: Path) -> None:
    """Before: the checkpoint (after the step) had a share, and compile's mean was over step 1 only: 147%."""
    write_records(tmp_path / "run", PPO_STEPS)
    text = render_report(tmp_path / "run")
    phases = breakdown(text)
    assert phases.pop("step") == ["0.530", "100.0%"]
    assert list(phases)[:2] == ["weight_sync", "generate"] and list(phases)[-1] == "other"  # as a step runs
    assert phases["compile"] == ["0.050", "9.4%"]  # 0.1 s in one of two steps
    assert "checkpoint" not in phases
    assert abs(sum(float(share.rstrip("%")) for _, share in phases.values()) - 100.0) < 0.3
    assert "overlap" not in text
    after = text.split("after the step")[1].split("\n\n")[0].splitlines()
    assert [line.split() for line in after[1:]] == [
        ["checkpoint", "0.284", "1", "of", "2"],
        ["export", "1.500", "1", "of", "2"],
    ]


def test_phases_that_overlap_are_said_to_not_hidden(tmp_path: Path) -> None:
    """A step function that times a phase inside another: the report says the phases add up to 150%."""
    write_records(
        tmp_path / "run", [{"perf/step_seconds": 2.0, "timing/generate": 2.0, "timing/reward": 1.0}]
    )
    text = render_report(tmp_path / "run")
    assert breakdown(text)["reward"] == ["1.000", "50.0%"]
    assert "(the phases add up to 150.0% of the step: they overlap)" in text


def test_every_export_is_listed_with_its_parity_gap_passed_or_refused(tmp_path: Path) -> None:
    """Before: the report did not mention exports. Written here as the runner writes them."""
    run, checkpoints = tmp_path / "run", tmp_path / "ckpt"
    gate = [
        {"export/seconds": 4.0, "export/parity_max_abs_diff": 0.00069, "export/passed": 1.0},
        {"export/seconds": 4.2, "export/parity_max_abs_diff": 0.31, "export/passed": 0.0},
    ]
    write_records(run, [{}, gate[0], {}, gate[1]])
    passed = Artifact(2, "merged", str(export_directory(checkpoints, 2)), "3769af75" * 8, 0.00069)
    record_artifact(checkpoints, passed)
    text = render_report(run, checkpoint_dir=checkpoints)
    section = text.split("exports (parity: largest log-prob gap to the trainer on the probes, nats):\n")[1]
    assert [line.split() for line in section.splitlines()] == [
        ["step", "kind", "parity", "max", "gap", "gate", "path"],
        ["2", "merged", "0.00069", "listed", f"{checkpoints}/exports/step-2"],
        ["4", "-", "0.31", "refused", f"{checkpoints}/exports/step-4.rejected"],
    ]
    write_records(tmp_path / "plain", [{}])
    assert f"exports: none in {tmp_path}/plain/checkpoints/exports" in render_report(tmp_path / "plain")


def test_an_unreadable_artifacts_list_is_an_error_naming_it(tmp_path: Path) -> None:
    write_records(tmp_path, [{}])
    (tmp_path / "checkpoints" / "exports").mkdir(parents=True)
    (tmp_path / "checkpoints" / "exports" / "artifacts.json").write_text("[{}]")
    with pytest.raises(ReportError, match=r"exports/artifacts.json: not a list of export artifacts"):
        render_report(tmp_path)


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


def test_an_evaluation_step_prints_its_validation_score() -> None:
    figures = {"reward/mean": 0.25, "perf/tokens_per_second": 812.4, "val/sampled/reward/mean": 0.5}
    assert progress_line(StepReport(4, 10, figures, 65.0, None)) == (
        "step 4/10 | reward 0.250 | val 0.500 | 812 tok/s | ETA 1m05s"
    )
    figures["val/greedy/reward/mean"] = 0.75  # the greedy pass's, when both ran
    assert "| val 0.750 |" in progress_line(StepReport(4, 10, figures, 65.0, None))


def test_live_bar_on_a_terminal_shows_step_reward_kl_throughput_eta() -> None:
    stream = io.StringIO()
    with ProgressDisplay(stream, total_steps=10, live=True) as display:
        display.update(report(3))
    out = stream.getvalue()
    for text in ("3/10", "reward 0.250", "kl 0.0125", "812 tok/s", "ETA 1m05s"):
        assert text in out
