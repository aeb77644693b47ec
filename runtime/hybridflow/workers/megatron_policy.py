"""Policy roles on the megatron-core backend: the trained actor and the frozen reference.

Same registered methods, batch fields and metrics as :mod:`hybridflow.workers.policy` (the FSDP
roles), so an algorithm does not know which backend runs: ``compute_log_probs``,
``update_policy``, ``save_checkpoint``/``load_checkpoint`` on the actor and
``compute_ref_log_probs`` on the reference. What differs is the layout: the role's mesh is
:meth:`DeviceMesh.training` with ``spec.training.pipelineParallelSize`` and
``tensorParallelSize`` (deployed by :func:`hybridflow.trainer.roles.job_roles`), so ``DP_SPLIT``
gives every rank of one DP group (its TP and PP ranks) the same rows and collects from TP rank 0
of the last stage, where megatron's results are complete.

Protocol, on every rank of the pool: the constructor initialises megatron's parallel state
(collective; roles colocated in one process share it, so they must use one layout) and loads
this rank's stage and slices. Scoring and training calls are collective over the model-parallel
and data-parallel groups; the controller's protocols call every rank, as they must.

The actor also serves the colocated rollout role (not the controller):
:meth:`MegatronActorWorker.training_shard` hands this rank's HF slices to the 3D-HybridEngine
(:mod:`hybridflow.workers.hybrid_rollout`) as a resharding ``TrainingShard``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from megatron.core import parallel_state

from hybridflow.backends import megatron as mb
from hybridflow.backends.offload import DeviceOffload, OffloadStats
from hybridflow.controller import BROADCAST, DP_SPLIT, DP_SPLIT_EXACT, Batch, Worker, WorkerContext, register
from hybridflow.metrics.device import device_metrics
from hybridflow.resharding.layout import Block
from hybridflow.resharding.transfer import TrainingShard
from hybridflow.rlmath.aggregation import LossNormalizer
from hybridflow.rlmath.objectives import actor_objective
from hybridflow.spec import RLHFJobSpec
from hybridflow.workers.mini_batches import (
    dp_sum_over,
    global_normalizers,
    importance_weight_cap,
    kl_exceeded,
    local_mini_batches,
)
from hybridflow.workers.policy import seed_everything
from hybridflow.workers.weight_push import WEIGHT_BUCKET_BYTES, engine_dtype, send_pushed_weights

__all__ = ["MODEL_FIELDS", "MegatronActorWorker", "MegatronReferenceWorker", "parameter_dtype"]

MODEL_FIELDS = ("input_ids", "attention_mask", "position_ids")


def parameter_dtype(spec: RLHFJobSpec, ctx: WorkerContext) -> torch.dtype:
    """bf16 parameters (megatron keeps fp32 main weights in the optimizer) on CUDA; fp32 on CPU."""
    return (
        torch.bfloat16
        if spec.training.precision == "bf16" and ctx.torch_device.type == "cuda"
        else torch.float32
    )


class _MegatronPolicyModel(Worker):
    """This rank's GPTModel stage of a causal LM, scoring response tokens; shared by actor and reference."""

    def __init__(self, ctx: WorkerContext, spec: RLHFJobSpec, model_path: str, *, trained: bool) -> None:
        super().__init__(ctx)
        self.spec = spec
        seed_everything(spec.training.seed + ctx.rank)
        training = spec.training
        self.layout = mb.initialize_parallel_state(
            tp_size=training.tensor_parallel_size, pp_size=training.pipeline_parallel_size, seed=training.seed
        )
        self.model: Any = mb.load_causal_lm(
            model_path,
            dtype=parameter_dtype(spec, ctx),
            activation_checkpointing=trained and training.activation_checkpointing,
        )
        self.micro_batch_size = training.micro_batch_size_per_gpu
        self.temperature = spec.rollout.temperature if spec.rollout.temperature > 0 else 1.0

    def _score(self, batch: Batch, field: str) -> Batch:
        device = self.ctx.torch_device
        tensors = [batch.tensors[name].to(device) for name in MODEL_FIELDS]
        log_probs, _ = mb.token_logprobs_and_entropy(
            self.model,
            *tensors,
            response_len=int(batch.tensors["responses"].shape[1]),
            temperature=self.temperature,
            with_entropy=False,
            micro_batch_size=self.micro_batch_size,
        )
        return Batch({field: log_probs.float().cpu()})


class MegatronReferenceWorker(_MegatronPolicyModel):
    """The frozen initial policy, for the KL term."""

    def __init__(self, ctx: WorkerContext, spec: RLHFJobSpec) -> None:
        super().__init__(ctx, spec, spec.models.reference_or_actor.path, trained=False)
        self.model.requires_grad_(False)

    @register(DP_SPLIT)
    def compute_ref_log_probs(self, batch: Batch) -> Batch:
        return self._score(batch, "ref_log_probs")


