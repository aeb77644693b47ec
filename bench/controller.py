"""Controller overhead and transfer figures on a local Ray with 8 simulated-GPU workers.

Every ratio compares two paths measured in the same process, interleaved round by round, so
machine noise hits both sides alike; each side's figure is the median over the rounds.

* dispatch_overhead_ratio: a split-by-DP no-op call (the worker returns its shard) carrying a
  1 MiB batch through the controller (split, object-store put, 8 calls, fail-fast wait,
  collect, concat), over a raw Ray fan-out of the same shards as numpy arrays to 8 plain actors.
  Target <= 1.5.
* transfer_vs_numpy_ratio: bytes/s of a 64 MiB Batch sent by the controller to the 8 workers
  (split by DP rank; each worker receives its 8 MiB shard and returns its row count), over the
  same bytes as numpy arrays through the object store. Target >= 0.5.
* transfer_vs_torch_pickle_ratio: the same Batch transfer over a container that pickles each
  torch tensor on its own (pickle.dumps before the hop, pickle.loads after). Target >= 10.
* roundtrip_*: the same three paths when every worker sends its shard back and the controller
  reassembles the batch (two object-store hops plus the concatenation), and, for reference,
  ``ray_torch``: torch tensors handed to Ray as they are (Ray's default, in-band pickling).

The last line printed is one JSON object.
"""

from __future__ import annotations

import json
import os
import pickle
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import ray
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH", "")]
)
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from bench_roles import EchoWorker, RawEcho

from hybridflow.controller import Batch, ResourcePool, RoleSpec, deploy
from hybridflow.controller.resource_pool import simulated_cluster_resources

WORKERS = 8
QUICK = os.environ.get("HYBRIDFLOW_BENCH_QUICK") == "1"
"""Quick mode (``make bench-smoke``): few rounds, to prove the bench runs and prints its JSON line."""
ROUNDS = 3 if QUICK else 30
TRANSFER_ROUNDS = 1 if QUICK else 8


def median_seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def interleaved(rounds: int, **paths: Callable[[], object]) -> dict[str, float]:
    """Median seconds per path; the paths alternate within each round after one warm-up call."""
    for fn in paths.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(rounds):
        for name, fn in paths.items():
            samples[name].append(median_seconds(fn))
    return {name: statistics.median(values) for name, values in samples.items()}


def batch_of(nbytes: int) -> Batch:
    columns = 1024
    rows = nbytes // (4 * columns)
    return Batch.from_dict({"x": torch.randn(rows, columns)})


def main() -> None:
    pool = ResourcePool("bench", nodes=1, gpus_per_node=WORKERS, cpus_per_gpu=0.1)
    ray.init(
        num_cpus=2,
        num_gpus=WORKERS,
        resources=simulated_cluster_resources([pool]),
        include_dashboard=False,
        configure_logging=False,
        log_to_driver=False,
    )
    raw_actors = [RawEcho.options(num_cpus=0).remote() for _ in range(WORKERS)]
    ray.get([a.echo.remote(np.zeros(1)) for a in raw_actors])
    with deploy([pool], {"echo": RoleSpec(EchoWorker, "bench")}, placement_timeout_seconds=60) as d:
        group = d["echo"]

        small = batch_of(1 << 20)
        small_shards = [s["x"].numpy() for s in small.split(WORKERS)]

        def raw_fan_out() -> object:
            return ray.get([a.echo.remote(s) for a, s in zip(raw_actors, small_shards, strict=True)])

        dispatch = interleaved(ROUNDS, controller=lambda: group.echo(small), raw_ray=raw_fan_out)

        big = batch_of(64 << 20)
        assert group.echo(big).equals(big)
        big_numpy = [s["x"].numpy() for s in big.split(WORKERS)]
        big_torch = [s["x"].clone() for s in big.split(WORKERS)]
        actors = raw_actors

        def one_way_numpy() -> object:
            return ray.get([a.consume.remote(s) for a, s in zip(actors, big_numpy, strict=True)])

        def one_way_torch_pickle() -> object:
            return ray.get(
                [a.consume_pickled.remote([pickle.dumps(s)]) for a, s in zip(actors, big_torch, strict=True)]
            )

        one_way = interleaved(
            TRANSFER_ROUNDS,
            batch=lambda: group.consume(big),
            numpy=one_way_numpy,
            torch_pickle=one_way_torch_pickle,
        )

        def round_trip_numpy() -> object:
            return ray.get([a.echo.remote(s) for a, s in zip(actors, big_numpy, strict=True)])

        def round_trip_ray_torch() -> object:
            return ray.get([a.echo.remote(s) for a, s in zip(actors, big_torch, strict=True)])

        def round_trip_torch_pickle() -> object:
            sent = [a.echo_pickled.remote([pickle.dumps(s)]) for a, s in zip(actors, big_torch, strict=True)]
            return [pickle.loads(blob) for blobs in ray.get(sent) for blob in blobs]

        round_trip = interleaved(
            TRANSFER_ROUNDS,
            batch=lambda: group.echo(big),
            numpy=round_trip_numpy,
            torch_pickle=round_trip_torch_pickle,
            ray_torch=round_trip_ray_torch,
        )
    ray.shutdown()

    one_way_rate = {name: big.nbytes / seconds / 2**20 for name, seconds in one_way.items()}
    round_trip_rate = {name: 2 * big.nbytes / seconds / 2**20 for name, seconds in round_trip.items()}
    figures = {
        "workers": WORKERS,
        "dispatch_batch_bytes": small.nbytes,
        "dispatch_controller_ms": round(dispatch["controller"] * 1e3, 3),
        "dispatch_raw_ray_ms": round(dispatch["raw_ray"] * 1e3, 3),
        "dispatch_overhead_ratio": round(dispatch["controller"] / dispatch["raw_ray"], 3),
        "transfer_batch_bytes": big.nbytes,
        "transfer_batch_mb_per_s": round(one_way_rate["batch"], 1),
        "transfer_numpy_mb_per_s": round(one_way_rate["numpy"], 1),
        "transfer_torch_pickle_mb_per_s": round(one_way_rate["torch_pickle"], 1),
        "transfer_vs_numpy_ratio": round(one_way_rate["batch"] / one_way_rate["numpy"], 3),
        "transfer_vs_torch_pickle_ratio": round(one_way_rate["batch"] / one_way_rate["torch_pickle"], 3),
        "roundtrip_mb_per_s": {name: round(rate, 1) for name, rate in round_trip_rate.items()},
        "roundtrip_vs_numpy_ratio": round(round_trip_rate["batch"] / round_trip_rate["numpy"], 3),
        "roundtrip_vs_torch_pickle_ratio": round(
            round_trip_rate["batch"] / round_trip_rate["torch_pickle"], 3
        ),
        "roundtrip_vs_ray_torch_ratio": round(round_trip_rate["batch"] / round_trip_rate["ray_torch"], 3),
        "targets": {
            "dispatch_overhead_ratio": "<= 1.5",
            "transfer_vs_numpy_ratio": ">= 0.5",
            "transfer_vs_torch_pickle_ratio": ">= 10",
        },
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
