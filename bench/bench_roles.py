"""Worker classes for bench/controller.py (imported by name in the Ray workers)."""

from __future__ import annotations

import pickle
from typing import Any

import ray

from hybridflow.controller import DP_SPLIT, Batch, Worker, register


class EchoWorker(Worker):
    @register(DP_SPLIT)
    def echo(self, batch: Batch) -> Batch:
        return batch

    @register(DP_SPLIT)
    def consume(self, batch: Batch) -> int:
        return len(batch)


@ray.remote
class RawEcho:
    def echo(self, payload: Any) -> Any:
        return payload

    def consume(self, payload: Any) -> int:
        return len(payload)

    def consume_pickled(self, pickled_tensors: list[bytes]) -> int:
        return sum(len(pickle.loads(blob)) for blob in pickled_tensors)

    def echo_pickled(self, pickled_tensors: list[bytes]) -> list[bytes]:
        """The naive container: every tensor pickled on its own, on both sides of each hop."""
        tensors = [pickle.loads(blob) for blob in pickled_tensors]
        return [pickle.dumps(t) for t in tensors]
