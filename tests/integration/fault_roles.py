"""Worker roles that misbehave on purpose (imported by Ray workers by name, like controller_roles)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from hybridflow.controller import BROADCAST, Worker, register


class HungCollective(Worker):
    """Rank 1 stops answering without dying; the other ranks wait for it inside an all-reduce."""

    @register(BROADCAST)
    def all_reduce_with_a_silent_peer(self) -> float:
        if self.ctx.rank == 1:
            time.sleep(3600)  # alive, silent: what a deadlocked engine or a lost NCCL peer looks like
        tensor = torch.ones(1)
        dist.all_reduce(tensor)
        return float(tensor)

    @register(BROADCAST)
    def answer(self) -> int:
        return self.ctx.rank
