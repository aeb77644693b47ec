"""Worker roles used by the controller's integration tests (imported by Ray workers by name)."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from hybridflow.controller import (
    BROADCAST,
    DP_SPLIT,
    DP_SPLIT_EXACT,
    PER_RANK,
    RANK_ZERO,
    Batch,
    Worker,
    register,
)
from hybridflow.controller.worker import WorkerContext


class Probe(Worker):
    """Reports where it runs and exercises the group's collectives."""

    def __init__(self, ctx: WorkerContext, offset: float = 0.0) -> None:
        super().__init__(ctx)
        self.offset = offset
        self.calls = 0

    @register(BROADCAST)
    def whoami(self) -> dict[str, object]:
        self.calls += 1
        return {
            "rank": self.ctx.rank,
            "world": self.ctx.world_size,
            "local_rank": self.ctx.local_rank,
            "pid": os.getpid(),
            "coord": self.ctx.coord,
            "backend": dist.get_backend(),
            "env_rank": os.environ["RANK"],
            "env_local_rank": os.environ["LOCAL_RANK"],
            "env_node_local_rank": os.environ["HYBRIDFLOW_NODE_LOCAL_RANK"],
            "visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "device": self.ctx.device,
            "calls": self.calls,
        }

    @register(BROADCAST)
    def all_reduce_rank(self) -> float:
        value = torch.tensor([float(self.ctx.rank)])
        dist.all_reduce(value)
        return float(value)

    @register(DP_SPLIT)
    def add_offset(self, batch: Batch) -> Batch:
        return batch.with_fields(
            y=batch["x"].float() + self.offset, dp=torch.full((len(batch),), self.ctx.coord.dp)
        )

    @register(DP_SPLIT_EXACT)
    def train_step(self, batch: Batch) -> dict[str, float]:
        return {"rows": float(len(batch))}

    @register(DP_SPLIT)
    def echo(self, batch: Batch) -> Batch:
        return batch

    @register(PER_RANK)
    def take(self, item: int) -> int:
        return item * 100 + self.ctx.rank

    @register(RANK_ZERO)
    def only_rank_zero(self) -> int:
        return self.ctx.rank

    @register(BROADCAST, blocking=False)
    def sleep_and_time(self, seconds: float) -> tuple[float, float]:
        start = time.time()
        time.sleep(seconds)
        return start, time.time()

    @register(BROADCAST)
    def fail_on_rank(self, rank: int) -> int:
        if self.ctx.rank == rank:
            raise ValueError(f"refusing on rank {rank}")
        return self.ctx.rank

    @register(BROADCAST)
    def die_on_rank(self, rank: int) -> int:
        if self.ctx.rank == rank:
            os._exit(3)
        return self.ctx.rank

    def not_exposed(self) -> None:
        """Not registered: the controller must refuse to call it."""


class BrokenConstructor(Worker):
    def __init__(self, ctx: WorkerContext) -> None:
        super().__init__(ctx)
        if ctx.rank == 1:
            raise RuntimeError("no model at /nowhere")
