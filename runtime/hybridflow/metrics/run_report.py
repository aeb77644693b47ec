"""``hybridflow report OUTPUT_DIR``: a finished or running job summarised from its files.

Reads ``OUTPUT_DIR/metrics.jsonl`` (one object per step, the step-report keys of
``catalogue.py``) and the checkpoint directory's ``latest`` pointer, and returns text: the steps
run, a table of the learning curves at evenly spaced steps, the validation scores of each
evaluation (``spec.data.valFiles``; step 0 is the one before training), the mean time of each
phase of a step and its share (the shares add up to 100%, or a line says by how much phases
overlap), what ran after the steps and is not in their seconds (checkpoints, exports), the newest
complete checkpoint, and every export with its parity figure (``hybridflow.checkpoint.exports``'s
list and the gate's figures in the metrics). :func:`plot_curves` draws reward and KL
against the step into a small PNG. Everything here reads files only: no Ray, no torch.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hybridflow.checkpoint.exports import (
    EXPORTS_DIRECTORY,
    export_directory,
    read_artifacts,
    rejected_directory,
)
from hybridflow.metrics.catalogue import CHECKPOINT_PHASE, OTHER_PHASE, STEP_PHASES

__all__ = ["ReportError", "load_records", "plot_curves", "render_report"]

# (key, column title, digits) of the table; absent keys show as "-".
TABLE_COLUMNS: tuple[tuple[str, str, int], ...] = (
    ("reward/mean", "reward", 3),
    ("kl/actor_ref", "kl", 4),
    ("actor/entropy", "entropy", 3),
    ("response/length_mean", "length", 1),
    ("perf/tokens_per_second", "tok/s", 0),
    ("perf/step_seconds", "step s", 2),
)
TIMING, STEP_SECONDS = "timing/", "perf/step_seconds"
# The validation table (spec.data.valFiles): the steps that evaluated, whatever the spacing above.
VALIDATION_COLUMNS: tuple[tuple[str, str, int], ...] = (
    ("val/greedy/reward/mean", "greedy", 3),
    ("val/sampled/reward/mean", "sampled", 3),
    ("val/sampled/reward/best_of_n_mean", "best of n", 3),
    ("val/greedy/response/length_mean", "greedy len", 1),
    ("val/sampled/response/length_mean", "sampled len", 1),
    ("val/seconds", "eval s", 2),
)
VALIDATION_PREFIX = "val/"
PLOTTED: tuple[tuple[str, str], ...] = (
    ("reward/mean", "reward (mean)"),
    ("kl/actor_ref", "KL(actor || ref)"),
)


class ReportError(ValueError):
    """The output directory holds no readable metrics (the message names the file)."""


def load_records(output_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    path = Path(output_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ReportError(f"{path}: no such file (is {output_dir} a job's spec.outputDir?)")
    records: list[dict[str, Any]] = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ReportError(f"{path}:{number}: not JSON ({err.msg})") from err
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise ReportError(f"{path}:{number}: a record needs an integer 'step'")
        records.append(record)
    if not records:
        raise ReportError(f"{path}: no steps recorded yet")
    return sorted(records, key=lambda r: r["step"])


def _cell(value: Any, digits: int) -> str:
    if not isinstance(value, int | float) or not math.isfinite(value):
        return "-"
    return f"{value:.{digits}f}"


def _spaced(records: Sequence[dict[str, Any]], rows: int) -> list[dict[str, Any]]:
    """At most ``rows`` records, evenly spaced, always the first and the last."""
    if len(records) <= rows:
        return list(records)
    picks = sorted({round(i * (len(records) - 1) / (rows - 1)) for i in range(rows)})
    return [records[i] for i in picks]


def _table(header: Sequence[str], body: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in (header, *body)) for i in range(len(header))]
    return [
        "  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True))
        for row in (header, *body)
    ]


def _number(record: dict[str, Any], key: str) -> float | None:
    value = record.get(key)
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


def _phase_order(phases: set[str]) -> list[str]:
    """Catalogue phases in the order a step runs them, then any others (a plugin's records) by name."""
    known = [phase.name for phase in (*STEP_PHASES, OTHER_PHASE) if phase.name in phases]
    return known + sorted(phases - set(known))


def _phase_lines(records: Sequence[dict[str, Any]]) -> list[str]:
    """The step's phases: each one's mean seconds over every timed step and its share of the step.

    A phase a step did not run counts 0 seconds in that step's mean (``compile`` on the first steps
    only), so the shares of phases that partition each step (the trainer's: disjoint intervals, the
    rest as ``other``) add up to 100%. Phases that overlap (a step function writing ``timing/*`` of its
    own) add up to more, and a last line says by how much instead of hiding it. The checkpoint runs
    after the step and is not part of it (:func:`_after_step_lines`).
    """
    timed = [r for r in records if (_number(r, STEP_SECONDS) or 0.0) > 0]
    after = {f"{TIMING}{CHECKPOINT_PHASE.name}"}
    phases = {k.removeprefix(TIMING) for r in timed for k in r if k.startswith(TIMING) and k not in after}
    if not timed or not phases:
        return ["(no timing/* figures recorded)"]
    mean_step = sum(_number(r, STEP_SECONDS) or 0.0 for r in timed) / len(timed)
    body, total = [], 0.0
    for name in _phase_order(phases):
        mean = sum(_number(r, TIMING + name) or 0.0 for r in timed) / len(timed)
        total += mean
        body.append([name, f"{mean:.3f}", f"{100 * mean / mean_step:.1f}%"])
    body.append(["step", f"{mean_step:.3f}", "100.0%"])
    lines = _table(["phase", "mean s", "share"], body)
    if abs(total / mean_step - 1) > 0.005:
        lines.append(
            f"(the phases add up to {100 * total / mean_step:.1f}% of the step: "
            + ("they overlap" if total > mean_step else "part of the step is untimed")
            + ")"
        )
    return lines


def _after_step_lines(records: Sequence[dict[str, Any]]) -> list[str]:
    """What runs after a step and is not in its seconds: checkpoints and exports, on their steps only."""
    body = []
    for name, key in (("checkpoint", f"{TIMING}{CHECKPOINT_PHASE.name}"), ("export", "export/seconds")):
        values = [v for r in records if (v := _number(r, key)) is not None]
        if values:
            body.append([name, f"{sum(values) / len(values):.3f}", f"{len(values)} of {len(records)}"])
    return _table(["after the step", "mean s", "steps"], body) if body else []


def _is_training_step(record: dict[str, Any]) -> bool:
    """A record with a training step's figures (not only an evaluation's: step 0 of ``atStart``)."""
    return any(key != "step" and not key.startswith(VALIDATION_PREFIX) for key in record)


def _validation_lines(records: Sequence[dict[str, Any]], rows: int) -> list[str]:
    """The validation scores at the steps that evaluated (at most ``rows`` of them, evenly spaced)."""
    evaluated = [r for r in records if any(key.startswith(VALIDATION_PREFIX) for key in r)]
    columns = [column for column in VALIDATION_COLUMNS if any(column[0] in r for r in evaluated)]
    if not evaluated or not columns:
        return []
    body = [
        [str(r["step"]), *(_cell(r.get(key), digits) for key, _, digits in columns)]
        for r in _spaced(evaluated, rows)
    ]
    return ["", "validation (spec.data.valFiles):", *_table(["step", *(t for _, t, _ in columns)], body)]


def _last_checkpoint(checkpoint_dir: Path) -> str:
    pointer = checkpoint_dir / "latest"
    candidates = [checkpoint_dir / pointer.read_text(encoding="utf-8").strip()] if pointer.is_file() else []
    candidates += sorted(checkpoint_dir.glob("step_*"), reverse=True)
    for directory in candidates:
        state = directory / "controller.json"
        if state.is_file():
            step = json.loads(state.read_text(encoding="utf-8")).get("step")
            return f"step {step}: {directory}"
    return f"none in {checkpoint_dir}"


def _export_lines(records: Sequence[dict[str, Any]], checkpoint_dir: Path) -> list[str]:
    """Every export: from the published list (``artifacts.json``) and the gate's figures in the metrics.

    The list has the exports that passed, with kind, path and parity; a step's metrics have the
    gate's figures whether it passed or not, so a refused export (kept as ``step-<N>.rejected``)
    shows too. The parity figure is the largest log-prob gap to the trainer on the probes, in nats.
    """
    try:
        listed = {artifact.step: artifact for artifact in read_artifacts(checkpoint_dir)}
    except ValueError as err:
        raise ReportError(str(err)) from err
    gated = {r["step"]: r for r in records if _number(r, "export/parity_max_abs_diff") is not None}
    if not listed and not gated:
        return [f"exports: none in {checkpoint_dir / EXPORTS_DIRECTORY}"]
    body, paths = [], ["path"]
    for step in sorted(set(listed) | set(gated)):
        artifact, record = listed.get(step), gated.get(step, {})
        if artifact is not None:
            kind, gap, gate, path = artifact.kind, artifact.parity_max_abs_diff, "listed", artifact.path
        elif _number(record, "export/passed") == 0:
            kind, gate, path = "-", "refused", str(rejected_directory(checkpoint_dir, step))
            gap = record["export/parity_max_abs_diff"]
        else:  # passed, but not in this checkpoint directory's list
            kind, gate, path = "-", "passed", str(export_directory(checkpoint_dir, step))
            gap = record["export/parity_max_abs_diff"]
        body.append([str(step), kind, f"{gap:.3g}", gate])
        paths.append(path)
    rows = _table(["step", "kind", "parity max gap", "gate"], body)
    title = "exports (parity: largest log-prob gap to the trainer on the probes, nats):"
    return [title, *(f"{row}  {path}" for row, path in zip(rows, paths, strict=True))]


def render_report(
    output_dir: str | os.PathLike[str],
    *,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    rows: int = 10,
) -> str:
    """The text summary of the run in ``output_dir`` (see the module docstring)."""
    everything = load_records(output_dir)
    records = [r for r in everything if _is_training_step(r)] or everything
    first, last = records[0], records[-1]
    lines = [f"{output_dir}: {len(records)} steps recorded (steps {first['step']}-{last['step']})", ""]
    for key, title, digits in TABLE_COLUMNS[:2]:
        lines.append(f"{title}: {_cell(first.get(key), digits)} -> {_cell(last.get(key), digits)}")
    lines += ["", "learning curves:"]
    columns = [(key, title, digits) for key, title, digits in TABLE_COLUMNS if any(key in r for r in records)]
    body = [
        [str(r["step"]), *(_cell(r.get(key), digits) for key, _, digits in columns)]
        for r in _spaced(records, rows)
    ]
    lines += _table(["step", *(title for _, title, _ in columns)], body)
    lines += _validation_lines(everything, rows)
    lines += ["", "step breakdown (mean over steps):", *_phase_lines(records), ""]
    if after_step := _after_step_lines(records):
        lines += [*after_step, ""]
    directory = Path(checkpoint_dir) if checkpoint_dir is not None else Path(output_dir) / "checkpoints"
    lines += [f"last checkpoint: {_last_checkpoint(directory)}", "", *_export_lines(records, directory)]
    return "\n".join(lines)


def plot_curves(records: Sequence[dict[str, Any]], path: str | os.PathLike[str]) -> Path:
    """Reward and KL against the step, side by side, as a small PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.ticker import MaxNLocator

    figure, axes = plt.subplots(1, len(PLOTTED), figsize=(8, 3), dpi=100)
    for axis, (key, title) in zip(axes, PLOTTED, strict=True):
        points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), int | float)]
        if points:
            steps, values = zip(*points, strict=True)
            axis.plot(steps, values, marker=".", linewidth=1)
        axis.set_title(title)
        axis.set_xlabel("step")
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.grid(alpha=0.3)
    figure.tight_layout()
    target = Path(path)
    figure.savefig(target)
    plt.close(figure)
    return target
