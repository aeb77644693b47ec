"""Overlapped generation and training: the rollout on its own pool, up to ``maxStaleness`` steps ahead.

A job whose rollout has a pool of its own (``spec.roles.rollout``) runs every step through a
:class:`RolloutPipeline`. Order of events at step ``k`` (``s = spec.rollout.maxStaleness``; the
trainer's policy version before step ``k`` is ``k - 1``, one actor update per step):

1. :meth:`RolloutPipeline.fill`: the generations of steps ``k .. min(k + s, total)`` that are not
   yet submitted go to the rollout pool, each with its own prompts (drawn from the sampler in
   step order) and seed. Generation ``k + s`` is queued behind the weights of version ``k - 1``.
2. :meth:`RolloutPipeline.serve`: step ``k``'s prompts and pending generation are handed to the
   :class:`~hybridflow.algorithms.prefetch.PrefetchedRollout` the step function sees.
3. The step function runs unchanged: it waits for step ``k``'s responses (usually already
   generated), scores them and updates the actor, while the rollout pool generates ``k+1 ..``.
4. :meth:`RolloutPipeline.push`: the new weights (version ``k``) go from the actor's pool to the
   rollout's over the ``weights`` bridge (``hybridflow.workers.weight_push``). The rollout takes
   them after the generations queued before (Ray runs a worker's calls in order), so generation
   ``j`` always uses version ``j - 1 - s`` (or the newest when ``j - 1 - s`` is before the start):
   a sample is at most ``s`` updates old when it trains, and exactly ``min(s, k - 1)``.

Hence, with ``s = 0`` the job is synchronous on split pools; with ``s >= 1`` one step's time is
about ``max(generate, score + update) + push`` instead of their sum.

Checkpoints. After step ``k`` the generations of ``k + 1 .. k + s`` are finished (the push of
step ``k`` waited behind them). :meth:`in_flight` returns them and the trainer saves them with
the step's checkpoint (``rollout_ahead.pt``); the sampler's saved position is already past their
prompts. A resumed run restores them (:meth:`restore`) and first pushes the checkpoint's
weights (version ``k``), so every later generation sees exactly the weights and prompts it
would have seen without the interruption.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from hybridflow.algorithms.api import JobWorkers
from hybridflow.algorithms.prefetch import PendingBatch, PrefetchedRollout, ReadyBatch
from hybridflow.controller import Batch, WorkerGroup

__all__ = [
    "IN_FLIGHT_FILE",
    "RolloutPipeline",
    "generation_steps",
    "load_in_flight",
    "save_in_flight",
]

IN_FLIGHT_FILE = "rollout_ahead.pt"


def generation_steps(step: int, max_staleness: int, total_steps: int) -> range:
    """The steps whose generations must be submitted before step ``step`` trains (step 1 of the protocol).

    >>> list(generation_steps(1, 1, 4)), list(generation_steps(4, 1, 4)), list(generation_steps(2, 0, 4))
    ([1, 2], [4], [2])
    """
    return range(step, min(step + max_staleness, total_steps) + 1)


def save_in_flight(path: Path, batches: Mapping[int, tuple[Batch, Batch]]) -> None:
    """Write the finished generations ahead of the checkpointed step: ``{step: (prompts, responses)}``."""
    torch.save({int(step): pair for step, pair in batches.items()}, path)


def load_in_flight(path: Path) -> dict[int, tuple[Batch, Batch]]:
    """What :func:`save_in_flight` wrote; empty when the checkpoint has none (a synchronous run's)."""
    if not path.exists():
        return {}
    loaded: dict[int, tuple[Batch, Batch]] = torch.load(path, weights_only=False)  # our own checkpoint
    return loaded


class RolloutPipeline:
    """The generations of a job whose rollout has its own pool (see the module docstring)."""

    def __init__(self, workers: JobWorkers, *, max_staleness: int, total_steps: int) -> None:
        if not isinstance(workers.rollout, WorkerGroup):
            raise TypeError("RolloutPipeline needs the rollout's worker group")
        self.group: WorkerGroup = workers.rollout
        self.actor = workers.actor
        self.max_staleness = max_staleness
        self.total_steps = total_steps
        self.view = PrefetchedRollout(self.group, max_staleness)
        self.workers = dataclasses.replace(workers, rollout=self.view)
        """What the step function gets: the job's workers with the prefetching rollout."""
        self._ahead: dict[int, tuple[Batch, PendingBatch]] = {}

    def restore(self, saved: Mapping[int, tuple[Batch, Batch]]) -> None:
        """Generations a checkpoint holds (finished before it was written), by step."""
        for step, (prompts, responses) in saved.items():
            self._ahead[step] = (prompts, ReadyBatch(responses))

    def fill(self, step: int, prompts_for: Callable[[int], Batch]) -> None:
        """Step 1: submit every generation due before ``step`` trains that is not yet submitted."""
        for due in generation_steps(step, self.max_staleness, self.total_steps):
            if due not in self._ahead:
                prompts = prompts_for(due)
                self._ahead[due] = (prompts, self.group.generate_sequences.submit(prompts))

    def serve(self, step: int) -> Batch:
        """Step 2: hand step ``step``'s generation to the step function's rollout; returns its prompts."""
        prompts, pending = self._ahead.pop(step)
        self.view.serve(prompts, pending, trainer_version=step - 1)
        return prompts

    def push(self, version: int) -> float:
        """Step 4: the actor's current weights (policy ``version``) to every rollout rank; seconds taken."""
        started = time.monotonic()
        sending = self.actor.push_weights.submit()
        receiving = self.group.receive_weights.submit(version)
        sending.result()
        receiving.result()
        return time.monotonic() - started

    def in_flight(self) -> dict[int, tuple[Batch, Batch]]:
        """The generations submitted for later steps, finished (waits for them): what a checkpoint keeps."""
        return {step: (prompts, pending.result()) for step, (prompts, pending) in sorted(self._ahead.items())}
