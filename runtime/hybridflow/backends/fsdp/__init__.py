"""The FSDP2 backend: load, shard, score, optimise, gather weights and checkpoint an HF model.

Plain functions, no Ray: the worker classes (:mod:`hybridflow.workers`) call them on every rank
of a role's group after joining the ``torch.distributed`` world, in this order:

1. :func:`load_causal_lm` / :func:`load_value_model`: identical full weights on every rank.
2. :func:`shard_model`: FSDP2 ``fully_shard`` per unit of decoder layers and on the root (collective).
3. For a trained role, :func:`build_optimizer` and :func:`build_lr_scheduler`.
4. Per batch: :func:`token_logprobs_and_entropy` / :func:`token_values` (forward passes, all
   ranks together), ``backward()``, then :func:`clip_grad_norm_and_step` per mini-batch
   (collective); ``scheduler.step()`` once per RL step, by the worker.
5. Weight sync to a colocated engine: :func:`iter_full_weight_buckets` (collective, lockstep).
6. :func:`save_train_state` / :func:`load_train_state` (collective, DCP).

The same code runs on CUDA/NCCL and on CPU/gloo; only the device passed to :func:`shard_model`
differs.
"""

from hybridflow.backends.fsdp.checkpoint import load_train_state, save_train_state
from hybridflow.backends.fsdp.load import (
    ValueModel,
    attention_implementation,
    load_causal_lm,
    load_value_model,
)
from hybridflow.backends.fsdp.logprobs import (
    pack_sequences,
    packed_token_logprobs_and_entropy,
    packed_token_values,
    token_logprobs_and_entropy,
    token_values,
)
from hybridflow.backends.fsdp.optim import (
    LRSchedule,
    build_lr_scheduler,
    build_optimizer,
    clip_grad_norm_and_step,
    lr_factor,
    offload_tensors,
)
from hybridflow.backends.fsdp.parallelize import (
    decoder_layers,
    enable_activation_checkpointing,
    fsdp_units,
    shard_model,
)
from hybridflow.backends.fsdp.weights import full_state_dict, iter_full_weight_buckets

__all__ = [
    "LRSchedule",
    "ValueModel",
    "attention_implementation",
    "build_lr_scheduler",
    "build_optimizer",
    "clip_grad_norm_and_step",
    "decoder_layers",
    "enable_activation_checkpointing",
    "fsdp_units",
    "full_state_dict",
    "iter_full_weight_buckets",
    "load_causal_lm",
    "load_train_state",
    "load_value_model",
    "lr_factor",
    "offload_tensors",
    "pack_sequences",
    "packed_token_logprobs_and_entropy",
    "packed_token_values",
    "save_train_state",
    "shard_model",
    "token_logprobs_and_entropy",
    "token_values",
]
