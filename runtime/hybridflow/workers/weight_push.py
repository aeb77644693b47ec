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

The dtypes live here because the push is where they meet: :func:`engine_dtype` is what the
weights travel and serve in, :func:`trainer_dtype` what the trainer's forward computes in, and
:func:`dtypes_differ` compares the dtype the rollout's log-probs come from with the trainer's,
which turns ``spec.rollout.importanceSampling: auto`` on (``RolloutSpec.corrects``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import torch

from hybridflow.controller import WorkerContext
from hybridflow.resharding.bucket_broadcast import receive_buckets, send_buckets
from hybridflow.resharding.fingerprint import (
    FingerprintPlan,
    SentFingerprint,
)
from hybridflow.spec import RLHFJobSpec

__all__ = [
    "WEIGHTS_BRIDGE",
    "WEIGHT_BUCKET_BYTES",
    "dtypes_differ",
    "engine_dtype",
    "generation_dtype",
    "receive_pushed_weights",
    "send_pushed_weights",
    "trainer_dtype",
]

WEIGHTS_BRIDGE = "weights"
WEIGHT_BUCKET_BYTES = 64 << 20
_ROOT = 0  # the actor's rank 0 is bridge rank 0 (bridge_members)


def engine_dtype(spec: RLHFJobSpec, ctx: WorkerContext) -> torch.dtype:
    """The dtype the engine serves in, and so the dtype weights travel in.

    bf16 on GPUs when training in bf16, for vLLM and the torch engine alike (a replica of its
    own, generating in the job's precision: half the bytes to sync and to hold, tensor-core
    matmuls); float32 on CPU, where both generate in fp32.
    """
    if ctx.torch_device.type == "cuda" and spec.training.precision == "bf16":
        return torch.bfloat16
    return torch.float32


def trainer_dtype(spec: RLHFJobSpec, device: torch.device) -> torch.dtype:
    """The dtype of the trainer's forward passes, and so of its log-probs' logits.

    bf16 on CUDA when ``spec.training.precision`` is bf16 (FSDP2's mixed-precision parameter
    dtype, megatron's parameters: ``backends/*/training.py`` decide alike), else fp32 (also for a
    bf16 job on CPU, which computes in fp32).
    """
    return torch.bfloat16 if spec.training.precision == "bf16" and device.type == "cuda" else torch.float32


def generation_dtype(spec: RLHFJobSpec, ctx: WorkerContext) -> torch.dtype:
    """The dtype the rollout computes its log-probs in, as a worker of the actor's pool sees it.

    :func:`engine_dtype` for an engine with weights of its own; the trainer's dtype when a
    colocated torch engine generates from the trainer's own weights: the actor's module itself
    (one FSDP rank, ``workers/rollout.py``'s ``shares_actor_module``) or the 3D-HybridEngine's
    views of megatron's shards (``t*p > 1``, ``workers/hybrid_rollout.py``).
    """
    training = spec.training
    colocated_torch = spec.rollout.engine == "torch" and not spec.rollout_has_own_pool
    model_parallel = training.tensor_parallel_size * training.pipeline_parallel_size > 1
    in_place = colocated_torch and (
        (training.backend == "megatron" and model_parallel)
        or (training.backend == "fsdp" and ctx.world_size == 1)
    )
    return trainer_dtype(spec, ctx.torch_device) if in_place else engine_dtype(spec, ctx)


def dtypes_differ(spec: RLHFJobSpec, ctx: WorkerContext) -> bool:
    """Whether the rollout's log-probs come from another dtype than the trainer's (``importanceSampling: auto``).

    Every rank of the actor's pool decides alike (same spec, same device type), so the correction
    is the same across the DP group.
    """
    return generation_dtype(spec, ctx) != trainer_dtype(spec, ctx.torch_device)


def send_pushed_weights(
    ctx: WorkerContext, buckets: Iterable[list[tuple[str, torch.Tensor]]], plan: FingerprintPlan
) -> dict[str, float]:
    """The actor's side: walk every bucket (collective); the bridge's member broadcasts them.

    The member checksums what it sends as ``plan`` says and sends the fingerprint after the
    buckets (:mod:`hybridflow.resharding.fingerprint`); every receiver compares its engine with
    it (:func:`~hybridflow.resharding.fingerprint.verify_served` with the trailer). Returns this rank's figures: ``push_seconds`` and
    ``push_bytes_sent`` (0 on ranks that are not on the bridge: they only take part in the gathers).
    """
    started = time.perf_counter()
    bridge = ctx.bridges.get(WEIGHTS_BRIDGE)
    if bridge is None:
        for _ in buckets:  # the gathers are collective over the actor's pool: every rank iterates
            pass
        sent = 0
    else:
        walking = iter(buckets)
        fingerprint = SentFingerprint(plan)
        try:
            sent = send_buckets(
                bridge,
                fingerprint.watch(walking),
                root=_ROOT,
                device=ctx.torch_device,
                trailer=fingerprint.to_json,
            )
        except Exception:
            # A receiver died mid-push (server mode replaces it and pushes again). The other
            # actor ranks are still gathering: finish the walk with them before raising, so that
            # no rank is left alone in a collective.
            for _ in walking:
                pass
            raise
    return {"push_seconds": time.perf_counter() - started, "push_bytes_sent": float(sent)}


def receive_pushed_weights(
    ctx: WorkerContext, trailer: dict[str, Any]
) -> Iterable[list[tuple[str, torch.Tensor]]]:
    """The rollout's side: the buckets the actor sends, one at a time (load each before the next).

    Once they are exhausted, ``trailer`` holds the sender's fingerprint (for
    :func:`~hybridflow.resharding.fingerprint.verify_served`).
    """
    bridge = ctx.bridges.get(WEIGHTS_BRIDGE)
    if bridge is None:
        raise LookupError(
            f"role {ctx.role!r} on pool {ctx.pool!r} is not on the {WEIGHTS_BRIDGE!r} bridge: the weights "
            "are pushed only to a rollout on a pool of its own (spec.roles.rollout)"
        )
    return receive_buckets(bridge, root=_ROOT, device=ctx.torch_device, trailer=trailer)
