"""The training backend interface the workers drive, and the registry that names its implementations.

One worker per role (:mod:`hybridflow.workers.policy`, :mod:`hybridflow.workers.value`) runs
the epoch / mini-batch / micro-batch loop of every backend; a :class:`TrainingBackend` is what
differs: how one model is loaded into the worker's mesh, run forward and backward, stepped,
checkpointed, offloaded and read back out. :func:`training_backend` maps
``spec.training.backend`` to its factory, imported only when asked for (megatron-core is not
installed everywhere FSDP runs).

Protocol, on every rank of the role's pool, after the worker joined the ``torch.distributed``
world (every call below is made by every rank in the same order; those marked collective
communicate, so a rank that skips one leaves its peers waiting):

1. ``factory(spec, device)`` builds the backend (megatron: initialises its parallel state from
   ``spec.training``'s TP/PP sizes, collective), then :meth:`TrainingBackend.load` reads the
   model from ``model_path`` into this rank's shard or stage (collective under FSDP).
   ``learning_rate`` set means trained: activation checkpointing as the spec asks, an AdamW
   optimizer and the job's LR schedule; None means frozen (no gradients, no optimizer).
2. Scoring: :meth:`~TrainingBackend.log_probs` (a causal LM) and :meth:`~TrainingBackend.values`
   (a value model) take a whole DP shard of rows and run it in micro-batches of
   ``spec.training.microBatchSizePerGpu`` without gradients; results come back fp32 on the CPU,
   on every rank.
3. Training, per mini-batch (one optimizer step): one
   :meth:`~TrainingBackend.forward_backward` call with all of the mini-batch's micro-batches
   (gradients start from zero and accumulate the sum of the micro-batches' losses, averaged
   over DP ranks), then one :meth:`~TrainingBackend.clip_and_step`. The loss function owns the
   normalisation: the worker divides by the mini-batch's global token or sequence count
   (:mod:`hybridflow.rlmath.aggregation`), so the backend never rescales a loss. Per RL step,
   once, :meth:`~TrainingBackend.step_lr_schedule`.
4. Around generation (colocated rollout): :meth:`~TrainingBackend.offload_tensors` names the
   tensors the worker's :class:`~hybridflow.backends.offload.DeviceOffload` moves; nothing is
   computed until they are back.
5. Weight sync: :meth:`~TrainingBackend.weight_buckets` (full HF tensors, collective, every rank
   in lockstep), :meth:`~TrainingBackend.full_state_dict` (the same, whole), or, for the
   3D-HybridEngine, :meth:`~TrainingBackend.training_shard` (this rank's slices, local). A backend
   without a capability raises :class:`UnsupportedByBackend` naming what would provide it.
6. :meth:`~TrainingBackend.save_state` / :meth:`~TrainingBackend.load_state` (collective):
   model, optimizer and LR schedule.

Batches cross this interface as ``Mapping[str, Tensor]`` of the engine layout
(:func:`hybridflow.engines.layout.response_tensors`: ``input_ids``, ``attention_mask``,
``position_ids`` ``[rows, prompt + response]``, ``responses``, ``response_mask`` and the
per-token fields a loss reads), not as the controller's ``Batch``: backends sit below the
controller and never load Ray.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist
from torch import nn

from hybridflow.resharding.layout import Block
from hybridflow.resharding.meter import TrafficMeter
from hybridflow.resharding.transfer import TrainingShard
from hybridflow.spec import RLHFJobSpec

__all__ = [
    "BACKEND_NAMES",
    "LossFn",
    "ModelKind",
    "Tensors",
    "TrainingBackend",
    "TrainingBackendFactory",
    "UnsupportedByBackend",
    "training_backend",
]

Tensors = Mapping[str, torch.Tensor]
"""Rows of a batch by field, in the engine layout (see the module docstring)."""

ModelKind = Literal["causal-lm", "value"]
"""A causal LM scored by per-token log-probs (actor, reference) or a decoder with a scalar head
scored by per-token values (critics, reward and cost models)."""

LossFn = Callable[[torch.Tensor, torch.Tensor | None, Tensors], tuple[torch.Tensor, Mapping[str, Any]]]
"""``loss_fn(outputs, entropy, micro) -> (loss, metrics)``, once per micro-batch.

``outputs`` are the log-probs ``[b, R]`` (a causal LM) or values ``[b, R]`` (a value model,
``entropy`` None), with grad; ``micro`` holds the fields the worker asked for, on the model's
device. ``loss`` is this micro-batch's share of the mini-batch's loss (already normalised by
global counts); ``metrics`` are scalars (floats or 0-d tensors), returned as floats."""


class UnsupportedByBackend(NotImplementedError):
    """A worker method the job's training backend does not provide (the message names the one that does)."""


