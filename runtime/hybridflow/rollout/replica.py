"""One rollout replica in server mode: an engine that batches requests continuously, as a Ray actor.

A replica runs on one GPU bundle of the rollout's pool, in a process of its own (not one of the
pool's worker hosts: a replica must be able to die and be replaced alone, and shares no
``torch.distributed`` world with the others). It holds an engine and its continuous batcher (the
torch engine's :class:`~hybridflow.engines.continuous.ContinuousBatcher`, or vLLM's scheduler
through :class:`~hybridflow.engines.vllm_continuous.VLLMContinuousBatcher`), and a decode
thread that steps the batcher whenever it has work and is not paused.

Protocol with the controller's :class:`~hybridflow.rollout.service.RolloutService` (every call
returns at once unless it says otherwise; calls arrive one at a time, Ray's actor order):

* ``ready()``: the replica's node and device, once the model is loaded.
* ``submit(requests)``: queue requests; the decode thread admits them into free slots.
* ``poll(wait_seconds)``: the requests that ended since the last poll, waiting up to
  ``wait_seconds`` for one, and the replica's :class:`ReplicaStats`.
* ``join_bridge(...)`` then ``receive_weights(version, abort)``: the weight update, three
  stages: pause (the decode thread stops after its current step; with ``abort`` every open
  request ends now as ``"abort"`` and is returned, for the controller to continue elsewhere),
  load the buckets the actor broadcasts over the ``weights`` bridge (the same wire format and
  path as a batch-mode rollout's push, ``workers/weight_push.py``), resume with the new
  version. The controller submits it together with ``actor.push_weights`` (a collective).
* ``shutdown()``: stop the decode thread.
"""

from __future__ import annotations

import os
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from hybridflow.controller.bridge import Bridge, new_process_group
from hybridflow.devices import device_environment, view_of_process
from hybridflow.engines.base import RolloutEngine
from hybridflow.engines.continuous import ContinuousBatcher, GenerationRequest, RequestResult
from hybridflow.engines.torch_engine import TorchRolloutEngine
from hybridflow.resharding.bucket_broadcast import receive_buckets
from hybridflow.spec import RLHFJobSpec
from hybridflow.workers.weight_push import WEIGHTS_BRIDGE

if TYPE_CHECKING:
    from hybridflow.engines.vllm_continuous import VLLMContinuousBatcher

__all__ = ["ReplicaPoll", "ReplicaStats", "RolloutReplica"]


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
    """See the module docstring; wrapped with ``ray.remote`` by the service."""

    def __init__(self, spec: RLHFJobSpec, index: int, torch_threads: int) -> None:
        import ray

        torch.set_num_threads(max(1, torch_threads))
        self.index = index
        node_id = str(ray.get_runtime_context().get_node_id())
        view = view_of_process(node_id, ray.get_gpu_ids())
        os.environ.update(device_environment(view, 0, 1))
        self.device = torch.device(f"cuda:{view.device_index()}" if torch.cuda.is_available() else "cpu")
        self.node_id = node_id
        dtype = (
            torch.bfloat16
            if self.device.type == "cuda" and spec.training.precision == "bf16"
            else torch.float32
        )
        max_sequence = spec.data.max_prompt_tokens + spec.rollout.max_response_tokens
        self._engine: RolloutEngine
        self._batcher: ContinuousBatcher | VLLMContinuousBatcher
        if spec.rollout.engine == "vllm":
            from hybridflow.engines.vllm_continuous import VLLMContinuousBatcher
            from hybridflow.engines.vllm_engine import VLLMRolloutEngine

            vllm_engine = VLLMRolloutEngine(
                spec.models.actor.path,
                max_model_len=max_sequence,
                dtype=dtype,
                device=self.device,
                gpu_memory_utilization=spec.rollout.gpu_memory_utilization,
                seed=spec.training.seed * 1000 + index,
            )
            self._engine, self._batcher = vllm_engine, VLLMContinuousBatcher(vllm_engine)
        else:
            torch_engine = TorchRolloutEngine(spec.models.actor.path, device=self.device, dtype=dtype)
            self._engine = torch_engine
            self._batcher = ContinuousBatcher(
                torch_engine.model,
                slots=spec.rollout.slots_per_replica,
                max_sequence=max_sequence,
                eos_token_ids=torch_engine.eos_token_ids,
                pad_token_id=torch_engine.pad_token_id,
            )
        self._condition = threading.Condition()
        self._paused = False
        self._stopped = False
        self._stepping = False
        self._busy_seconds = 0.0
        self._load_seconds = 0.0
        self._started = time.monotonic()
        self._bridge: Bridge | None = None
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._decode_loop, name=f"replica-{index}-decode", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the decode thread

    def _decode_loop(self) -> None:
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

    def _check(self) -> None:
        if self._failure is not None:
            where = "".join(traceback.format_exception(self._failure)[-6:])
            raise RuntimeError(
                f"rollout replica {self.index}: decoding failed: {self._failure!r}\n{where}"
            ) from self._failure

    # ------------------------------------------------------------------ the controller's calls

    def ready(self) -> tuple[str, str]:
        return self.node_id, str(self.device)

    def submit(self, requests: list[GenerationRequest]) -> None:
        with self._condition:
            self._check()
            self._quiet()
            for request in requests:
                self._batcher.add(request)
            self._condition.notify_all()

    def poll(self, wait_seconds: float = 0.0) -> ReplicaPoll:
        deadline = time.monotonic() + wait_seconds
        with self._condition:
            while True:
                self._check()
                self._quiet()
                finished = self._batcher.take_finished()
                left = deadline - time.monotonic()
                if finished or left <= 0:
                    return ReplicaPoll(finished, self._stats())
                self._condition.wait(timeout=left)

    def stats(self) -> ReplicaStats:
        with self._condition:
            return self._stats()

    def _stats(self) -> ReplicaStats:
        batcher = self._batcher
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
        if self._bridge is None:
            raise RuntimeError(f"rollout replica {self.index} is on no weights bridge: join_bridge first")
        with self._condition:
            self._check()
            self._paused = True
            self._quiet()
            aborted = self._batcher.abort() if abort else []
        started = time.monotonic()
        try:
            loaded = self._engine.load_weight_buckets(
                receive_buckets(self._bridge, root=0, device=self.device)
            )
        finally:
            with self._condition:
                self._load_seconds += time.monotonic() - started
                self._batcher.version = version
                self._paused = False
                self._condition.notify_all()
        return loaded, aborted

    def shutdown(self) -> None:
        with self._condition:
            self._stopped = True
            self._condition.notify_all()
        self._thread.join(timeout=30)


def replica_options(placement_group: Any, bundle_index: int, cpus: float) -> dict[str, Any]:
    """Ray options that put a replica on one bundle of the rollout pool's placement group."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {
        "num_cpus": cpus,
        "num_gpus": 1,
        "max_restarts": 0,
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=placement_group, placement_group_bundle_index=bundle_index
        ),
    }
