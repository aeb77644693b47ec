"""``hybridflow plan --profile``: the device constants measured on this machine (needs torch).

A short run of the job's own code paths with its actor architecture (random weights of its
config, so no checkpoint is read). On a CPU it runs in a worker process like a simulated GPU's,
one thread, with the model wrapped as the job's backend wraps it (FSDP2 over a one-rank group:
every forward pass runs FSDP's per-unit work even without a peer). Measured, each the fastest
of a few runs (other load only adds time):

* **Forward passes** as the actor, the reference and the scoring models run them (the
  log-prob pass of ``backends/fsdp/logprobs.py``), on a micro-batch of the job's shape and on
  a one-row, short one, through the plain model. The time is fitted as ``a + T/r`` for ``T``
  tokens: ``a`` becomes the fixed cost of a call (``call_overhead_seconds``), ``2*N*r`` the
  sustained FLOP/s (``peak_flops`` with ``train_efficiency = 1`` and no small-batch penalty:
  the fit already is the rate at the job's micro-batch).
* With FSDP, the micro-batch's forward pass through the wrapped model: its extra time per
  FSDP unit (groups of decoder layers, and the root) is ``fsdp_unit_overhead_seconds`` (the
  copies into and out of the gathered buffer, hooks).
* **A training pass** on the micro-batch (forward with entropy, backward) through the wrapped
  model: its time over the wrapped forward's is ``training_pass_ratio`` (3 by FLOPs; more
  where elementwise work and FSDP's backward hooks weigh), the median over back-to-back pairs
  of the two passes (:func:`_paired_ratio`).
* **An optimizer step** after each training pass (``backends/fsdp/optim``: gradient norm,
  clip, AdamW): its time less the memory traffic the cost model prices
  (``cost.OPTIMIZER_BYTES_PER_PARAMETER``) is ``optimizer_step_overhead_seconds``.
* **Decoding** with the torch engine (``engines/torch_engine.py``) at two batch sizes, one and
  several new tokens, from a plain copy of the model (what a rollout with its own weights
  runs): a decoding step costs ``a_d + rows*c_d``; ``a_d`` becomes
  ``decode_step_overhead_seconds`` and ``2*N/(c_d*peak_flops)`` the ``decode_efficiency`` (one
  token per sequence makes thin GEMMs, and a step's sampling and cache updates are per row
  too). With FSDP, the same from the wrapped module (what a one-rank FSDP actor's engine
  generates from): the extra fixed cost per step is ``shared_decode_step_overhead_seconds``.
* A 64 MiB copy: the memory bandwidth.
* On a CPU, a worker's step in small (the job's generation from the wrapped module, a training
  pass, an optimizer step) with one thread per core against one thread, in back-to-back pairs
  (a worker's thread count does not change between its calls), gives ``all_cores_speedup``
  (a one-GPU job's worker gets every core's thread; the cost model applies it to the whole of
  that worker's time).

On a CPU, two more worker processes measure how simulated GPUs share the host
(:func:`measure_host_sharing`): the same compute loop alone and in both at once gives
``compute_slots`` (how many workers progress in parallel: 2 on two idle cores, 1 when they only
take turns), and a gloo all-gather of one decoder layer's parameters (FSDP's collective per
unit) issued between slices of that loop, as a training step issues its collectives,
``collective_latency_seconds`` (the wait includes the ranks' skew under load). The same among
four workers pinned to two cores, then to one, gives ``oversubscribed_collective_latencies`` at
2 and 4 workers per core: with more workers than cores a collective waits for ranks that are
not running (milliseconds, against a fraction of one). Bandwidths are those of gloo on one host (docs/placement.md). On a GPU the
measurements run in this process on the plain model, and the link constants of the base
device are kept. The whole run takes 20-60 s on two cores, most of it starting processes and
importing torch and transformers.
"""

from __future__ import annotations

import copy
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from hybridflow.host import available_cores
from hybridflow.planner.cost import OPTIMIZER_BYTES_PER_PARAMETER, fsdp_unit_count
from hybridflow.planner.hardware import DeviceConstants
from hybridflow.planner.shapes import Workload
from hybridflow.resharding.layout import DecoderSpec

__all__ = [
    "GLOO_HOST_BYTES_PER_SECOND",
    "HostSharing",
    "MicroBatchShape",
    "WorkerFigures",
    "calibrate_device",
    "measure_host_sharing",
    "measure_worker",
]

