"""Policy roles on any training backend: the trained actor and the frozen reference.

Both receive rollout batches laid out by :func:`hybridflow.engines.layout.response_tensors`
(``input_ids``, ``attention_mask``, ``position_ids``, ``responses``, ``response_mask``) split by
DP rank, and both compute per-token log-probs of the response tokens. The actor also trains:
``update_policy`` runs ``ppo_epochs`` passes over the batch in mini-batches (one optimizer step
each) made of micro-batches (gradient accumulation), then steps the LR schedule once per RL step.
The model itself lives in a :class:`~hybridflow.backends.api.TrainingBackend` named by
``spec.training.backend``: FSDP2 over a data-parallel mesh, or megatron-core over
:meth:`DeviceMesh.training` with the job's TP/PP sizes (deployed by
:func:`hybridflow.trainer.roles.job_roles`), where ``DP_SPLIT`` gives every rank of one DP
group (its TP and PP ranks) the same rows and collects from TP rank 0 of the last stage. FSDP
with ``spec.training.sequenceParallelSize`` ``P > 1`` is deployed the same way with
``tp = P``: the ``P`` ranks of a Ulysses group get the same rows and split their columns.

Protocol, on every rank of the pool: the constructor loads this rank's shard (collective:
FSDP shards, megatron initialises its parallel state, which roles colocated in one process
share, so they must use one layout). Scoring and training calls are collective over the
backend's groups; the controller's protocols call every rank, as they must.

The actor serves the colocated rollout role (not the controller): :meth:`ActorWorker.weight_buckets`
is a collective iteration over the full weights, bucket by bucket; under megatron with
``t*p > 1``, :meth:`ActorWorker.training_shard` hands this rank's HF slices to the
3D-HybridEngine (:mod:`hybridflow.workers.hybrid_rollout`). To a rollout on a pool of its own it
pushes the buckets with ``push_weights`` (``workers/weight_push.py``). Its ``policy_version`` is
the number of updates it has made (the LR schedule's step count, so a checkpoint restores it):
what the rollout stamps on every sample.

Every rollout returns its engine's log-probs (``rollout_log_probs``); the update reports the
rollout-vs-trainer gap from them every step (``off_policy/*``, when the two are at the same
temperature), and with ``spec.rollout.importanceSampling`` on (by default: stale samples, or an
engine computing in another dtype than the trainer) it weights or masks each token's loss by the
ratio of the trainer's log-prob before the update (the proximal policy: ``old_log_probs``, or
on-policy the update's own first forward, the same weights) to the rollout's (the behaviour
policy): :mod:`hybridflow.rlmath.rollout_correction`. Without a correction the loss is bit for
bit what it would be without the rollout's log-probs.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from hybridflow.backends.api import TrainingBackend, training_backend
from hybridflow.backends.offload import DeviceOffload, OffloadStats
from hybridflow.controller import BROADCAST, DP_SPLIT, DP_SPLIT_EXACT, Batch, Worker, WorkerContext, register
from hybridflow.export.publish import ExportOutcome, export_checked
from hybridflow.metrics.catalogue import combine_values
from hybridflow.metrics.device import device_metrics
from hybridflow.models.lora import adapters_disabled, lora_config
from hybridflow.resharding.fingerprint import FingerprintPlan
from hybridflow.resharding.layout import Block
from hybridflow.resharding.meter import TrafficMeter
from hybridflow.resharding.transfer import TrainingShard
from hybridflow.rlmath.aggregation import LossNormalizer
from hybridflow.rlmath.objectives import actor_objective
from hybridflow.spec import RLHFJobSpec
from hybridflow.workers.mini_batches import (
    dp_sum_over,
    global_normalizers,
    kl_exceeded,
    local_mini_batches,
    rollout_correction,
    update_micro_batches,
)
from hybridflow.workers.weight_push import (
    WEIGHT_BUCKET_BYTES,
    dtypes_differ,
    engine_dtype,
    send_pushed_weights,
)

__all__ = ["ActorWorker", "ReferenceWorker", "seed_everything"]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


class _PolicyModel(Worker):
    """A causal LM on the job's backend that scores response tokens; shared by actor and reference."""

    def __init__(
        self, ctx: WorkerContext, spec: RLHFJobSpec, model_path: str, *, learning_rate: float | None
    ) -> None:
        super().__init__(ctx)
        self.spec = spec
        sequence_parallel = spec.training.sequence_parallel_size
        if spec.training.backend == "fsdp" and ctx.mesh.tp_size != sequence_parallel:
            # The backend's Ulysses groups are the mesh's tp groups; any other mesh would hand the
            # ranks of a group different rows (or count each row several times in the loss).
            raise RuntimeError(
                f"the {ctx.role} role runs under {ctx.mesh.describe()}, but spec.training.sequenceParallelSize "
                f"is {sequence_parallel}: deploy it with DeviceMesh.training(world, tp={sequence_parallel}) "
                "(hybridflow.trainer.roles.job_roles)"
            )
        seed_everything(spec.training.seed + ctx.rank)
        self.backend: TrainingBackend = training_backend(spec.training.backend)(spec, ctx.torch_device)
        self.backend.load(model_path, kind="causal-lm", learning_rate=learning_rate)
        self.temperature = spec.rollout.temperature if spec.rollout.temperature > 0 else 1.0

    @property
    def model(self) -> nn.Module:
        """The backend's module (a colocated torch engine with ``t_g = 1`` generates from it in place)."""
        return self.backend.model

    def _score(self, batch: Batch, field: str) -> Batch:
        log_probs, _ = self.backend.log_probs(batch.tensors, temperature=self.temperature, with_entropy=False)
        return Batch({field: log_probs})


