"""``workers.rollout`` of an overlapped job: the step's responses were generated ahead of it.

With the rollout on a pool of its own and ``spec.rollout.maxStaleness > 0``, the trainer
(``hybridflow.trainer.overlap``) submits each step's generation before earlier steps train, so
that the rollout pool generates while the actor's pool updates. Algorithms and plugins need not
know: their step function receives a :class:`~hybridflow.algorithms.api.JobWorkers` whose
``rollout`` is a :class:`PrefetchedRollout`, and the calls they already make keep their meaning.

Protocol, per step, between the trainer and a step function:

1. The trainer calls :meth:`PrefetchedRollout.serve` with the step's prompts (the very batch it
   then passes to the step function), their pending generation and the trainer's policy version.
2. The step calls ``workers.rollout.sync_weights()``: nothing to do, the trainer pushes the new
   weights to the rollout pool after every update. Returns 0 bytes.
3. The step calls ``workers.rollout.generate_sequences(prompts)`` with that batch: it receives
   the pending generation's result (waiting only for the part not yet done). Any other batch
   (ReMax's greedy pass) is generated on the rollout group at once, with the weights the
   rollout holds then (the newest pushed), behind the generations already queued there.
4. After the step, :meth:`staleness_metrics` describes the samples it was served.

Every other method (``transition_stats``, plugins' own registered calls) goes to the rollout's
worker group unchanged.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from hybridflow.controller import Batch, WorkerGroup

__all__ = ["PendingBatch", "PrefetchedRollout", "ReadyBatch", "staleness_metrics"]


class PendingBatch(Protocol):
    """A generation's result to come (a :class:`~hybridflow.controller.GroupFuture`, or one already here)."""

    def result(self) -> Any: ...


class ReadyBatch:
    """A generation that already finished (restored from a checkpoint)."""

    def __init__(self, batch: Batch) -> None:
        self._batch = batch

    def result(self) -> Batch:
        return self._batch


def staleness_metrics(versions: torch.Tensor, trainer_version: int, max_staleness: int) -> dict[str, float]:
    """``staleness/mean``, ``staleness/max`` and the histogram ``staleness/samples/<k>``, k = 0..max_staleness.

    ``versions`` are the samples' ``policy_version`` (actor updates behind the weights that
    generated them), ``trainer_version`` the updates behind the weights about to train on them.
    A sample staler than ``max_staleness`` (or from a future policy) breaks the overlap's bound
    and raises: it would mean the schedule is wrong, not that the data is.
    """
    staleness = trainer_version - versions.to(torch.int64)
    worst, best = int(staleness.max()), int(staleness.min())
    if best < 0 or worst > max_staleness:
        raise RuntimeError(
            f"samples {best}..{worst} updates behind the trainer (version {trainer_version}); "
            f"spec.rollout.maxStaleness allows 0..{max_staleness}"
        )
    counts = torch.bincount(staleness, minlength=max_staleness + 1)
    return {
        "staleness/mean": float(staleness.float().mean()),
        "staleness/max": float(worst),
        **{f"staleness/samples/{k}": float(counts[k]) for k in range(max_staleness + 1)},
    }


class PrefetchedRollout:
    """The rollout group as an overlapped step sees it (see the module docstring)."""

    def __init__(self, group: WorkerGroup, max_staleness: int) -> None:
        self.group = group
        self.max_staleness = max_staleness
        self._prompts: Batch | None = None
        self._pending: PendingBatch | None = None
        self._trainer_version = 0
        self._served: Batch | None = None

    def serve(self, prompts: Batch, pending: PendingBatch, trainer_version: int) -> None:
        """Step 1 of the protocol: what the next ``generate_sequences(prompts)`` returns."""
        self._prompts, self._pending, self._trainer_version = prompts, pending, trainer_version
        self._served = None

    def sync_weights(self) -> int:
        """Nothing to load here: the trainer pushes the weights after each update (0 bytes)."""
        return 0

    def generate_sequences(self, prompts: Batch) -> Batch:
        if prompts is self._prompts and self._pending is not None:
            batch: Batch = self._pending.result()
            self._pending = None
            self._served = batch
            return batch
        result: Batch = self.group.generate_sequences(prompts)
        return result

    def staleness_metrics(self) -> dict[str, float]:
        """Step 4: the staleness of the samples served this step (empty if none was)."""
        if self._served is None:
            return {}
        return staleness_metrics(
            self._served.tensors["policy_version"], self._trainer_version, self.max_staleness
        )

    def transition_stats(self) -> Any:
        return self.group.transition_stats()

    def __getattr__(self, method: str) -> Any:
        if method.startswith("_"):
            raise AttributeError(method)
        return getattr(self.group, method)
