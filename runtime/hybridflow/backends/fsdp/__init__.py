"""The FSDP2 backend: load, shard, score, optimise, gather weights and checkpoint a HF model."""

from hybridflow.backends.fsdp.checkpoint import load_train_state, save_train_state
from hybridflow.backends.fsdp.load import ValueModel, load_causal_lm, load_value_model
from hybridflow.backends.fsdp.logprobs import token_logprobs_and_entropy, token_values
from hybridflow.backends.fsdp.optim import build_lr_scheduler, build_optimizer, clip_grad_norm_and_step
from hybridflow.backends.fsdp.parallelize import shard_model
from hybridflow.backends.fsdp.weights import full_state_dict, iter_full_weight_buckets

__all__ = [
    "ValueModel",
    "build_lr_scheduler",
    "build_optimizer",
    "clip_grad_norm_and_step",
    "full_state_dict",
    "iter_full_weight_buckets",
    "load_causal_lm",
    "load_train_state",
    "load_value_model",
    "save_train_state",
    "shard_model",
    "token_logprobs_and_entropy",
    "token_values",
]
