"""The rollout role of the 3D-HybridEngine: model-parallel generation from the actor's own shards.

Deployed (by :func:`hybridflow.trainer.roles.job_roles`) when the actor trains on megatron with
``t*p > 1``, on the actor's pool, with the generation mesh
``DeviceMesh.generation(training mesh, pp=p_g, tp=t_g)`` (``spec.rollout.pipelineParallelSize``
and ``tensorParallelSize``). ``DP_SPLIT`` on that mesh gives every generation replica (one
generation DP index: a TP x PP group of ``t_g*p_g`` ranks) its own prompts, the same on each of
its ranks, and collects the replica's output from its TP rank 0 of the last generation stage.

Protocol, per RL step, every rank of the pool taking part in each call:

1. ``sync_weights`` (controller, before generation): asks the colocated actor for this rank's
   :class:`~hybridflow.resharding.transfer.TrainingShard` (views of its megatron parameters:
   no copy where the fused layout allows) and runs :meth:`Resharder.to_generation`, the
   all-gather inside each micro-DP group (collective there), then points the
   :class:`~hybridflow.engines.tp_engine.TensorParallelRolloutEngine` at the resulting
   generation shard (no copy): the engine reads the rank's own part of the weights where the
   trainer keeps them, and only the received blocks are memory of its own. With
   ``offloadDuringGeneration.parameters`` the trainer's storages leave the device during
   generation, so the rank's own part is copied first (counted in ``packed_copy_bytes``). The
   first call builds the engine, which creates the generation TP and replica process groups
   (collective over the pool).
2. ``generate_sequences`` (controller): decodes over each replica, then
   :meth:`Resharder.to_training` releases the generation-only memory (received buffers), and the
   training shard is dropped. If no shard is live (a second generation in one step, a
   validation pass), it runs step 1 first.
3. ``transition_stats`` (controller, after the step): this rank's figures of the last round,
   measured from the process, which :mod:`hybridflow.trainer.runner` turns into ``reshard/*``
   metrics: ``to_generation_seconds`` (getting the actor's shard included, and copying it when
   parameters are offloaded; ``packing_seconds`` apart), ``bytes_sent``/``bytes_received`` (handed to ``torch.distributed``, counted by the
   resharder's :class:`~hybridflow.resharding.meter.TrafficMeter`), ``peak_memory_bytes``
   (:class:`~hybridflow.resharding.meter.PeakMemory` over that and the exchange; absent where the
   process cannot be measured), ``packed_copy_bytes`` (the actor reports the bytes of its shard
   that do not live in its parameters' storages: 0 when every block is a view),
   ``redundant_bytes`` (held while generating and not read, plus that copy while the parameters
   it duplicates stay on the device: measured inside the offload window),
   ``to_training_seconds``, ``freed_bytes``.

Between 1 and 2 the actor must not train (the controller's step order guarantees it); the
generation shard reads a snapshot of its weights.
"""

from __future__ import annotations

import time
from typing import Any

from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from hybridflow.controller import BROADCAST, DP_SPLIT, Batch, DeviceMesh, Worker, WorkerContext, register
from hybridflow.engines.tp_engine import TensorParallelRolloutEngine
from hybridflow.resharding import DecoderSpec, decoder_layout, hybridflow_plan
from hybridflow.resharding.meter import PeakMemory
from hybridflow.resharding.transfer import GenerationShard, Resharder, SubgroupCache, TrainingShard
from hybridflow.spec import RLHFJobSpec
from hybridflow.workers.rollout import actor_offloaded, pack_responses, prompt_token_ids, sampling_params

__all__ = ["HybridRolloutWorker", "actor_tokenizer", "eos_token_ids"]


def eos_token_ids(model_path: str) -> list[int]:
    """The ids HF ``generate`` stops on: the generation config's, else the model config's."""
    try:
        found: Any = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:  # no generation_config.json
        found = None
    if found is None:
        found = AutoConfig.from_pretrained(model_path).eos_token_id
    if found is None:
        return []
    return [int(found)] if isinstance(found, int) else [int(token) for token in found]


def actor_tokenizer(spec: RLHFJobSpec) -> tuple[Any, list[int], int]:
    """The actor's tokenizer, its eos ids (generation config first, then the tokenizer's) and the pad id."""
    actor = spec.models.actor
    tokenizer = AutoTokenizer.from_pretrained(actor.tokenizer_path or actor.path)
    eos_ids = eos_token_ids(actor.path) or [int(tokenizer.eos_token_id)]
    pad = tokenizer.pad_token_id
    return tokenizer, eos_ids, int(pad if pad is not None else eos_ids[0])


