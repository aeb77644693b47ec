"""The rollout role on vLLM with tensor parallelism: each rank's engine holds, and receives, only its shard.

Deployed (by :func:`hybridflow.trainer.roles.job_roles`) on the actor's pool when
``rollout.engine: vllm`` and the generation is model-parallel (``rollout.tensorParallelSize
t_g > 1``) or the megatron actor is (``t*p > 1``). One vLLM engine shard per rank joins the
workers' ``torch.distributed`` world (:class:`~hybridflow.engines.vllm_engine.VLLMRolloutEngine`
with ``tensor_parallel_size=t_g``), its TP groups being the generation mesh's
(:func:`vllm_tensor_parallel_groups`, checked at construction):

* FSDP2 actor: ``DeviceMesh.fsdp_generation(world, tp=t_g)`` (generation TP rank
  ``r // (d/t_g)``, strided groups). Each rank receives, from the ranks that
  hold its rows, only the part of its ``1/t_g`` generation block it lacks
  (:mod:`hybridflow.resharding.fsdp`), bucket by bucket, in the engine's dtype, and writes each
  bucket straight into vLLM's sharded parameters.
* Megatron actor ``(p, t, d)``: ``DeviceMesh.generation(training, pp=1, tp=t_g)``, the
  3D-HybridEngine's layout (micro-DP groups exchange their training shards,
  :meth:`~hybridflow.resharding.transfer.Resharder.generation_buckets`); its generation TP
  groups are consecutive ranks when ``t_g`` is 1 or ``t`` and strided otherwise (t 4 -> t_g 2:
  ``[0, 2], [1, 3]``), and vLLM's groups are built from those ranks
  (:mod:`hybridflow.engines.vllm_groups`). The generation shard, HF-named blocks of generation
  TP rank ``j``, is vLLM TP rank ``j``'s shard, written in bucket by bucket (64 MiB of
  generation bytes), in the engine's dtype. The rank's own blocks are views of megatron's
  parameters (no copy, and no cast when the dtypes agree: fp32 into fp32 on CPU, bf16 into
  bf16 on GPUs); only q/k/v of a rank holding several key/value groups is a copy (megatron
  interleaves them per group).

Protocol per RL step, every rank taking part in each call (as
:class:`~hybridflow.workers.rollout.RolloutWorker`):

1. ``sync_weights`` (controller, before generation; collective over the actor's ranks).
2. ``generate_sequences`` (``DP_SPLIT`` on the generation mesh: both ranks of a TP group get
   the same prompts and, through the replica's seed stream ``coord.dp``, the same seeds; the
   output comes from TP rank 0). The colocated actor is offloaded around generation as the spec
   chooses; the engine then sleeps at level 2 (weights and KV cache released on GPUs), so the
   next generation needs a sync first (done here if the controller did not).
   After the load, the sync check (``spec.rollout.weightSyncCheck``) compares this rank's blocks,
   checksummed as they were handed to vLLM, with what vLLM's parameters hold: it covers the
   hand-over into vLLM (the fused and padded layout, the reload, the dtype), not the transfer
   between ranks, whose bytes the resharding's own tests pin.
3. ``transition_stats``: this rank's figures of the last sync, measured from the process:
   ``to_generation_seconds``, ``bytes_sent``/``bytes_received`` (the
   :class:`~hybridflow.resharding.meter.TrafficMeter`), ``loaded_bytes`` (written into vLLM),
   ``peak_memory_bytes`` (:class:`~hybridflow.resharding.meter.PeakMemory`), ``packed_copy_bytes``
   (megatron: bytes of the training shard that are copies, not views of the parameters; freed
   before generation), for megatron the transfer's own figures measured from the tensors it
   created (``buckets``, ``largest_bucket_bytes``: receive buffers and casts of one bucket,
   ``cast_bytes``, ``own_bytes``: the rank's own blocks handed to vLLM), and
   ``redundant_bytes`` (the actor's parameter bytes left in place while the engine generates
   from its own shard, 0 once ``offloadDuringGeneration.parameters`` moved them, plus
   ``packed_copy_bytes``: a copy is never hidden).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence

import torch
from torch.distributed.tensor import DTensor
from transformers import AutoConfig

from hybridflow.backends.fsdp.weights import hf_name
from hybridflow.controller import BROADCAST, DP_SPLIT, Batch, DeviceMesh, Worker, WorkerContext, register
from hybridflow.engines.vllm_engine import VLLMRolloutEngine
from hybridflow.resharding import DecoderSpec, ReshardingError, decoder_layout, hybridflow_plan
from hybridflow.resharding.fingerprint import (
    FingerprintPlan,
    SentFingerprint,
    block_fingerprints,
    verify_served,
)
from hybridflow.resharding.fsdp import FSDPResharder, fsdp_generation_plan
from hybridflow.resharding.meter import PeakMemory, TrafficMeter
from hybridflow.resharding.transfer import BucketRecord, Resharder, SubgroupCache
from hybridflow.spec import RLHFJobSpec
from hybridflow.workers.hybrid_rollout import actor_tokenizer
from hybridflow.workers.rollout import actor_offloaded, pack_responses, prompt_token_ids, sampling_params
from hybridflow.workers.weight_push import WEIGHT_BUCKET_BYTES, engine_dtype

__all__ = ["ShardedVLLMRolloutWorker", "vllm_tensor_parallel_groups"]


def vllm_tensor_parallel_groups(mesh: DeviceMesh) -> list[list[int]]:
    """The generation TP groups as vLLM must build them: global ranks in generation-TP-rank order.

    vLLM (and ``torch.distributed``) number a group's members in ascending global-rank order, so
    generation TP rank ``j`` of every group must be its ``j``-th lowest rank, as in the
    3D-HybridEngine's layout (``[0, 2], [1, 3]`` for t 4 -> t_g 2) and in consecutive groups.
    vLLM generates without pipeline stages. Raises :class:`ReshardingError` naming the first
    rank that breaks either rule.
    """
    groups = mesh.groups("tp")
    for group in groups:
        for position, rank in enumerate(group):
            coord = mesh.coords[rank]
            if coord.tp != position or coord.pp != 0:
                raise ReshardingError(
                    f"the generation layout {mesh.describe()} puts rank {rank} at TP rank {coord.tp}, "
                    f"PP rank {coord.pp} in the group {group}; vLLM needs pipeline rank 0 and TP ranks "
                    "in ascending rank order within a group"
                )
    return groups


class ShardedVLLMRolloutWorker(Worker):
    """Generates with one vLLM shard per rank from the colocated actor (FSDP2 or megatron)."""

    def __init__(self, ctx: WorkerContext, spec: RLHFJobSpec) -> None:
        super().__init__(ctx)
        self.spec = spec
        actor_path = spec.models.actor.path
        self.tokenizer, self.eos_ids, self.pad_id = actor_tokenizer(spec)
        tp_groups = vllm_tensor_parallel_groups(ctx.mesh)
        self.t_g = ctx.mesh.tp_size
        self.dtype = engine_dtype(spec, ctx)
        decoder = DecoderSpec.from_hf_config(AutoConfig.from_pretrained(actor_path))
        self.meter = TrafficMeter()
        self.megatron = spec.training.backend == "megatron"
        if self.megatron:
            train = DeviceMesh.training(
                ctx.world_size, pp=spec.training.pipeline_parallel_size, tp=spec.training.tensor_parallel_size
            )
            self.plan = hybridflow_plan(decoder_layout(decoder), train, ctx.mesh)
            # Collective over the world: the micro-DP groups.
            self.resharder = Resharder(self.plan, ctx.rank, SubgroupCache(), self.meter)
        else:
            layout = decoder_layout(decoder, itemsize=self.dtype.itemsize)
            tp_ranks = tuple(coord.tp for coord in ctx.mesh.coords)
            self.fsdp = FSDPResharder(
                fsdp_generation_plan(layout, ctx.world_size, self.t_g, tp_ranks), ctx.rank, meter=self.meter
            )
        rollout = spec.rollout
        # Collective over the world: vLLM creates its groups and agrees on free memory.
        self.engine = VLLMRolloutEngine(
            actor_path,
            max_model_len=spec.data.max_prompt_tokens + rollout.max_response_tokens,
            dtype=self.dtype,
            device=ctx.torch_device,
            gpu_memory_utilization=rollout.gpu_memory_utilization,
            # The same on every rank of a TP group: its ranks must sample alike.
            seed=spec.training.seed * 1000 + ctx.coord.dp,
            tensor_parallel_size=self.t_g,
            tensor_parallel_groups=tp_groups,
        )
        self._stats: dict[str, float] = {}
        self._synced = False
        # The sync check (spec.rollout.weightSyncCheck): this rank's blocks, checksummed as they go
        # into vLLM and read back from its parameters once loaded.
        self._block_dims = {name: block.dim for name, block in self.engine.shard_blocks().items()}
        self._sent: SentFingerprint | None = None

    def _load_megatron(self) -> tuple[int, int, BucketRecord]:
        """The micro-DP exchange bucket by bucket, each bucket written into vLLM before the next.

        The actor's shard is views of its parameters (copies only where megatron's fused layout
        forces them: ``copied`` bytes); the rank's own blocks go into vLLM straight from them
        (cast only if the engine's dtype differs), the peers' blocks through receive buffers of
        one bucket at a time.
        """
        actor = self.ctx.colocated("actor")
        shard = actor.training_shard(self.plan.rank(self.ctx.rank).training)
        copied = actor.training_shard_copy_bytes(shard)
        record = BucketRecord()
        loaded = 0
        buckets = self.resharder.generation_buckets(
            shard, bucket_bytes=WEIGHT_BUCKET_BYTES, dtype=self.dtype, record=record
        )
        for generation in buckets:
            loaded += self.engine.load_shard(
                self._watched((name, generation.blocks(name)) for name in generation.names())
            )
        return loaded, copied, record

    def _load_fsdp(self) -> int:
        model = self.ctx.colocated("actor").model
        local = {
            hf_name(name): (tensor.to_local() if isinstance(tensor, DTensor) else tensor).detach()
            for name, tensor in model.state_dict().items()
        }
        loaded = 0
        for bucket in self.fsdp.generation_buckets(local, bucket_bytes=WEIGHT_BUCKET_BYTES, dtype=self.dtype):
            loaded += self.engine.load_shard(self._watched(bucket))
        return loaded

    def _watched(
        self, named_blocks: Iterable[tuple[str, torch.Tensor | Sequence[torch.Tensor]]]
    ) -> Iterator[tuple[str, torch.Tensor | Sequence[torch.Tensor]]]:
        """The blocks handed to vLLM, each checksummed on the way (the sync check's sender side)."""
        assert self._sent is not None
        return block_fingerprints(named_blocks, self._block_dims, self._sent.plan, self._sent)

    @register(BROADCAST)
    def sync_weights(self) -> int:
        """Deliver this rank's generation shard into its vLLM shard (collective); returns the bytes written."""
        self.engine.wake_up()
        wire_before = self.meter.total
        copied = 0
        record: BucketRecord | None = None
        start = time.perf_counter()
        version = int(self.ctx.colocated("actor").policy_version)
        self._sent = SentFingerprint(FingerprintPlan(self.spec.rollout.weight_sync_check, version))
        with PeakMemory(self.ctx.torch_device) as probe:
            if self.megatron:
                loaded, copied, record = self._load_megatron()
            else:
                loaded = self._load_fsdp()
        seconds = time.perf_counter() - start
        check = verify_served(self.engine, self._sent.to_json(), sender_seconds=self._sent.seconds)
        wire = self.meter.total - wire_before
        self._synced = True
        self._stats = {
            "to_generation_seconds": seconds,
            "bytes_sent": float(wire.sent),
            "bytes_received": float(wire.received),
            "loaded_bytes": float(loaded),
            "packed_copy_bytes": float(copied),
        }
        if record is not None:
            self._stats.update(
                {
                    "buckets": float(record.buckets),
                    "largest_bucket_bytes": float(record.largest_bucket_bytes),
                    "cast_bytes": float(record.cast_bytes),
                    "own_bytes": float(record.own_bytes),
                }
            )
        if probe.bytes is not None:
            self._stats["peak_memory_bytes"] = float(probe.bytes)
        if check is not None:
            self._stats.update(check.stats())
        return loaded

    @register(BROADCAST)
    def transition_stats(self) -> dict[str, float]:
        """This rank's figures of the last sync and generation (empty before the first)."""
        return dict(self._stats)

    @register(DP_SPLIT)
    def generate_sequences(self, prompts: Batch) -> Batch:
        """As :meth:`RolloutWorker.generate_sequences`, decoded by this rank's TP group."""
        if not self._synced:
            self.sync_weights()
        params = sampling_params(self.spec, prompts, stream=self.ctx.coord.dp)
        prompt_ids = prompt_token_ids(prompts)
        actor = self.ctx.colocated("actor")
        with actor_offloaded(self.spec, self.ctx, self._stats):
            self.engine.wake_up()
            kept = actor.local_parameter_bytes()  # measured here: offloaded storages are 0 bytes now
            output = self.engine.generate(prompt_ids, params)
            self.engine.sleep(level=2)  # weights and KV cache go (on GPUs); the next sync reloads them
            self._synced = False
        # The copy megatron's fused layout forced is counted too: it duplicated parameter bytes.
        self._stats["redundant_bytes"] = float(kept) + self._stats.get("packed_copy_bytes", 0.0)
        return pack_responses(
            self.spec,
            self.tokenizer,
            self.pad_id,
            prompts,
            prompt_ids,
            output,
            params.n,
            policy_version=int(actor.policy_version),
        )
