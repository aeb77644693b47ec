"""Weight-sync fingerprints: proof, after every sync, that the engine serves what the trainer sent.

A sync that silently fails to deliver (an adapter never applied, weights not reloaded after a
sleep, a loader that maps a fused tensor wrongly after an upgrade) trains on samples from the
wrong policy for as long as nobody looks. So every sync ends with a comparison: the trainer's
side checksums each tensor as it streams out, in the dtype the engine stores (the buckets are
already cast to it), and the engine checksums the same elements of its own copy, read back from
where it serves them. Any difference is a :class:`WeightSyncMismatch` that names the tensor and
fails the step.

**The checksum** of a set of elements is ``sum(bits(x_i) * w(i)) mod 2**64``: ``bits`` is the
element's bit pattern as an integer (so -0.0 and 0.0, or two NaNs, differ as they do in memory),
``i`` its flat index in the HF tensor and ``w`` an odd multiplicative hash of it, so that moved
elements (a transposed or permuted tensor) change the sum too. Integer addition modulo 2**64 is
exact and order-free: every device and reduction order gives the same number, and the checksum of
a tensor is the sum of the checksums of any split of its elements (an engine holding a tensor in
pieces can add its pieces up).

**What is checked** (``spec.rollout.weightSyncCheck``, a :class:`FingerprintPlan`):

* ``sampled`` (the default): every tensor of at most :data:`SAMPLED_ELEMENTS` elements whole
  (norms, biases), and :data:`SAMPLED_ELEMENTS` elements of every larger one, evenly strided
  through it from an offset seeded by the policy version and the tensor's name, so each sync
  reads every region of every tensor and successive syncs read different elements. It catches
  whatever corrupts or misses a tensor as a whole (an undelivered tensor, a stale one, a wrong
  mapping, a dtype or layout mix-up) and, over many syncs, partial damage too; it reads a few
  thousandths of a large model's bytes. A change confined to elements it did not draw passes
  that sync.
* ``full``: every element of every tensor; a pass over all weights on both sides.
* ``off``: nothing.

**Who does what.** The trainer's side is :class:`SentFingerprint`, a pass-through over the
bucket stream. The engine's side is the engine's ``weight_fingerprint(plan, shapes)``
(:mod:`hybridflow.engines`), which returns a checksum per name, or ``None`` for a tensor the
engine cannot read back (vLLM's CPU backend repacks linear weights into an opaque format): such
tensors are counted as unverified, never passed off as checked. :func:`compare_fingerprints`
decides. Over a bridge, the sender's fingerprint follows the buckets as one more message
(:mod:`hybridflow.resharding.bucket_broadcast`) and every receiver compares its own engine.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

__all__ = [
    "SAMPLED_ELEMENTS",
    "CheckMode",
    "FingerprintPlan",
    "FingerprintReport",
    "Sample",
    "SentFingerprint",
    "WeightSyncMismatch",
    "block_fingerprints",
    "compare_fingerprints",
    "fingerprint_tensors",
    "tensor_checksum",
    "tiled_checksum",
]

CheckMode = Literal["off", "sampled", "full"]

SAMPLED_ELEMENTS = 1024
"""Elements a ``sampled`` fingerprint reads of each larger tensor, at least (under twice as many:
the stride runs to the tensor's end), and all of a smaller one. A strided view costs the same
whatever the tensor's size, so a sync's check costs a few tens of microseconds per tensor on
each side (``bench/lora.py`` measures it against the sync: docs/benchmarks.md)."""

_WEIGHT_MULTIPLIER = 0x9E3779B97F4A7C15 - (1 << 64)
"""An odd 64-bit constant (the golden ratio's), as a signed int64: ``w(i) = i * M + 1`` wraps modulo
2**64 and is odd, hence never zero, for every index."""

_CHUNK_ELEMENTS = 1 << 22
"""Elements checksummed at once: the pass holds two int64 copies of a chunk (64 MiB), not of a tensor."""

_BIT_VIEWS: dict[int, torch.dtype] = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class WeightSyncMismatch(RuntimeError):
    """The engine does not hold what the trainer sent; names the first tensor that differs."""

    def __init__(self, message: str, *, tensor: str, version: int) -> None:
        super().__init__(message)
        self.tensor = tensor
        self.version = version


@dataclass(frozen=True)
class Sample:
    """Flat indices ``start, start + stride, ...``, ``count`` of them, of a tensor in its HF layout."""

    start: int
    stride: int
    count: int

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sampled elements of ``tensor`` (contiguous, HF layout): a strided view, no copy."""
        return tensor.reshape(-1)[self.start :: self.stride][: self.count]

    def positions(self, device: torch.device) -> torch.Tensor:
        return self.start + self.stride * torch.arange(self.count, device=device)


@dataclass(frozen=True)
class FingerprintPlan:
    """Which elements of each tensor a sync's fingerprint covers; the same on both sides."""

    mode: CheckMode
    version: int
    """The policy version the sync delivers; seeds the sampled elements."""

    def sample(self, name: str, shape: Sequence[int]) -> Sample | None:
        """The elements checked of tensor ``name``, as a :class:`Sample` of its flat indices, or ``None`` for all."""
        numel = math.prod(shape)
        if self.mode == "full" or numel <= SAMPLED_ELEMENTS:
            return None
        stride = numel // SAMPLED_ELEMENTS
        seed = int.from_bytes(hashlib.sha256(f"{self.version}/{name}".encode()).digest()[:8], "little")
        start = seed % stride
        # To the tensor's end: between SAMPLED_ELEMENTS and twice as many, every region read.
        return Sample(start=start, stride=stride, count=(numel - start + stride - 1) // stride)

    def to_json(self) -> dict[str, Any]:
        return {"mode": self.mode, "version": self.version}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> FingerprintPlan:
        return cls(mode=data["mode"], version=int(data["version"]))


def _bits(values: torch.Tensor) -> torch.Tensor:
    """The elements' bit patterns as int64, flat."""
    view = _BIT_VIEWS.get(values.element_size())
    if view is None:
        raise ValueError(f"cannot checksum elements of {values.element_size()} bytes ({values.dtype})")
    flat = values.detach().contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    return flat.view(view).to(torch.int64)


def _weighted_sum(values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``sum(bits(values) * w(positions))`` as a 0-d int64 tensor (wrapping modulo 2**64): the checksum's one formula."""
    return (_bits(values) * (positions * _WEIGHT_MULTIPLIER + 1)).sum()


def _span_checksum(values: torch.Tensor, first_index: int) -> int:
    """Checksum of ``values`` (any shape) whose elements sit at flat indices ``first_index, first_index+1, ...``."""
    total = torch.zeros((), dtype=torch.int64, device=values.device)
    flat = values.reshape(-1)
    for start in range(0, flat.numel(), _CHUNK_ELEMENTS):
        chunk = flat[start : start + _CHUNK_ELEMENTS]
        index = torch.arange(
            first_index + start, first_index + start + chunk.numel(), dtype=torch.int64, device=values.device
        )
        total += _weighted_sum(chunk, index)
    return int(total.item())


def tensor_checksum(tensor: torch.Tensor, sample: Sample | None = None) -> int:
    """The checksum of ``tensor`` (all of it) or of its ``sample``d elements, by their flat indices in ``tensor``.

    Signed 64-bit. ``tensor`` is in its HF layout (contiguous); reading a sample touches nothing else.
    """
    if sample is None:
        return _span_checksum(tensor, 0)
    values = sample.of(tensor)
    return int(_weighted_sum(values, sample.positions(values.device)).item())


def _wrap(value: int) -> int:
    """``value`` modulo 2**64, as a signed 64-bit integer (sums of checksums stay comparable)."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


def fingerprint_tensors(named: Sequence[tuple[str, torch.Tensor]], plan: FingerprintPlan) -> dict[str, int]:
    """The checksums ``plan`` asks for of many tensors at once, by name.

    What both sides call. A sync has hundreds of tensors, so the per-tensor work is kept to a few
    tensor operations on the sampled elements, and the sums come back to Python in one copy; a
    large tensor read whole (``full``) goes through :func:`tensor_checksum`'s chunks, never
    copied at once.
    """
    result: dict[str, int] = {}
    names: list[str] = []
    sums: list[torch.Tensor] = []
    for name, tensor in named:
        sample = plan.sample(name, tuple(tensor.shape))
        if sample is None and tensor.numel() > SAMPLED_ELEMENTS:  # full mode: in chunks, never copied whole
            result[name] = tensor_checksum(tensor)
            continue
        if sample is None:
            flat = tensor.detach().reshape(-1)
            position = torch.arange(flat.numel(), device=tensor.device)
        else:
            flat = sample.of(tensor.detach())
            position = sample.positions(tensor.device)
        names.append(name)
        sums.append(_weighted_sum(flat, position))
    if names:  # one device-to-host copy for all of them
        result.update(zip(names, (int(value) for value in torch.stack(sums).tolist()), strict=True))
    return result


def tiled_checksum(pieces: Sequence[torch.Tensor], along: int, sample: Sample | None) -> int:
    """The checksum of the tensor that ``pieces`` tile along dim ``along``, without joining them.

    What a shard sync's sender computes of a block it hands over in pieces (a resharding's
    delivery, :meth:`~hybridflow.engines.vllm_engine.VLLMRolloutEngine.load_shard`): equal to
    :func:`tensor_checksum` of the concatenated block, whose flat indices it uses.
    """
    if len(pieces) == 1:
        return tensor_checksum(pieces[0], sample)
    shape = list(pieces[0].shape)
    shape[along] = sum(int(piece.shape[along]) for piece in pieces)
    device = pieces[0].device
    numel = math.prod(shape)
    positions = torch.arange(numel, device=device) if sample is None else sample.positions(device)
    coordinates = torch.unravel_index(positions, tuple(shape))
    bounds = torch.tensor([0, *itertools.accumulate(int(p.shape[along]) for p in pieces)], device=device)
    owner = torch.bucketize(coordinates[along].contiguous(), bounds[1:], right=True)
    total = 0
    for index, piece in enumerate(pieces):
        mine = owner == index
        local = [coordinate[mine] for coordinate in coordinates]
        local[along] = local[along] - bounds[index]
        values = piece.detach()[tuple(local)]
        total += int(_weighted_sum(values, positions[mine]).item())
    return _wrap(total)


def block_fingerprints(
    named_blocks: Iterable[tuple[str, torch.Tensor | Sequence[torch.Tensor]]],
    along: Mapping[str, int | None],
    plan: FingerprintPlan,
    sent: SentFingerprint,
) -> Iterator[tuple[str, torch.Tensor | Sequence[torch.Tensor]]]:
    """A shard sync's sender side: pass ``named_blocks`` through, recording each block's checksum in ``sent``.

    ``along`` gives each block's split dimension (``None``: whole, pieces tile dim 0).
    """
    for name, given in named_blocks:
        if plan.mode != "off":
            started = time.perf_counter()
            pieces = (given,) if isinstance(given, torch.Tensor) else tuple(given)
            dim = along.get(name)
            axis = 0 if dim is None else dim
            shape = list(pieces[0].shape)
            shape[axis] = sum(int(piece.shape[axis]) for piece in pieces)
            sent.checksums[name] = tiled_checksum(pieces, axis, plan.sample(name, tuple(shape)))
            sent.shapes[name] = tuple(shape)
            sent.seconds += time.perf_counter() - started
        yield name, given


@dataclass
class SentFingerprint:
    """The trainer's side: checksums of the tensors a sync streams, taken as they pass.

    Protocol: wrap the bucket stream with :meth:`watch` and hand it to the engine (or the
    bridge); once the stream has ended, :attr:`checksums` and :attr:`shapes` hold every tensor
    sent, and :attr:`seconds` the time the checksums took.
    """

    plan: FingerprintPlan
    checksums: dict[str, int] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    seconds: float = 0.0

    def watch(
        self, buckets: Iterable[Sequence[tuple[str, torch.Tensor]]]
    ) -> Iterator[Sequence[tuple[str, torch.Tensor]]]:
        for bucket in buckets:
            if self.plan.mode != "off":
                started = time.perf_counter()
                self.checksums.update(fingerprint_tensors(bucket, self.plan))
                self.shapes.update((name, tuple(tensor.shape)) for name, tensor in bucket)
                self.seconds += time.perf_counter() - started
            yield bucket

    def to_json(self) -> dict[str, Any]:
        """The message a bridge carries after the buckets (``{}`` when the check is off)."""
        if self.plan.mode == "off":
            return {}
        return {
            "plan": self.plan.to_json(),
            "checksums": self.checksums,
            "shapes": {name: list(shape) for name, shape in self.shapes.items()},
        }


@dataclass(frozen=True)
class FingerprintReport:
    """What a passed check covered: tensors compared, and tensors the engine could not read back."""

    checked: int
    unverified: tuple[str, ...]
    seconds: float

    def stats(self) -> dict[str, float]:
        """The figures a rollout's ``transition_stats`` carry into the step's metrics."""
        return {
            "sync_check_seconds": self.seconds,
            "sync_checked_tensors": float(self.checked),
            "sync_unverified_tensors": float(len(self.unverified)),
        }


def compare_fingerprints(
    sent: Mapping[str, int],
    served: Mapping[str, int | None],
    *,
    version: int,
    engine: str,
    seconds: float = 0.0,
) -> FingerprintReport:
    """Raise :class:`WeightSyncMismatch` unless ``served`` (the engine's) agrees with ``sent`` (the trainer's).

    A name the engine lacks is a mismatch; a ``None`` from the engine is an unverified tensor,
    listed in the report. The error names the first differing tensor (in sorted order) and how
    many others differ.
    """
    wrong: list[str] = []
    unverified: list[str] = []
    for name in sorted(sent):
        if name not in served:
            wrong.append(name)
        elif served[name] is None:
            unverified.append(name)
        elif served[name] != sent[name]:
            wrong.append(name)
    if wrong:
        first = wrong[0]
        found = "no tensor of that name and shape" if first not in served else f"checksum {served[first]:#x}"
        others = f"; {len(wrong) - 1} more tensors differ" if len(wrong) > 1 else ""
        raise WeightSyncMismatch(
            f"weight sync to policy version {version}: the {engine} engine does not serve what the trainer "
            f"sent for {first!r} (trainer checksum {sent[first]:#x}, engine {found}){others}. The step "
            "stops rather than generate from weights nobody trained",
            tensor=first,
            version=version,
        )
    return FingerprintReport(
        checked=len(sent) - len(unverified), unverified=tuple(unverified), seconds=seconds
    )


def state_dict_fingerprint(
    tensors: Mapping[str, torch.Tensor], plan: FingerprintPlan, shapes: Mapping[str, Sequence[int]]
) -> dict[str, int | None]:
    """An engine's side for engines that hold HF-named tensors (the torch engine): one checksum per name.

    Names the engine does not hold, or holds in another shape than the one sent, are left out: a
    mismatch for :func:`compare_fingerprints`.
    """
    result: dict[str, int | None] = {}
    held = [
        (name, tensors[name])
        for name, shape in shapes.items()
        if name in tensors and tuple(tensors[name].shape) == tuple(shape)
    ]
    result.update(fingerprint_tensors(held, plan))
    return result


def verify_served(
    engine: Any, sent: Mapping[str, Any], *, sender_seconds: float = 0.0
) -> FingerprintReport | None:
    """Compare ``engine``'s copy with the sender's fingerprint (:meth:`SentFingerprint.to_json`, or a
    bridge's trailer); ``None`` when the sender checked nothing (``weightSyncCheck: off``).

    Called right after the engine loaded the sync, before it generates from it. The report's
    seconds are both sides' (``sender_seconds`` is the trainer's, when it ran in this process).
    """
    if not sent:
        return None
    plan = FingerprintPlan.from_json(sent["plan"])
    shapes = {name: tuple(shape) for name, shape in sent["shapes"].items()}
    started = time.perf_counter()
    served = engine.weight_fingerprint(plan, shapes)
    seconds = time.perf_counter() - started + sender_seconds
    return compare_fingerprints(
        {name: int(value) for name, value in sent["checksums"].items()},
        served,
        version=plan.version,
        engine=type(engine).__name__,
        seconds=seconds,
    )