class HybridRolloutWorker(Worker):
    """Generates with the generation layout ``p_g-t_g`` from the colocated megatron actor's shards."""

    def __init__(self, ctx: WorkerContext, spec: RLHFJobSpec) -> None:
        super().__init__(ctx)
        self.spec = spec
        actor_path = spec.models.actor.path
        self.tokenizer, self.eos_ids, self.pad_id = actor_tokenizer(spec)
        self.decoder = DecoderSpec.from_hf_config(AutoConfig.from_pretrained(actor_path))
        train = DeviceMesh.training(
            ctx.world_size, pp=spec.training.pipeline_parallel_size, tp=spec.training.tensor_parallel_size
        )
        self.plan = hybridflow_plan(decoder_layout(self.decoder), train, ctx.mesh)
        self.groups = SubgroupCache()
        self.resharder = Resharder(self.plan, ctx.rank, self.groups)  # collective: the micro-DP groups
        self.engine: TensorParallelRolloutEngine | None = None
        self._shard: TrainingShard | None = None
        self._generation: GenerationShard | None = None
        self._stats: dict[str, float] = {}
        self._resharding_redundant = 0.0
        choice = spec.training.offload_during_generation
        self._offloads_parameters = choice.parameters and not spec.rollout_has_own_pool

    @register(BROADCAST)
    def sync_weights(self) -> int:
        """Train -> generate (see the module docstring); returns the bytes this rank received."""
        self._release()
        actor = self.ctx.colocated("actor")
        start = time.perf_counter()
        with PeakMemory(self.ctx.torch_device) as probe:
            shard = actor.training_shard(self.plan.rank(self.ctx.rank).training)
            if self._offloads_parameters:
                # The engine reads its own blocks in place while the actor's storages leave the
                # device: it needs them as memory of its own (one copy of M/(t*p)).
                shard = TrainingShard.pack(shard.blocks, shard.views())
            self._shard = shard
            packing_seconds = time.perf_counter() - start
            self._generation, stats = self.resharder.to_generation(self._shard, measure_memory=False)
        seconds = time.perf_counter() - start
        copied = actor.training_shard_copy_bytes(self._shard)
        if self.engine is None:
            self.engine = TensorParallelRolloutEngine(
                self.decoder,
                self._generation,
                self.ctx.mesh,
                self.ctx.rank,
                self.groups,
                eos_token_ids=self.eos_ids,
                pad_token_id=self.pad_id,
            )
        else:
            self.engine.set_weights(self._generation)
        self._stats = {
            "to_generation_seconds": seconds,
            "packing_seconds": packing_seconds,
            "bytes_sent": float(stats.wire_sent),
            "bytes_received": float(stats.wire_received),
            "held_bytes": float(stats.held.total),
            "packed_copy_bytes": float(copied),
            "redundant_bytes": float(stats.redundant.total + copied),
        }
        self._resharding_redundant = float(stats.redundant.total)
        if probe.bytes is not None:
            self._stats["peak_memory_bytes"] = float(probe.bytes)
        return stats.bytes_received

    def _release(self) -> None:
        """Generate -> train: free the generation-only memory and this step's training shard copy."""
        if self._generation is None or self._shard is None:
            return
        stats = self.resharder.to_training(self._generation, self._shard)
        self._stats["to_training_seconds"] = stats.seconds
        self._stats["freed_bytes"] = float(stats.freed.total)
        self._generation, self._shard = None, None

    @register(DP_SPLIT)
    def generate_sequences(self, prompts: Batch) -> Batch:
        """As :meth:`RolloutWorker.generate_sequences`, decoded by this rank's generation replica."""
        if self._generation is None:
            self.sync_weights()
        assert self.engine is not None
        # One sampling stream per replica: only its output rank samples, the others follow.
        params = sampling_params(self.spec, prompts, stream=self.ctx.coord.dp)
        prompt_ids = prompt_token_ids(prompts)
        actor = self.ctx.colocated("actor")
        with actor_offloaded(self.spec, self.ctx, self._stats):
            self.engine.wake_up()
            # A copy duplicates parameter bytes only while the parameters stay on the device.
            resident = actor.local_parameter_bytes() > 0
            output = self.engine.generate(prompt_ids, params)
            self.engine.sleep()
        copied = self._stats.get("packed_copy_bytes", 0.0) if resident else 0.0
        self._stats["redundant_bytes"] = self._resharding_redundant + copied
        self._release()
        version = int(actor.policy_version)
        return pack_responses(
            self.spec,
            self.tokenizer,
            self.pad_id,
            prompts,
            prompt_ids,
            output,
            params.n,
            policy_version=version,
        )

    @register(BROADCAST)
    def transition_stats(self) -> dict[str, float]:
        """This rank's figures of the last train -> generate -> train round (empty before the first)."""
        return dict(self._stats)
