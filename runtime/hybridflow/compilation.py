"""``torch.compile`` for the hot paths (``spec.rollout.compile``, ``spec.training.compile``), and its cache.

Who uses it: the torch engine compiles its decode step (:mod:`hybridflow.engines.torch_engine`),
the FSDP backend its model's forward (and so, through AOTAutograd, the backward) one region at a
time (:mod:`hybridflow.backends.fsdp.parallelize`). Each asks :func:`compiled_module` for the
wrapper and reports :func:`compile_seconds_so_far` deltas, which the trainer shows as the step
phase ``compile`` (taken out of the phase that paid for it).

The compile cache. Inductor keeps what it built (FX graphs, AOTAutograd graphs, the C++ or
Triton kernels) in ``TORCHINDUCTOR_CACHE_DIR``; a process that compiles the same graph again
finds it there and skips code generation, which is most of a compile on CPU (C++ builds) and
much of it on GPU. :func:`use_compile_cache` points that directory at the job's checkpoint
volume (``<checkpoint dir>/compile-cache``) in every worker before its first compile, so an
attempt that resumes after a failure, a preemption or a suspend reuses what the first attempt
compiled. Entries are keyed by the graph, torch version and device, so ranks and attempts share
one directory safely (inductor writes each entry atomically); a cache from another torch or GPU
is simply not hit. :func:`compile_cache_counters` tells hits from misses, which the tests use to
show a resumed run did not compile again.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = [
    "COMPILE_CACHE_DIR",
    "compile_cache_counters",
    "compile_seconds_so_far",
    "compiled_module",
    "use_compile_cache",
]

COMPILE_CACHE_DIR = "compile-cache"
"""The compile cache's folder inside the job's checkpoint directory (not a step: never pruned)."""


def use_compile_cache(checkpoint_dir: str | os.PathLike[str]) -> Path:
    """Point inductor's cache at ``<checkpoint_dir>/compile-cache``; call before the process's first compile.

    Inductor reads the variable when it first needs its cache directory, so setting it later
    has no effect on what is already cached in memory; a worker calls this when it is built. The
    FX-graph and AOTAutograd caches are turned on explicitly (they are torch's defaults, and a
    cache directory is useless without them).
    """
    directory = Path(checkpoint_dir) / COMPILE_CACHE_DIR
    directory.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(directory)
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "1")
    return directory


def compiled_module(
    module: nn.Module | Callable[..., Any], device: torch.device, *, static: bool = True
) -> Any:
    """``module`` (or a module's bound ``forward``) compiled for ``device``: CUDA graphs on CUDA when
    shapes are static, fused kernels elsewhere.

    ``static``: the caller keeps every input's shape fixed between calls (the engine's decode
    step), so no dynamic-shape guards are generated and, on CUDA, the graph can be replayed.
    Otherwise every dimension is symbolic from the first compile (``dynamic=True``): training
    micro-batches vary in width, and in rows when prompt sharing groups them, and letting dynamo
    discover that one dimension at a time cost a recompile each (measured on the tiny job: 17 s
    at step 2 and 12-17 s again at step 144, against one compile 1.8x as long as a static one).
    """
    mode = "reduce-overhead" if device.type == "cuda" and static else None
    return torch.compile(module, dynamic=not static, mode=mode)


def compile_seconds_so_far() -> float:
    """Seconds this process has spent in ``torch.compile`` (tracing, code generation, cache loads)."""
    from torch._dynamo.utils import calculate_time_spent

    return float(calculate_time_spent().get("total_wall_time", 0.0))


def compile_cache_counters() -> dict[str, int]:
    """Inductor's FX-graph cache hits and misses in this process so far (``{"hits": h, "misses": m}``)."""
    from torch._dynamo.utils import counters

    inductor = counters["inductor"]
    return {"hits": int(inductor["fxgraph_cache_hit"]), "misses": int(inductor["fxgraph_cache_miss"])}
