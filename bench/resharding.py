"""3D-HybridEngine transition figures on 8 gloo ranks (CPU), against the paper's Table 2.

For each layout and each design (hybridflow, vanilla, allgather), 8 spawned ranks run the
train -> generate transition of :mod:`hybridflow.resharding` on a tiny Qwen2 model's layout and
report, per rank: bytes received, peak parameter memory, redundant parameter memory (measured
from the tensors that exist, see :mod:`hybridflow.resharding.transfer`), and the transition's
wall time (the slowest rank of each repeat, median over repeats), next to Table 2's formulas.

``M`` in the formulas is the model's TP-partitioned weight bytes; the RMSNorm weights, which
Megatron replicates on every TP rank, are reported apart (``*_replicated``), as
``docs/hybrid-engine.md`` explains. Training buffers are filled with random values: the bytes
and times do not depend on them, and tests/integration/test_resharding.py checks the contents.

Top-level fields: ``max_formula_error_bytes`` (largest |measured - formula| over every layout,
design, rank and figure; target 0), ``traffic_ratio_allgather_over_hybridflow_t4d2_tg2``
(Table 2 gives 3.5), ``redundant_bytes_hybridflow`` (largest redundant bytes of any HybridFlow
rank, replicated included; target 0). The last line printed is one JSON object.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybridflow.mesh import DeviceMesh
from hybridflow.resharding import DESIGNS, DecoderSpec, ParamBytes, build_plan, decoder_layout, table2
from hybridflow.resharding.transfer import Resharder, SubgroupCache, TrainingShard, TransitionStats

WORLD_SIZE = 8
QUICK = os.environ.get("HYBRIDFLOW_BENCH_QUICK") == "1"
"""Quick mode (``make bench-smoke``): one repeat, to prove the bench runs and prints its JSON line."""
REPEATS = 1 if QUICK else 5  # timed transitions per layout and design, after one warm-up
# A tiny Qwen2 (the shapes build_tiny_model gives for these arguments): ~136 MB of fp32
# weights, large enough that a transition moves tens of MB per rank.
MODEL = {
    "vocab_size": 384,
    "hidden": 512,
    "layers": 2 if QUICK else 8,
    "heads": 8,
    "kv_heads": 8,
    "intermediate": 2048,
}
# (name, p, t, p_g, t_g); d = 8 / (p t)
LAYOUTS = [
    ("t4d2-tg2", 1, 4, 1, 2),
    ("t8-tg2", 1, 8, 1, 2),
    ("p2t4-pg1tg2", 2, 4, 1, 2),
    ("t4d2-tg1", 1, 4, 1, 1),
]


def _figures(bytes_: ParamBytes) -> dict[str, int]:
    return {"partitioned": bytes_.partitioned, "replicated": bytes_.replicated}


def run_rank(rank: int, port: int, spec_json: str, out_path: str) -> None:
    """One rank: every layout x design, warm-up then timed repeats; rank 0 writes everyone's records."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=datetime.timedelta(seconds=300),
    )
    layout = decoder_layout(DecoderSpec(**json.loads(spec_json)))
    groups = SubgroupCache()
    generator = torch.Generator().manual_seed(rank)
    records: list[dict[str, Any]] = []
    for name, p, t, p_g, t_g in LAYOUTS:
        train = DeviceMesh.training(WORLD_SIZE, pp=p, tp=t)
        setups = {}
        for design in DESIGNS:
            plan = build_plan(design, layout, train, pp=p_g, tp=t_g)
            shard = TrainingShard.allocate(plan.rank(rank).training, torch.float32, "cpu")
            for kind in ("partitioned", "replicated"):
                shard.buffer(kind).copy_(torch.randn(shard.buffer(kind).numel(), generator=generator))
            setups[design] = (plan, Resharder(plan, rank, groups), shard)
        # Designs alternate inside each round (after one warm-up round), so that the noise of
        # a shared machine hits them alike.
        runs: dict[str, list[tuple[TransitionStats, TransitionStats]]] = {design: [] for design in DESIGNS}
        for _ in range(REPEATS + 1):
            for design, (_, resharder, shard) in setups.items():
                dist.barrier()
                generation, forward = resharder.to_generation(shard)
                backward = resharder.to_training(generation, shard)
                runs[design].append((forward, backward))
        for design, (plan, _, _) in setups.items():
            timed = runs[design][1:]
            forward, backward = timed[-1]
            records.append(
                {
                    "layout": name,
                    "design": design,
                    "rank": rank,
                    "seconds": [f.seconds for f, _ in timed],
                    "to_training_seconds": [b.seconds for _, b in timed],
                    "received": _figures(forward.received),
                    "peak": _figures(forward.peak),
                    "peak_total": _figures(forward.peak_total),
                    "redundant": _figures(forward.redundant),
                    "freed": _figures(backward.freed),
                    "plan_received": _figures(plan.bytes_received(rank)),
                }
            )
        del setups
    everyone: list[Any] = [None] * WORLD_SIZE
    dist.all_gather_object(everyone, records)
    if rank == 0:
        Path(out_path).write_text(json.dumps([record for per_rank in everyone for record in per_rank]))
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def exact(value: Fraction) -> int:
    if value.denominator != 1:
        raise SystemExit(f"a Table 2 figure is not a whole number of bytes: {value}")
    return int(value)


