"""The batch container passed between the single controller and its worker groups.

A :class:`Batch` holds three things that travel together:

* ``tensors``: torch tensors that share the first (batch) dimension;
* ``non_tensors``: numpy arrays (often ``dtype=object``, e.g. raw prompt strings or ground
  truths) that share the same first dimension;
* ``meta``: a small dict of per-batch values (sampling temperature, the step number...). It is
  copied, not split, when the batch is split.

Row operations (select, split, concat, union, repeat, reorder) keep the three in step.

Transport protocol. Pickling a torch tensor goes through ``torch.save`` into an in-band byte
string: one copy per tensor on each side and no shared memory. A Batch instead reduces itself to
numpy views of the tensors' bytes (zero copy), so that Ray's pickle-5 serializer moves every
array out of band into the object store with a single memcpy. The receiving side rebuilds the
tensors either as views of the object-store buffer (zero copy) or as private copies:

* a batch read by exactly one receiver (a DP shard sent to one rank, a worker's result read by
  the controller) is marked with :meth:`Batch.single_reader` and arrives as views: nobody else
  can observe an in-place write to that buffer;
* anything else (a broadcast, a shard shared by the TP/PP peers of a DP group, a batch a user
  puts into the object store) arrives as copies, because one reader's in-place write would
  otherwise change what the others see.

The worker group applies the marking; it never has to be done by hand.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

__all__ = ["Batch", "BatchError"]


class BatchError(ValueError):
    """A batch operation was asked for something the rows or keys do not allow."""


def _rows_of(name: str, value: torch.Tensor | np.ndarray) -> int:
    if value.ndim == 0:
        raise BatchError(f"batch field {name!r} is a scalar; every field needs a leading batch dimension")
    return int(value.shape[0])


@dataclass(frozen=True, eq=False)
class Batch:
    """Tensors, non-tensor arrays and meta data with one shared batch dimension.

    The container is immutable in its structure (fields are never added in place; use
    :meth:`union`), but the tensors themselves are ordinary torch tensors.
    """

    tensors: Mapping[str, torch.Tensor] = field(default_factory=dict)
    non_tensors: Mapping[str, np.ndarray] = field(default_factory=dict)
    meta: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tensors", dict(self.tensors))
        object.__setattr__(
            self,
            "non_tensors",
            {k: v if isinstance(v, np.ndarray) else _object_array(v) for k, v in self.non_tensors.items()},
        )
        object.__setattr__(self, "meta", dict(self.meta))
        for name, value in self.tensors.items():
            if not isinstance(value, torch.Tensor):
                raise BatchError(f"tensors[{name!r}] is a {type(value).__name__}, not a torch.Tensor")
        overlap = set(self.tensors) & set(self.non_tensors)
        if overlap:
            raise BatchError(f"keys {sorted(overlap)} appear both as tensors and as non-tensors")
        sizes = {name: _rows_of(name, v) for name, v in self.tensors.items()}
        sizes.update({name: _rows_of(name, v) for name, v in self.non_tensors.items()})
        if len(set(sizes.values())) > 1:
            detail = ", ".join(f"{k}={n}" for k, n in sizes.items())
            raise BatchError(f"batch fields disagree on the batch size: {detail}")

    # -- construction -------------------------------------------------------------------

    @classmethod
    def from_dict(
        cls,
        data: Mapping[str, torch.Tensor | np.ndarray | Sequence[Any]],
        meta: Mapping[str, Any] | None = None,
    ) -> Batch:
        """Sort a flat mapping into tensors (torch.Tensor) and non-tensors (anything else)."""
        tensors = {k: v for k, v in data.items() if isinstance(v, torch.Tensor)}
        non_tensors = {
            k: v if isinstance(v, np.ndarray) else _object_array(v)
            for k, v in data.items()
            if not isinstance(v, torch.Tensor)
        }
        return cls(tensors, non_tensors, dict(meta or {}))

    # -- shape ---------------------------------------------------------------------------

    def __len__(self) -> int:
        for value in self.tensors.values():
            return int(value.shape[0])
        for array in self.non_tensors.values():
            return int(array.shape[0])
        return 0

    @property
    def keys(self) -> list[str]:
        return [*self.tensors, *self.non_tensors]

    @property
    def nbytes(self) -> int:
        """Payload bytes of the tensors and of the numeric non-tensor arrays."""
        tensor_bytes = sum(t.numel() * t.element_size() for t in self.tensors.values())
        return tensor_bytes + sum(a.nbytes for a in self.non_tensors.values() if a.dtype != object)

    def __getitem__(self, key: str) -> torch.Tensor | np.ndarray:
        if key in self.tensors:
            return self.tensors[key]
        if key in self.non_tensors:
            return self.non_tensors[key]
        raise KeyError(f"batch has no field {key!r}; fields: {self.keys}")

    def __repr__(self) -> str:
        tensors = ", ".join(
            f"{k}:{tuple(v.shape)}:{str(v.dtype).removeprefix('torch.')}" for k, v in self.tensors.items()
        )
        others = ", ".join(f"{k}:{v.dtype}" for k, v in self.non_tensors.items())
        return (
            f"Batch(rows={len(self)}, tensors=[{tensors}], non_tensors=[{others}], meta={sorted(self.meta)})"
        )

    # -- row and key operations ----------------------------------------------------------

    def select(self, keys: Iterable[str], *, meta_keys: Iterable[str] | None = None) -> Batch:
        """A batch with only ``keys`` (and all meta, unless ``meta_keys`` narrows it)."""
        wanted = list(keys)
        missing = [k for k in wanted if k not in self.tensors and k not in self.non_tensors]
        if missing:
            raise BatchError(f"cannot select {missing}: the batch has {self.keys}")
        meta = self.meta if meta_keys is None else {k: self.meta[k] for k in meta_keys}
        return Batch(
            {k: self.tensors[k] for k in wanted if k in self.tensors},
            {k: self.non_tensors[k] for k in wanted if k in self.non_tensors},
            meta,
        )

    def pop(self, keys: Iterable[str]) -> tuple[Batch, Batch]:
        """Split the fields in two: (the named ``keys``, everything else). Meta goes to both."""
        wanted = set(keys)
        taken = self.select([k for k in self.keys if k in wanted])
        if len(taken.keys) != len(wanted):
            raise BatchError(f"cannot pop {sorted(wanted - set(taken.keys))}: the batch has {self.keys}")
        return taken, self.select([k for k in self.keys if k not in wanted])

    def rows(self, index: slice | Sequence[int] | torch.Tensor | np.ndarray) -> Batch:
        """The rows at ``index`` (a slice keeps views; an index list gathers copies)."""
        if isinstance(index, slice):
            return Batch(
                {k: v[index] for k, v in self.tensors.items()},
                {k: v[index] for k, v in self.non_tensors.items()},
                self.meta,
            )
        positions = np.asarray(index, dtype=np.int64)
        if positions.ndim != 1:
            raise BatchError(f"row index must be one-dimensional, got shape {positions.shape}")
        size = len(self)
        if positions.size and (positions.min() < -size or positions.max() >= size):
            raise BatchError(f"row index out of range for a batch of {size} rows")
        torch_positions = torch.from_numpy(positions)
        return Batch(
            {k: v.index_select(0, torch_positions.to(v.device)) for k, v in self.tensors.items()},
            {k: v[positions] for k, v in self.non_tensors.items()},
            self.meta,
        )

    def reorder(self, order: Sequence[int] | torch.Tensor | np.ndarray) -> Batch:
        """The same rows in the order given by a permutation of ``range(len(self))``."""
        positions = np.asarray(order, dtype=np.int64)
        if sorted(positions.tolist()) != list(range(len(self))):
            raise BatchError(
                f"reorder needs a permutation of range({len(self)}), got {positions.tolist()[:8]}..."
            )
        return self.rows(positions)

    def split(self, parts: int) -> list[Batch]:
        """``parts`` equal, contiguous chunks. Raises if the rows do not divide evenly."""
        size = len(self)
        if parts <= 0:
            raise BatchError(f"cannot split into {parts} parts")
        if size % parts:
            raise BatchError(f"a batch of {size} rows cannot be split into {parts} equal parts")
        step = size // parts
        return [self.rows(slice(i * step, (i + 1) * step)) for i in range(parts)]

    def chunk_by_size(self, rows_per_chunk: int) -> list[Batch]:
        """Contiguous chunks of ``rows_per_chunk`` rows (the last may be shorter); for micro-batches."""
        if rows_per_chunk <= 0:
            raise BatchError(f"rows_per_chunk must be positive, got {rows_per_chunk}")
        return [self.rows(slice(i, i + rows_per_chunk)) for i in range(0, len(self), rows_per_chunk)]

    def pad_to_multiple(self, multiple: int) -> tuple[Batch, int]:
        """Append copies of the first rows until the size divides ``multiple``; returns (batch, pad).

        Padding repeats real rows rather than inventing zeros so that workers never see inputs a
        real batch could not contain. Collectors remove the padding with :meth:`unpad`.
        """
        size = len(self)
        if size == 0:
            raise BatchError("cannot pad an empty batch: there is no row to repeat")
        pad = (-size) % multiple
        if pad == 0:
            return self, 0
        filler = np.arange(pad) % size
        return Batch.concat([self, self.rows(filler)]), pad

    def unpad(self, pad: int) -> Batch:
        """Drop the last ``pad`` rows added by :meth:`pad_to_multiple`."""
        return self if pad == 0 else self.rows(slice(0, len(self) - pad))

    def repeat(self, times: int, *, interleave: bool = True) -> Batch:
        """Each row ``times`` times: ``a a b b`` when interleaved (samples of a prompt stay adjacent), else ``a b a b``."""
        if times < 1:
            raise BatchError(f"repeat times must be >= 1, got {times}")
        base = np.arange(len(self))
        order = np.repeat(base, times) if interleave else np.tile(base, times)
        return self.rows(order)

    def union(self, other: Batch) -> Batch:
        """Fields of both batches (same rows). A key on both sides must hold equal values."""
        if len(self) != len(other) and self.keys and other.keys:
            raise BatchError(f"cannot union batches of {len(self)} and {len(other)} rows")
        tensors = dict(self.tensors)
        for k, v in other.tensors.items():
            if k in tensors and not (tensors[k].shape == v.shape and torch.equal(tensors[k], v)):
                raise BatchError(f"cannot union: tensor {k!r} differs between the two batches")
            tensors[k] = v
        non_tensors = dict(self.non_tensors)
        for k, a in other.non_tensors.items():
            if k in non_tensors and not np.array_equal(non_tensors[k], a):
                raise BatchError(f"cannot union: non-tensor {k!r} differs between the two batches")
            non_tensors[k] = a
        meta = {**self.meta, **other.meta}
        return Batch(tensors, non_tensors, meta)

    def with_fields(self, **fields: torch.Tensor | np.ndarray) -> Batch:
        """A copy with fields added or replaced (same rows)."""
        update = Batch.from_dict(fields)
        tensors = {k: v for k, v in self.tensors.items() if k not in update.non_tensors}
        non_tensors = {k: v for k, v in self.non_tensors.items() if k not in update.tensors}
        return Batch({**tensors, **update.tensors}, {**non_tensors, **update.non_tensors}, self.meta)

    def with_meta(self, **meta: Any) -> Batch:
        return Batch(self.tensors, self.non_tensors, {**self.meta, **meta})

    def to(self, device: torch.device | str) -> Batch:
        return Batch({k: v.to(device) for k, v in self.tensors.items()}, self.non_tensors, self.meta)

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        """Rows of all ``batches`` in order. All must have the same fields; meta of the first wins."""
        if not batches:
            raise BatchError("cannot concatenate an empty list of batches")
        first = batches[0]
        for i, b in enumerate(batches[1:], start=1):
            if set(b.tensors) != set(first.tensors) or set(b.non_tensors) != set(first.non_tensors):
                raise BatchError(
                    f"cannot concatenate: batch {i} has fields {b.keys}, batch 0 has {first.keys}"
                )
        if len(batches) == 1:
            return first
        tensors = {k: torch.cat([b.tensors[k] for b in batches]) for k in first.tensors}
        non_tensors = {k: np.concatenate([b.non_tensors[k] for b in batches]) for k in first.non_tensors}
        return Batch(tensors, non_tensors, first.meta)

    def equals(self, other: Batch) -> bool:
        """Same fields, same values (tensors bit for bit), same meta."""
        return (
            set(self.tensors) == set(other.tensors)
            and set(self.non_tensors) == set(other.non_tensors)
            and all(
                self.tensors[k].dtype == other.tensors[k].dtype
                and self.tensors[k].shape == other.tensors[k].shape
                and torch.equal(self.tensors[k], other.tensors[k])
                for k in self.tensors
            )
            and all(np.array_equal(self.non_tensors[k], other.non_tensors[k]) for k in self.non_tensors)
            and self.meta == other.meta
        )

    # -- transport -----------------------------------------------------------------------

    def single_reader(self) -> Batch:
        """The same batch, marked to arrive as zero-copy views (see the module docstring)."""
        marked = Batch(self.tensors, self.non_tensors, self.meta)
        object.__setattr__(marked, "_copy_on_receive", False)
        return marked

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        packed = {name: _tensor_to_wire(t) for name, t in self.tensors.items()}
        copy_on_receive = bool(getattr(self, "_copy_on_receive", True))
        return (_rebuild_batch, (packed, self.non_tensors, self.meta, copy_on_receive))


def _object_array(values: Sequence[Any]) -> np.ndarray:
    """A 1-D object array; avoids numpy turning a list of equal-length lists into a 2-D array."""
    array = np.empty(len(values), dtype=object)
    array[:] = list(values)
    return array


def _tensor_to_wire(tensor: torch.Tensor) -> tuple[str, tuple[int, ...], np.ndarray]:
    """(dtype name, shape, a flat uint8 numpy view of the bytes). Zero copy for contiguous CPU tensors."""
    source = tensor.detach()
    if source.device.type != "cpu":
        source = source.cpu()
    source = source.contiguous()
    raw = source.reshape(-1).view(torch.uint8) if source.numel() else torch.empty(0, dtype=torch.uint8)
    return (str(source.dtype).removeprefix("torch."), tuple(source.shape), raw.numpy())


def _tensor_from_wire(dtype_name: str, shape: tuple[int, ...], raw: np.ndarray, copy: bool) -> torch.Tensor:
    dtype = getattr(torch, dtype_name)
    if raw.size == 0:
        return torch.empty(shape, dtype=dtype)
    if copy or not raw.flags.c_contiguous:
        data = torch.from_numpy(np.array(raw, dtype=np.uint8, copy=True))
    else:
        with warnings.catch_warnings():
            # The object-store buffer is flagged read-only; a single reader may still write to it.
            warnings.simplefilter("ignore", UserWarning)
            data = torch.from_numpy(raw)
    return data.view(dtype).reshape(shape)


def _rebuild_batch(
    packed: dict[str, tuple[str, tuple[int, ...], np.ndarray]],
    non_tensors: dict[str, np.ndarray],
    meta: dict[str, Any],
    copy_on_receive: bool = True,
) -> Batch:
    return Batch({k: _tensor_from_wire(*v, copy_on_receive) for k, v in packed.items()}, non_tensors, meta)