GLOO_HOST_BYTES_PER_SECOND = 1.1e9
"""gloo all-reduce on one host: 64 MiB fp32 in ~60 ms between 2 ranks (shared/notes/cpu-stack.md)."""

COMPUTE_LOOP_MATMULS = 400
"""128x128 fp32 matmuls per timed loop: ~0.1 s on one idle core."""

SLOT_PAIRS = 7
"""Pairs of (one worker's loop alone, every worker's loop at once) behind ``compute_slots``."""

INTERLEAVED_COLLECTIVES = 50
"""Collectives in the interleaved loop, one after each slice of the compute loop."""

MAX_TIMED_TOKENS = 2048
"""Tokens of the largest timed pass: the job's micro-batch, cut to this (a large model profiled
on a CPU must still finish)."""

DEFAULT_RAY_WORKER_NICENESS = 15
"""The niceness Ray's raylet gives the worker processes it starts (ray_config_def.h, ``worker_niceness``)."""

OVERSUBSCRIBED_WORKERS = 4
"""Workers of the oversubscribed measurements: on two cores (2 per core), then on one (4)."""

MAX_COLLECTIVE_ELEMENTS = 1 << 16
"""Largest per-worker shard of the timed all-gather (256 KiB of fp32)."""

DECODE_ROWS = (8, 64)
"""Batch sizes of the two timed generations (each at most the job's sequences)."""

DECODE_STEPS = 16
"""New tokens of the longer timed generation (at most the job's response length)."""


