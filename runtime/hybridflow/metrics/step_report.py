"""The per-step report the loop hands to progress sinks (kept free of heavy imports)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["StepReport"]


@dataclass(frozen=True)
class StepReport:
    """What the loop tells progress sinks after each step (the CLI line, the in-cluster status push)."""

    step: int
    total_steps: int
    metrics: dict[str, float]
    eta_seconds: float
    last_checkpoint_step: int | None
    rollout: dict[str, Any] | None = field(default=None)
    """Server mode: the replicas' health in the status's camelCase form (``RolloutService.health``)."""
    artifacts: tuple[dict[str, Any], ...] = ()
    """``spec.checkpoint.export``: every export published so far, in ``status.artifacts``' form."""