class MegatronActorWorker(_MegatronPolicyModel):
    """The trained policy: megatron DDP over the DP group, AdamW, the job's LR schedule."""

    def __init__(self, ctx: WorkerContext, spec: RLHFJobSpec) -> None:
        super().__init__(ctx, spec, spec.models.actor.path, trained=True)
        training = spec.training
        self.model = mb.wrap_data_parallel(self.model)
        self.optimizer = mb.build_optimizer(self.model, learning_rate=training.learning_rate)
        self.scheduler = mb.build_lr_scheduler(
            self.optimizer,
            warmup_steps=training.warmup_steps,
            total_steps=training.total_steps,
            schedule=training.lr_schedule,
        )
        self.local_mini_batch = training.mini_batch_size // ctx.mesh.dp_size
        self.offload = DeviceOffload("the actor's training state")

    def offload_for_generation(self) -> OffloadStats | None:
        """As :meth:`hybridflow.workers.policy.ActorWorker.offload_for_generation`.

        Under the 3D-HybridEngine the rollout calls it after packing this rank's training shard
        (a copy) and resharding it, so generation never reads the offloaded parameters.
        """
        choice = self.spec.training.offload_during_generation
        parameters, optimizer_state = mb.offload_tensors(self.model, self.optimizer)
        tensors = (parameters if choice.parameters else []) + (
            optimizer_state if choice.optimizer_state else []
        )
        return self.offload.offload(tensors) if tensors else None

    def reload_after_generation(self) -> OffloadStats | None:
        return self.offload.reload() if self.offload.is_offloaded else None

    @register(DP_SPLIT)
    def compute_log_probs(self, batch: Batch) -> Batch:
        """Log-probs of the responses under the current policy (the PPO "old" log-probs)."""
        return self._score(batch, "old_log_probs")

    @register(DP_SPLIT_EXACT)
    def update_policy(self, batch: Batch) -> dict[str, float]:
        """PPO-clip updates, as the FSDP actor's: one optimizer step per mini-batch, LR step per call.

        Same contract as :meth:`hybridflow.workers.policy.ActorWorker.update_policy`: global
        loss counts over micro-batches and DP ranks, on-policy without ``old_log_probs``, early
        stop at ``algorithm.targetKl``.
        """
        algo = self.spec.algorithm
        use_kl_loss = algo.kl.mode == "loss" and "ref_log_probs" in batch.tensors
        on_policy = "old_log_probs" not in batch.tensors
        device = self.ctx.torch_device
        response_len = int(batch.tensors["responses"].shape[1])
        wanted = [*MODEL_FIELDS, "response_mask", "advantages"]
        if not on_policy:
            wanted.append("old_log_probs")
        if use_kl_loss:
            wanted.append("ref_log_probs")
        max_weight = importance_weight_cap(self.spec)
        with_behaviour = "rollout_log_probs" in batch.tensors
        if with_behaviour:
            wanted.append("rollout_log_probs")
        dp_size = self.ctx.mesh.dp_size
        dp_sum = dp_sum_over(parallel_state.get_data_parallel_group(), device)
        minis = local_mini_batches(batch, self.local_mini_batch, on_policy=on_policy, epochs=algo.ppo_epochs)
        normalizers = global_normalizers(minis, dp_size=dp_size, dp_sum=dp_sum)
        self.model.train()
        totals: dict[str, list[float]] = {}
        for _ in range(algo.ppo_epochs):
            epoch_k3: list[float] = []
            for mini, normalizer in zip(minis, normalizers, strict=True):
                micro_batches = [
                    {name: micro.tensors[name].to(device) for name in wanted}
                    for micro in mini.chunk_by_size(self.micro_batch_size)
                ]

                def loss_fn(
                    log_probs: torch.Tensor,
                    entropy: torch.Tensor | None,
                    micro: Mapping[str, torch.Tensor],
                    normalizer: LossNormalizer = normalizer,
                ) -> tuple[torch.Tensor, dict[str, Any]]:
                    return actor_objective(
                        algo,
                        log_probs,
                        entropy,
                        old_log_probs=log_probs.detach() if on_policy else micro["old_log_probs"],
                        advantages=micro["advantages"],
                        response_mask=micro["response_mask"],
                        ref_log_probs=micro["ref_log_probs"] if use_kl_loss else None,
                        normalizer=normalizer,
                        behaviour_log_probs=micro["rollout_log_probs"] if with_behaviour else None,
                        max_importance_weight=max_weight,
                    )

                for metrics in mb.forward_backward(
                    self.model,
                    micro_batches,
                    loss_fn,
                    response_len=response_len,
                    temperature=self.temperature,
                ):
                    for name, value in metrics.items():
                        totals.setdefault(name, []).append(value)
                    epoch_k3.append(metrics["actor/approx_kl_k3"])
                grad_norm = mb.clip_grad_norm_and_step(
                    self.model, self.optimizer, self.scheduler, max_grad_norm=self.spec.training.max_grad_norm
                )
                totals.setdefault("actor/grad_norm", []).append(grad_norm)
            totals.setdefault("actor/epochs", [0.0])[0] += 1
            if kl_exceeded(algo.target_kl, epoch_k3, dp_size=dp_size, dp_sum=dp_sum):
                break
        self.model.eval()
        result = {name: float(np.mean(values)) for name, values in totals.items()}
        result["actor/lr"] = float(self.scheduler.get_last_lr()[0])
        result.update(device_metrics("actor"))
        self.scheduler.step()
        return result

    def training_shard(self, blocks: Sequence[Block]) -> TrainingShard:
        """This rank's slices as the resharding plan's training shard (``RankPlan.training``).

        Local, no communication. Called by the colocated rollout before each transition. The
        slices are packed into the shard's two flat buffers: one copy of ``M/(p*t)`` bytes per
        step, since megatron's parameters are stored fused (``linear_qkv``, ``linear_fc1``) and
        in its own order, not as the plan's back-to-back HF blocks. The copy is the rollout's to
        free after generation (it never aliases the parameters the optimizer updates).
        """
        pieces = {name: shard.tensor for name, shard in mb.local_shards(self.model).items()}
        return TrainingShard.pack(blocks, pieces)

    def training_shard_copy_bytes(self, shard: TrainingShard) -> int:
        """Bytes of ``shard`` whose storage is not one of the model's parameter storages.

        Measured from the tensors: a shard made of views of the live parameters would count 0;
        today's packed copy (see :meth:`training_shard`) counts whole, as redundant memory.
        """
        live = {param.untyped_storage().data_ptr() for param in self.model.parameters()}
        return sum(
            shard.buffer(kind).nbytes
            for kind in ("partitioned", "replicated")
            if shard.buffer(kind).numel() and shard.buffer(kind).untyped_storage().data_ptr() not in live
        )

    def weight_buckets(
        self, bucket_bytes: int, *, dtype: torch.dtype | None = None, meter: object | None = None
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full weights by HF name, a bucket at a time, for the plain rollout role (``t*p == 1``).

        Collective: every rank iterates in lockstep, as with the FSDP actor.
        """
        # ``meter`` is accepted for the rollout's one call shape: with t*p == 1 every rank holds
        # the whole model (DDP), so the gather communicates nothing and there is nothing to count.
        return mb.iter_full_weight_buckets(self.model, bucket_bytes=bucket_bytes, dtype=dtype)

    @property
    def policy_version(self) -> int:
        """Updates made so far (``update_policy`` steps the LR schedule once each; checkpoints keep it)."""
        return int(self.scheduler.last_epoch)

    @register(BROADCAST)
    def push_weights(self) -> dict[str, float]:
        """Send the current weights to the rollout's pool over the ``weights`` bridge (``t*p == 1``).

        As the FSDP actor's (``workers/weight_push.py``); the spec allows a rollout on its own
        pool only with ``t*p == 1``, where every rank holds the whole model.
        """
        buckets = self.weight_buckets(WEIGHT_BUCKET_BYTES, dtype=engine_dtype(self.spec, self.ctx))
        return send_pushed_weights(self.ctx, buckets)

    def local_parameter_bytes(self) -> int:
        """Bytes of this rank's own parameters (the whole model under DDP with ``t*p == 1``)."""
        storages = {
            param.untyped_storage().data_ptr(): param.untyped_storage().nbytes()
            for param in self.model.parameters()
        }
        return sum(
            storages.values()
        )  # megatron's DDP keeps parameters as views of flat buffers: each counts once

    @register(BROADCAST)
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The actor's current full HF weights, from every rank (collective).

        For checks and export, not the training loop: every rank assembles and returns the whole model.
        """
        return {name: tensor.detach().cpu() for name, tensor in mb.full_state_dict(self.model).items()}

    @register(BROADCAST)
    def save_checkpoint(self, directory: str) -> None:
        mb.save_train_state(Path(directory), self.model, self.optimizer, self.scheduler)

    @register(BROADCAST)
    def load_checkpoint(self, directory: str) -> None:
        mb.load_train_state(Path(directory), self.model, self.optimizer, self.scheduler)
