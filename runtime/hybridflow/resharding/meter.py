"""Measuring a weight transition from the process: the bytes handed to the wire, the memory peak.

Two probes, used by :class:`~hybridflow.resharding.transfer.Resharder` in every job step and by
``bench/resharding.py``:

* :class:`TrafficMeter` counts the bytes this rank hands to ``torch.distributed``. Callers route
  their communication through the meter's methods (same signatures as ``torch.distributed``),
  which pass each call on unchanged and count the tensors it was given:

  - point-to-point (``send``/``recv``/``isend``/``irecv`` inside ``batch_isend_irecv``): a send
    counts its tensor's bytes as sent, a receive as received;
  - ``all_gather_into_tensor(output, input)``: received = output bytes - the rank's own input
    bytes, sent = input bytes x (group size - 1) (every peer receives the rank's input once,
    whatever algorithm the library uses);
  - ``broadcast``: the source sends its tensor to each other member, the others receive it.

  Summed over the ranks, ``received`` is what crossed the wire, which is what the loopback
  interface's received-bytes counter (:func:`loopback_rx_bytes`) sees for a single-host gloo
  job; ``bench/resharding.py`` checks the two agree (TCP/IP and gloo framing add well under 1%).

* :class:`PeakMemory` measures the transition's own peak memory: on CPU it returns freed heap
  pages to the kernel (``malloc_trim``), reads the resident size, resets the process's
  high-water mark (``/proc/self/clear_refs``, value 5) and on exit reads ``VmHWM``; the peak is
  ``VmHWM`` minus the resident size before. On CUDA it is ``torch.cuda.max_memory_allocated``
  minus the allocated bytes before. The CPU figure is process-wide: memory another thread of
  the process allocates during the window counts too, and pages the allocator reuses without
  returning them to the kernel do not. Where ``clear_refs`` is not writable the peak is
  ``None`` (unmeasured), never a guess.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["PeakMemory", "Traffic", "TrafficMeter", "loopback_rx_bytes", "resident_bytes"]

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
_LO_RX = Path("/sys/class/net/lo/statistics/rx_bytes")
_PROC_NET_DEV = Path("/proc/net/dev")


@dataclass(frozen=True)
class Traffic:
    """Bytes handed to communication calls, and how many calls."""

    sent: int = 0
    received: int = 0
    calls: int = 0

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(self.sent + other.sent, self.received + other.received, self.calls + other.calls)

    def __sub__(self, other: Traffic) -> Traffic:
        return Traffic(self.sent - other.sent, self.received - other.received, self.calls - other.calls)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class TrafficMeter:
    """Passes calls on to ``torch.distributed`` and counts their bytes (see the module docstring).

    One meter per process; read :attr:`total` before and after a window and subtract.
    """

    def __init__(self) -> None:
        self.total = Traffic()

    def _count(self, sent: int, received: int) -> None:
        self.total = self.total + Traffic(sent, received, 1)

    def batch_isend_irecv(self, ops: Sequence[dist.P2POp]) -> list[Any]:
        sent = sum(_nbytes(op.tensor) for op in ops if op.op is dist.isend)
        received = sum(_nbytes(op.tensor) for op in ops if op.op is dist.irecv)
        if len(ops) != sum(op.op is dist.isend or op.op is dist.irecv for op in ops):
            raise ValueError("TrafficMeter.batch_isend_irecv counts only dist.isend and dist.irecv ops")
        works = dist.batch_isend_irecv(list(ops)) if ops else []
        self._count(sent, received)
        return works

    def send(
        self, tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None, tag: int = 0
    ) -> None:
        dist.send(tensor, dst, group, tag)
        self._count(_nbytes(tensor), 0)

    def recv(
        self, tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None, tag: int = 0
    ) -> None:
        dist.recv(tensor, src, group, tag)
        self._count(0, _nbytes(tensor))

    def all_gather_into_tensor(
        self, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None = None
    ) -> None:
        size = dist.get_world_size(group)
        if _nbytes(output) != size * _nbytes(input):
            raise ValueError(
                f"all_gather_into_tensor: output has {_nbytes(output)} bytes, expected {size} x {_nbytes(input)}"
            )
        # torch 2.13 renamed the collective all_gather_single (the old name warns on every call).
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(output, input, group=group)
        self._count(_nbytes(input) * (size - 1), _nbytes(output) - _nbytes(input))

    def broadcast(self, tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None) -> None:
        dist.broadcast(tensor, src, group=group)
        size = dist.get_world_size(group)
        if dist.get_rank() == src:
            self._count(_nbytes(tensor) * (size - 1), 0)
        else:
            self._count(0, _nbytes(tensor))


# --------------------------------------------------------------------------- memory


def _status_bytes(key: str) -> int:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(key + ":"):
            value, unit = line.split()[1:3]
            if unit != "kB":
                raise RuntimeError(f"{_STATUS}: unexpected unit {unit!r} for {key}")
            return int(value) * 1024
    raise RuntimeError(f"{_STATUS} has no {key} line")


def resident_bytes() -> int:
    """The process's resident set size (``VmRSS``)."""
    return _status_bytes("VmRSS")


@functools.cache
def _libc_malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, looked up once: ``find_library`` runs ``ldconfig`` in a subprocess."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    trim: Callable[[int], int] | None = getattr(ctypes.CDLL(name), "malloc_trim", None)
    return trim


def _malloc_trim() -> None:
    trim = _libc_malloc_trim()
    if trim is not None:
        trim(0)


class PeakMemory:
    """``with PeakMemory(device) as probe: ...`` then ``probe.bytes``: the window's own peak, or ``None``.

    See the module docstring for what is measured. Not reentrant: the high-water mark is the
    process's, so nested windows would reset each other's.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.bytes: int | None = None
        self._before = 0
        self._armed = False

    def __enter__(self) -> PeakMemory:
        self.bytes = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._before = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._armed = True
            return self
        _malloc_trim()
        try:
            self._before = resident_bytes()
            _CLEAR_REFS.write_text("5")
            self._armed = True
        except OSError:
            self._armed = False
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        if not self._armed:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.bytes = max(0, torch.cuda.max_memory_allocated(self.device) - self._before)
        else:
            self.bytes = max(0, _status_bytes("VmHWM") - self._before)


# --------------------------------------------------------------------------- loopback


def loopback_rx_bytes() -> int | None:
    """Bytes the loopback interface has received since boot (``None`` where it cannot be read)."""
    try:
        return int(_LO_RX.read_text())
    except (OSError, ValueError):
        pass
    try:
        for line in _PROC_NET_DEV.read_text().splitlines():
            name, _, counters = line.partition(":")
            if name.strip() == "lo":
                return int(counters.split()[0])
    except (OSError, ValueError, IndexError):
        pass
    return None
