"""The order prompts are visited in, as a resumable position in an endless sequence of epochs.

Protocol. The single controller builds one :class:`PromptSampler` over the job's
:class:`~hybridflow.data.prompts.PromptDataset` and calls ``next_batch(batch_size)`` once per
training step. When it checkpoints, it stores ``state_dict()`` next to the model weights (the
state is taken *after* the batch of the last finished step was drawn); on restart it builds the
sampler over the same files with the same tokenizer and limit, calls ``load_state_dict(state)``
and carries on.

Order. Epoch ``e`` visits every prompt once, in the order :func:`epoch_order` gives for
``(seed, e)``, a pure function of those two numbers and the dataset size. A batch that runs
past the end of an epoch takes the rest from the start of the next epoch, so every batch has
exactly ``batch_size`` rows and no prompt is skipped.

Resume guarantee. The state is ``{"epoch", "position", "seed"}``: the next prompt is at
``position`` of epoch ``epoch``'s order. Because each epoch's order depends only on
``(seed, epoch, size)``, a sampler restored from a state returns exactly the batches, for any
sequence of batch sizes, that the original would have returned from that point on. This holds
as long as the dataset has the same rows in the same order (same files, tokenizer and
``max_prompt_tokens``); a changed size is caught, a same-size edit is not.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypedDict

import numpy as np

from hybridflow.data.prompts import PromptBatch, PromptDataset

__all__ = ["PromptSampler", "SamplerState", "SamplerStateError", "epoch_order"]


class SamplerState(TypedDict):
    """Where a :class:`PromptSampler` stands: the next prompt is ``position`` of epoch ``epoch``'s order."""

    epoch: int
    position: int
    seed: int


class SamplerStateError(ValueError):
    """``load_state_dict`` got a state that cannot resume this sampler."""


def epoch_order(size: int, *, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """The permutation of ``range(size)`` that epoch ``epoch`` visits (identity without ``shuffle``).

    Built by sorting raw draws of a PCG64 stream seeded with ``(seed, epoch)``: NumPy keeps
    bit-generator streams stable across releases (NEP 19), whereas ``Generator.permutation``
    may change its algorithm, which would silently reorder a resumed run's epoch.
    """
    if size < 0 or seed < 0 or epoch < 0:
        raise ValueError(f"size, seed and epoch must be >= 0, got {size}, {seed}, {epoch}")
    if not shuffle:
        return np.arange(size, dtype=np.int64)
    draws = np.random.PCG64(np.random.SeedSequence([seed, epoch])).random_raw(size)
    return np.argsort(draws, kind="stable").astype(np.int64)


class PromptSampler:
    """Draws batches from a dataset epoch after epoch; see the module docstring for the protocol."""

    def __init__(self, dataset: PromptDataset, *, seed: int = 0, shuffle: bool = True) -> None:
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self._dataset = dataset
        self._seed = seed
        self._shuffle = shuffle
        self._epoch = 0
        self._position = 0
        self._order = epoch_order(len(dataset), seed=seed, epoch=0, shuffle=shuffle)

    @property
    def dataset(self) -> PromptDataset:
        return self._dataset

    @property
    def seed(self) -> int:
        return self._seed

    @property
    def epoch(self) -> int:
        """The epoch the next prompt comes from (0-based)."""
        return self._epoch

    @property
    def position(self) -> int:
        """How many prompts of the current epoch have been drawn; always below the dataset size."""
        return self._position

    def next_indices(self, batch_size: int) -> list[int]:
        """Dataset indices of the next ``batch_size`` prompts, advancing the position."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        size = len(self._dataset)
        indices: list[int] = []
        while len(indices) < batch_size:
            end = min(size, self._position + batch_size - len(indices))
            indices.extend(int(i) for i in self._order[self._position : end])
            self._position = end
            if self._position == size:
                self._start_epoch(self._epoch + 1)
        return indices

    def next_batch(self, batch_size: int) -> PromptBatch:
        """The next ``batch_size`` prompts, crossing into the next epoch when this one runs out."""
        return self._dataset.take(self.next_indices(batch_size))

    def state_dict(self) -> SamplerState:
        """A plain-int snapshot; :meth:`load_state_dict` on it continues from exactly this point."""
        return {"epoch": self._epoch, "position": self._position, "seed": self._seed}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Continue from ``state`` (from :meth:`state_dict` of a sampler over the same dataset).

        Raises :class:`SamplerStateError` for a state of another seed (the shuffle would differ,
        so prompts would be repeated or skipped) or a position past the end of the dataset.
        """
        missing = [key for key in SamplerState.__annotations__ if key not in state]
        if missing:
            raise SamplerStateError(f"sampler state lacks {missing}; it has {sorted(state)}")
        values = {key: state[key] for key in SamplerState.__annotations__}
        for key, value in values.items():
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0:
                raise SamplerStateError(f"sampler state {key!r} must be an integer >= 0, got {value!r}")
        epoch, position, seed = int(values["epoch"]), int(values["position"]), int(values["seed"])
        if seed != self._seed:
            raise SamplerStateError(
                f"the checkpoint's prompt order was shuffled with seed {seed} but this run uses seed "
                f"{self._seed}; resume with spec.data.seed: {seed}, or the run would repeat and skip prompts"
            )
        size = len(self._dataset)
        if position > size:
            raise SamplerStateError(
                f"the checkpoint stopped at prompt {position} of an epoch but the dataset now has {size} "
                "prompts; resume with the same data files, tokenizer and maxPromptTokens"
            )
        self._start_epoch(epoch)
        if position == size:  # a state taken right at an epoch's end: the next epoch starts
            self._start_epoch(epoch + 1)
        else:
            self._position = position

    def _start_epoch(self, epoch: int) -> None:
        self._epoch = epoch
        self._position = 0
        self._order = epoch_order(len(self._dataset), seed=self._seed, epoch=epoch, shuffle=self._shuffle)
