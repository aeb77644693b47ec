"""Value-model roles on the FSDP2 backend: the critic (trained), the reward and cost models (frozen).

All run a decoder backbone with a scalar head. The critic predicts a value per response token
and trains with the clipped value loss; the reward and cost models score each sequence by their
value at the last response token.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from hybridflow.backends.fsdp import (
    attention_implementation,
    build_lr_scheduler,
    build_optimizer,
    clip_grad_norm_and_step,
    load_train_state,
    load_value_model,
    packed_token_values,
    save_train_state,
    shard_model,
    token_values,
)
from hybridflow.controller import BROADCAST, DP_SPLIT, DP_SPLIT_EXACT, Batch, Worker, WorkerContext, register
from hybridflow.metrics.device import device_metrics
from hybridflow.rlmath import core
from hybridflow.spec import RLHFJobSpec
from hybridflow.workers.mini_batches import dp_sum_over, global_normalizers, update_micro_batches
from hybridflow.workers.policy import seed_everything

__all__ = ["CostCriticWorker", "CostModelWorker", "CriticWorker", "RewardModelWorker"]


class _ValueRole(Worker):
    trained = False
    """Whether the role trains (the critics): only those get activation checkpointing."""

    def __init__(self, ctx: WorkerContext, spec: RLHFJobSpec, model_path: str) -> None:
        super().__init__(ctx)
        self.spec = spec
        seed_everything(spec.training.seed + 7919 + ctx.rank)
        mixed = spec.training.precision == "bf16" and ctx.torch_device.type == "cuda"
        self.packed = spec.training.pack_sequences
        attention = attention_implementation(ctx.torch_device, packed=self.packed, bf16=mixed)
        self.model = shard_model(
            load_value_model(model_path, attn_implementation=attention),
            device=ctx.torch_device,
            mixed_precision=mixed,
            activation_checkpointing=self.trained and spec.training.activation_checkpointing,
        )
        self.micro_batch_size = spec.training.micro_batch_size_per_gpu

    def _values(self, batch: Batch) -> torch.Tensor:
        device = self.ctx.torch_device
        if self.packed:  # spec.training.packSequences
            return packed_token_values(
                self.model,
                batch.tensors["input_ids"].to(device),
                batch.tensors["attention_mask"].to(device),
                response_len=int(batch.tensors["responses"].shape[1]),
            )
        return token_values(
            self.model,
            batch.tensors["input_ids"].to(device),
            batch.tensors["attention_mask"].to(device),
            batch.tensors["position_ids"].to(device),
            response_len=int(batch.tensors["responses"].shape[1]),
        )

    def _scored(self, batch: Batch) -> torch.Tensor:
        self.model.eval()
        with torch.no_grad():
            return torch.cat(
                [self._values(m).float().cpu() for m in batch.chunk_by_size(self.micro_batch_size)]
            )


class _SequenceScorer(_ValueRole):
    """A frozen scalar-head model that scores each sequence by its value at the last response token."""

    def _sequence_scores(self, batch: Batch) -> torch.Tensor:
        values = self._scored(batch)
        mask = batch.tensors["response_mask"].float()
        last = (mask.sum(dim=1).long() - 1).clamp(min=0)
        return values.gather(1, last[:, None]).squeeze(1)


class RewardModelWorker(_SequenceScorer):
    def __init__(self, ctx: WorkerContext, spec: RLHFJobSpec) -> None:
        if spec.models.reward is None:
            raise ValueError("the reward role needs spec.models.reward")
        super().__init__(ctx, spec, spec.models.reward.path)
        self.model.requires_grad_(False)

    @register(DP_SPLIT)
    def compute_scores(self, batch: Batch) -> Batch:
        return Batch({"rm_scores": self._sequence_scores(batch)})


class CostModelWorker(_SequenceScorer):
    """Safe-RLHF's cost model: higher means less safe; the constraint is ``E[cost] <= costLimit``."""

    def __init__(self, ctx: WorkerContext, spec: RLHFJobSpec) -> None:
        if spec.models.cost is None:
            raise ValueError("the cost role needs spec.models.cost")
        super().__init__(ctx, spec, spec.models.cost.path)
        self.model.requires_grad_(False)

    @register(DP_SPLIT)
    def compute_costs(self, batch: Batch) -> Batch:
        return Batch({"cost_scores": self._sequence_scores(batch)})


