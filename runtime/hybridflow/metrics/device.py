"""What a worker reports about its accelerator, as step-metric keys (see ``catalogue.py``).

Called by a role's worker at the end of its update, in the worker process: the figures are the
process's own CUDA allocator counters, so colocated roles (one process per GPU) report the same
memory, which is what that GPU holds. The peak counter is reset after reading, so each step's
``peak_allocated_bytes`` is the peak of that step. On a CPU process it reports nothing.
"""

from __future__ import annotations

from hybridflow.metrics.flops import peak_flops

__all__ = ["device_metrics"]


def device_metrics(role: str) -> dict[str, float]:
    """``memory/<role>/{allocated,reserved,peak_allocated}_bytes`` and ``gpu/peak_flops`` (known GPUs)."""
    import torch

    if not torch.cuda.is_available():
        return {}
    device = torch.cuda.current_device()
    metrics = {
        f"memory/{role}/allocated_bytes": float(torch.cuda.memory_allocated(device)),
        f"memory/{role}/reserved_bytes": float(torch.cuda.memory_reserved(device)),
        f"memory/{role}/peak_allocated_bytes": float(torch.cuda.max_memory_allocated(device)),
    }
    torch.cuda.reset_peak_memory_stats(device)
    peak = peak_flops(torch.cuda.get_device_name(device))
    if peak is not None:
        metrics["gpu/peak_flops"] = peak
    return metrics
