"""Moving a trainer's parameters and optimizer state off the device while the rollout generates.

Protocol (``spec.training.offloadDuringGeneration``; the colocated rollout drives it, see
:mod:`hybridflow.workers.rollout`): after the weight sync and before generation the rollout
calls the actor's ``offload_for_generation()``; after generation, once the engine has gone to
sleep (its KV cache freed), it calls ``reload_after_generation()``, so the device holds the
engine's memory and the trainer's in turn, never both. The actor must not compute between the
two calls (the controller's step order guarantees it: nothing but the rollout runs in between).

Mechanism: :class:`DeviceOffload` moves *storages*, not tensors. For each distinct storage of the
given tensors it copies the bytes to a host buffer (pinned on CUDA, allocated once and reused
every step) and resizes the device storage to 0 bytes; reloading resizes it back and copies the
bytes in. Every tensor object, view and reference stays what it was: FSDP2's sharded parameters
(views of its padded shard buffers), megatron's parameters and ``main_grad`` (views of its DDP
buffers), the optimizer's state and fp32 main weights, and anything holding them (the
optimizer's param groups, FSDP's and megatron's bookkeeping) need no fix-up. On the CPU the same
copies and resizes run (the host buffer is simply another CPU allocation), so the CPU tests check
the round trip bit for bit; only a GPU sees the device memory drop.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

__all__ = ["DeviceOffload", "OffloadStats", "optimizer_state_tensors"]


@dataclass(frozen=True)
class OffloadStats:
    """What one offload or reload moved: bytes and seconds (device synchronised at the end)."""

    bytes: int
    seconds: float


class DeviceOffload:
    """Offloads the storages of a fixed set of tensors and brings them back; see the module docstring.

    ``tensors`` is called at every :meth:`offload` (the set can grow: optimizer state appears
    at the first step). Calls alternate, offload first; a second offload without a reload is
    refused, and so is a reload without an offload.
    """

    def __init__(self, what: str) -> None:
        self.what = what
        self._offloaded: list[tuple[torch.UntypedStorage, torch.Tensor]] = []
        self._host: dict[int, torch.Tensor] = {}  # host buffers by storage pointer, reused each step
        self.is_offloaded = False

    def offload(self, tensors: Iterable[torch.Tensor]) -> OffloadStats:
        if self.is_offloaded:
            raise RuntimeError(f"{self.what} is already offloaded; reload it first")
        start = time.perf_counter()
        storages: dict[int, torch.UntypedStorage] = {}
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if storage.nbytes() > 0:
                storages.setdefault(storage.data_ptr(), storage)
        moved = 0
        device: torch.device | None = None
        for pointer, storage in storages.items():
            host = self._host.get(pointer)
            if host is None or host.numel() != storage.nbytes():
                host = torch.empty(
                    storage.nbytes(), dtype=torch.uint8, pin_memory=storage.device.type == "cuda"
                )
                self._host[pointer] = host
            device_bytes = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
            host.copy_(device_bytes, non_blocking=True)
            device = storage.device
            moved += storage.nbytes()
            self._offloaded.append((storage, host))
        _synchronize(device)  # the copies must land before the device memory is handed back
        for storage, _ in self._offloaded:
            storage.resize_(0)
        self.is_offloaded = True
        return OffloadStats(moved, time.perf_counter() - start)

    def reload(self) -> OffloadStats:
        if not self.is_offloaded:
            raise RuntimeError(f"{self.what} is not offloaded")
        start = time.perf_counter()
        moved = 0
        device: torch.device | None = None
        for storage, host in self._offloaded:
            storage.resize_(host.numel())
            device_bytes = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
            device_bytes.copy_(host, non_blocking=True)
            device = storage.device
            moved += host.numel()
        _synchronize(device)
        # Keyed by the storage's pointer before the offload; after the resize it may differ.
        self._host = {storage.data_ptr(): host for storage, host in self._offloaded}
        self._offloaded = []
        self.is_offloaded = False
        return OffloadStats(moved, time.perf_counter() - start)


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors of a torch optimizer's per-parameter state (Adam's moments and step counts)."""
    found = []
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                found.append(value)
    return found


def _synchronize(device: torch.device | None) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
