"""Policy roles on the FSDP2 backend: the trained actor and the frozen reference.

Both receive rollout batches laid out by :func:`hybridflow.engines.layout.response_tensors`
(``input_ids``, ``attention_mask``, ``position_ids``, ``responses``, ``response_mask``) split by
DP rank, and both compute per-token log-probs of the response tokens. The actor also trains:
``update_policy`` runs ``ppo_epochs`` passes over the batch in mini-batches (one optimizer step
each) made of micro-batches (gradient accumulation), then steps the LR schedule once per RL step.

The actor exposes :meth:`ActorWorker.weight_buckets` to the colocated rollout role (not to the
controller): a collective iteration over the full weights, bucket by bucket. To a rollout on a
pool of its own it pushes the same buckets with ``push_weights`` (``workers/weight_push.py``).
Its ``policy_version`` is the number of updates it has made (the LR schedule's step count, so
a checkpoint restores it): what the rollout stamps on every sample.

With ``rollout_log_probs`` in the batch the update reports the rollout-vs-trainer gap, and with
``spec.rollout.importanceSampling`` on it weights each token's loss by the truncated ratio of
the trainer's log-prob before the update (the proximal policy: ``old_log_probs``, or on-policy
the update's own first forward, the same weights) to the rollout's (the behaviour policy).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from hybridflow.backends.fsdp import (
    attention_implementation,
    build_lr_scheduler,
    build_optimizer,
    clip_grad_norm_and_step,
    iter_full_weight_buckets,
    load_causal_lm,
    load_train_state,
    offload_tensors,
    packed_token_logprobs_and_entropy,
    save_train_state,
    shard_model,
    token_logprobs_and_entropy,
)
from hybridflow.backends.offload import DeviceOffload, OffloadStats
from hybridflow.controller import BROADCAST, DP_SPLIT, DP_SPLIT_EXACT, Batch, Worker, WorkerContext, register
from hybridflow.metrics.device import device_metrics
from hybridflow.resharding.meter import TrafficMeter
from hybridflow.rlmath.objectives import actor_objective
from hybridflow.spec import RLHFJobSpec
from hybridflow.workers.mini_batches import (
    dp_sum_over,
    global_normalizers,
    importance_weight_cap,
    kl_exceeded,
    local_mini_batches,
    update_micro_batches,
)
from hybridflow.workers.weight_push import WEIGHT_BUCKET_BYTES, engine_dtype, send_pushed_weights

__all__ = ["ActorWorker", "ReferenceWorker", "seed_everything"]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def _model_dtype(spec: RLHFJobSpec, ctx: WorkerContext) -> tuple[torch.dtype, bool]:
    """(parameter dtype, FSDP mixed precision). bf16 compute only on CUDA; CPU runs fp32."""
    mixed = spec.training.precision == "bf16" and ctx.torch_device.type == "cuda"
    return torch.float32, mixed


def _model_inputs(batch: Batch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    return (
        batch.tensors["input_ids"].to(device),
        batch.tensors["attention_mask"].to(device),
        batch.tensors["position_ids"].to(device),
        int(batch.tensors["responses"].shape[1]),
    )


class _PolicyModel(Worker):
    """A sharded causal LM that scores response tokens; shared by actor and reference."""

    def __init__(self, ctx: WorkerContext, spec: RLHFJobSpec, model_path: str, *, trained: bool) -> None:
        super().__init__(ctx)
        self.spec = spec
        seed_everything(spec.training.seed + ctx.rank)
        dtype, mixed = _model_dtype(spec, ctx)
        self.packed = spec.training.pack_sequences
        attention = attention_implementation(ctx.torch_device, packed=self.packed, bf16=mixed)
        self.model = shard_model(
            load_causal_lm(model_path, dtype=dtype, attn_implementation=attention),
            device=ctx.torch_device,
            mixed_precision=mixed,
            activation_checkpointing=trained and spec.training.activation_checkpointing,
        )
        self.micro_batch_size = spec.training.micro_batch_size_per_gpu
        self.temperature = spec.rollout.temperature if spec.rollout.temperature > 0 else 1.0

    def _log_probs(self, batch: Batch, *, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        input_ids, attention_mask, position_ids, response_len = _model_inputs(batch, self.ctx.torch_device)
        if self.packed:  # spec.training.packSequences: one row of real tokens per micro-batch
            return packed_token_logprobs_and_entropy(
                self.model,
                input_ids,
                attention_mask,
                response_len=response_len,
                temperature=self.temperature,
                with_entropy=with_entropy,
            )
        return token_logprobs_and_entropy(
            self.model,
            input_ids,
            attention_mask,
            position_ids,
            response_len=response_len,
            temperature=self.temperature,
            with_entropy=with_entropy,
        )

    def _score(self, batch: Batch, field: str) -> Batch:
        self.model.eval()
        pieces = []
        with torch.no_grad():
            for micro in batch.chunk_by_size(self.micro_batch_size):
                log_probs, _ = self._log_probs(micro, with_entropy=False)
                pieces.append(log_probs.float().cpu())
        return Batch({field: torch.cat(pieces)})


class ReferenceWorker(_PolicyModel):
    """The frozen initial policy, for the KL term."""

    def __init__(self, ctx: WorkerContext, spec: RLHFJobSpec) -> None:
        super().__init__(ctx, spec, spec.models.reference_or_actor.path, trained=False)
        self.model.requires_grad_(False)

    @register(DP_SPLIT)
    def compute_ref_log_probs(self, batch: Batch) -> Batch:
        return self._score(batch, "ref_log_probs")


class ActorWorker(_PolicyModel):
    """The trained policy."""

    def __init__(self, ctx: WorkerContext, spec: RLHFJobSpec) -> None:
        super().__init__(ctx, spec, spec.models.actor.path, trained=True)
        training = spec.training
        self.optimizer = build_optimizer(self.model, learning_rate=training.learning_rate)
        self.scheduler = build_lr_scheduler(
            self.optimizer,
            warmup_steps=training.warmup_steps,
            total_steps=training.total_steps,
            schedule=training.lr_schedule,
        )
        self.local_mini_batch = training.mini_batch_size // ctx.mesh.dp_size
        self.offload = DeviceOffload("the actor's training state")

    def offload_for_generation(self) -> OffloadStats | None:
        """Move what ``spec.training.offloadDuringGeneration`` names to host memory (None: nothing).

        Called by the colocated rollout after the weight sync, before generating; the actor
        computes nothing until :meth:`reload_after_generation` (:mod:`hybridflow.backends.offload`).
        """
        choice = self.spec.training.offload_during_generation
        parameters, optimizer_state = offload_tensors(self.model, self.optimizer)
        tensors = (parameters if choice.parameters else []) + (
            optimizer_state if choice.optimizer_state else []
        )
        return self.offload.offload(tensors) if tensors else None

    def reload_after_generation(self) -> OffloadStats | None:
        """Bring back what :meth:`offload_for_generation` moved (None when it moved nothing)."""
        return self.offload.reload() if self.offload.is_offloaded else None

    @register(DP_SPLIT)
    def compute_log_probs(self, batch: Batch) -> Batch:
        """Log-probs of the responses under the current policy (the PPO "old" log-probs)."""
        return self._score(batch, "old_log_probs")

    @register(DP_SPLIT_EXACT)
    def update_policy(self, batch: Batch) -> dict[str, float]:
        """PPO-clip updates over ``batch`` (needs advantages; ref_log_probs for the KL loss).

        Without ``old_log_probs`` (on-policy: one mini-batch, one epoch; see
        :mod:`hybridflow.workers.mini_batches`) the detached log-probs of the update's own
        forward are the old ones. Each micro-batch's loss is its share of the mini-batch's
        (global counts over micro-batches and DP ranks), so the split never changes the result.
        """
        algo = self.spec.algorithm
        use_kl_loss = algo.kl.mode == "loss" and "ref_log_probs" in batch.tensors
        on_policy = "old_log_probs" not in batch.tensors
        max_weight = importance_weight_cap(self.spec)
        self.model.train()
        totals: dict[str, list[float]] = {}
        device = self.ctx.torch_device
        dp_size = self.ctx.mesh.dp_size
        dp_sum = dp_sum_over(None, device)
        minis = local_mini_batches(batch, self.local_mini_batch, on_policy=on_policy, epochs=algo.ppo_epochs)
        normalizers = global_normalizers(minis, dp_size=dp_size, dp_sum=dp_sum)
        for _ in range(algo.ppo_epochs):
            epoch_k3: list[float] = []
            for mini, normalizer in zip(minis, normalizers, strict=True):
                self.optimizer.zero_grad(set_to_none=True)
                for micro in update_micro_batches(self.spec, self.ctx, mini, dp_sum):
                    log_probs, entropy = self._log_probs(micro, with_entropy=True)
                    old_log_probs = (
                        log_probs.detach() if on_policy else micro.tensors["old_log_probs"].to(device)
                    )
                    loss, stats = actor_objective(
                        algo,
                        log_probs,
                        entropy,
                        old_log_probs=old_log_probs,
                        advantages=micro.tensors["advantages"].to(device),
                        response_mask=micro.tensors["response_mask"].to(device),
                        ref_log_probs=micro.tensors["ref_log_probs"].to(device) if use_kl_loss else None,
                        normalizer=normalizer,
                        behaviour_log_probs=(
                            micro.tensors["rollout_log_probs"].to(device)
                            if "rollout_log_probs" in micro.tensors
                            else None
                        ),
                        max_importance_weight=max_weight,
                    )
                    loss.backward()
                    for name, value in stats.items():
                        totals.setdefault(name, []).append(float(value))
                    epoch_k3.append(float(stats["actor/approx_kl_k3"]))
                grad_norm = clip_grad_norm_and_step(
                    self.model, self.optimizer, self.scheduler, max_grad_norm=self.spec.training.max_grad_norm
                )
                totals.setdefault("actor/grad_norm", []).append(grad_norm)
            totals.setdefault("actor/epochs", [0.0])[0] += 1
            if kl_exceeded(algo.target_kl, epoch_k3, dp_size=dp_size, dp_sum=dp_sum):
                break
        metrics = {name: float(np.mean(values)) for name, values in totals.items()}
        metrics["actor/lr"] = float(self.scheduler.get_last_lr()[0])
        metrics.update(device_metrics("actor"))
        self.scheduler.step()
        return metrics

    def weight_buckets(
        self, bucket_bytes: int, *, dtype: torch.dtype | None = None, meter: TrafficMeter | None = None
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full weights by HF name, a bucket at a time, in ``dtype`` (the engine's; cast before gathering).

        Collective: every rank iterates in lockstep. ``meter`` counts the gathers' bytes.
        """
        return iter_full_weight_buckets(self.model, bucket_bytes=bucket_bytes, dtype=dtype, meter=meter)

    @property
    def policy_version(self) -> int:
        """Updates made so far (``update_policy`` steps the LR schedule once each; checkpoints keep it)."""
        return int(self.scheduler.last_epoch)

    @register(BROADCAST)
    def push_weights(self) -> dict[str, float]:
        """Send the current weights to the rollout's pool over the ``weights`` bridge (collective).

        The rollout's ``receive_weights`` must be submitted with it (``workers/weight_push.py``).
        """
        buckets = self.weight_buckets(WEIGHT_BUCKET_BYTES, dtype=engine_dtype(self.spec, self.ctx))
        return send_pushed_weights(self.ctx, buckets)

    def local_parameter_bytes(self) -> int:
        """Bytes of this rank's own parameter shards (what it keeps aside while an engine holds a full copy)."""
        storages = {}
        for param in self.model.parameters():
            storage = (param.to_local() if isinstance(param, DTensor) else param).untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()  # a storage shared by views counts once
        return sum(storages.values())

    @register(BROADCAST)
    def save_checkpoint(self, directory: str) -> None:
        save_train_state(Path(directory), self.model, self.optimizer, self.scheduler)

    @register(BROADCAST)
    def load_checkpoint(self, directory: str) -> None:
        load_train_state(Path(directory), self.model, self.optimizer, self.scheduler)
