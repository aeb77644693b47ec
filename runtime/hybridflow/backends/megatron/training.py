"""The megatron-core backend behind :class:`hybridflow.backends.api.TrainingBackend`.

This rank's ``GPTModel`` stage and TP slices of one model, the functions of this package in
the order of its ``__init__``. Constructing the backend initialises megatron's parallel state
from ``spec.training``'s TP/PP sizes (collective; one layout per process, so roles colocated
in a process must share it). A trained model is wrapped in megatron's DDP over the DP group;
a frozen one stays a bare stage. Scoring runs the rows through the pipeline in micro-batches of
``spec.training.microBatchSizePerGpu``; the train step is one
:func:`~hybridflow.backends.megatron.optim.forward_backward` per mini-batch (megatron's
schedule reduces the gradients over DP once, at its end). Results are broadcast over each PP
group, so every rank returns them, as under FSDP; the DP split of the controller gives the
ranks of one DP replica (its TP and PP ranks) the same rows.

Token-budget micro-batches and packed sequences are refused by the spec for this backend
(megatron's pipeline needs micro-batches of one shape).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from torch import nn

from hybridflow.backends.api import LossFn, ModelKind, Tensors
from hybridflow.backends.megatron.checkpoint import load_train_state, save_train_state
from hybridflow.backends.megatron.load import load_causal_lm, load_value_model
from hybridflow.backends.megatron.logprobs import token_logprobs_and_entropy, token_values
from hybridflow.backends.megatron.optim import (
    build_lr_scheduler,
    build_optimizer,
    clip_grad_norm_and_step,
    forward_backward,
    offload_tensors,
)
from hybridflow.backends.megatron.parallelize import initialize_parallel_state, wrap_data_parallel
from hybridflow.backends.megatron.weights import (
    full_state_dict,
    iter_full_weight_buckets,
    shard_copy_bytes,
    training_shard,
)
from hybridflow.resharding.layout import Block
from hybridflow.resharding.meter import TrafficMeter
from hybridflow.resharding.transfer import TrainingShard
from hybridflow.spec import RLHFJobSpec

__all__ = ["MODEL_FIELDS", "MegatronTrainingBackend", "parameter_dtype"]

MODEL_FIELDS = ("input_ids", "attention_mask", "position_ids")


def parameter_dtype(spec: RLHFJobSpec, device: torch.device) -> torch.dtype:
    """bf16 parameters (megatron keeps fp32 main weights in the optimizer) on CUDA; fp32 on CPU."""
    return torch.bfloat16 if spec.training.precision == "bf16" and device.type == "cuda" else torch.float32


class MegatronTrainingBackend:
    """One megatron-core model stage on this rank; the protocol is :class:`~hybridflow.backends.api.TrainingBackend`'s."""

    name = "megatron"

    def __init__(self, spec: RLHFJobSpec, device: torch.device) -> None:
        self.spec = spec
        self.device = device
        training = spec.training
        self.layout = initialize_parallel_state(
            tp_size=training.tensor_parallel_size, pp_size=training.pipeline_parallel_size, seed=training.seed
        )
        self.micro_batch_size = training.micro_batch_size_per_gpu
        self._model: Any = None
        self.kind: ModelKind = "causal-lm"
        self._optimizer: Any = None
        self._scheduler: torch.optim.lr_scheduler.LambdaLR | None = None

    # ------------------------------------------------------------------ loading

    def load(self, model_path: str, *, kind: ModelKind, learning_rate: float | None) -> None:
        training = self.spec.training
        loader = load_causal_lm if kind == "causal-lm" else load_value_model
        model = loader(
            model_path,
            dtype=parameter_dtype(self.spec, self.device),
            activation_checkpointing=learning_rate is not None and training.activation_checkpointing,
        )
        self.kind = kind
        if learning_rate is None:
            model.requires_grad_(False)
            self._model = model
            return
        self._model = wrap_data_parallel(model)
        self._optimizer = build_optimizer(
            self._model, learning_rate=learning_rate, weight_decay=training.weight_decay
        )
        self._scheduler = build_lr_scheduler(
            self._optimizer,
            warmup_steps=training.warmup_steps,
            total_steps=training.total_steps,
            schedule=training.lr_schedule,
        )

    @property
    def model(self) -> nn.Module:
        if self._model is None:
            raise RuntimeError("the megatron backend has no model yet: call load() first")
        model: nn.Module = self._model
        return model

    @property
    def optimizer(self) -> Any:
        if self._optimizer is None:
            raise RuntimeError("this model is frozen (loaded without a learning rate): it has no optimizer")
        return self._optimizer

    @property
    def scheduler(self) -> torch.optim.lr_scheduler.LambdaLR:
        if self._scheduler is None:
            raise RuntimeError("this model is frozen (loaded without a learning rate): it has no LR schedule")
        return self._scheduler

    def dp_group(self) -> dist.ProcessGroup | None:
        group: dist.ProcessGroup = parallel_state.get_data_parallel_group()
        return group

    # ------------------------------------------------------------------ forward passes

    def log_probs(
        self, batch: Tensors, *, temperature: float, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.model.eval()
        log_probs, entropy = token_logprobs_and_entropy(
            self.model,
            *(batch[name].to(self.device) for name in MODEL_FIELDS),
            response_len=int(batch["responses"].shape[1]),
            temperature=temperature,
            with_entropy=with_entropy,
            micro_batch_size=self.micro_batch_size,
        )
        return log_probs.float().cpu(), None if entropy is None else entropy.float().cpu()

    def values(self, batch: Tensors) -> torch.Tensor:
        self.model.eval()
        values = token_values(
            self.model,
            *(batch[name].to(self.device) for name in MODEL_FIELDS),
            response_len=int(batch["responses"].shape[1]),
            micro_batch_size=self.micro_batch_size,
        )
        return values.float().cpu()

    # ------------------------------------------------------------------ training

    def forward_backward(
        self,
        micro_batches: Sequence[Tensors],
        loss_fn: LossFn,
        *,
        fields: Sequence[str],
        temperature: float = 1.0,
        entropy_grad: bool = True,
    ) -> list[dict[str, float]]:
        """All micro-batches through megatron's schedule; the gradients are zero from the last step.

        The vocab-parallel head computes log-probs and entropy in one fused autograd function;
        with ``entropy_grad=False`` the entropy reaches ``loss_fn`` detached (its gradient is 0).
        """
        if not micro_batches:
            raise ValueError("forward_backward needs at least one micro-batch")
        self.model.train()
        wanted = (*MODEL_FIELDS, *fields)
        on_device = [{name: micro[name].to(self.device) for name in wanted} for micro in micro_batches]
        return forward_backward(
            self.model,
            on_device,
            loss_fn,
            response_len=int(micro_batches[0]["responses"].shape[1]),
            temperature=temperature,
            entropy_grad=entropy_grad,
        )

    def clip_and_step(self, *, max_grad_norm: float) -> float:
        return clip_grad_norm_and_step(
            self.model, self.optimizer, self.scheduler, max_grad_norm=max_grad_norm
        )

    def step_lr_schedule(self) -> None:
        self.scheduler.step()

    @property
    def learning_rate(self) -> float:
        return float(self.scheduler.get_last_lr()[0])

    @property
    def lr_steps(self) -> int:
        return int(self.scheduler.last_epoch)

    def save_state(self, directory: Path) -> None:
        save_train_state(directory, self.model, self.optimizer, self.scheduler)

    def load_state(self, directory: Path) -> None:
        load_train_state(directory, self.model, self.optimizer, self.scheduler)

    def offload_tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return offload_tensors(self.model, self.optimizer)

    # ------------------------------------------------------------------ weights out

    def local_parameter_bytes(self) -> int:
        """The whole model under DDP with ``t*p == 1``; megatron's DDP keeps parameters as views of flat buffers."""
        storages = {
            param.untyped_storage().data_ptr(): param.untyped_storage().nbytes()
            for param in self.model.parameters()
        }
        return sum(storages.values())

    def weight_buckets(
        self, bucket_bytes: int, *, dtype: torch.dtype | None, meter: TrafficMeter | None
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full HF tensors for the plain rollout role (``t*p == 1``).

        ``meter`` is accepted for the rollout's one call shape: with ``t*p == 1`` every rank
        holds the whole model (DDP), so the gather communicates nothing and there is nothing to count.
        """
        del meter
        return iter_full_weight_buckets(self.model, bucket_bytes=bucket_bytes, dtype=dtype)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {name: tensor.detach().cpu() for name, tensor in full_state_dict(self.model).items()}

    def training_shard(self, blocks: Sequence[Block]) -> TrainingShard:
        """See :func:`~hybridflow.backends.megatron.weights.training_shard` (views, no copy where possible)."""
        return training_shard(self.model, blocks)

    def training_shard_copy_bytes(self, shard: TrainingShard) -> int:
        return shard_copy_bytes(self.model, shard)