class TrainingBackend(Protocol):
    """One model of one role on this rank; see the module docstring for the call order."""

    name: str
    """The ``spec.training.backend`` value this implementation serves."""

    @property
    def model(self) -> nn.Module:
        """The module as the backend holds it (FSDP's sharded module, megatron's DDP or bare stage).

        A colocated torch engine with ``t_g = 1`` generates from it in place.
        """
        ...

    def load(self, model_path: str, *, kind: ModelKind, learning_rate: float | None) -> None:
        """Load ``model_path`` into this rank's shard; with ``learning_rate``, also the optimizer and schedule."""
        ...

    def dp_group(self) -> dist.ProcessGroup | None:
        """The data-parallel group the loss counts are summed over (None: the default group)."""
        ...

    def log_probs(
        self, batch: Tensors, *, temperature: float, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-token log-probs (and entropy) ``[rows, R]`` of the responses, fp32 on the CPU, no grad."""
        ...

    def values(self, batch: Tensors) -> torch.Tensor:
        """Per-token values ``[rows, R]`` at the columns that predict each response token, fp32 on the CPU."""
        ...

    def forward_backward(
        self,
        micro_batches: Sequence[Tensors],
        loss_fn: LossFn,
        *,
        fields: Sequence[str],
        temperature: float = 1.0,
        entropy_grad: bool = True,
    ) -> list[dict[str, float]]:
        """Zero the gradients, then forward and backward every micro-batch; each one's metrics, on every rank.

        ``fields`` are the micro-batch fields ``loss_fn`` reads (moved to the device). The
        gradients are those of the sum of the losses, averaged over DP ranks. Collective; one
        call per optimizer step. ``entropy_grad=False`` (no entropy bonus in the loss) hands
        ``loss_fn`` an entropy without a graph, so backward never runs through it.
        """
        ...

    def clip_and_step(self, *, max_grad_norm: float) -> float:
        """Clip to a global L2 norm (0: no clipping), step, zero the gradients; the pre-clip norm.

        A non-finite norm on any rank skips the step on every rank and returns NaN. Collective.
        """
        ...

    def step_lr_schedule(self) -> None:
        """Advance the LR schedule by one RL step."""
        ...

    @property
    def learning_rate(self) -> float:
        """The learning rate the next optimizer step uses."""
        ...

    @property
    def lr_steps(self) -> int:
        """How often :meth:`step_lr_schedule` ran (restored by :meth:`load_state`)."""
        ...

    def save_state(self, directory: Path) -> None:
        """Write model, optimizer and LR-schedule state into ``directory`` (collective)."""
        ...

    def load_state(self, directory: Path) -> None:
        """Restore what :meth:`save_state` wrote (collective)."""
        ...

    def offload_tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(parameters and gradient buffers, optimizer state) of this rank, for offloading during generation."""
        ...

    def local_parameter_bytes(self) -> int:
        """Bytes of this rank's own parameter storages (a storage shared by views counts once)."""
        ...

    def weight_buckets(
        self, bucket_bytes: int, *, dtype: torch.dtype | None, meter: TrafficMeter | None
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full weights by HF name, a bucket at a time, in ``dtype``; collective, every rank in lockstep."""
        ...

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every full weight by HF name on every rank, on the CPU (checks and export; collective)."""
        ...

    def training_shard(self, blocks: Sequence[Block]) -> TrainingShard:
        """This rank's slices as the resharding plan's training shard (the 3D-HybridEngine; local).

        Views of the live parameters where the backend's layout allows (no copy): valid until the
        next optimizer step.
        """
        ...

    def training_shard_copy_bytes(self, shard: TrainingShard) -> int:
        """Bytes of ``shard`` whose storage is not one of the model's parameter storages (the copies)."""
        ...


TrainingBackendFactory = Callable[[RLHFJobSpec, torch.device], TrainingBackend]
"""``factory(spec, device)``: an empty backend for this rank, configured by ``spec.training``."""


def _fsdp() -> TrainingBackendFactory:
    from hybridflow.backends.fsdp.training import FSDPTrainingBackend

    return FSDPTrainingBackend


def _megatron() -> TrainingBackendFactory:
    from hybridflow.backends.megatron.training import MegatronTrainingBackend

    return MegatronTrainingBackend


_FACTORIES: dict[str, Callable[[], TrainingBackendFactory]] = {"fsdp": _fsdp, "megatron": _megatron}
BACKEND_NAMES = tuple(_FACTORIES)


def training_backend(name: str) -> TrainingBackendFactory:
    """The factory of the backend ``spec.training.backend`` names; imports only that backend."""
    if name not in _FACTORIES:
        raise ValueError(
            f"spec.training.backend: {name!r} is not one of {', '.join(map(repr, BACKEND_NAMES))}"
        )
    return _FACTORIES[name]()
