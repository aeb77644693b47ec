"""Value-model roles: the critic (trained), the reward and cost models (frozen).

All run a decoder backbone with a scalar head on a :class:`~hybridflow.backends.api.TrainingBackend`.
The critic predicts a value per response token and trains with the clipped value loss, on
``spec.training.backend`` (under megatron, the mesh is :meth:`DeviceMesh.training` of the
critic's pool with the job's TP/PP sizes, deployed by :func:`hybridflow.trainer.roles.job_roles`;
colocated with the actor it shares the process's megatron parallel state, hence the same
layout). The reward and cost models score each sequence by their value at the last response
token; they and Safe-RLHF's cost critic stay on FSDP whatever the job's backend (small models,
pure data parallel over their pools).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from hybridflow.backends.api import TrainingBackend, training_backend
from hybridflow.controller import BROADCAST, DP_SPLIT, DP_SPLIT_EXACT, Batch, Worker, WorkerContext, register
from hybridflow.metrics.device import device_metrics
from hybridflow.rlmath import core
from hybridflow.rlmath.aggregation import LossNormalizer
from hybridflow.spec import RLHFJobSpec
from hybridflow.workers.mini_batches import dp_sum_over, global_normalizers, update_micro_batches
from hybridflow.workers.policy import seed_everything

__all__ = ["CostCriticWorker", "CostModelWorker", "CriticWorker", "RewardModelWorker"]


class _ValueRole(Worker):
    backend_name: ClassVar[str | None] = None
    """The backend the role runs on; None: ``spec.training.backend`` (the trained critic's)."""

    def __init__(
        self, ctx: WorkerContext, spec: RLHFJobSpec, model_path: str, *, learning_rate: float | None
    ) -> None:
        super().__init__(ctx)
        self.spec = spec
        seed_everything(spec.training.seed + 7919 + ctx.rank)
        name = self.backend_name or spec.training.backend
        self.backend: TrainingBackend = training_backend(name)(spec, ctx.torch_device)
        self.backend.load(model_path, kind="value", learning_rate=learning_rate)

    @property
    def model(self) -> nn.Module:
        """The backend's module (checks and tests read it)."""
        return self.backend.model

    def _scored(self, batch: Batch) -> torch.Tensor:
        return self.backend.values(batch.tensors)


class _SequenceScorer(_ValueRole):
    """A frozen scalar-head model that scores each sequence by its value at the last response token."""

    backend_name = "fsdp"

    def _sequence_scores(self, batch: Batch) -> torch.Tensor:
        values = self._scored(batch)
        mask = batch.tensors["response_mask"].float()
        last = (mask.sum(dim=1).long() - 1).clamp(min=0)
        return values.gather(1, last[:, None]).squeeze(1)


class RewardModelWorker(_SequenceScorer):
    def __init__(self, ctx: WorkerContext, spec: RLHFJobSpec) -> None:
        if spec.models.reward is None:
            raise ValueError("the reward role needs spec.models.reward")
        super().__init__(ctx, spec, spec.models.reward.path, learning_rate=None)

    @register(DP_SPLIT)
    def compute_scores(self, batch: Batch) -> Batch:
        return Batch({"rm_scores": self._sequence_scores(batch)})


class CostModelWorker(_SequenceScorer):
    """Safe-RLHF's cost model: higher means less safe; the constraint is ``E[cost] <= costLimit``."""

    def __init__(self, ctx: WorkerContext, spec: RLHFJobSpec) -> None:
        if spec.models.cost is None:
            raise ValueError("the cost role needs spec.models.cost")
        super().__init__(ctx, spec, spec.models.cost.path, learning_rate=None)

    @register(DP_SPLIT)
    def compute_costs(self, batch: Batch) -> Batch:
        return Batch({"cost_scores": self._sequence_scores(batch)})


class CriticWorker(_ValueRole):
    """The reward critic: a value per response token, trained towards the GAE returns."""

    metric_prefix = "critic"

    def __init__(self, ctx: WorkerContext, spec: RLHFJobSpec) -> None:
        super().__init__(
            ctx, spec, self.initial_model_path(spec), learning_rate=spec.training.critic_learning_rate
        )
        self.local_mini_batch = spec.training.mini_batch_size // ctx.mesh.dp_size

    @staticmethod
    def initial_model_path(spec: RLHFJobSpec) -> str:
        if spec.models.critic is None:
            raise ValueError("the critic role needs spec.models.critic")
        return spec.models.critic.path

    @register(DP_SPLIT)
    def compute_values(self, batch: Batch) -> Batch:
        return Batch({"values": self._scored(batch)})

    @register(DP_SPLIT_EXACT)
    def update_critic(self, batch: Batch) -> dict[str, float]:
        """Clipped value-loss updates; micro-batch losses are shares of the mini-batch's (global counts)."""
        algo = self.spec.algorithm
        prefix = self.metric_prefix
        totals: dict[str, list[float]] = {}
        minis = batch.chunk_by_size(self.local_mini_batch)
        dp_sum = dp_sum_over(self.backend.dp_group(), self.ctx.torch_device)
        normalizers = global_normalizers(minis, dp_size=self.ctx.mesh.dp_size, dp_sum=dp_sum)
        for _ in range(algo.ppo_epochs):
            for mini, normalizer in zip(minis, normalizers, strict=True):

                def loss_fn(
                    values: torch.Tensor,
                    entropy: torch.Tensor | None,
                    micro: Mapping[str, torch.Tensor],
                    normalizer: LossNormalizer = normalizer,
                ) -> tuple[torch.Tensor, dict[str, Any]]:
                    del entropy  # a value model has none
                    mask = micro["response_mask"].float()
                    loss, clipfrac = core.value_loss_clipped(
                        values,
                        micro["values"],
                        micro["returns"],
                        mask,
                        algo.value_clip,
                        aggregation=algo.loss_aggregation,
                        normalizer=normalizer,
                    )
                    local_loss, _ = core.value_loss_clipped(
                        values.detach(), micro["values"], micro["returns"], mask, algo.value_clip
                    )
                    return loss, {f"{prefix}/value_loss": local_loss, f"{prefix}/clipfrac": float(clipfrac)}

                micro_batches = update_micro_batches(self.spec, self.ctx, mini, dp_sum)
                for stats in self.backend.forward_backward(
                    [micro.tensors for micro in micro_batches],
                    loss_fn,
                    fields=("response_mask", "values", "returns"),
                ):
                    for name, value in stats.items():
                        totals.setdefault(name, []).append(value)
                norm = self.backend.clip_and_step(max_grad_norm=self.spec.training.max_grad_norm)
                totals.setdefault(f"{prefix}/grad_norm", []).append(norm)
        self.backend.step_lr_schedule()
        return {name: float(np.mean(v)) for name, v in totals.items()} | device_metrics(prefix)

    @register(BROADCAST)
    def save_checkpoint(self, directory: str) -> None:
        self.backend.save_state(Path(directory))

    @register(BROADCAST)
    def load_checkpoint(self, directory: str) -> None:
        self.backend.load_state(Path(directory))


class CostCriticWorker(CriticWorker):
    """Safe-RLHF's cost critic: values of the expected cost, with their own GAE and clipped loss.

    Starts from the cost model's weights, as Safe-RLHF initialises its cost critic (Dai et al.,
    2023, section 4); trained with the critic's learning rate. Same fields as the reward critic
    (``values``, ``returns``): the controller renames the cost ones on the way in and out.
    """

    metric_prefix = "cost_critic"
    backend_name = "fsdp"

    @staticmethod
    def initial_model_path(spec: RLHFJobSpec) -> str:
        if spec.models.cost is None:
            raise ValueError("the cost critic needs spec.models.cost (it starts from the cost model)")
        return spec.models.cost.path
