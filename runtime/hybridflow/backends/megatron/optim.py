"""The optimizer, the LR schedule and the train step (forward/backward through the stages, clipped step).

Protocol with a worker (the same shape as :mod:`hybridflow.backends.fsdp.optim`):

* Once, after loading: :func:`~hybridflow.backends.megatron.parallelize.wrap_data_parallel`,
  then :func:`build_optimizer` on the DDP model and :func:`build_lr_scheduler` on the optimizer.
* Per mini-batch (one optimizer step): exactly one :func:`forward_backward` call with all of
  the mini-batch's micro-batches (megatron's schedule runs them through the pipeline and
  reduces the gradients over DP once, at the end: a second call before the step would reduce
  the accumulated gradients again), then :func:`clip_grad_norm_and_step` (collective).
* Per RL step: ``scheduler.step()``, by the worker, once (``warmup_steps``/``total_steps``
  count RL steps, as in the FSDP backend, whose :func:`~hybridflow.backends.fsdp.optim.lr_factor`
  this schedule shares).

Optimizer: megatron-core's distributed optimizer (``DistributedOptimizer``, the ZeRO-1 of
megatron: Adam's state sharded over the DP ranks, see
:func:`~hybridflow.backends.megatron.parallelize.wrap_data_parallel`), or its non-distributed
one when the DDP wrapper was built without it (``FP32Optimizer``: fp32 training steps the
model's parameters directly; ``Float16OptimizerWithFloat16Params``: bf16 parameters with fp32
main weights), wrapping AdamW (torch's, or Apex/TE's fused one where installed). With the
distributed optimizer each DP rank steps only its ``1/d`` range of the flat parameter buffer
(fp32: views of the parameters; bf16: fp32 main copies of that range) and the step ends with the
all-gather of the updated parameters over DP. Weight decay applies to every parameter alike
(``config_overrides={}``), as in the FSDP backend; megatron's default would exempt biases and
norms.

Clipping: :func:`clip_grad_norm_and_step` calls megatron's own pieces (``prepare_grads``,
``get_grad_norm``: the L2 norm over TP/PP shards (and, with the distributed optimizer, over the
DP ranks' ranges), TP-replicated parameters counted once;
``clip_grad_by_total_norm_fp32``; ``step_with_ready_grads``) instead of ``optimizer.step()``
so that a non-finite norm skips the step on every rank, as in the FSDP backend (megatron's fp32
step would apply NaN gradients). megatron's clipping asserts that gradients are
``torch.cuda.FloatTensor``: it runs on CUDA; the CPU tests get past it with their shim (which
makes CPU tensors report CUDA types), never the product code.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
from megatron.core.optimizer.optimizer import ChainedOptimizer
from torch import nn

from hybridflow.backends.megatron.load import model_info, unwrap
from hybridflow.backends.megatron.logprobs import logprob_head, value_head
from hybridflow.backends.megatron.pipeline import MicroBatch, check_layout, run_micro_batches
from hybridflow.backends.offload import optimizer_state_tensors
from hybridflow.backends.schedule import LRSchedule
from hybridflow.backends.schedule import build_lr_scheduler as _build_torch_lr_scheduler

__all__ = [
    "LossFn",
    "build_lr_scheduler",
    "build_optimizer",
    "clip_grad_norm_and_step",
    "forward_backward",
    "offload_tensors",
    "torch_optimizer",
]

LossFn = Callable[[torch.Tensor, torch.Tensor | None, MicroBatch], tuple[torch.Tensor, Mapping[str, Any]]]
"""``loss_fn(outputs, entropy, micro) -> (loss, metrics)``, called on the last pipeline stage per
micro-batch. ``outputs`` is ``log_probs [b, R]`` (a policy) or ``values [b, R]`` (a critic, with
``entropy`` None), with grad; ``micro`` holds the micro-batch's tensors on the model's device.
``metrics`` are scalars (floats or 0-d tensors) reported back on every rank."""


def build_optimizer(
    model: nn.Module,
    *,
    learning_rate: float,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
) -> MegatronOptimizer:
    """megatron's AdamW over ``model`` (the DDP wrapper), fp32 or bf16 as the model was built.

    Distributed (Adam's state sharded over DP) exactly when the wrapper was built for it
    (``ddp_config.use_distributed_optimizer``, see :func:`wrap_data_parallel`): the two must
    agree, so the choice is read from there. Collective only in that every rank builds its own
    (no communication). Same argument checks
    as the FSDP backend's ``build_optimizer``; clipping is an argument of
    :func:`clip_grad_norm_and_step`, not of the optimizer.
    """
    if learning_rate < 0:
        raise ValueError(f"learning_rate={learning_rate} must be non-negative")
    if weight_decay < 0:
        raise ValueError(f"weight_decay={weight_decay} must be non-negative")
    if not all(0.0 <= beta < 1.0 for beta in betas):
        raise ValueError(f"betas={betas} must both lie in [0, 1)")
    if not hasattr(model, "ddp_config"):
        raise TypeError("build_optimizer needs the DDP model from wrap_data_parallel")
    params_dtype = unwrap(model).config.params_dtype
    ddp_config: Any = model.ddp_config
    config = OptimizerConfig(
        optimizer="adam",
        lr=learning_rate,
        weight_decay=weight_decay,
        adam_beta1=betas[0],
        adam_beta2=betas[1],
        adam_eps=eps,
        clip_grad=0.0,
        bf16=params_dtype == torch.bfloat16,
        params_dtype=params_dtype,
        use_distributed_optimizer=bool(ddp_config.use_distributed_optimizer),
    )
    optimizer = get_megatron_optimizer(config, [model], config_overrides={}, use_gloo_process_groups=False)
    torch_optimizer(optimizer)  # refuses a chain of several optimizers early
    return optimizer


def torch_optimizer(optimizer: MegatronOptimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside megatron's wrapper (its ``param_groups`` carry the learning rates)."""
    inner: Any = optimizer
    if isinstance(inner, ChainedOptimizer):
        if len(inner.chained_optimizers) != 1:
            raise ValueError(f"expected one optimizer, megatron chained {len(inner.chained_optimizers)}")
        inner = inner.chained_optimizers[0]
    found = getattr(inner, "optimizer", None)
    if not isinstance(found, torch.optim.Optimizer):
        raise TypeError(f"{type(optimizer).__name__} wraps no torch optimizer")
    return found


def build_lr_scheduler(
    optimizer: MegatronOptimizer, *, warmup_steps: int, total_steps: int, schedule: LRSchedule
) -> torch.optim.lr_scheduler.LambdaLR:
    """The FSDP backend's schedule (:func:`~hybridflow.backends.fsdp.optim.lr_factor`) on the inner torch optimizer.

    megatron's ``OptimizerParamScheduler`` is not used: it counts iterations differently and the
    job's schedule must not depend on the backend. Setting the inner optimizer's
    ``param_groups[i]["lr"]`` is exactly what megatron's own scheduler does.
    """
    return _build_torch_lr_scheduler(
        torch_optimizer(optimizer), warmup_steps=warmup_steps, total_steps=total_steps, schedule=schedule
    )


def forward_backward(
    model: nn.Module,
    micro_batches: Sequence[MicroBatch],
    loss_fn: LossFn,
    *,
    response_len: int,
    temperature: float = 1.0,
    with_entropy: bool = True,
    entropy_grad: bool = True,
) -> list[dict[str, float]]:
    """Forward and backward every micro-batch through the pipeline; returns each one's metrics on every rank.

    ``model`` is the DDP wrapper. Each micro-batch holds ``input_ids``, ``attention_mask``,
    ``position_ids`` (engine layout) and what ``loss_fn`` reads (advantages, old log-probs,
    masks...). The gradients left in the parameters' ``main_grad`` are those of
    ``sum(loss_fn(...)[0] over micro-batches)``, averaged over DP ranks: the same as calling
    ``backward()`` on each micro-batch's loss under FSDP, so a worker's loss scaling (e.g.
    ``len(micro) / len(mini)``) carries over unchanged. Collective; see the module docstring
    for the once-per-step rule. ``entropy_grad=False`` hands ``loss_fn`` the entropy detached.
    """
    if not micro_batches:
        raise ValueError("forward_backward needs at least one micro-batch")
    check_layout(micro_batches[0]["input_ids"], response_len)
    if not temperature > 0:
        raise ValueError(f"temperature={temperature} must be positive")
    info = model_info(model)
    read_out = (
        value_head(response_len=response_len)
        if info.value_head
        else logprob_head(
            response_len=response_len,
            temperature=temperature,
            with_entropy=with_entropy,
            vocab_size=info.arch.vocab_size,
        )
    )

    def head(output: torch.Tensor, micro: MicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        _, results = read_out(output, micro)
        outputs = results["values"] if info.value_head else results["log_probs"]
        entropy = results.get("entropy")
        if entropy is not None and not entropy_grad:
            entropy = entropy.detach()
        loss, metrics = loss_fn(outputs, entropy, micro)
        return loss, {
            name: torch.as_tensor(value, dtype=torch.float32).detach() for name, value in metrics.items()
        }

    results = run_micro_batches(model, micro_batches, head, forward_only=False)
    return [{name: float(value) for name, value in result.items()} for result in results]


def clip_grad_norm_and_step(
    model: nn.Module,
    optimizer: MegatronOptimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    *,
    max_grad_norm: float,
) -> float:
    """Clip to a global L2 norm of ``max_grad_norm``, step, zero the gradients; returns the pre-clip norm.

    Same contract as the FSDP backend's function of this name: collective (the norm is reduced
    over the model-parallel group, and a non-finite flag over the data-parallel group, so every
    rank gets the same verdict and takes the same branch); ``max_grad_norm == 0`` disables
    clipping; a non-finite norm on any rank skips the step on every rank, drops the gradients
    and is returned as NaN everywhere; the scheduler is not stepped. Gradients (``main_grad`` buffers and ``.grad``) are zero on return either way.
    """
    del scheduler  # stepped by the caller once per RL step
    if max_grad_norm < 0:
        raise ValueError(f"max_grad_norm={max_grad_norm} must be non-negative (0 disables clipping)")
    found_inf = optimizer.prepare_grads()  # copies main_grad to .grad (fp32: the same tensors)
    norm = math.nan if found_inf else float(optimizer.get_grad_norm())
    # The norm is reduced over the model-parallel group only; DP replicas agree because their
    # gradients were all-reduced, but one flag over DP makes the skip collective even if a
    # replica's gradients went bad after that reduction.
    bad = torch.tensor([0.0 if math.isfinite(norm) else 1.0], device=next(model.parameters()).device)
    dist.all_reduce(bad, group=parallel_state.get_data_parallel_group())
    if bad.item() > 0:
        norm = math.nan
    if math.isfinite(norm):
        if max_grad_norm > 0:
            clip_grad_by_total_norm_fp32(optimizer.get_parameters(), max_grad_norm, norm)
        optimizer.step_with_ready_grads()
    optimizer.zero_grad(set_to_none=True)
    zero_grad_buffer: Callable[[], None] = model.zero_grad_buffer  # type: ignore[assignment]
    zero_grad_buffer()
    return norm


def offload_tensors(
    model: nn.Module, optimizer: MegatronOptimizer
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(parameters and gradient buffers, optimizer state) of this rank's stage, for offloading.

    For :class:`~hybridflow.backends.offload.DeviceOffload`, which moves storages: megatron's
    DDP keeps every ``main_grad`` as a view of its flat gradient buffer (and, with the
    distributed optimizer, every parameter as a view of a flat parameter buffer), so listing the
    views moves the buffers whole. The optimizer's part is Adam's state (this DP rank's range
    only, with the distributed optimizer) plus, under bf16, the fp32 main weights (the param
    groups' tensors that do not live in the model's parameters; in fp32 the groups hold the
    parameters themselves or views of their buffer, which are not optimizer state).
    """
    parameters: list[torch.Tensor] = []
    for parameter in model.parameters():
        parameters.append(parameter)
        for grad in (getattr(parameter, "main_grad", None), parameter.grad):
            if isinstance(grad, torch.Tensor):
                parameters.append(grad)
    inner = torch_optimizer(optimizer)
    own = {parameter.untyped_storage().data_ptr() for parameter in model.parameters()}
    state = optimizer_state_tensors(inner)
    for group in inner.param_groups:
        for main in group["params"]:
            if main.untyped_storage().data_ptr() not in own:
                state.append(main)
                if main.grad is not None:
                    state.append(main.grad)
    return parameters, state