@dataclass(frozen=True)
class MicroBatchShape:
    """The timed pass: ``rows`` sequences of ``tokens`` tokens, the last ``response`` of them scored."""

    rows: int
    tokens: int
    response: int

    @staticmethod
    def of(workload: Workload) -> MicroBatchShape:
        tokens = workload.prompt_tokens + workload.response_tokens
        if tokens > MAX_TIMED_TOKENS:
            scale = MAX_TIMED_TOKENS / tokens
            return MicroBatchShape(1, MAX_TIMED_TOKENS, max(1, int(workload.response_tokens * scale)))
        rows = max(1, min(workload.micro_batch_sequences, MAX_TIMED_TOKENS // tokens))
        return MicroBatchShape(rows, tokens, workload.response_tokens)

    @property
    def total(self) -> int:
        return self.rows * self.tokens


@dataclass(frozen=True)
class WorkerFigures:
    """What one worker's passes cost (see the module docstring for each figure's source)."""

    call_overhead_seconds: float
    peak_flops: float
    training_pass_ratio: float
    decode_step_overhead_seconds: float
    decode_efficiency: float
    shared_decode_step_overhead_seconds: float
    fsdp_unit_overhead_seconds: float
    optimizer_step_seconds: float
    memory_bandwidth_bytes_per_second: float
    all_cores_speedup: float


@dataclass(frozen=True)
class HostSharing:
    """How worker processes share this host: parallel compute slots and collective latencies."""

    compute_slots: float
    collective_latency_seconds: float
    oversubscribed_collective_latencies: tuple[tuple[float, float], ...]


def _random_model(decoder: DecoderSpec, device: Any) -> Any:
    """The decoder with random weights (seeded: every process builds the same one), in eval mode."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        decoder.arch,
        vocab_size=decoder.vocab_size,
        hidden_size=decoder.hidden_size,
        intermediate_size=decoder.intermediate_size,
        num_hidden_layers=decoder.num_layers,
        num_attention_heads=decoder.num_heads,
        num_key_value_heads=decoder.num_kv_heads,
        head_dim=decoder.head_dim,
        max_position_embeddings=decoder.max_position_embeddings,
        tie_word_embeddings=False,
    )
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).eval()


def _pass(net: Any, shape: MicroBatchShape, vocab: int, device: Any, *, train: bool) -> Callable[[], object]:
    """One micro-batch as the policy workers run it: the log-prob pass, or a training pass."""
    import torch

    from hybridflow.backends.fsdp.logprobs import token_logprobs_and_entropy

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (shape.rows, shape.tokens), generator=generator).to(device)
    mask = torch.ones_like(ids)
    positions = torch.arange(shape.tokens, device=device).expand(shape.rows, shape.tokens)

    def run() -> object:
        with torch.set_grad_enabled(train):
            log_probs, entropy = token_logprobs_and_entropy(
                net, ids, mask, positions, response_len=shape.response, with_entropy=train
            )
            if train:
                assert entropy is not None
                (log_probs.mean() + entropy.mean()).backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return log_probs

    return run


def _best_seconds(run: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` timed runs after a warm-up: other load on the machine only adds time."""
    run()
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        samples.append(time.perf_counter() - started)
    return min(samples)


def _paired_seconds(
    first: Callable[[], object], second: Callable[[], object], repeats: int
) -> list[tuple[float, float]]:
    """``repeats`` back-to-back timings ``(seconds(first), seconds(second))``, after one warm-up pair.

    Each pair runs within a fraction of a second, so load that drifts on the machine weighs on
    both of a pair alike; the callers take the median over the pairs, which drops those a burst
    of other work hit. (Two separate minima moved by half between runs on a shared two-core
    machine: the ratio of training to forward pass measured 3.0 in one run and 4.7 in the next.)
    """
    first()
    second()
    pairs = []
    for _ in range(repeats):
        started = time.perf_counter()
        first()
        middle = time.perf_counter()
        second()
        pairs.append((middle - started, time.perf_counter() - middle))
    return pairs


def _paired_ratio(first: Callable[[], object], second: Callable[[], object], repeats: int) -> float:
    """The median over back-to-back pairs of ``seconds(second) / seconds(first)``."""
    return statistics.median(b / max(a, 1e-12) for a, b in _paired_seconds(first, second, repeats))


def _optimizer_step_seconds(net: Any, train: Callable[[], object], repeats: int) -> float:
    """One clipped AdamW step over ``net``'s gradients (``backends/fsdp/optim``), the fastest of ``repeats``.

    Each step follows an untimed training pass, so it steps real gradients of the job's shape.
    """
    from hybridflow.backends.fsdp.optim import build_optimizer, clip_grad_norm_and_step

    optimizer = build_optimizer(net, learning_rate=1e-6)
    samples = []
    for _ in range(repeats + 1):
        train()
        started = time.perf_counter()
        clip_grad_norm_and_step(net, optimizer, None, max_grad_norm=1.0)  # type: ignore[arg-type]
        samples.append(time.perf_counter() - started)
    return min(samples[1:])


def _timed_prompt(workload: Workload) -> list[int]:
    """The prompt of every timed generation: the job's prompt length, at most 64 tokens."""
    return list(range(min(workload.prompt_tokens, 64)))


def _decode_step_fit(net: Any, workload: Workload, repeats: int) -> tuple[float, float]:
    """``(a_d, c_d)``: a decoding step of ``rows`` sequences takes ``a_d + rows*c_d`` seconds."""
    from hybridflow.engines.base import SamplingParams
    from hybridflow.engines.torch_engine import TorchRolloutEngine

    # No eos: every row decodes every step, so the steps timed are the steps counted.
    engine = TorchRolloutEngine(net, eos_token_ids=[])
    prompt = _timed_prompt(workload)
    steps = max(2, min(DECODE_STEPS, workload.response_tokens))
    rows_timed = sorted({min(rows, workload.sequences) for rows in DECODE_ROWS})
    if len(rows_timed) == 1:
        rows_timed = [max(1, rows_timed[0] // 2), rows_timed[0]]
    per_step = []
    for rows in rows_timed:

        def generate(tokens: int, rows: int = rows) -> Callable[[], object]:
            params = SamplingParams(max_new_tokens=tokens, temperature=1.0, seed=0)
            return lambda: engine.generate([prompt] * rows, params)

        # The difference of back-to-back pairs: the prefill and the first token cancel out.
        pairs = _paired_seconds(generate(1), generate(steps), repeats)
        per_step.append(max(statistics.median(b - a for a, b in pairs), 0.0) / (steps - 1))
    (small_rows, large_rows), (small, large) = rows_timed, per_step
    per_row = max((large - small) / (large_rows - small_rows), 1e-12)
    return max(small - small_rows * per_row, 0.0), per_row


def _worker_step(net: Any, training_pass: Callable[[], object], workload: Workload) -> Callable[[], object]:
    """A one-GPU worker's step in small: the rollout, a training pass and an optimizer step.

    The generation decodes the job's sequences (at most ``DECODE_ROWS[-1]`` of them, at most
    ``DECODE_STEPS`` new tokens) with the torch engine from ``net`` itself, as a one-rank FSDP
    actor's engine does (``workers/rollout.py``, ``shares_actor_module``).
    """
    from hybridflow.backends.fsdp.optim import build_optimizer, clip_grad_norm_and_step
    from hybridflow.engines.base import SamplingParams
    from hybridflow.engines.torch_engine import TorchRolloutEngine

    engine = TorchRolloutEngine(net, eos_token_ids=[])
    prompts = [_timed_prompt(workload)] * min(DECODE_ROWS[-1], workload.sequences)
    params = SamplingParams(
        max_new_tokens=max(1, min(DECODE_STEPS, workload.response_tokens)), temperature=1.0, seed=0
    )
    optimizer = build_optimizer(net, learning_rate=1e-6)

    def step() -> object:
        engine.generate(prompts, params)
        training_pass()
        clip_grad_norm_and_step(net, optimizer, None, max_grad_norm=1.0)  # type: ignore[arg-type]
        return None

    return step


def _all_cores_speedup(step: Callable[[], object], cores: int, pairs: int) -> float:
    """The median over ``pairs`` back-to-back pairs of ``seconds(step, 1 thread) / seconds(step, cores)``.

    A worker's thread count does not change between its calls, so each timing follows a
    warm-up ``step`` at its count (the thread pool resizes on the switch). Over a whole step,
    not a forward pass alone: the forward gains 1.3x from a second thread on two idle cores,
    a generation 1.0-1.15x, and a one-GPU job's step measured 1.05x (docs/placement.md).
    Below 1 when the cores are busy: a worker's threads then wait for one another.
    """
    import torch

    threads = torch.get_num_threads()

    def seconds_with(count: int) -> float:
        torch.set_num_threads(count)
        try:
            step()
            started = time.perf_counter()
            step()
            return time.perf_counter() - started
        finally:
            torch.set_num_threads(threads)

    timed = [(seconds_with(1), seconds_with(cores)) for _ in range(pairs)]
    return statistics.median(one / max(every, 1e-12) for one, every in timed)


def measure_worker(workload: Workload, *, repeats: int = 7) -> WorkerFigures:
    """The passes of one worker, in this process, on its device (see the module docstring).

    On a CPU the caller has set one thread; with FSDP, a one-rank process group must exist
    (the model is wrapped over it as the backend wraps it).
    """
    import torch

    from hybridflow.backends.fsdp.parallelize import shard_model

    model = workload.actor
    decoder = model.decoder
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    plain = _random_model(decoder, device)
    wrapped = plain
    if workload.backend == "fsdp" and not on_gpu:
        wrapped = shard_model(
            copy.deepcopy(plain), device=device, unit_min_parameters=workload.fsdp_unit_min_parameters
        )
    large_shape = MicroBatchShape.of(workload)
    small_shape = MicroBatchShape(1, min(16, large_shape.tokens), min(8, large_shape.response))
    vocab = decoder.vocab_size
    small = _best_seconds(_pass(plain, small_shape, vocab, device, train=False), repeats)
    forward = _pass(plain, large_shape, vocab, device, train=False)
    large = _best_seconds(forward, repeats)
    seconds_per_token = max((large - small) / max(large_shape.total - small_shape.total, 1), 1e-12)
    fixed = max(small - small_shape.total * seconds_per_token, 0.0)
    flops = 2 * model.params / seconds_per_token
    decode_fixed, decode_per_row = _decode_step_fit(plain, workload, repeats)
    wrapped_forward = large
    shared_decode = 0.0
    unit = 0.0
    if wrapped is not plain:
        wrapped_forward = _best_seconds(_pass(wrapped, large_shape, vocab, device, train=False), repeats)
        unit = max(wrapped_forward - large, 0.0) / fsdp_unit_count(model, workload)
        shared_fixed, _ = _decode_step_fit(wrapped, workload, repeats)
        shared_decode = max(shared_fixed - decode_fixed, 0.0)
    wrapped_pass = _pass(wrapped, large_shape, vocab, device, train=False)
    training_pass = _pass(wrapped, large_shape, vocab, device, train=True)
    train_ratio = _paired_ratio(wrapped_pass, training_pass, repeats)
    optimizer_step = _optimizer_step_seconds(wrapped, training_pass, max(3, repeats // 2))
    buffer = torch.empty(64 * 2**20 // 4, dtype=torch.float32, device=device)
    target = torch.empty_like(buffer)
    bandwidth = 2 * buffer.numel() * 4 / _best_seconds(lambda: target.copy_(buffer), repeats)
    speedup = 1.0
    cores = available_cores()
    if not on_gpu and cores > 1:
        step = _worker_step(wrapped, training_pass, workload)
        speedup = _all_cores_speedup(step, cores, repeats)
    return WorkerFigures(
        call_overhead_seconds=fixed,
        peak_flops=flops,
        training_pass_ratio=train_ratio,
        decode_step_overhead_seconds=decode_fixed,
        decode_efficiency=min(1.0, 2 * model.params / (decode_per_row * flops)),
        shared_decode_step_overhead_seconds=shared_decode,
        fsdp_unit_overhead_seconds=unit,
        optimizer_step_seconds=optimizer_step,
        memory_bandwidth_bytes_per_second=bandwidth,
        all_cores_speedup=speedup,
    )


def _as_ray_worker() -> None:
    """Lower this process's priority as Ray lowers its workers' (``RAY_worker_niceness``, 15).

    A simulated GPU is a Ray worker: on a loaded host it yields to every process of normal
    priority. Measured at normal priority, the figures would hold for an idle host only.
    """
    os.nice(int(os.environ.get("RAY_worker_niceness", DEFAULT_RAY_WORKER_NICENESS)))  # noqa: SIM112 (Ray's name)


def _worker_process(port: int, workload: Workload, repeats: int, results: Any) -> None:
    import torch
    import torch.distributed as dist

    _as_ray_worker()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        results.put(measure_worker(workload, repeats=repeats))
    finally:
        dist.destroy_process_group()


def _compute_loop(matmuls: int = COMPUTE_LOOP_MATMULS) -> float:
    import torch

    a = torch.randn(128, 128)
    started = time.perf_counter()
    for _ in range(matmuls):
        a = torch.tanh(a @ a)
    return time.perf_counter() - started


def _sharing_worker(
    rank: int, world: int, port: int, pin: tuple[int, ...] | None, elements: int, results: Any
) -> None:
    import torch
    import torch.distributed as dist

    _as_ray_worker()
    if pin is not None:
        os.sched_setaffinity(0, pin)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    # One worker's loop while the others wait, then every worker's at once, in back-to-back
    # pairs (compute_slots is the median over the pairs: the cores' speed drifts on a shared host).
    alone_loops, loops = [], []
    for _ in range(SLOT_PAIRS):
        dist.barrier()
        if rank == 0:
            alone_loops.append(_compute_loop())
        dist.barrier()
        loops.append(_compute_loop())
    dist.barrier()
    shard = torch.zeros(elements)
    gathered = torch.zeros(elements * world)

    # torch 2.13 renamed the collective all_gather_single (the old name warns on every call).
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def collective() -> None:
        gather(gathered, shard)

    for _ in range(20):
        collective()
    latencies = []
    for _ in range(100):
        started = time.perf_counter()
        collective()
        latencies.append(time.perf_counter() - started)
    # A training step interleaves compute and collectives; under load the ranks reach each
    # collective at different times, and that skew, not the idle round trip, is what a step pays.
    chunk = COMPUTE_LOOP_MATMULS // INTERLEAVED_COLLECTIVES
    dist.barrier()
    alone = _compute_loop(chunk * INTERLEAVED_COLLECTIVES)
    dist.barrier()
    started = time.perf_counter()
    for _ in range(INTERLEAVED_COLLECTIVES):
        _compute_loop(chunk)
        collective()
    interleaved = (time.perf_counter() - started - alone) / INTERLEAVED_COLLECTIVES
    dist.destroy_process_group()
    results.put((rank, max(statistics.median(latencies), interleaved), loops, alone_loops))


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _run_sharing_workers(
    world: int, pin: tuple[int, ...] | None, elements: int
) -> list[tuple[int, float, list[float], list[float]]]:
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = _free_port()
    workers = [
        context.Process(target=_sharing_worker, args=(rank, world, port, pin, elements, results))
        for rank in range(world)
    ]
    for worker in workers:
        worker.start()
    measured = [results.get(timeout=300) for _ in workers]
    for worker in workers:
        worker.join(timeout=60)
    return measured


def measure_host_sharing(workload: Workload) -> HostSharing:
    """Gloo workers on this host: their parallelism and collective latency, and oversubscribed.

    The collective is the one FSDP issues per unit: an all-gather of one decoder layer's
    parameters, sharded over the workers (at most :data:`MAX_COLLECTIVE_ELEMENTS` per worker:
    bandwidth is costed apart). Two workers on all cores give ``compute_slots`` and
    ``collective_latency_seconds``; four workers pinned to two cores, then to one, the
    latency at 2 and 4 workers per core.
    """
    layer_elements = sum(param.numel for param in workload.actor.layout(4).params if param.layer == 0)
    measured = _run_sharing_workers(2, None, max(1, min(MAX_COLLECTIVE_ELEMENTS, layer_elements // 2)))
    alone = next(m[3] for m in measured if m[0] == 0)
    together = [statistics.mean(m[2][pair] for m in measured) for pair in range(SLOT_PAIRS)]
    latency = statistics.mean(m[1] for m in measured)
    allowed = tuple(sorted(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else (0,)
    over = []
    for cores in {allowed[:2], allowed[:1]}:
        workers = OVERSUBSCRIBED_WORKERS
        timed = _run_sharing_workers(
            workers, cores, max(1, min(MAX_COLLECTIVE_ELEMENTS, layer_elements // workers))
        )
        over.append((workers / len(cores), statistics.mean(m[1] for m in timed)))
    return HostSharing(
        compute_slots=max(
            0.5,
            min(2.0, statistics.median(2 * one / both for one, both in zip(alone, together, strict=True))),
        ),
        collective_latency_seconds=latency,
        oversubscribed_collective_latencies=tuple(sorted(over)),
    )


def calibrate_device(workload: Workload, base: DeviceConstants, *, repeats: int = 7) -> DeviceConstants:
    """``base`` with the constants measured on this machine (see the module docstring)."""
    import multiprocessing

    import torch

    on_gpu = torch.cuda.is_available()
    if on_gpu:
        figures = measure_worker(workload, repeats=repeats)
    else:
        # A worker process of its own: one thread and a one-rank group, as a simulated GPU has.
        context = multiprocessing.get_context("spawn")
        results = context.Queue()
        worker = context.Process(target=_worker_process, args=(_free_port(), workload, repeats, results))
        worker.start()
        figures = results.get(timeout=600)
        worker.join(timeout=60)
    measured = replace(
        base,
        name=f"{'cuda' if on_gpu else 'cpu'} (measured with {workload.actor.name})",
        peak_flops=figures.peak_flops,
        train_efficiency=1.0,
        tokens_for_half_efficiency=0.0,
        memory_bandwidth_bytes_per_second=figures.memory_bandwidth_bytes_per_second,
        decode_bandwidth_efficiency=1.0,
        decode_efficiency=figures.decode_efficiency,
        call_overhead_seconds=figures.call_overhead_seconds,
        decode_step_overhead_seconds=figures.decode_step_overhead_seconds,
        training_pass_ratio=figures.training_pass_ratio,
        fsdp_unit_overhead_seconds=figures.fsdp_unit_overhead_seconds,
        shared_decode_step_overhead_seconds=figures.shared_decode_step_overhead_seconds,
        optimizer_step_overhead_seconds=max(
            0.0,
            figures.optimizer_step_seconds
            - OPTIMIZER_BYTES_PER_PARAMETER
            * workload.actor.params
            / figures.memory_bandwidth_bytes_per_second,
        ),
    )
    if on_gpu:
        return replace(measured, memory_bytes=float(torch.cuda.get_device_properties(0).total_memory))
    sharing = measure_host_sharing(workload)
    cores = available_cores()
    return replace(
        measured,
        memory_bytes=float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")),
        intra_node_bytes_per_second=GLOO_HOST_BYTES_PER_SECOND,
        inter_node_bytes_per_second=GLOO_HOST_BYTES_PER_SECOND,
        collective_latency_seconds=sharing.collective_latency_seconds,
        oversubscribed_collective_latencies=sharing.oversubscribed_collective_latencies,
        # Two workers measured; more cores scale the same share.
        compute_slots=sharing.compute_slots * cores / 2,
        host_cores=cores,
        all_cores_speedup=max(0.05, figures.all_cores_speedup),
    )
