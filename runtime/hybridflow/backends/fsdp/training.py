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
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

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
from hybridflow.backends.fsdp.parallelize import shard_model
from hybridflow.backends.fsdp.sharded_load import (
    ShardedLoadReport,
    build_on_meta,
    materialize_and_load,
    sharded_load_supported,
)
from hybridflow.backends.fsdp.weights import full_state_dict, iter_full_weight_buckets
from hybridflow.compilation import use_compile_cache
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
        self._optimizer = build_optimizer(self._model, learning_rate=learning_rate)
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
        return None  # fully_shard over the default group: every rank is a data-parallel rank

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
        keys and values), under activation checkpointing too.
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
        """One ``backward()`` per micro-batch; FSDP reduce-scatters each one's gradients as it goes."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        results = []
        for micro in micro_batches:
            outputs, entropy = self._forward(
                micro, temperature=temperature, with_entropy=True, entropy_grad=entropy_grad
            )
            loss, metrics = loss_fn(outputs, entropy, {name: micro[name].to(self.device) for name in fields})
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
