"""The critic on the megatron-core backend: same methods and fields as :class:`hybridflow.workers.value.CriticWorker`.

``compute_values`` and ``update_critic`` (clipped value loss, one optimizer step per mini-batch,
LR step per call), ``save_checkpoint``/``load_checkpoint``. The mesh is
:meth:`DeviceMesh.training` of the critic's pool with the job's TP/PP sizes (deployed by
:func:`hybridflow.trainer.roles.job_roles`); every call is collective over the pool, as the
controller's protocols make it. Colocated with the actor, it shares the process's megatron
parallel state, hence the same layout. Reward and cost models stay on FSDP (frozen scorers,
pure data parallel).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from megatron.core import parallel_state

from hybridflow.backends import megatron as mb
from hybridflow.controller import BROADCAST, DP_SPLIT, DP_SPLIT_EXACT, Batch, Worker, WorkerContext, register
from hybridflow.metrics.device import device_metrics
from hybridflow.rlmath import core
from hybridflow.rlmath.aggregation import LossNormalizer
from hybridflow.spec import RLHFJobSpec
from hybridflow.workers.megatron_policy import MODEL_FIELDS, parameter_dtype
from hybridflow.workers.mini_batches import dp_sum_over, global_normalizers
from hybridflow.workers.policy import seed_everything

__all__ = ["MegatronCriticWorker"]


class MegatronCriticWorker(Worker):
    def __init__(self, ctx: WorkerContext, spec: RLHFJobSpec) -> None:
        super().__init__(ctx)
        if spec.models.critic is None:
            raise ValueError("the critic role needs spec.models.critic")
        self.spec = spec
        seed_everything(spec.training.seed + 7919 + ctx.rank)
        training = spec.training
        mb.initialize_parallel_state(
            tp_size=training.tensor_parallel_size, pp_size=training.pipeline_parallel_size, seed=training.seed
        )
        model = mb.load_value_model(
            spec.models.critic.path,
            dtype=parameter_dtype(spec, ctx),
            activation_checkpointing=training.activation_checkpointing,
        )
        self.model: Any = mb.wrap_data_parallel(model)
        self.optimizer = mb.build_optimizer(self.model, learning_rate=training.critic_learning_rate)
        self.scheduler = mb.build_lr_scheduler(
            self.optimizer,
            warmup_steps=training.warmup_steps,
            total_steps=training.total_steps,
            schedule=training.lr_schedule,
        )
        self.micro_batch_size = training.micro_batch_size_per_gpu
        self.local_mini_batch = training.mini_batch_size // ctx.mesh.dp_size

    @register(DP_SPLIT)
    def compute_values(self, batch: Batch) -> Batch:
        device = self.ctx.torch_device
        values = mb.token_values(
            self.model,
            *(batch.tensors[name].to(device) for name in MODEL_FIELDS),
            response_len=int(batch.tensors["responses"].shape[1]),
            micro_batch_size=self.micro_batch_size,
        )
        return Batch({"values": values.float().cpu()})

    @register(DP_SPLIT_EXACT)
    def update_critic(self, batch: Batch) -> dict[str, float]:
        algo = self.spec.algorithm
        device = self.ctx.torch_device
        response_len = int(batch.tensors["responses"].shape[1])
        wanted = [*MODEL_FIELDS, "response_mask", "values", "returns"]
        minis = batch.chunk_by_size(self.local_mini_batch)
        normalizers = global_normalizers(
            minis,
            dp_size=self.ctx.mesh.dp_size,
            dp_sum=dp_sum_over(parallel_state.get_data_parallel_group(), device),
        )
        self.model.train()
        totals: dict[str, list[float]] = {}
        for _ in range(algo.ppo_epochs):
            for mini, normalizer in zip(minis, normalizers, strict=True):
                micro_batches = [
                    {name: micro.tensors[name].to(device) for name in wanted}
                    for micro in mini.chunk_by_size(self.micro_batch_size)
                ]

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
                    return loss, {"critic/value_loss": local_loss, "critic/clipfrac": float(clipfrac)}

                for metrics in mb.forward_backward(
                    self.model, micro_batches, loss_fn, response_len=response_len
                ):
                    for name, value in metrics.items():
                        totals.setdefault(name, []).append(value)
                norm = mb.clip_grad_norm_and_step(
                    self.model, self.optimizer, self.scheduler, max_grad_norm=self.spec.training.max_grad_norm
                )
                totals.setdefault("critic/grad_norm", []).append(norm)
        self.model.eval()
        self.scheduler.step()
        return {name: float(np.mean(values)) for name, values in totals.items()} | device_metrics("critic")

    @register(BROADCAST)
    def save_checkpoint(self, directory: str) -> None:
        mb.save_train_state(Path(directory), self.model, self.optimizer, self.scheduler)

    @register(BROADCAST)
    def load_checkpoint(self, directory: str) -> None:
        mb.load_train_state(Path(directory), self.model, self.optimizer, self.scheduler)
