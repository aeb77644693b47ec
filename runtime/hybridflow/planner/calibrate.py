"""``hybridflow plan --profile``: the device constants measured on this machine (needs torch).

A short run, a few seconds: the job's own actor model (random weights of its config, so no
checkpoint is read) runs forward passes of two sizes on one device, single-threaded on a CPU
as one simulated GPU worker is. The time of a pass is fitted as ``a + T/r`` for ``T`` tokens:
``a`` becomes the fixed cost of a call and of a decoding step, ``2*N*r`` the sustained FLOP/s
(``peak_flops`` with ``train_efficiency = 1`` and no small-batch penalty: the fit already is
the sustained rate). A large tensor copy gives the memory bandwidth.

On a CPU, the simulated GPUs of a local run are processes sharing its cores, with whatever
else runs there. Two worker processes measure what that costs (:func:`measure_host_sharing`):
the same compute loop alone and in both at once gives ``compute_slots`` (how many workers
progress in parallel: 2 on two idle cores, 1 when they only take turns), and a gloo all-reduce
of one float between them, issued between slices of that loop as a training step issues its
collectives, ``collective_latency_seconds`` (the wait includes the ranks' skew under load). Bandwidths are those of gloo on one
host (docs/placement.md). On a GPU the link constants of the base device are kept.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from hybridflow.planner.hardware import DeviceConstants
from hybridflow.planner.shapes import ModelShape

__all__ = ["GLOO_HOST_BYTES_PER_SECOND", "HostSharing", "calibrate_device", "measure_host_sharing"]

GLOO_HOST_BYTES_PER_SECOND = 1.1e9
"""gloo all-reduce on one host: 64 MiB fp32 in ~60 ms between 2 ranks (shared/notes/cpu-stack.md)."""


@dataclass(frozen=True)
class HostSharing:
    """How two worker processes share this host: parallel compute slots and collective latency."""

    compute_slots: float
    collective_latency_seconds: float


COMPUTE_LOOP_MATMULS = 400
"""128x128 fp32 matmuls per timed loop: ~0.1 s on one idle core."""


INTERLEAVED_COLLECTIVES = 50
"""Collectives in the interleaved loop, one after each slice of the compute loop."""


def _compute_loop(matmuls: int = COMPUTE_LOOP_MATMULS) -> float:
    import torch

    a = torch.randn(128, 128)
    started = time.perf_counter()
    for _ in range(matmuls):
        a = torch.tanh(a @ a)
    return time.perf_counter() - started


def _sharing_worker(rank: int, port: int, results: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    one = torch.zeros(1)
    for _ in range(20):
        dist.all_reduce(one)
    latencies = []
    for _ in range(200):
        started = time.perf_counter()
        dist.all_reduce(one)
        latencies.append(time.perf_counter() - started)
    loops = []
    for _ in range(3):
        dist.barrier()
        loops.append(_compute_loop())
    # A training step interleaves compute and collectives; under load the ranks reach each
    # collective at different times, and that skew, not the idle round trip, is what a step pays.
    chunk = COMPUTE_LOOP_MATMULS // INTERLEAVED_COLLECTIVES
    dist.barrier()
    alone = _compute_loop(chunk * INTERLEAVED_COLLECTIVES)
    dist.barrier()
    started = time.perf_counter()
    for _ in range(INTERLEAVED_COLLECTIVES):
        _compute_loop(chunk)
        dist.all_reduce(one)
    interleaved = (time.perf_counter() - started - alone) / INTERLEAVED_COLLECTIVES
    dist.destroy_process_group()
    results.put((rank, max(statistics.median(latencies), interleaved), min(loops)))


def measure_host_sharing() -> HostSharing:
    """Start two gloo workers on this host and measure their parallelism and collective latency."""
    import multiprocessing
    import socket

    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _compute_loop()
        alone = min(_compute_loop() for _ in range(3))
    finally:
        torch.set_num_threads(threads)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    workers = [context.Process(target=_sharing_worker, args=(rank, port, results)) for rank in range(2)]
    for worker in workers:
        worker.start()
    measured = [results.get(timeout=300) for _ in workers]
    for worker in workers:
        worker.join(timeout=60)
    together = statistics.mean(loop for _, _, loop in measured)
    latency = statistics.mean(lat for _, lat, _ in measured)
    return HostSharing(
        compute_slots=max(0.5, min(2.0, 2 * alone / together)), collective_latency_seconds=latency
    )


def _best_seconds(run: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` timed runs after a warm-up: other load on the machine only adds time."""
    run()
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        samples.append(time.perf_counter() - started)
    return min(samples)


def calibrate_device(model: ModelShape, base: DeviceConstants, *, repeats: int = 7) -> DeviceConstants:
    """``base`` with compute, call and memory constants measured on this machine (see the module docstring)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    decoder = model.decoder
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    threads = torch.get_num_threads()
    if not on_gpu:
        torch.set_num_threads(1)
    try:
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
        dtype = torch.bfloat16 if on_gpu else torch.float32
        net = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).eval()
        small_tokens, large_tokens = 8, 8 * min(256, decoder.max_position_embeddings)

        def forward(tokens: int) -> Callable[[], object]:
            ids = torch.randint(0, decoder.vocab_size, (tokens // 8, 8) if tokens == 8 else (8, tokens // 8))
            ids = ids.to(device)

            def run() -> object:
                with torch.no_grad():
                    out = net(input_ids=ids).logits
                if on_gpu:
                    torch.cuda.synchronize()
                return out

            return run

        small = _best_seconds(forward(small_tokens), repeats)
        large = _best_seconds(forward(large_tokens), repeats)
        seconds_per_token = max((large - small) / (large_tokens - small_tokens), 1e-12)
        fixed = max(small - small_tokens * seconds_per_token, 0.0)
        flops = 2 * model.params / seconds_per_token
        buffer = torch.empty(64 * 2**20 // 4, dtype=torch.float32, device=device)
        target = torch.empty_like(buffer)
        copy = _best_seconds(lambda: target.copy_(buffer), repeats)
        bandwidth = 2 * buffer.numel() * 4 / copy
    finally:
        torch.set_num_threads(threads)
    measured = replace(
        base,
        name=f"{'cuda' if on_gpu else 'cpu'} (measured with {model.name})",
        peak_flops=flops,
        train_efficiency=1.0,
        tokens_for_half_efficiency=0.0,
        memory_bandwidth_bytes_per_second=bandwidth,
        decode_bandwidth_efficiency=1.0,
        call_overhead_seconds=fixed,
        decode_step_overhead_seconds=fixed,
    )
    if on_gpu:
        return replace(measured, memory_bytes=float(torch.cuda.get_device_properties(0).total_memory))
    sharing = measure_host_sharing()
    return replace(
        measured,
        memory_bytes=float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")),
        intra_node_bytes_per_second=GLOO_HOST_BYTES_PER_SECOND,
        inter_node_bytes_per_second=GLOO_HOST_BYTES_PER_SECOND,
        collective_latency_seconds=sharing.collective_latency_seconds,
        # Two workers measured; more cores scale the same share.
        compute_slots=sharing.compute_slots * (os.cpu_count() or 1) / 2,
    )
