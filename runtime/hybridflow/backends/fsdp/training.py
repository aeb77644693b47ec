"""The FSDP2 backend behind :class:`hybridflow.backends.api.TrainingBackend`.

One HF model per role, sharded with ``fully_shard`` over the default (data-parallel) group in
units of decoder layers (``spec.training.fsdpUnitMinParameters``); the functions of this
package in the order of its ``__init__``. With ``spec.training.packSequences`` every pass runs
on packed rows (one row of real tokens per micro-batch); otherwise on the engine layout as it
comes. bf16 mixed precision on CUDA only, fp32 parameters always (the optimizer steps fp32
master weights).

FSDP has no model-parallel slices: :meth:`FSDPTrainingBackend.training_shard` raises (the
3D-HybridEngine needs megatron); a colocated rollout reads the full weights through
:meth:`FSDPTrainingBackend.weight_buckets` or, with ``t_g = 1`` on one rank, the module itself.

Sequence parallelism (``spec.training.sequenceParallelSize`` ``P > 1``, causal LMs only: the
actor and the reference). :meth:`FSDPTrainingBackend.load` checks the model's heads split ``P``
ways, switches it to Ulysses attention before sharding and builds the Ulysses and data-parallel
groups (:func:`~hybridflow.backends.fsdp.parallelize.sequence_parallel_groups`, the ``tp`` and
``dp`` groups of ``DeviceMesh.training(world, tp=P)``, the mesh ``trainer/roles.py`` deploys
these roles with, so the ``P`` ranks of a group receive the same rows). Every pass then runs
each micro-batch on all ``P`` ranks together, each on its slice of the columns, inside
:func:`~hybridflow.backends.fsdp.ulysses.ulysses_context` from the forward through the
backward; every rank gets the whole micro-batch's results. FSDP still shards over the whole
world, so its gradient mean divides by ``dp * P`` and each loss is multiplied by
:func:`~hybridflow.backends.fsdp.ulysses.fsdp_loss_scale`; the workers sum their loss counts over
:meth:`FSDPTrainingBackend.dp_group` (one rank per group: each row once). At ``P = 1`` none of
this runs: no groups, no context, no scaling.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import PretrainedConfig

from hybridflow.backends.api import LossFn, ModelKind, Tensors, UnsupportedByBackend
from hybridflow.backends.fsdp.checkpoint import load_train_state, save_train_state
from hybridflow.backends.fsdp.load import attention_implementation, load_causal_lm, load_value_model
from hybridflow.backends.fsdp.logprobs import (
    first_used_column,
    packed_token_logprobs_and_entropy,
    packed_token_values,
    token_logprobs_and_entropy,
    token_values,
)
from hybridflow.backends.fsdp.optim import (
    build_lr_scheduler,
    build_optimizer,
    clip_grad_norm_and_step,
    offload_tensors,
)
from hybridflow.backends.fsdp.parallelize import SequenceParallelGroups, sequence_parallel_groups, shard_model
from hybridflow.backends.fsdp.sharded_load import (
    ShardedLoadReport,
    build_on_meta,
    materialize_and_load,
    sharded_load_supported,
)
from hybridflow.backends.fsdp.ulysses import (
    fsdp_loss_scale,
    sequence_parallel_problem,
    ulysses_context,
    ulysses_token_logprobs_and_entropy,
    use_ulysses_attention,
)
from hybridflow.backends.fsdp.weights import full_state_dict, iter_full_weight_buckets
from hybridflow.compilation import use_compile_cache
from hybridflow.mesh import MeshError
from hybridflow.models.lora import LoRAConfig, apply_lora, initialize_adapters, is_adapter_name, lora_config
from hybridflow.resharding.layout import Block
from hybridflow.resharding.meter import TrafficMeter
from hybridflow.resharding.transfer import TrainingShard
from hybridflow.spec import RLHFJobSpec

__all__ = ["FSDPTrainingBackend"]

_NO_SHARD = (
    "the FSDP backend has no model-parallel training shard: the 3D-HybridEngine reshards megatron's "
    "slices and needs spec.training.backend 'megatron' (the FSDP actor syncs through weight_buckets)"
)


def _use_sequence_parallelism(model: nn.Module, model_path: str, size: int) -> SequenceParallelGroups:
    """Switch ``model`` to Ulysses attention for ``size`` ranks and build the groups (collective).

    Called on every rank after the model is built and before it is sharded. The head counts come
    from the model itself (the spec cannot know them), so a size that does not split them fails
    here, naming the field, the value and the model's counts.
    """
    config = cast(PretrainedConfig, model.config)
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    problem = sequence_parallel_problem(heads, kv_heads, size, model_path)
    if problem is not None:
        raise ValueError(problem)
    use_ulysses_attention(model, size)
    try:
        return sequence_parallel_groups(size)
    except MeshError:
        raise ValueError(
            f"spec.training.sequenceParallelSize: {size} does not divide this role's {dist.get_world_size()} "
            "ranks; allowed: a divisor of the pool's GPUs"
        ) from None


def _rows(batch: Tensors, size: int) -> list[dict[str, torch.Tensor]]:
    """Contiguous chunks of ``size`` rows (views; the last may be shorter): the scoring micro-batches."""
    rows = int(batch["input_ids"].shape[0])
    return [
        {name: tensor[start : start + size] for name, tensor in batch.items()}
        for start in range(0, rows, size)
    ]


class FSDPTrainingBackend:
    """One FSDP2-sharded model on this rank; the protocol is :class:`~hybridflow.backends.api.TrainingBackend`'s."""

    name = "fsdp"

    def __init__(self, spec: RLHFJobSpec, device: torch.device) -> None:
        if spec.training.compile:
            use_compile_cache(spec.checkpoint_dir)  # before this process's first compile
        self.spec = spec
        self.device = device
        self.packed = spec.training.pack_sequences
        self.mixed_precision = spec.training.precision == "bf16" and device.type == "cuda"
        self.micro_batch_size = spec.training.micro_batch_size_per_gpu
        self.activation_checkpointing = False  # set by load() for a trained model
        self._model: nn.Module | None = None
        self.kind: ModelKind = "causal-lm"
        self._optimizer: torch.optim.Optimizer | None = None
        self._scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        self.load_report: ShardedLoadReport | None = None  # None: loaded by the plain path
        self.lora: LoRAConfig | None = None  # set by load() when this model trains an adapter
        # Set by load() for a causal LM at spec.training.sequenceParallelSize > 1.
        self.sequence_parallel: SequenceParallelGroups | None = None

    # ------------------------------------------------------------------ loading

    def load(self, model_path: str, *, kind: ModelKind, learning_rate: float | None) -> None:
        trained = learning_rate is not None
        attention = attention_implementation(self.device, packed=self.packed, bf16=self.mixed_precision)
        # Each rank reads only its shard (sharded_load.py) unless the model needs the plain path,
        # where every rank builds the whole model on the host first.
        sharded = sharded_load_supported(model_path)
        self.load_report = None
        if sharded:
            loaded = build_on_meta(model_path, kind=kind, dtype=torch.float32, attn_implementation=attention)
        elif kind == "causal-lm":
            loaded = load_causal_lm(model_path, dtype=torch.float32, attn_implementation=attention)
        else:
            loaded = load_value_model(model_path, attn_implementation=attention)
        self.kind = kind
        sequence_parallel_size = self.spec.training.sequence_parallel_size if kind == "causal-lm" else 1
        self.sequence_parallel = None
        if sequence_parallel_size > 1:  # before sharding: FSDP wraps the attention modules as they are
            self.sequence_parallel = _use_sequence_parallelism(loaded, model_path, sequence_parallel_size)
        self.lora = self._lora_for(kind, trained=trained)
        if self.lora is not None:
            apply_lora(loaded, self.lora)
            if kind == "value":  # the head maps the backbone's output to a value: it trains whole
                for name, parameter in loaded.named_parameters():
                    parameter.requires_grad_(is_adapter_name(name) or name.startswith("value_head."))
        self.activation_checkpointing = trained and self.spec.training.activation_checkpointing
        self._model = shard_model(
            loaded,
            device=self.device,
            mixed_precision=self.mixed_precision,
            activation_checkpointing=self.activation_checkpointing,
            unit_min_parameters=self.spec.training.fsdp_unit_min_parameters,
            compile_forward=self.spec.training.compile,
        )
        if sharded:
            self.load_report = materialize_and_load(self._model, model_path, kind=kind, device=self.device)
        if self.lora is not None:  # after loading: the checkpoint has no adapter to read
            initialize_adapters(self._model, seed=self.spec.training.seed)
        if learning_rate is None:
            self._model.requires_grad_(False)
            return
        training = self.spec.training
        self._optimizer = build_optimizer(
            self._model, learning_rate=learning_rate, weight_decay=training.weight_decay
        )
        self._scheduler = build_lr_scheduler(
            self._optimizer,
            warmup_steps=training.warmup_steps,
            total_steps=training.total_steps,
            schedule=training.lr_schedule,
        )

    def _lora_for(self, kind: ModelKind, *, trained: bool) -> LoRAConfig | None:
        """The adapter this model trains (``spec.training.lora``): the actor's, and the critic's if asked."""
        lora = self.spec.training.lora
        if lora is None or not trained or (kind == "value" and not lora.critic):
            return None
        return lora_config(lora)

    @property
    def model(self) -> nn.Module:
        if self._model is None:
            raise RuntimeError("the FSDP backend has no model yet: call load() first")
        return self._model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        if self._optimizer is None:
            raise RuntimeError("this model is frozen (loaded without a learning rate): it has no optimizer")
        return self._optimizer

    @property
    def scheduler(self) -> torch.optim.lr_scheduler.LambdaLR:
        if self._scheduler is None:
            raise RuntimeError("this model is frozen (loaded without a learning rate): it has no LR schedule")
        return self._scheduler

    def dp_group(self) -> dist.ProcessGroup | None:
        """None (the default group: every rank is a data-parallel rank), or under sequence
        parallelism the ranks at this rank's position in every Ulysses group."""
        return None if self.sequence_parallel is None else self.sequence_parallel.data

    # ------------------------------------------------------------------ forward passes

    def _forward(
        self, micro: Tensors, *, temperature: float, with_entropy: bool, entropy_grad: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One micro-batch's log-probs (+ entropy) or values, on the device, with grad if enabled.

        Padded passes start at the micro-batch's first prompt column that any row uses
        (:func:`~hybridflow.backends.fsdp.logprobs.first_used_column`): the rollout pads every
        prompt on the left to ``data.maxPromptTokens``, and columns that are padding in every row
        change no valid token's result (positions come from the mask) but cost a full pass.
        Log-prob passes run each distinct prompt once when that saves at least
        ``training.sharedPromptMinTokens`` prompt tokens (the ``n`` samples of a prompt share its
        keys and values), under activation checkpointing too; not under sequence parallelism,
        whose passes run inside :meth:`_sequence_context` (same micro-batch) and split the columns.
        """
        device = self.device
        response_len = int(micro["responses"].shape[1])
        start = 0 if self.packed else first_used_column(micro["attention_mask"], response_len)
        input_ids = micro["input_ids"][:, start:].to(device)
        attention_mask = micro["attention_mask"][:, start:].to(device)
        if self.kind == "value":
            if self.packed:  # spec.training.packSequences
                return packed_token_values(
                    self.model, input_ids, attention_mask, response_len=response_len
                ), None
            position_ids = micro["position_ids"][:, start:].to(device)
            return token_values(
                self.model, input_ids, attention_mask, position_ids, response_len=response_len
            ), None
        if self.packed:  # spec.training.packSequences: one row of real tokens per micro-batch
            return packed_token_logprobs_and_entropy(
                self.model,
                input_ids,
                attention_mask,
                response_len=response_len,
                temperature=temperature,
                with_entropy=with_entropy,
                entropy_grad=entropy_grad,
            )
        if self.sequence_parallel is not None:  # inside self._sequence_context(micro)
            return ulysses_token_logprobs_and_entropy(
                self.model,
                input_ids,
                micro["position_ids"][:, start:].to(device),
                response_len=response_len,
                temperature=temperature,
                with_entropy=with_entropy,
                entropy_grad=entropy_grad,
            )
        return token_logprobs_and_entropy(
            self.model,
            input_ids,
            attention_mask,
            micro["position_ids"][:, start:].to(device),
            response_len=response_len,
            temperature=temperature,
            with_entropy=with_entropy,
            entropy_grad=entropy_grad,
            shared_prompt_min_tokens=self.spec.training.shared_prompt_min_tokens,
        )

    def _sequence_context(self, micro: Tensors) -> AbstractContextManager[None]:
        """Ulysses' context for ``micro``'s pass (nothing without sequence parallelism).

        Holds the group and the whole micro-batch's attention mask, trimmed as :meth:`_forward`
        trims the inputs; the caller keeps it open through the backward (activation
        checkpointing recomputes attention there).
        """
        if self.sequence_parallel is None:
            return nullcontext()
        attention_mask = micro["attention_mask"]
        start = first_used_column(attention_mask, int(micro["responses"].shape[1]))
        return ulysses_context(self.sequence_parallel.sequence, attention_mask[:, start:].to(self.device))

    def log_probs(
        self, batch: Tensors, *, temperature: float, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.kind != "causal-lm":
            raise ValueError("this model is a value model; use values()")
        self.model.eval()
        log_probs: list[torch.Tensor] = []
        entropies: list[torch.Tensor] = []
        with torch.no_grad():
            for micro in _rows(batch, self.micro_batch_size):
                with self._sequence_context(micro):
                    piece, entropy = self._forward(micro, temperature=temperature, with_entropy=with_entropy)
                log_probs.append(piece.float().cpu())
                if entropy is not None:
                    entropies.append(entropy.float().cpu())
        return torch.cat(log_probs), torch.cat(entropies) if with_entropy else None

    def values(self, batch: Tensors) -> torch.Tensor:
        if self.kind != "value":
            raise ValueError("this model is a causal LM; use log_probs()")
        self.model.eval()
        with torch.no_grad():
            return torch.cat(
                [
                    self._forward(micro, temperature=1.0, with_entropy=False)[0].float().cpu()
                    for micro in _rows(batch, self.micro_batch_size)
                ]
            )

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
        """One ``backward()`` per micro-batch; FSDP reduce-scatters each one's gradients as it goes.

        Under sequence parallelism every rank of a Ulysses group runs the same micro-batches, the
        backward inside the micro-batch's context, and backpropagates ``fsdp_loss_scale(P)``
        times its loss (the metrics are the loss function's own, unscaled).
        """
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        results = []
        for micro in micro_batches:
            with self._sequence_context(micro):
                outputs, entropy = self._forward(
                    micro, temperature=temperature, with_entropy=True, entropy_grad=entropy_grad
                )
                loss, metrics = loss_fn(
                    outputs, entropy, {name: micro[name].to(self.device) for name in fields}
                )
                if self.sequence_parallel is not None:
                    loss = loss * fsdp_loss_scale(self.sequence_parallel.size)
                loss.backward()
            results.append({name: float(value) for name, value in metrics.items()})
        return results

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
        storages = {}
        for param in self.model.parameters():
            storage = (param.to_local() if isinstance(param, DTensor) else param).untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()  # a storage shared by views counts once
        return sum(storages.values())

    def weight_buckets(
        self, bucket_bytes: int, *, dtype: torch.dtype | None, meter: TrafficMeter | None
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The all-gathers of the shards, cast to ``dtype`` before gathering; ``meter`` counts their bytes.

        With a LoRA adapter, the adapter's tensors alone: the engine holds the frozen base already
        (loaded from the same checkpoint) and applies the adapter itself.
        """
        keep = is_adapter_name if self.lora is not None else None
        return iter_full_weight_buckets(
            self.model, bucket_bytes=bucket_bytes, dtype=dtype, meter=meter, keep=keep
        )

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {name: tensor.detach().cpu() for name, tensor in full_state_dict(self.model).items()}

    def training_shard(self, blocks: Sequence[Block]) -> TrainingShard:
        raise UnsupportedByBackend(_NO_SHARD)

    def training_shard_copy_bytes(self, shard: TrainingShard) -> int:
        raise UnsupportedByBackend(_NO_SHARD)
