"""Finished groups waiting for the trainer, and the staleness bound on what may be generated.

Terms. The *policy version* counts actor updates: the trainer's version before step ``k`` is
``k - 1``. A *group* is one prompt's ``n`` finished samples; every token carries the version of
the weights that produced it, and a group's *oldest version* is the smallest of them. Trained
at version ``v``, a group is ``v - oldest`` updates *stale*; ``spec.rollout.maxStaleness`` =
``k`` bounds that.

Two rules keep the bound (the same two AReaL's asynchronous trainer uses, written down here
from its paper's definition, not its code):

1. **The submission gate** (:func:`may_submit`): with the trainer at version ``v`` and ``B``
   groups per step, at most ``(v + 1 + k) * B`` groups may have been accepted or be on their
   way (submitted, not dropped). With ``k = 0`` that is exactly the next step's batch: the
   synchronous schedule. With ``k >= 1`` generation runs up to ``k`` steps ahead and never
   waits for training unless the bound is reached.
2. **The take rule** (:meth:`ReplayBuffer.take`): a step takes the ``B`` *oldest* groups first
   (by oldest version, then arrival), so that the groups nearest the bound train first, and
   drops any group already staler than ``k`` (a straggler that outlived the bound: counted,
   its prompt not retried).

Dynamic sampling (DAPO's filter-and-refill, Yu et al. 2025): a group whose rewards are all
equal has zero advantage under group-normalised algorithms and teaches nothing; with
``spec.rollout.dynamicSampling`` such groups are dropped on arrival (:func:`informative`) and
their prompts replaced by fresh ones, at most ``maxTries`` prompts per training prompt; past
the cap the buffer accepts uninformative groups rather than stall the job. The dropped
fraction is a metric.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch

__all__ = ["FinishedGroup", "ReplayBuffer", "informative", "may_submit", "staleness_histogram"]

G = TypeVar("G")


def may_submit(
    *, accepted_or_on_the_way: int, trainer_version: int, max_staleness: int, groups_per_step: int
) -> bool:
    """Rule 1: whether one more group may be submitted now.

    >>> may_submit(accepted_or_on_the_way=3, trainer_version=0, max_staleness=0, groups_per_step=4)
    True
    >>> may_submit(accepted_or_on_the_way=4, trainer_version=0, max_staleness=0, groups_per_step=4)
    False
    >>> may_submit(accepted_or_on_the_way=11, trainer_version=0, max_staleness=2, groups_per_step=4)
    True
    """
    return accepted_or_on_the_way < (trainer_version + 1 + max_staleness) * groups_per_step


def informative(rewards: Sequence[float] | torch.Tensor, *, tolerance: float = 1e-6) -> bool:
    """Whether a group's rewards differ (a group-normalised advantage is not all zero)."""
    values = torch.as_tensor(rewards, dtype=torch.float64)
    return bool(values.numel() > 1 and float(values.max() - values.min()) > tolerance)


@dataclass
class FinishedGroup(Generic[G]):
    """A group in the buffer: its payload (the rows the trainer gets) and its token versions."""

    payload: G
    oldest_version: int
    newest_version: int
    arrival: int = 0


@dataclass
class ReplayBuffer(Generic[G]):
    """The finished groups, taken ``B`` at a time by the trainer (rule 2 of the module docstring)."""

    max_staleness: int
    groups: list[FinishedGroup[G]] = field(default_factory=list)
    dropped_stale: int = 0
    _arrivals: int = 0

    def put(self, payload: G, *, oldest_version: int, newest_version: int) -> None:
        self.groups.append(FinishedGroup(payload, oldest_version, newest_version, self._arrivals))
        self._arrivals += 1

    def __len__(self) -> int:
        return len(self.groups)

    def drop_stale(self, trainer_version: int) -> int:
        """Drop the groups staler than the bound at ``trainer_version``; returns how many."""
        kept = [g for g in self.groups if trainer_version - g.oldest_version <= self.max_staleness]
        dropped = len(self.groups) - len(kept)
        self.groups = kept
        self.dropped_stale += dropped
        return dropped

    def ready(self, count: int, trainer_version: int) -> bool:
        """Whether ``count`` groups within the bound are here."""
        self.drop_stale(trainer_version)
        return len(self.groups) >= count

    def take(self, count: int, trainer_version: int) -> list[FinishedGroup[G]]:
        """The ``count`` oldest groups within the bound (raises when fewer are here: ask :meth:`ready`)."""
        self.drop_stale(trainer_version)
        if len(self.groups) < count:
            raise RuntimeError(f"{len(self.groups)} groups in the buffer, {count} asked for")
        order = sorted(self.groups, key=lambda g: (g.oldest_version, g.arrival))
        taken, self.groups = order[:count], sorted(order[count:], key=lambda g: g.arrival)
        return taken


def staleness_histogram(stalenesses: Sequence[int], max_staleness: int) -> dict[str, float]:
    """``staleness/samples/<k>`` for k = 0..max_staleness, with ``staleness/mean`` and ``/max``."""
    counts = [0] * (max_staleness + 1)
    for value in stalenesses:
        if not 0 <= value <= max_staleness:
            raise RuntimeError(
                f"a sample {value} updates stale, outside spec.rollout.maxStaleness 0..{max_staleness}"
            )
        counts[value] += 1
    return {
        "staleness/mean": sum(stalenesses) / max(len(stalenesses), 1),
        "staleness/max": float(max(stalenesses, default=0)),
        **{f"staleness/samples/{k}": float(c) for k, c in enumerate(counts)},
    }
