"""The per-step report the loop hands to progress sinks (kept free of heavy imports)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StepReport"]


@dataclass(frozen=True)
class StepReport:
    """What the loop tells progress sinks after each step (the CLI line, the in-cluster status push)."""

    step: int
    total_steps: int
    metrics: dict[str, float]
    eta_seconds: float
    last_checkpoint_step: int | None
