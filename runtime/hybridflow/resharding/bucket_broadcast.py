"""Weight buckets broadcast over a group that spans pools: the wire format of the weight push.

The trainer's pool and a rollout on a pool of its own share no process, so the rollout cannot
pull the actor's weights in-process as a colocated one does. Instead the actor's rank 0
broadcasts them, bucket by bucket, over a bridge (``hybridflow.controller.bridge``) whose other
members are the rollout's ranks; the controller only starts both sides.

Wire format, one bucket at a time from the root, every member in the same sequence of calls:

1. an int64 tensor ``[n]``: the byte length of the bucket's header; ``0`` ends the stream;
2. a uint8 tensor of ``n`` bytes: the header, JSON ``[[name, shape, dtype], ...]``;
3. a uint8 tensor holding the bucket's tensors back to back (each contiguous, in header order).

After the end marker, one trailer in the form of steps 1 and 2: JSON of the sender's weight-sync
fingerprint (:mod:`hybridflow.resharding.fingerprint`), or length ``0`` when it sends none.
Every receiver reads it, so the sequence of collectives is the same whatever the check.

Receivers learn names, shapes and dtypes from the header, so they need no copy of the sender's
bucket plan. Peak extra memory is one bucket (plus its flat copy on the root). The flat buffer
makes one broadcast per bucket whatever its tensor count: a 64 MiB bucket costs one collective's
latency, not one per parameter.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

import torch

__all__ = [
    "BroadcastGroup",
    "decode_header",
    "encode_header",
    "receive_buckets",
    "send_buckets",
    "split_flat",
]

Bucket = list[tuple[str, torch.Tensor]]


class BroadcastGroup(Protocol):
    """What the push needs of a group: a blocking in-place broadcast from one of its ranks."""

    def broadcast(self, tensor: torch.Tensor, root: int) -> None: ...


_DTYPES: dict[str, torch.dtype] = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int64,
        torch.int32,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}


def encode_header(bucket: Sequence[tuple[str, torch.Tensor]]) -> bytes:
    """The header of ``bucket``: JSON ``[[name, shape, dtype], ...]`` in UTF-8."""
    entries = []
    for name, tensor in bucket:
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in _DTYPES:
            raise ValueError(
                f"weight {name!r}: dtype {tensor.dtype} cannot be pushed; supported: {sorted(_DTYPES)}"
            )
        entries.append([name, list(tensor.shape), dtype])
    return json.dumps(entries, separators=(",", ":")).encode()


def decode_header(header: bytes) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """The inverse of :func:`encode_header`."""
    return [(name, tuple(shape), _DTYPES[dtype]) for name, shape, dtype in json.loads(header.decode())]


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    count = 1
    for size in shape:
        count *= size
    return count * dtype.itemsize


def split_flat(flat: torch.Tensor, entries: list[tuple[str, tuple[int, ...], torch.dtype]]) -> Bucket:
    """The tensors a flat uint8 buffer holds back to back, as ``entries`` describe them (views of it)."""
    described = sum(_nbytes(shape, dtype) for _, shape, dtype in entries)
    if described != flat.numel():
        raise ValueError(f"a pushed bucket holds {flat.numel()} bytes but its header describes {described}")
    bucket: Bucket = []
    offset = 0
    for name, shape, dtype in entries:
        size = _nbytes(shape, dtype)
        piece = flat[offset : offset + size]
        if offset % dtype.itemsize:  # a view needs an aligned start (after an odd-sized bool tensor)
            piece = piece.clone()
        bucket.append((name, piece.view(dtype).reshape(shape)))
        offset += size
    return bucket


def _send_header(group: BroadcastGroup, header: bytes, root: int, device: torch.device) -> None:
    """Step 1 and 2 of the wire format on the root; an empty header is the end marker."""
    group.broadcast(torch.tensor([len(header)], dtype=torch.int64, device=device), root)
    if header:
        group.broadcast(torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device), root)


def _receive_header(group: BroadcastGroup, root: int, device: torch.device) -> bytes:
    """Step 1 and 2 on a receiver; empty at the end of the stream."""
    length = torch.zeros(1, dtype=torch.int64, device=device)
    group.broadcast(length, root)
    size = int(length.item())
    if size == 0:
        return b""
    raw = torch.empty(size, dtype=torch.uint8, device=device)
    group.broadcast(raw, root)
    return bytes(raw.cpu().numpy().tobytes())


def send_buckets(
    group: BroadcastGroup,
    buckets: Iterable[Sequence[tuple[str, torch.Tensor]]],
    *,
    root: int,
    device: torch.device,
    trailer: Callable[[], dict[str, Any]] | None = None,
) -> int:
    """Broadcast every bucket from this rank (``root``), the end marker and the trailer; returns the weight bytes sent.

    ``trailer`` is called once the buckets are sent (the fingerprint is complete only then).
    """
    sent = 0
    for bucket in buckets:
        if not bucket:
            continue
        _send_header(group, encode_header(bucket), root, device)
        flat = torch.cat([tensor.detach().contiguous().reshape(-1).view(torch.uint8) for _, tensor in bucket])
        group.broadcast(flat.to(device), root)
        sent += flat.numel()
    _send_header(group, b"", root, device)
    message = trailer() if trailer is not None else {}
    _send_header(group, json.dumps(message).encode() if message else b"", root, device)
    return sent


def receive_buckets(
    group: BroadcastGroup, *, root: int, device: torch.device, trailer: dict[str, Any] | None = None
) -> Iterator[Bucket]:
    """The buckets ``root`` sends (see :func:`send_buckets`), one at a time; each is valid until the next.

    Once the stream is exhausted, ``trailer`` (when given) holds the sender's trailer (empty if none).
    """
    while True:
        header = _receive_header(group, root, device)
        if not header:
            message = _receive_header(group, root, device)
            if trailer is not None and message:
                trailer.update(json.loads(message.decode()))
            return
        entries = decode_header(header)
        flat = torch.empty(
            sum(_nbytes(shape, dtype) for _, shape, dtype in entries), dtype=torch.uint8, device=device
        )
        group.broadcast(flat, root)
        yield split_flat(flat, entries)