class ReferenceWorker(_PolicyModel):
    """The frozen initial policy, for the KL term."""

    def __init__(self, ctx: WorkerContext, spec: RLHFJobSpec) -> None:
        super().__init__(ctx, spec, spec.models.reference_or_actor.path, learning_rate=None)

    @register(DP_SPLIT)
    def compute_ref_log_probs(self, batch: Batch) -> Batch:
        return self._score(batch, "ref_log_probs")


class ActorWorker(_PolicyModel):
    """The trained policy: AdamW and the job's LR schedule on the backend's data-parallel group."""

    def __init__(self, ctx: WorkerContext, spec: RLHFJobSpec) -> None:
        super().__init__(ctx, spec, spec.models.actor.path, learning_rate=spec.training.learning_rate)
        self.local_mini_batch = spec.training.mini_batch_size // ctx.mesh.dp_size
        self.offload = DeviceOffload("the actor's training state")
        # The same on every rank (spec and device type): every DP rank weights its tokens alike.
        self.correction = rollout_correction(spec, dtypes_differ=dtypes_differ(spec, ctx))

    def offload_for_generation(self) -> OffloadStats | None:
        """Move what ``spec.training.offloadDuringGeneration`` names to host memory (None: nothing).

        Called by the colocated rollout after the weight sync (under the 3D-HybridEngine with
        parameters offloaded, the rollout has copied this rank's own blocks first: the engine
        reads them while the originals are away), before generating; the actor
        computes nothing until :meth:`reload_after_generation` (:mod:`hybridflow.backends.offload`).
        """
        choice = self.spec.training.offload_during_generation
        parameters, optimizer_state = self.backend.offload_tensors()
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

    @register(DP_SPLIT)
    def compute_ref_log_probs(self, batch: Batch) -> Batch:
        """The reference's log-probs with ``spec.training.lora``: this model with its adapter switched off.

        The base model is the frozen initial policy exactly (the adapter starts at zero), so no
        reference model is loaded; :func:`hybridflow.algorithms.api.JobWorkers.of` sends the
        reference's calls here when the job has no reference role.
        """
        if self.spec.training.lora is None:
            raise RuntimeError(
                "the actor computes reference log-probs only with spec.training.lora; this job has a "
                "reference role for them"
            )
        with adapters_disabled(self.model):
            return self._score(batch, "ref_log_probs")

    @register(DP_SPLIT_EXACT)
    def update_policy(self, batch: Batch) -> dict[str, float]:
        """PPO-clip updates over ``batch`` (needs advantages; ref_log_probs for the KL loss).

        Without ``old_log_probs`` (on-policy: one mini-batch, one epoch; see
        :mod:`hybridflow.workers.mini_batches`) the detached log-probs of the update's own
        forward are the old ones. Each micro-batch's loss is its share of the mini-batch's
        (global counts over micro-batches and DP ranks), so the split never changes the result.
        After each epoch the epochs stop early once the k3 KL passes ``algorithm.targetKl``.
        """
        algo = self.spec.algorithm
        use_kl_loss = algo.kl.mode == "loss" and "ref_log_probs" in batch.tensors
        on_policy = "old_log_probs" not in batch.tensors
        # The engines' log-probs are at temperature 1, the trainer's at the sampling temperature (1
        # also for greedy decoding): at any other temperature they are not comparable, and the
        # spec corrects only at temperature 1.
        with_rollout = "rollout_log_probs" in batch.tensors and self.temperature == 1.0
        fields = ["response_mask", "advantages"]
        fields += [] if on_policy else ["old_log_probs"]
        fields += ["ref_log_probs"] if use_kl_loss else []
        fields += ["rollout_log_probs"] if with_rollout else []
        dp_size = self.ctx.mesh.dp_size
        dp_sum = dp_sum_over(self.backend.dp_group(), self.ctx.torch_device)
        minis = local_mini_batches(batch, self.local_mini_batch, on_policy=on_policy, epochs=algo.ppo_epochs)
        normalizers = global_normalizers(minis, dp_size=dp_size, dp_sum=dp_sum)
        totals: dict[str, list[float]] = {}
        for _ in range(algo.ppo_epochs):
            epoch_k3: list[float] = []
            for mini, normalizer in zip(minis, normalizers, strict=True):

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
                        rollout_log_probs=micro["rollout_log_probs"] if with_rollout else None,
                        correction=self.correction,
                    )

                micro_batches = update_micro_batches(self.spec, self.ctx, mini, dp_sum)
                for stats in self.backend.forward_backward(
                    [micro.tensors for micro in micro_batches],
                    loss_fn,
                    fields=fields,
                    temperature=self.temperature,
                    entropy_grad=algo.entropy_coef != 0,  # otherwise the entropy is only a metric
                ):
                    for name, value in stats.items():
                        totals.setdefault(name, []).append(value)
                    epoch_k3.append(stats["actor/approx_kl_k3"])
                grad_norm = self.backend.clip_and_step(max_grad_norm=self.spec.training.max_grad_norm)
                totals.setdefault("actor/grad_norm", []).append(grad_norm)
            totals.setdefault("actor/epochs", [0.0])[0] += 1
            if kl_exceeded(algo.target_kl, epoch_k3, dp_size=dp_size, dp_sum=dp_sum):
                break
        metrics = {name: combine_values(name, values) for name, values in totals.items()}
        metrics["actor/lr"] = self.backend.learning_rate
        metrics.update(device_metrics("actor"))
        self.backend.step_lr_schedule()
        return metrics

    def weight_buckets(
        self, bucket_bytes: int, *, dtype: torch.dtype | None = None, meter: TrafficMeter | None = None
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full weights by HF name, a bucket at a time, in ``dtype`` (the engine's; cast before gathering).

        Collective: every rank iterates in lockstep. ``meter`` counts the gathers' bytes.
        """
        return self.backend.weight_buckets(bucket_bytes, dtype=dtype, meter=meter)

    def training_shard(self, blocks: Sequence[Block]) -> TrainingShard:
        """This rank's slices as the resharding plan's training shard (``RankPlan.training``; megatron only).

        Local, no communication. Called by the colocated 3D-HybridEngine rollout before each
        transition. The shard's blocks are views of the live parameters where megatron's fused
        layout allows (copies otherwise, counted by :meth:`training_shard_copy_bytes`): the
        rollout must be done with it before the next update.
        """
        return self.backend.training_shard(blocks)

    def training_shard_copy_bytes(self, shard: TrainingShard) -> int:
        """Bytes of ``shard`` whose storage is not one of the model's parameter storages (megatron only)."""
        return self.backend.training_shard_copy_bytes(shard)

    @property
    def policy_version(self) -> int:
        """Updates made so far (``update_policy`` steps the LR schedule once each; checkpoints keep it)."""
        return self.backend.lr_steps

    @register(BROADCAST)
    def push_weights(self) -> dict[str, float]:
        """Send the current weights to the rollout's pool over the ``weights`` bridge (collective).

        The rollout's ``receive_weights`` must be submitted with it (``workers/weight_push.py``);
        under megatron the spec allows a rollout on its own pool only with ``t*p == 1``, where
        every rank holds the whole model.
        """
        buckets = self.weight_buckets(WEIGHT_BUCKET_BYTES, dtype=engine_dtype(self.spec, self.ctx))
        plan = FingerprintPlan(self.spec.rollout.weight_sync_check, self.policy_version)
        return send_pushed_weights(self.ctx, buckets, plan)

    def local_parameter_bytes(self) -> int:
        """Bytes of this rank's own parameter shards (what it keeps aside while an engine holds a full copy)."""
        return self.backend.local_parameter_bytes()

    @register(BROADCAST)
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The actor's current full HF weights, from every rank (collective).

        For checks and export, not the training loop: every rank assembles and returns the whole model.
        """
        return self.backend.full_state_dict()

    def probe_log_probs(self, probes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """The trainer's next-token log-probs of each probe (temperature 1), one probe per pass (collective).

        The parity gate's reference (:func:`hybridflow.export.probe_log_probs` is the same for an HF
        model): a probe is one row, its first token the prompt and the rest the response, unpadded.
        """
        results = []
        for probe in probes:
            ids = torch.tensor([list(probe)], dtype=torch.long)
            batch = {
                "input_ids": ids,
                "attention_mask": torch.ones_like(ids),
                "position_ids": torch.arange(ids.shape[1]).unsqueeze(0),
                "responses": ids[:, 1:],
                "response_mask": torch.ones(1, ids.shape[1] - 1, dtype=torch.long),
            }
            log_probs, _ = self.backend.log_probs(batch, temperature=1.0, with_entropy=False)
            results.append(log_probs[0].float().cpu())
        return results

    @register(BROADCAST)
    def export_hf(self, directory: str, step: int, probes: list[list[int]]) -> ExportOutcome | None:
        """``spec.checkpoint.export``: the actor as an HF model (or adapter) in ``directory``, gated (collective).

        Every rank gathers the full weights and scores the probes (both collective); rank 0 writes
        the export and runs the parity gate (:mod:`hybridflow.export.publish`) and returns its
        outcome, the other ranks ``None``. Holds the whole model on every rank's host for the
        duration, as :meth:`full_state_dict` does.
        """
        export = self.spec.checkpoint.export
        if export is None:
            raise RuntimeError("export_hf needs spec.checkpoint.export")
        state = self.backend.full_state_dict()
        expected = self.probe_log_probs(probes)
        if self.ctx.rank != 0:
            return None
        lora = self.spec.training.lora
        actor = self.spec.models.actor
        return export_checked(
            state,
            Path(directory),
            step=step,
            kind=export.resolved_kind(lora=lora is not None),
            dtype=export.dtype,
            source_model_dir=actor.path,
            tokenizer_dir=actor.tokenizer_path or actor.path,
            lora=lora_config(lora),
            probes=probes,
            trainer_log_probs=expected,
            tolerance=export.tolerance(),
        )

    @register(BROADCAST)
    def save_checkpoint(self, directory: str) -> None:
        self.backend.save_state(Path(directory))

    @register(BROADCAST)
    def load_checkpoint(self, directory: str) -> None:
        self.backend.load_state(Path(directory))