class CriticWorker(_ValueRole):
    """The reward critic: a value per response token, trained towards the GAE returns."""

    metric_prefix = "critic"
    trained = True

    def __init__(self, ctx: WorkerContext, spec: RLHFJobSpec) -> None:
        super().__init__(ctx, spec, self.initial_model_path(spec))
        training = spec.training
        self.optimizer = build_optimizer(self.model, learning_rate=training.critic_learning_rate)
        self.scheduler = build_lr_scheduler(
            self.optimizer,
            warmup_steps=training.warmup_steps,
            total_steps=training.total_steps,
            schedule=training.lr_schedule,
        )
        self.local_mini_batch = training.mini_batch_size // ctx.mesh.dp_size

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
        device = self.ctx.torch_device
        self.model.train()
        totals: dict[str, list[float]] = {}
        minis = batch.chunk_by_size(self.local_mini_batch)
        dp_sum = dp_sum_over(None, device)
        normalizers = global_normalizers(minis, dp_size=self.ctx.mesh.dp_size, dp_sum=dp_sum)
        for _ in range(algo.ppo_epochs):
            for mini, normalizer in zip(minis, normalizers, strict=True):
                self.optimizer.zero_grad(set_to_none=True)
                for micro in update_micro_batches(self.spec, self.ctx, mini, dp_sum):
                    values = self._values(micro)
                    old_values = micro.tensors["values"].to(device)
                    returns = micro.tensors["returns"].to(device)
                    mask = micro.tensors["response_mask"].to(device).float()
                    loss, clipfrac = core.value_loss_clipped(
                        values,
                        old_values,
                        returns,
                        mask,
                        algo.value_clip,
                        aggregation=algo.loss_aggregation,
                        normalizer=normalizer,
                    )
                    loss.backward()
                    local_loss, _ = core.value_loss_clipped(
                        values.detach(), old_values, returns, mask, algo.value_clip
                    )
                    totals.setdefault(f"{self.metric_prefix}/value_loss", []).append(float(local_loss))
                    totals.setdefault(f"{self.metric_prefix}/clipfrac", []).append(float(clipfrac))
                norm = clip_grad_norm_and_step(
                    self.model, self.optimizer, self.scheduler, max_grad_norm=self.spec.training.max_grad_norm
                )
                totals.setdefault(f"{self.metric_prefix}/grad_norm", []).append(norm)
        self.scheduler.step()
        return {name: float(np.mean(v)) for name, v in totals.items()} | device_metrics(self.metric_prefix)

    @register(BROADCAST)
    def save_checkpoint(self, directory: str) -> None:
        save_train_state(Path(directory), self.model, self.optimizer, self.scheduler)

    @register(BROADCAST)
    def load_checkpoint(self, directory: str) -> None:
        load_train_state(Path(directory), self.model, self.optimizer, self.scheduler)


class CostCriticWorker(CriticWorker):
    """Safe-RLHF's cost critic: values of the expected cost, with their own GAE and clipped loss.

    Starts from the cost model's weights, as Safe-RLHF initialises its cost critic (Dai et al.,
    2023, section 4); trained with the critic's learning rate. Same fields as the reward critic
    (``values``, ``returns``): the controller renames the cost ones on the way in and out.
    """

    metric_prefix = "cost_critic"

    @staticmethod
    def initial_model_path(spec: RLHFJobSpec) -> str:
        if spec.models.cost is None:
            raise ValueError("the cost critic needs spec.models.cost (it starts from the cost model)")
        return spec.models.cost.path
