"""The machines a plan runs on: the cluster's shape and the constants of one GPU and its links.

Every constant is named, with its unit in the name and its source next to it. The defaults
describe the HybridFlow paper's testbed (Sec. 8.1: machines of 8 NVIDIA A100-80GB GPUs joined
by 600 GB/s NVLink, 200 Gbps between machines). ``hybridflow plan --profile`` replaces the
compute and memory constants with figures measured on the current machine
(:mod:`hybridflow.planner.calibrate`). The other GPUs a job may be planned for, and how the one it
runs on is recognised, are in :mod:`hybridflow.planner.gpus`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

from hybridflow.planner.shapes import PlannerInputError

__all__ = ["A100_80GB", "SIMULATED_CPU_GPU", "ClusterShape", "DeviceConstants"]


@dataclass(frozen=True)
class DeviceConstants:
    """What one GPU and its links can do; the cost model reads nothing else about the hardware.

    * ``peak_flops``: dense bf16 tensor-core FLOP/s.
    * ``train_efficiency``: the fraction of peak a well-fed training or prefill kernel sustains
      (model FLOPs utilisation at large per-GPU batches).
    * ``tokens_for_half_efficiency``: tokens per GPU per forward at which the efficiency is half
      of ``train_efficiency``: small per-GPU batches starve the GPU (the saturating curve
      ``e(x) = train_efficiency * x / (x + tokens_for_half_efficiency)``).
    * ``memory_bandwidth_bytes_per_second`` and ``decode_bandwidth_efficiency``: HBM bandwidth
      and the fraction a decoding step attains; a decoding step reads every weight of its shard.
    * ``memory_bytes``: HBM per GPU; ``memory_headroom``: fraction kept free (allocator
      fragmentation, CUDA context, communication buffers).
    * ``intra_node_bytes_per_second`` / ``inter_node_bytes_per_second``: per-GPU, one-direction
      bandwidth of collectives inside a node and across nodes.
    * ``call_overhead_seconds``: fixed cost of one forward call (kernel launches, Python, the
      controller's dispatch); ``decode_step_overhead_seconds``: fixed cost of one decoding step;
      ``collective_latency_seconds``: latency of one small all-reduce (TP inside a decoding step).
    * ``training_pass_ratio``: a training micro-batch (forward with entropy, backward) over a
      forward one: 3 by FLOPs (the backward computes twice the forward's).
    * ``fsdp_unit_overhead_seconds``: FSDP's own work per unit (decoder layer, root) and forward
      pass, even on one rank (copies into and out of the gathered buffer, hooks); hidden behind
      compute on GPUs (0), a millisecond-scale cost of every pass on a CPU.
    * ``shared_decode_step_overhead_seconds``: the extra fixed cost of a decoding step when the
      torch engine generates from a one-rank FSDP actor's own (wrapped) module.
    * ``optimizer_step_overhead_seconds``: the fixed cost of one optimizer step (the gradient
      norm, the clip and AdamW's per-tensor work) on top of its memory traffic
      (``cost.OPTIMIZER_BYTES_PER_PARAMETER`` per parameter of the shard); launch overhead on
      GPUs, milliseconds of Python and small-tensor work on a CPU.
    * ``decode_efficiency``: the fraction of ``peak_flops`` a decoding step's GEMMs sustain (one
      token per sequence: thin matrices); ``None`` means ``train_efficiency``.
    * ``compute_slots``: how many GPUs can compute at the same time. ``None`` on real GPUs (each
      computes on its own). With simulated GPUs on a CPU the workers share the cores: at most
      ``compute_slots`` of them make progress at once.
    * ``oversubscribed_collective_latencies`` (simulated GPUs only): ``(workers per compute
      slot, seconds)`` of the same collective when more workers than cores compete (a
      collective waits for ranks that are not running: milliseconds instead of a fraction of
      one), measured at a few ratios above 1. Empty: GPUs do not share compute.
    * ``host_cores`` and ``all_cores_speedup`` (simulated GPUs only): a local run gives each
      worker ``host_cores // job GPUs`` torch threads (``trainer/roles.py``), and a worker with
      every core's thread runs its step (a generation, a training pass, an optimizer step)
      ``all_cores_speedup`` times as fast as with one (small models barely gain: their step is
      mostly fixed per-call work; on a busy host it is below 1: the threads wait for one
      another). :meth:`for_budget` turns that into the constants of one worker.
    """

    name: str
    peak_flops: float
    train_efficiency: float
    tokens_for_half_efficiency: float
    memory_bandwidth_bytes_per_second: float
    decode_bandwidth_efficiency: float
    memory_bytes: float
    memory_headroom: float
    intra_node_bytes_per_second: float
    inter_node_bytes_per_second: float
    call_overhead_seconds: float
    decode_step_overhead_seconds: float
    collective_latency_seconds: float
    compute_slots: float | None = None
    training_pass_ratio: float = 3.0
    fsdp_unit_overhead_seconds: float = 0.0
    shared_decode_step_overhead_seconds: float = 0.0
    optimizer_step_overhead_seconds: float = 0.0
    decode_efficiency: float | None = None
    oversubscribed_collective_latencies: tuple[tuple[float, float], ...] = ()
    host_cores: int | None = None
    all_cores_speedup: float = 1.0

    def for_budget(self, gpus: int) -> DeviceConstants:
        """The constants of one GPU of a job that has ``gpus`` GPUs in all.

        Real GPUs do not depend on the budget. A simulated GPU is a worker process with
        ``host_cores // gpus`` threads (at least one); the constants are one thread's, and each
        thread beyond the first adds its share of ``all_cores_speedup - 1`` (linear between one
        thread and all of them). The speedup is measured over a whole worker step, so it applies
        to the whole of a worker's time: the compute rate rises by it, and every fixed cost
        (per call, per decoding step, per FSDP unit, per optimizer step) falls by it.
        """
        if self.host_cores is None or self.host_cores < 2:
            return self
        threads = max(1, self.host_cores // gpus)
        speedup = 1.0 + (threads - 1) / (self.host_cores - 1) * (self.all_cores_speedup - 1.0)
        return replace(
            self,
            peak_flops=self.peak_flops * speedup,
            call_overhead_seconds=self.call_overhead_seconds / speedup,
            decode_step_overhead_seconds=self.decode_step_overhead_seconds / speedup,
            fsdp_unit_overhead_seconds=self.fsdp_unit_overhead_seconds / speedup,
            shared_decode_step_overhead_seconds=self.shared_decode_step_overhead_seconds / speedup,
            optimizer_step_overhead_seconds=self.optimizer_step_overhead_seconds / speedup,
            host_cores=None,
        )

    def contention(self, busy_gpus: float) -> float:
        """How much slower each GPU computes while ``busy_gpus`` GPUs compute at the same time.

        Real GPUs (``compute_slots is None``) do not slow each other down. Simulated GPUs share
        ``compute_slots`` CPU cores evenly: with more busy workers than cores, each gets
        ``slots/busy`` of a core.
        """
        if self.compute_slots is None:
            return 1.0
        return max(1.0, busy_gpus / self.compute_slots)

    def collective_latency(self, busy_gpus: float) -> float:
        """One latency-bound collective while ``busy_gpus`` GPUs compute at the same time.

        Up to ``compute_slots`` busy workers it is ``collective_latency_seconds``; beyond, it
        follows the measured ``oversubscribed_collective_latencies`` (piecewise linear in
        workers per slot, held past the last point).
        """
        slots = self.compute_slots
        if slots is None or not self.oversubscribed_collective_latencies or busy_gpus <= slots:
            return self.collective_latency_seconds
        ratio = busy_gpus / slots
        points = [(1.0, self.collective_latency_seconds), *sorted(self.oversubscribed_collective_latencies)]
        for (low, low_seconds), (high, high_seconds) in itertools.pairwise(points):
            if ratio <= high:
                return low_seconds + (ratio - low) / max(high - low, 1e-9) * (high_seconds - low_seconds)
        return points[-1][1]

    def efficiency(self, tokens_per_gpu: float) -> float:
        """Sustained fraction of ``peak_flops`` for a pass of ``tokens_per_gpu`` tokens on each GPU."""
        return self.train_efficiency * tokens_per_gpu / (tokens_per_gpu + self.tokens_for_half_efficiency)

    @property
    def usable_memory_bytes(self) -> float:
        return self.memory_bytes * (1.0 - self.memory_headroom)


A100_80GB = DeviceConstants(
    name="A100-80GB",
    # NVIDIA A100 datasheet: 312 TFLOPS dense BF16, 2,039 GB/s HBM2e (80GB SXM), 80 GB.
    peak_flops=312e12,
    memory_bandwidth_bytes_per_second=2.039e12,
    memory_bytes=80e9,
    # Megatron-LM reaches 52% of peak at scale (Narayanan et al., SC'21, Table 1); RLHF training
    # passes are shorter and less fused: 45%.
    train_efficiency=0.45,
    # Assumed: MFU halves at 1k tokens per GPU per pass (one 1k-token sequence); calibrate with --profile.
    tokens_for_half_efficiency=1024.0,
    # Decoding attains ~60% of HBM bandwidth in vLLM-class engines (assumed; calibrate with --profile).
    decode_bandwidth_efficiency=0.6,
    memory_headroom=0.1,
    # NVLink 3: 600 GB/s bidirectional per GPU, 300 GB/s per direction; ring collectives reach ~80%.
    intra_node_bytes_per_second=240e9,
    # HybridFlow Sec. 8.1: 200 Gbps between machines = 25 GB/s per machine, shared by its 8 GPUs.
    inter_node_bytes_per_second=25e9 / 8,
    # Kernel-launch-bound overheads with CUDA graphs off (assumed).
    call_overhead_seconds=0.01,
    decode_step_overhead_seconds=0.002,
    # NCCL all-reduce of a small tensor across 8 NVLink GPUs: ~20 us (nccl-tests, ring/tree latency).
    collective_latency_seconds=20e-6,
)
"""The paper's A100 testbed; ``gpuType: A100-80GB`` plans for it, and the other GPUs of
:data:`hybridflow.planner.gpus.KNOWN_GPUS` share its assumed (non-datasheet) constants."""


@dataclass(frozen=True)
class ClusterShape:
    """The GPU budget: ``gpus`` in all, ``gpus_per_node`` per machine (pools are cut at node bounds)."""

    gpus: int
    gpus_per_node: int

    def __post_init__(self) -> None:
        if self.gpus < 1:
            raise PlannerInputError(f"--gpus must be >= 1, got {self.gpus}")
        if self.gpus_per_node < 1:
            raise PlannerInputError(f"--gpus-per-node must be >= 1, got {self.gpus_per_node}")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise PlannerInputError(
                f"--gpus {self.gpus} is not a whole number of nodes of --gpus-per-node {self.gpus_per_node}; "
                "allowed: fewer GPUs than one node, or a multiple of gpus-per-node"
            )

    @property
    def nodes(self) -> int:
        return max(1, self.gpus // self.gpus_per_node)

    @property
    def node_gpus(self) -> int:
        """GPUs of one node that the budget uses (all of them, or the whole budget if smaller)."""
        return min(self.gpus, self.gpus_per_node)


SIMULATED_CPU_GPU = DeviceConstants(
    name="simulated GPU (one CPU thread)",
    # `hybridflow plan --profile` on the 2-core development machine with the tiny model
    # (hidden 64, 2 layers), rounded from its calibrations near idle (docs/placement.md): ~57
    # GFLOP/s per thread at the job's micro-batch, ~0.9 ms fixed per forward call and per
    # decoding step, decoded tokens at ~10% of that rate, a training pass ~3.8 forwards, FSDP's
    # work ~1.1 ms per unit and pass (+2 ms per decoding step from the wrapped module), an
    # optimizer step ~6 ms (clip and AdamW over the tiny model's 27 tensors), gloo's
    # all-gather ~1.1 ms between two workers and ~6.5 ms with 2-4 workers per core, a worker's
    # step ~1.15x as fast with both cores' threads as with one (0.97-1.20). Fixed here
    # so that `placement: auto` picks the same plan on every (re)start of a job; --profile
    # measures the current machine instead.
    peak_flops=57e9,
    train_efficiency=1.0,
    tokens_for_half_efficiency=0.0,
    memory_bandwidth_bytes_per_second=23e9,
    decode_bandwidth_efficiency=1.0,
    # A simulated GPU has no memory of its own; tiny models fit anywhere (assumed share of host RAM).
    memory_bytes=8e9,
    memory_headroom=0.1,
    # gloo on one host (shared/notes/cpu-stack.md: 64 MiB all-reduce in ~60 ms).
    intra_node_bytes_per_second=1.1e9,
    inter_node_bytes_per_second=1.1e9,
    call_overhead_seconds=0.0009,
    decode_step_overhead_seconds=0.0009,
    collective_latency_seconds=0.0011,
    compute_slots=None,
    training_pass_ratio=3.8,
    fsdp_unit_overhead_seconds=0.0011,
    shared_decode_step_overhead_seconds=0.002,
    optimizer_step_overhead_seconds=0.006,
    decode_efficiency=0.1,
    oversubscribed_collective_latencies=((2.0, 0.0065), (4.0, 0.0065)),
    all_cores_speedup=1.15,
)
"""The device of local runs without GPUs; set ``compute_slots`` and ``host_cores`` to the core count
when using it (``planner.job.local_device``)."""
