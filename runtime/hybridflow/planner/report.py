"""How ``hybridflow plan`` and ``placement: auto`` print plans (pure text)."""

from __future__ import annotations

from collections.abc import Sequence

from hybridflow.planner.hardware import ClusterShape, DeviceConstants
from hybridflow.planner.search import Plan
from hybridflow.planner.shapes import Workload

__all__ = ["describe_plan", "plan_table"]

GB = 1e9


def describe_plan(plan: Plan) -> str:
    """One line: placement, each pool's layouts, the estimates (the line ``placement: auto`` logs)."""
    pools = "; ".join(
        f"{'+'.join(pool.roles)} on {pool.gpus} GPU(s): "
        + ", ".join(f"{role} {layout.describe()}" for role, layout in pool.layouts.items())
        + f", peak {pool.peak_memory_bytes / GB:.1f} GB/GPU, idle {idle:.0%}"
        for pool, idle in zip(plan.pools, plan.idle_fraction, strict=True)
    )
    phases = ", ".join(f"{name} {seconds:.3g}" for name, seconds in plan.phase_seconds.items())
    return (
        f"{plan.placement.kind} [{pools}]; step {plan.step_seconds:.3g} s ({phases}), "
        f"{plan.tokens_per_second:.4g} tokens/s, reshard {plan.reshard_bytes_per_gpu / GB:.3g} GB/GPU"
    )


def plan_table(
    plans: Sequence[Plan], workload: Workload, cluster: ClusterShape, device: DeviceConstants, *, top: int
) -> str:
    """The best ``top`` plans, then the best plan of each placement kind not already shown."""
    shown = list(plans[:top])
    for kind in ("colocate", "split", "standalone"):
        best = next((p for p in plans if p.placement.kind == kind), None)
        if best is not None and best not in shown:
            shown.append(best)
    models = ", ".join(
        f"{role} {shape.name} ({shape.params / 1e9:.3g}B)" for role, shape in workload.models().items()
    )
    lines = [
        f"budget: {cluster.gpus} GPU(s), {cluster.gpus_per_node} per node; device: {device.name}",
        f"models: {models}",
        f"step: {workload.sequences} sequences x ({workload.prompt_tokens} prompt + {workload.response_tokens} "
        f"response) tokens, backend {workload.backend}; {len(plans)} feasible plan(s)",
        "",
        f"{'#':>3}  {'placement':<11} {'step s':>9} {'gen s':>9} {'score s':>9} {'train s':>9} "
        f"{'tokens/s':>10}  pools (layouts; peak memory per GPU; idle fraction)",
    ]
    for plan in shown:
        rank = plans.index(plan) + 1
        phases = plan.phase_seconds
        pools = " | ".join(
            f"{'+'.join(pool.roles)}:{pool.gpus} ("
            + ", ".join(layout.describe() for layout in pool.layouts.values())
            + f"; {pool.peak_memory_bytes / GB:.3g} GB; idle {idle:.0%})"
            for pool, idle in zip(plan.pools, plan.idle_fraction, strict=True)
        )
        lines.append(
            f"{rank:>3}  {plan.placement.kind:<11} {plan.step_seconds:>9.3g} {phases['generate']:>9.3g} "
            f"{phases['score']:>9.3g} {phases['train']:>9.3g} {plan.tokens_per_second:>10.4g}  {pools}"
        )
    return "\n".join(lines)