def summarise(records: list[dict[str, Any]], spec: DecoderSpec) -> dict[str, Any]:
    layout = decoder_layout(spec)
    m = layout.partitioned_bytes
    out_layouts = []
    max_error = 0
    for name, p, t, p_g, t_g in LAYOUTS:
        d = WORLD_SIZE // (p * t)
        designs: dict[str, Any] = {}
        for design in DESIGNS:
            mine = sorted(
                (r for r in records if r["layout"] == name and r["design"] == design), key=lambda r: r["rank"]
            )
            row = table2(design, p=p, t=t, d=d, p_g=p_g, t_g=t_g, model_bytes=m)
            formula = {
                "traffic": exact(row.traffic),
                "peak": exact(row.peak),
                "redundant": exact(row.redundant),
            }
            measured = {
                "traffic": [r["received"]["partitioned"] for r in mine],
                "peak": [r["peak"]["partitioned"] for r in mine],
                "redundant": [r["redundant"]["partitioned"] for r in mine],
            }
            error = max(abs(v - formula[key]) for key, values in measured.items() for v in values)
            max_error = max(max_error, error)
            # The transition of a repeat ends when its slowest rank is done.
            per_repeat = [max(r["seconds"][i] for r in mine) for i in range(REPEATS)]
            designs[design] = {
                "bytes_received_per_rank": max(measured["traffic"]),
                "peak_param_bytes_per_rank": max(measured["peak"]),
                "redundant_bytes_per_rank": max(measured["redundant"]),
                "formula": formula,
                "formula_error_bytes": error,
                "replicated_bytes_received_max": max(r["received"]["replicated"] for r in mine),
                "replicated_redundant_bytes_max": max(r["redundant"]["replicated"] for r in mine),
                "peak_total_param_bytes_max": max(
                    r["peak_total"]["partitioned"] + r["peak_total"]["replicated"] for r in mine
                ),
                "measured_equals_plan": all(r["received"] == r["plan_received"] for r in mine),
                "transition_seconds_median": statistics.median(per_repeat),
                "transition_seconds_min": min(per_repeat),
                "to_training_seconds_median": statistics.median(
                    max(r["to_training_seconds"][i] for r in mine) for i in range(REPEATS)
                ),
            }
        hybrid = designs["hybridflow"]["transition_seconds_median"]
        out_layouts.append(
            {
                "name": name,
                "train": {"p": p, "t": t, "d": d},
                "generation": {"p_g": p_g, "t_g": t_g, "micro_dp": (p * t) // (p_g * t_g)},
                "designs": designs,
                "time_reduction_vs_vanilla": 1 - hybrid / designs["vanilla"]["transition_seconds_median"],
                "time_reduction_vs_allgather": 1 - hybrid / designs["allgather"]["transition_seconds_median"],
            }
        )
    t4d2 = next(entry for entry in out_layouts if entry["name"] == "t4d2-tg2")["designs"]
    hybridflow_redundant = max(
        r["redundant"]["partitioned"] + r["redundant"]["replicated"]
        for r in records
        if r["design"] == "hybridflow"
    )
    return {
        "bench": "resharding",
        "world_size": WORLD_SIZE,
        "backend": "gloo",
        "device": "cpu",
        "repeats": REPEATS,
        "model": {
            "arch": spec.arch,
            **MODEL,
            "weight_bytes": layout.total_bytes,
            "M_partitioned_bytes": m,
            "replicated_bytes": layout.replicated_bytes,
        },
        "layouts": out_layouts,
        "max_formula_error_bytes": max_error,
        "traffic_ratio_allgather_over_hybridflow_t4d2_tg2": t4d2["allgather"]["bytes_received_per_rank"]
        / t4d2["hybridflow"]["bytes_received_per_rank"],
        "redundant_bytes_hybridflow": hybridflow_redundant,
    }


def main() -> None:
    from hybridflow.models.tiny import tiny_config

    config = tiny_config(
        "qwen2",
        MODEL["vocab_size"],
        MODEL["hidden"],
        MODEL["layers"],
        MODEL["heads"],
        MODEL["kv_heads"],
        MODEL["intermediate"],
    )
    spec = DecoderSpec.from_hf_config(config)
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "records.json")
        start = time.perf_counter()
        mp.start_processes(
            run_rank,
            args=(free_port(), json.dumps(spec.__dict__), out_path),
            nprocs=WORLD_SIZE,
            start_method="spawn",
        )
        records = json.loads(Path(out_path).read_text())
    summary = summarise(records, spec)
    summary["wall_seconds"] = time.perf_counter() - start
    print(
        f"{'layout':<13}{'design':<11}{'recv MB':>9}{'formula':>9}{'peak MB':>9}{'redund MB':>10}{'seconds':>9}",
        file=sys.stderr,
    )
    for entry in summary["layouts"]:
        for design, figures in entry["designs"].items():
            print(
                f"{entry['name']:<13}{design:<11}"
                f"{figures['bytes_received_per_rank'] / 1e6:>9.2f}{figures['formula']['traffic'] / 1e6:>9.2f}"
                f"{figures['peak_param_bytes_per_rank'] / 1e6:>9.2f}{figures['redundant_bytes_per_rank'] / 1e6:>10.2f}"
                f"{figures['transition_seconds_median']:>9.3f}",
                file=sys.stderr,
            )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
