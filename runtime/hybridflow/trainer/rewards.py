"""Sequence scores for a rollout batch: weighted rule/user functions plus the reward model.

Rule and user functions run in the controller on the decoded response text (cheap, CPU only);
the reward model, when the job has one, is a worker group. A function that raises is reported
with its name and the sample it failed on, not as a bare traceback.
"""

from __future__ import annotations

import torch

from hybridflow.controller import Batch, WorkerGroup
from hybridflow.rewards import resolve_reward_function
from hybridflow.spec import RLHFJobSpec

__all__ = ["RewardFunctionError", "RewardScorer"]


class RewardFunctionError(RuntimeError):
    """A reward function raised or returned a non-number; names the function and the sample."""


class RewardScorer:
    def __init__(self, spec: RLHFJobSpec, reward_model: WorkerGroup | None) -> None:
        self.functions = [(f.function, resolve_reward_function(f.function), f.weight) for f in spec.rewards]
        self.reward_model = reward_model

    def scores(self, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        """One score per row, and the mean of each component for the metrics."""
        total = torch.zeros(len(batch), dtype=torch.float32)
        metrics: dict[str, float] = {}
        texts = batch.non_tensors["response_text"]
        for name, fn, weight in self.functions:
            values = torch.empty(len(batch), dtype=torch.float32)
            for row in range(len(batch)):
                sample = (
                    str(batch.non_tensors["data_source"][row]),
                    str(texts[row]),
                    batch.non_tensors["ground_truth"][row],
                    batch.non_tensors["extra_info"][row] or {},
                )
                try:
                    value = float(fn(*sample))
                except Exception as err:
                    uid = batch.non_tensors["uid"][row]
                    raise RewardFunctionError(
                        f"reward function {name!r} failed on sample {uid} (response {str(texts[row])[:80]!r}): "
                        f"{type(err).__name__}: {err}"
                    ) from err
                values[row] = value
            total += weight * values
            metrics[f"reward/{name}"] = float(values.mean())
        if self.reward_model is not None:
            rm = self.reward_model.compute_scores(batch)["rm_scores"].float()
            total += rm
            metrics["reward/model"] = float(rm.mean())
        return total, metrics
