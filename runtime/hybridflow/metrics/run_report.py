"""``hybridflow report OUTPUT_DIR``: a finished or running job summarised from its files.

Reads ``OUTPUT_DIR/metrics.jsonl`` (one object per step, the step-report keys of
``catalogue.py``) and the checkpoint directory's ``latest`` pointer, and returns text: the steps
run, a table of the learning curves at evenly spaced steps, the mean time of each phase of a
step and its share, and the newest complete checkpoint. :func:`plot_curves` draws reward and KL
against the step into a small PNG. Everything here reads files only: no Ray, no torch.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

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


def _phase_lines(records: Sequence[dict[str, Any]]) -> list[str]:
    phases = sorted({key for r in records for key in r if key.startswith("timing/")})
    step_seconds = [
        r["perf/step_seconds"] for r in records if isinstance(r.get("perf/step_seconds"), int | float)
    ]
    mean_step = sum(step_seconds) / len(step_seconds) if step_seconds else 0.0
    body = []
    for key in phases:
        values = [r[key] for r in records if isinstance(r.get(key), int | float)]
        mean = sum(values) / len(values)
        share = f"{100 * mean / mean_step:.1f}%" if mean_step > 0 else "-"
        body.append([key.removeprefix("timing/"), f"{mean:.3f}", share])
    if not body:
        return ["(no timing/* figures recorded)"]
    body.append(["step", f"{mean_step:.3f}", "100.0%"])
    return _table(["phase", "mean s", "share"], body)


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


def render_report(
    output_dir: str | os.PathLike[str],
    *,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    rows: int = 10,
) -> str:
    """The text summary of the run in ``output_dir`` (see the module docstring)."""
    records = load_records(output_dir)
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
    lines += ["", "step breakdown (mean over steps):", *_phase_lines(records), ""]
    directory = Path(checkpoint_dir) if checkpoint_dir is not None else Path(output_dir) / "checkpoints"
    lines.append(f"last checkpoint: {_last_checkpoint(directory)}")
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
