"""The weight push from the actor's pool to a rollout on a pool of its own, both sides.

Protocol (the trainer, ``hybridflow.trainer.overlap``, drives it after every actor update):
the controller submits ``actor.push_weights(version)`` on the actor's pool and
``rollout.receive_weights(version)`` on the rollout's pool together. Every actor rank gathers
the full weights bucket by bucket in the engine's dtype (the FSDP all-gather is collective over
the actor's pool); actor rank 0, bridge rank 0 of the ``weights`` bridge
(``hybridflow.controller.bridge``), broadcasts each bucket over it with
:mod:`hybridflow.resharding.bucket_broadcast`; every rollout rank receives each bucket and loads
it into its engine before the next arrives, then records ``version`` as the policy its samples
come from. Nothing goes through the driver. Peak extra memory: one bucket on each side.

With ``t_g = 1`` (the only generation layout a rollout on its own pool has) this is the
3D-HybridEngine's transition with a generation group of the whole model per rank: the
training shards are all-gathered inside the actor's pool and the result broadcast to the
generation ranks.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch

from hybridflow.controller import WorkerContext
from hybridflow.resharding.bucket_broadcast import receive_buckets, send_buckets
from hybridflow.spec import RLHFJobSpec

__all__ = [
    "WEIGHTS_BRIDGE",
    "WEIGHT_BUCKET_BYTES",
    "engine_dtype",
    "receive_pushed_weights",
    "send_pushed_weights",
    "wants_rollout_log_probs",
]

WEIGHTS_BRIDGE = "weights"
WEIGHT_BUCKET_BYTES = 64 << 20
_ROOT = 0  # the actor's rank 0 is bridge rank 0 (bridge_members)


def engine_dtype(spec: RLHFJobSpec, ctx: WorkerContext) -> torch.dtype:
    """The dtype the engine serves in, and so the dtype weights travel in.

    float32 for the torch engine and on CPU (as the torch engine generates there); bf16 for vLLM
    on GPUs when training in bf16.
    """
    on_cuda = ctx.torch_device.type == "cuda"
    if spec.rollout.engine == "vllm" and on_cuda and spec.training.precision == "bf16":
        return torch.bfloat16
    return torch.float32


def wants_rollout_log_probs(spec: RLHFJobSpec) -> bool:
    """Whether the rollout returns the engine's log-probs (``rollout_log_probs``).

    For the importance-sampling correction, and whenever the rollout has its own pool, where
    the gap between the rollout's and the trainer's log-probs is a metric worth watching.
    """
    return spec.rollout.importance_sampling_on or spec.rollout_has_own_pool


def send_pushed_weights(
    ctx: WorkerContext, buckets: Iterable[list[tuple[str, torch.Tensor]]]
) -> dict[str, float]:
    """The actor's side: walk every bucket (collective); the bridge's member broadcasts them.

    Returns this rank's figures: ``push_seconds`` and ``push_bytes_sent`` (0 on ranks that are
    not on the bridge: they only take part in the gathers).
    """
    started = time.perf_counter()
    bridge = ctx.bridges.get(WEIGHTS_BRIDGE)
    if bridge is None:
        for _ in buckets:  # the gathers are collective over the actor's pool: every rank iterates
            pass
        sent = 0
    else:
        sent = send_buckets(bridge, buckets, root=_ROOT, device=ctx.torch_device)
    return {"push_seconds": time.perf_counter() - started, "push_bytes_sent": float(sent)}


def receive_pushed_weights(ctx: WorkerContext) -> Iterable[list[tuple[str, torch.Tensor]]]:
    """The rollout's side: the buckets the actor sends, one at a time (load each before the next)."""
    bridge = ctx.bridges.get(WEIGHTS_BRIDGE)
    if bridge is None:
        raise LookupError(
            f"role {ctx.role!r} on pool {ctx.pool!r} is not on the {WEIGHTS_BRIDGE!r} bridge: the weights "
            "are pushed only to a rollout on a pool of its own (spec.roles.rollout)"
        )
    return receive_buckets(bridge, root=_ROOT, device=ctx.torch_device)
