"""The cost model: seconds and bytes per GPU of each phase of an RL step, for one model on one pool.

Pure arithmetic over a :class:`~hybridflow.planner.shapes.ModelShape`, a parallel layout
(:class:`~hybridflow.planner.parallel.ModelLayoutChoice`), the step's
:class:`~hybridflow.planner.shapes.Workload` and the
:class:`~hybridflow.planner.hardware.DeviceConstants`. ``N`` is the parameter count, ``T`` the
tokens of the step (prompt + response of every sequence), ``b`` the bytes per parameter.

Time
  * forward (log-probs, values, scores): ``2*N*T`` FLOPs over ``n`` GPUs at ``efficiency(T/n)``
    of peak, stretched by the pipeline bubble ``1 + (p-1)/m`` (``m`` micro-batches per DP rank),
    plus Megatron's two TP all-reduces of the activations per layer and a fixed cost per call
    (with FSDP, also its per-unit work: :func:`fsdp_unit_count` units per pass, on one rank too).
  * training: ``training_pass_ratio`` (3: ``6*N*T`` FLOPs) times the forward's compute and
    fixed costs per epoch (forward and backward), four TP all-reduces per layer,
    and the gradient synchronisation over ``d`` ranks: ``2(d-1)/d`` of the shard's bytes for
    Megatron's all-reduce, ``3(d-1)/d`` of them for FSDP (all-gather in forward and backward,
    reduce-scatter of gradients); and one optimizer step per mini-batch and epoch: its fixed
    cost (``optimizer_step_overhead_seconds``) plus :data:`OPTIMIZER_BYTES_PER_PARAMETER` of
    memory traffic per parameter of the optimizer's shard, and, on more than one rank, the
    all-reduce of the gradient norm.
  * generation: each of the ``n/t_g`` replicas decodes its share of the sequences in waves that
    fit its KV cache; a decoding step reads the whole generation shard (``b*N/t_g`` bytes) and
    the KV cache of the wave at its average context, or computes ``2*N*batch/t_g`` FLOPs at
    the device's decode efficiency (thin GEMMs), whichever is slower (a roofline), plus two TP
    all-reduce latencies per layer and a fixed cost; prefill is a forward pass over the prompts.
  * resharding (train -> generate): the bytes each rank receives in the 3D-HybridEngine
    transition, :func:`hybridflow.resharding.plan.table2` (``(tp - t_g)/(t_g tp) M`` with
    ``p_g = 1``), over NVLink when the micro-DP group sits in one node; with FSDP each rank
    receives its generation block less the rows it holds (the full weights, ``(d-1)/d`` of
    them, at ``t_g = 1``; vLLM's ``t_g > 1`` blocks otherwise, as ``resharding.fsdp`` plans),
    one flat gather per 64 MiB weight bucket (:data:`WEIGHT_SYNC_BUCKET_BYTES`).
  * collective latency: every latency-bound collective (FSDP's per-layer all-gathers and
    reduce-scatters, Megatron's per-layer TP all-reduces, per micro-batch) costs
    ``collective_latency_seconds``; on CPUs with gloo this, and FSDP's own work around each
    unit's collective, not bandwidth, dominates (``--profile`` measures the two together).

Memory per GPU (bytes)
  * trained models: weights and gradients ``2b*N/(p t)``; Adam moments and (for 16-bit
    weights) fp32 master weights, ``(8 + 4)*N/(p t d)`` with Megatron's distributed optimizer;
    FSDP shards all of it ``n`` ways. Activations of one micro-batch with selective
    recomputation and sequence parallelism, ``34*s*h*L/(p t)`` bytes at 16 bits (Korthikanti et
    al., MLSys'23, Sec. 4), times the ``min(p, m)`` micro-batches 1F1B keeps in flight, plus the
    fp32 logits of the micro-batch.
  * scoring-only models: weights ``b*N/(p t)``, and the logits of one micro-batch.
  * the actor while generating: its generation shard ``b*N/t_g`` (the training shard lies
    inside it: no redundant copy) and the KV cache of the sequences decoded at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from hybridflow.planner.hardware import DeviceConstants
from hybridflow.planner.parallel import ModelLayoutChoice
from hybridflow.planner.shapes import ModelShape, Workload
from hybridflow.resharding.layout import DecoderSpec, decoder_layout
from hybridflow.resharding.plan import table2
from hybridflow.spec.training import fsdp_units

__all__ = [
    "ACTIVATION_BYTES_PER_TOKEN_HIDDEN_LAYER",
    "OPTIMIZER_BYTES_PER_PARAMETER",
    "GenerationEstimate",
    "ModelMemory",
    "forward_collectives",
    "forward_seconds",
    "fsdp_unit_count",
    "generation_estimate",
    "model_memory",
    "optimizer_steps",
    "reshard_bytes",
    "reshard_collectives",
    "reshard_seconds",
    "train_collectives",
    "train_seconds",
]

ACTIVATION_BYTES_PER_TOKEN_HIDDEN_LAYER = 34
"""Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (MLSys'23),
Sec. 4: ``s*b*h*34/t`` bytes per layer with sequence parallelism and selective recomputation,
16-bit activations."""

FP32_BYTES = 4
ADAM_MOMENT_BYTES = 8
"""Adam's two fp32 moments per parameter."""

OPTIMIZER_BYTES_PER_PARAMETER = 28
"""Memory traffic of one AdamW step per fp32 parameter: it reads the weight, the gradient and
both moments (16 bytes) and writes the weight and both moments (12 bytes)."""


def _micro_batches(workload: Workload, layout: ModelLayoutChoice) -> int:
    per_rank = math.ceil(workload.sequences / layout.dp)
    return max(1, math.ceil(per_rank / workload.micro_batch_sequences))


def _bubble(workload: Workload, layout: ModelLayoutChoice) -> float:
    """1F1B pipeline bubble: ``(p-1)`` idle slots per ``m`` micro-batches."""
    return 1.0 + (layout.pp - 1) / _micro_batches(workload, layout)


def _tp_allreduce_seconds(
    model: ModelShape, layout: ModelLayoutChoice, workload: Workload, device: DeviceConstants, per_layer: int
) -> float:
    """Megatron's activation all-reduces inside the TP group (ring: ``2(t-1)/t`` of the tensor each)."""
    if layout.tp == 1:
        return 0.0
    tokens_per_rank = workload.tokens / layout.dp
    tensor = tokens_per_rank * model.decoder.hidden_size * workload.param_bytes
    layers = model.decoder.num_layers / layout.pp
    ring = 2 * (layout.tp - 1) / layout.tp
    return per_layer * layers * ring * tensor / device.intra_node_bytes_per_second


def _compute_seconds(
    flops: float, tokens: float, layout: ModelLayoutChoice, workload: Workload, device: DeviceConstants
) -> float:
    gpus = layout.world_size
    return flops / (gpus * device.peak_flops * device.efficiency(tokens / gpus)) * _bubble(workload, layout)


def _collectives_per_micro_batch(
    model: ModelShape, layout: ModelLayoutChoice, workload: Workload, passes: int
) -> int:
    """Latency-bound collectives of one micro-batch over ``passes`` (1: forward, 3: forward+backward).

    FSDP gathers each unit's parameters (:func:`fsdp_unit_count`) in the forward and again in the
    backward, and reduce-scatters their gradients: one collective per unit and pass. Megatron's
    TP all-reduces twice per layer and pass.
    """
    layers = model.decoder.num_layers
    if workload.backend == "fsdp":
        return 0 if layout.dp == 1 else passes * fsdp_unit_count(model, workload)
    return 0 if layout.tp == 1 else 2 * passes * layers // layout.pp


def forward_collectives(model: ModelShape, layout: ModelLayoutChoice, workload: Workload) -> int:
    """Latency-bound collectives one rank issues in :func:`forward_seconds`."""
    return _micro_batches(workload, layout) * _collectives_per_micro_batch(model, layout, workload, 1)


def train_collectives(model: ModelShape, layout: ModelLayoutChoice, workload: Workload) -> int:
    """Latency-bound collectives one rank issues in :func:`train_seconds`.

    Per micro-batch those of its passes; per optimizer step, on more than one rank, the
    all-reduce of the gradient norm.
    """
    micro = _micro_batches(workload, layout)
    per_step = 1 if layout.world_size > 1 else 0
    return workload.update_epochs * micro * _collectives_per_micro_batch(
        model, layout, workload, 3
    ) + per_step * optimizer_steps(workload)


def optimizer_steps(workload: Workload) -> int:
    """Optimizer steps of one RL step: one per mini-batch and epoch."""
    minis = (
        1
        if workload.mini_batch_sequences is None
        else math.ceil(workload.sequences / workload.mini_batch_sequences)
    )
    return workload.update_epochs * minis


def _optimizer_step_seconds(
    model: ModelShape, layout: ModelLayoutChoice, workload: Workload, device: DeviceConstants
) -> float:
    """One optimizer step on one rank: its fixed cost and the memory traffic of its shard.

    FSDP shards the optimizer over every rank; megatron's distributed optimizer over all
    ``p*t*d`` of them too (each rank updates its slice of its ``(p, t)`` shard).
    """
    shard = model.params / layout.world_size
    traffic = OPTIMIZER_BYTES_PER_PARAMETER * shard / device.memory_bandwidth_bytes_per_second
    return device.optimizer_step_overhead_seconds + traffic


def fsdp_unit_count(model: ModelShape, workload: Workload) -> int:
    """FSDP's units (groups of decoder layers, :func:`~hybridflow.spec.training.fsdp_units`, and the
    root): its per-unit work runs on every pass, one rank or many."""
    if workload.backend != "fsdp":
        return 0
    layers = [model.layer_params] * model.decoder.num_layers
    return len(fsdp_units(layers, workload.fsdp_unit_min_parameters)) + 1


def _micro_batch_fixed_seconds(model: ModelShape, workload: Workload, device: DeviceConstants) -> float:
    """The fixed cost of one forward call: the call itself and FSDP's per-unit work."""
    return device.call_overhead_seconds + fsdp_unit_count(model, workload) * device.fsdp_unit_overhead_seconds


def forward_seconds(
    model: ModelShape, layout: ModelLayoutChoice, workload: Workload, device: DeviceConstants
) -> float:
    """One forward pass over every sequence of the step (log-probs, values or scores)."""
    tokens = workload.tokens
    compute = _compute_seconds(2 * model.params * tokens, tokens, layout, workload, device)
    micro = _micro_batches(workload, layout)
    calls = micro * _micro_batch_fixed_seconds(model, workload, device)
    latency = (
        micro * _collectives_per_micro_batch(model, layout, workload, 1) * device.collective_latency_seconds
    )
    return compute + _tp_allreduce_seconds(model, layout, workload, device, per_layer=2) + calls + latency


def _gradient_sync_seconds(
    model: ModelShape,
    layout: ModelLayoutChoice,
    workload: Workload,
    device: DeviceConstants,
    gpus_per_node: int,
) -> float:
    if layout.dp == 1:
        return 0.0
    shard = model.params * workload.param_bytes / (layout.pp * layout.tp)
    factor = 3 if workload.backend == "fsdp" else 2
    bandwidth = (
        device.intra_node_bytes_per_second
        if layout.world_size <= gpus_per_node
        else device.inter_node_bytes_per_second
    )
    return factor * (layout.dp - 1) / layout.dp * shard / bandwidth


def train_seconds(
    model: ModelShape,
    layout: ModelLayoutChoice,
    workload: Workload,
    device: DeviceConstants,
    gpus_per_node: int,
) -> float:
    """The optimizer passes over the step's sequences (``update_epochs`` of them)."""
    tokens = workload.tokens
    epochs = workload.update_epochs
    ratio = device.training_pass_ratio
    compute = ratio * _compute_seconds(2 * model.params * tokens, tokens, layout, workload, device)
    micro = _micro_batches(workload, layout)
    calls = ratio * micro * _micro_batch_fixed_seconds(model, workload, device)
    latency = (
        micro * _collectives_per_micro_batch(model, layout, workload, 3) * device.collective_latency_seconds
    )
    comm = (
        _tp_allreduce_seconds(model, layout, workload, device, per_layer=4)
        + _gradient_sync_seconds(model, layout, workload, device, gpus_per_node)
        + latency
    )
    steps = optimizer_steps(workload)
    step_latency = (1 if layout.world_size > 1 else 0) * device.collective_latency_seconds
    return epochs * (compute + calls + comm) + steps * (
        _optimizer_step_seconds(model, layout, workload, device) + step_latency
    )


def reshard_bytes(model: ModelShape, layout: ModelLayoutChoice, workload: Workload) -> int:
    """Bytes each rank receives going from training ``p-t-d`` to generation ``1-t_g`` (Table 2, HybridFlow).

    Table 2's ``M`` is the TP-partitioned bytes (``ModelLayout.partitioned_bytes``); the
    replicated RMSNorm weights move only when ``p > 1`` and are added as the plan does: each
    rank receives the other stages' copies. FSDP: :func:`_fsdp_reshard_bytes`.
    """
    t_g = layout.generation_tp or 1
    if workload.backend == "fsdp":
        return _fsdp_reshard_bytes(model.decoder, workload.param_bytes, layout.dp, t_g)
    partitioned, _ = model.param_bytes(workload.param_bytes)
    row = table2("hybridflow", p=layout.pp, t=layout.tp, d=layout.dp, p_g=1, t_g=t_g, model_bytes=partitioned)
    return int(row.traffic) + model.replicated_bytes_from_other_stages(layout.pp, workload.param_bytes)


def _fsdp_rows(rows: int, world: int, rank: int) -> tuple[int, int]:
    """FSDP2's rows of ``rank`` (``torch.chunk`` sizes), as ``hybridflow.resharding.fsdp.fsdp_rows``."""
    chunk = -(-rows // world)
    start = min(rank * chunk, rows)
    return start, min(start + chunk, rows)


@lru_cache(maxsize=256)
def _fsdp_reshard_bytes(decoder: DecoderSpec, itemsize: int, world: int, t_g: int) -> int:
    """The most bytes any of ``world`` FSDP ranks receives to hold its ``t_g``-way generation block.

    A rank receives every element of its blocks except the rows it holds already:
    ``resharding.fsdp.fsdp_generation_plan`` with the job's strided TP groups (generation TP
    rank ``r // (d/t_g)``, ``DeviceMesh.fsdp_generation``), counted per rank in ``O(params)``
    instead of listing every piece (a paper-scale pool has 10^4 ranks' worth of pairs).
    """
    layout = decoder_layout(decoder, itemsize)
    most = 0
    for rank in range(world):
        received = 0
        for param in layout.params:
            want = param.block(t_g, rank // (world // t_g))
            start, stop = _fsdp_rows(param.shape[0], world, rank)
            per_row = math.prod(want.shape[1:])
            if want.dim == 0:
                held_rows = max(0, min(stop, want.stop) - max(start, want.start))
            else:  # whole (replicated) or split by columns: the rank holds its rows of the block
                held_rows = stop - start
            received += want.numel - held_rows * per_row
        most = max(most, received)
    return most * itemsize


WEIGHT_SYNC_BUCKET_BYTES = 64 << 20
"""The weight sync's bucket (``workers.weight_push.WEIGHT_BUCKET_BYTES``; a test keeps the two equal)."""


def reshard_collectives(model: ModelShape, layout: ModelLayoutChoice, workload: Workload) -> int:
    """Latency-bound collectives of :func:`reshard_seconds`: FSDP's weight sync gathers per bucket.

    ``backends/fsdp/weights.py`` groups the parameters, in order, into buckets of at most
    :data:`WEIGHT_SYNC_BUCKET_BYTES` (a larger tensor alone) and gathers each bucket's shards
    with one flat all-gather; this counts those buckets.
    """
    if workload.backend != "fsdp" or reshard_bytes(model, layout, workload) == 0:
        return 0
    buckets, filled = 0, 0
    for param in model.layout(workload.param_bytes).params:
        size = param.numel * workload.param_bytes
        if buckets == 0 or (filled and filled + size > WEIGHT_SYNC_BUCKET_BYTES):
            buckets, filled = buckets + 1, 0
        filled += size
    return buckets


def reshard_seconds(
    model: ModelShape,
    layout: ModelLayoutChoice,
    workload: Workload,
    device: DeviceConstants,
    gpus_per_node: int,
) -> float:
    """The train -> generate all-gather inside each micro-DP group (generate -> train moves nothing)."""
    received = reshard_bytes(model, layout, workload)
    if received == 0:
        return 0.0
    if workload.backend == "fsdp":
        # One flat gather per weight bucket (backends/fsdp/weights.py).
        gathers = reshard_collectives(model, layout, workload)
        return received / device.intra_node_bytes_per_second + gathers * device.collective_latency_seconds
    # A micro-DP group spans the TP ranks of one replica (one node) and, with p > 1, its stages.
    group_span = layout.tp if layout.pp == 1 else layout.tp * layout.dp * layout.pp
    bandwidth = (
        device.intra_node_bytes_per_second
        if group_span <= gpus_per_node
        else device.inter_node_bytes_per_second
    )
    return received / bandwidth


@dataclass(frozen=True)
class ModelMemory:
    """Bytes per GPU of one model: held all step (``static``), and on top of it while it trains or scores."""

    weights: float
    gradients: float
    optimizer: float
    train_activations: float
    forward_activations: float

    @property
    def static(self) -> float:
        return self.weights + self.optimizer


def _logits_bytes(model: ModelShape, layout: ModelLayoutChoice, workload: Workload) -> float:
    seq = workload.prompt_tokens + workload.response_tokens
    return workload.micro_batch_sequences * seq * model.decoder.vocab_size * FP32_BYTES / layout.tp


def model_memory(
    model: ModelShape, layout: ModelLayoutChoice, workload: Workload, *, trains: bool
) -> ModelMemory:
    """Per-GPU memory of ``model`` under ``layout`` (see the module docstring for the formulas)."""
    b, n = workload.param_bytes, model.params
    if workload.backend == "fsdp":
        model_shards = layout.world_size
        optimizer_shards = layout.world_size
    else:
        model_shards = layout.pp * layout.tp
        optimizer_shards = layout.world_size
    weights = b * n / model_shards
    logits = _logits_bytes(model, layout, workload)
    if not trains:
        return ModelMemory(weights, 0.0, 0.0, 0.0, logits)
    master = FP32_BYTES if b < FP32_BYTES else 0
    optimizer = (ADAM_MOMENT_BYTES + master) * n / optimizer_shards
    d = model.decoder
    seq = workload.prompt_tokens + workload.response_tokens
    per_micro = (
        workload.micro_batch_sequences
        * seq
        * d.hidden_size
        * (d.num_layers / layout.pp)
        * ACTIVATION_BYTES_PER_TOKEN_HIDDEN_LAYER
        / layout.tp
        * b
        / 2
    )
    in_flight = min(layout.pp, _micro_batches(workload, layout))
    return ModelMemory(weights, b * n / model_shards, optimizer, per_micro * in_flight + logits, logits)


@dataclass(frozen=True)
class GenerationEstimate:
    """The actor's generation on its pool: seconds, and the KV cache it holds per GPU at most."""

    seconds: float
    waves: int
    sequences_per_wave: int
    kv_bytes_per_gpu: float
    weights_bytes_per_gpu: float
    collectives: int = 0
    """Latency-bound collectives on the way (TP all-reduces of the decoding steps)."""


def generation_estimate(
    model: ModelShape,
    layout: ModelLayoutChoice,
    workload: Workload,
    device: DeviceConstants,
    *,
    kv_budget_bytes_per_gpu: float,
) -> GenerationEstimate | None:
    """Decode every response on the actor's pool, or ``None`` if not one sequence's KV cache fits."""
    t_g = layout.generation_tp or 1
    replicas = layout.world_size // t_g
    per_replica = math.ceil(workload.sequences / replicas)
    seq = workload.prompt_tokens + workload.response_tokens
    kv_per_sequence = model.kv_bytes_per_token(workload.param_bytes) * seq / t_g
    weights = workload.param_bytes * model.params / t_g
    fits = (
        int((kv_budget_bytes_per_gpu - weights) // kv_per_sequence)
        if kv_budget_bytes_per_gpu > weights
        else 0
    )
    if fits < 1:
        return None
    waves = math.ceil(per_replica / fits)
    batch = math.ceil(per_replica / waves)
    # Each step reads the shard's weights and the KV cache of every sequence decoded at once, at
    # its average context (the prompt plus half the response).
    context = workload.prompt_tokens + workload.response_tokens / 2
    kv_read = batch * model.kv_bytes_per_token(workload.param_bytes) * context / t_g
    read = (weights + kv_read) / (
        device.memory_bandwidth_bytes_per_second * device.decode_bandwidth_efficiency
    )
    # Roofline: a decoding step is bound by reading the shard or by its thin GEMMs at the
    # device's decode efficiency (the saturating curve would count the small batch twice).
    decode_efficiency = device.decode_efficiency or device.train_efficiency
    compute = 2 * model.params * batch / (t_g * device.peak_flops * decode_efficiency)
    # Two TP all-reduces per layer per decoding step; their latency, not their bytes, dominates.
    all_reduces = 2 * model.decoder.num_layers * device.collective_latency_seconds if t_g > 1 else 0.0
    # A one-rank FSDP actor's torch engine generates from the wrapped module itself (no copy):
    # every step also runs FSDP's per-unit work (workers/rollout.py, shares_actor_module).
    shared = (
        device.shared_decode_step_overhead_seconds
        if workload.backend == "fsdp" and workload.rollout_engine == "torch" and layout.world_size == 1
        else 0.0
    )
    step = max(read, compute) + all_reduces + device.decode_step_overhead_seconds + shared
    prompt_tokens = batch * workload.prompt_tokens
    prefill = (
        2 * model.params * prompt_tokens / (t_g * device.peak_flops * device.efficiency(prompt_tokens))
        + device.call_overhead_seconds
    )
    seconds = waves * (prefill + workload.response_tokens * step)
    collectives = waves * workload.response_tokens * 2 * model.decoder.num_layers if t_g > 1 else 0
    return GenerationEstimate(seconds, waves, batch, batch * kv_per_sequence, weights, collectives)
