"""``spec.training``: the optimization loop shared by the actor and the critic.

Batch sizes count sequences (one prompt plus one response), except ``promptsPerStep``: a step
samples ``promptsPerStep`` prompts, generates ``samplesPerPrompt`` responses for each, and
splits those sequences into optimizer mini-batches of ``miniBatchSize``, each processed in
micro-batches of ``microBatchSizePerGpu`` per data-parallel rank. The parallel sizes apply to
every trained model (actor and critic), except ``sequenceParallelSize``, which applies to the actor
and the reference (the causal LMs) only; data parallelism fills the rest of the role's pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pydantic import Field

from hybridflow.spec.base import SpecModel
from hybridflow.spec.rules import CrossFieldRule

DEFAULT_FSDP_UNIT_MIN_PARAMETERS = 100_000_000
"""Default smallest FSDP unit, in parameters (FSDP1's size-based wrapping used the same 1e8)."""

DEFAULT_SHARED_PROMPT_MIN_TOKENS = 512
"""Default of ``training.sharedPromptMinTokens``. Running shared prompts once takes two forward
passes instead of one, so it pays only above some size. Measured (tiny model, 1 CPU thread,
forward + backward, rows sharing one 46-token prompt, 32 response tokens): 8 rows (322 prompt
tokens saved) 18.5 ms shared against 18.1 ms whole, 12 rows (506) 22.0 / 23.9, 16 rows (690)
25.0 / 31.0, 24 rows (1,058) 33.3 / 45.0. A real model's prompts of hundreds of tokens times
several samples save far more than this in every micro-batch."""


def fsdp_units(layer_parameters: Sequence[int], min_parameters: int) -> list[list[int]]:
    """Indices of consecutive layers grouped into FSDP units of at least ``min_parameters`` each.

    What ``training.fsdpUnitMinParameters`` means; the FSDP backend shards by it and the planner
    counts its collectives by it.

    Greedy in execution order: a unit closes as soon as it holds ``min_parameters``; the layers
    left at the end, if they hold fewer, are returned in no unit (they join the root's). 0 gives
    one unit per layer. ``layer_parameters`` are the layers' parameter counts.
    """
    if min_parameters < 0:
        raise ValueError(f"min_parameters={min_parameters} must be >= 0")
    units: list[list[int]] = []
    current: list[int] = []
    held = 0
    for index, count in enumerate(layer_parameters):
        current.append(index)
        held += count
        if held >= min_parameters:
            units.append(current)
            current, held = [], 0
    return units


class OffloadSpec(SpecModel):
    """What the actor moves to host memory while the rollout generates, and brings back after."""

    parameters: bool = Field(
        default=False,
        description=(
            "The actor's parameters (its FSDP shards, or megatron's parameters) and gradient buffers. "
            "Not with the torch engine on a one-GPU actor pool, which generates from those very "
            "parameters."
        ),
    )
    optimizer_state: bool = Field(
        default=False,
        description=(
            "The actor's optimizer state: AdamW's two moments (twice the fp32 parameters) and, with "
            "megatron in bf16, its fp32 main weights."
        ),
    )


DEFAULT_LORA_TARGETS: tuple[str, ...] = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)
"""Every linear of a Qwen2/Llama decoder layer (``hybridflow.models.lora.DEFAULT_TARGET_MODULES``;
the spec does not import torch)."""


class LoRASpec(SpecModel):
    """A low-rank adapter trained on a frozen base (docs/lora.md)."""

    rank: int = Field(
        ge=1,
        le=1024,
        description="Rank r of each adapter: A is [r, in], B is [out, r]. 8 to 64 is usual; 16 a good start.",
    )
    alpha: float = Field(
        default=32.0,
        gt=0,
        description="The adapter's output is scaled by alpha / rank (PEFT's lora_alpha).",
    )
    target_modules: list[str] = Field(
        default_factory=lambda: list(DEFAULT_LORA_TARGETS),
        min_length=1,
        description=(
            "Names of the linear modules to adapt (the last part of their path): by default every "
            "linear of a decoder layer. A name that matches no linear of the model fails the job at "
            "load, naming the model's linears. The LM head is never adapted."
        ),
    )
    dropout: float = Field(
        default=0.0,
        ge=0.0,
        lt=1.0,
        description="Dropout on each adapter's input while training (0: none; log-prob passes never drop).",
    )
    critic: bool = Field(
        default=False,
        description=(
            "Also train the critic (ppo, safe-rlhf) as an adapter on its frozen backbone, with its value "
            "head trained whole; otherwise the critic trains all its weights."
        ),
    )


class TrainingSpec(SpecModel):
    """Steps, batch sizes, optimizer, precision and training-time parallelism."""

    backend: Literal["fsdp", "megatron"] = Field(
        default="fsdp",
        description=(
            "Training backend: 'fsdp' (PyTorch FSDP2: data parallelism, and Ulysses sequence parallelism "
            "with sequenceParallelSize; the training and rollout tensorParallelSize and pipelineParallelSize "
            "must be 1) or 'megatron' (Megatron-core: "
            "tensor and pipeline parallelism; with tensorParallelSize * pipelineParallelSize > 1 the "
            "3D-HybridEngine reshards to the rollout's layout and generates with rollout.engine 'torch')."
        ),
    )
    total_steps: int = Field(
        ge=1,
        description="Training steps to run; a step is one rollout of promptsPerStep prompts and its updates.",
    )
    prompts_per_step: int = Field(
        default=8,
        ge=1,
        description="Prompts sampled per step; each gets spec.algorithm.samplesPerPrompt responses.",
    )
    mini_batch_size: int = Field(
        default=8,
        ge=1,
        description=(
            "Sequences per optimizer update. The step's promptsPerStep * spec.algorithm.samplesPerPrompt "
            "sequences are cut in order into mini-batches of this size; when it does not divide them, "
            "the last mini-batch of each epoch is smaller (its loss is normalized by its own token or "
            "sequence count, like every mini-batch's). At least that product: each step is a single "
            "on-policy update per epoch."
        ),
    )
    micro_batch_size_per_gpu: int = Field(
        default=1,
        ge=1,
        description=(
            "Sequences per forward/backward pass on one data-parallel rank; gradients accumulate over "
            "micro-batches. Trades memory for speed, never changes the result: losses are normalized by "
            "the whole mini-batch's token or sequence count (spec.algorithm.lossAggregation)."
        ),
    )
    max_tokens_per_micro_batch: int | None = Field(
        default=None,
        ge=1,
        description=(
            "backend 'fsdp' only: form each rank's update micro-batches by a token budget instead of "
            "microBatchSizePerGpu: rows sorted by length, packed while rows x the widest row stay within "
            "this many tokens, and trimmed of the columns that are padding in every row. Unset: fixed "
            "row counts. Never changes the result (global loss counts)."
        ),
    )
    pack_sequences: bool = Field(
        default=False,
        description=(
            "backend 'fsdp' only: run the log-prob, value and update passes on packed sequences: each "
            "micro-batch's rows laid end to end as one row of real tokens, positions restarting per "
            "sequence, attention kept within each sequence (block-diagonal mask; flash-attention's "
            "variable-length kernel on CUDA with bf16 where installed), so no compute goes to padding. "
            "Results equal the padded layout's up to floating-point summation order. With "
            "maxTokensPerMicroBatch the budget then counts real tokens."
        ),
    )
    learning_rate: float = Field(
        default=1e-6,
        gt=0,
        description="Peak learning rate of the actor (AdamW).",
    )
    critic_learning_rate: float = Field(
        default=1e-5,
        gt=0,
        description="Peak learning rate of the critic (AdamW); used by ppo and safe-rlhf.",
    )
    warmup_steps: int = Field(
        default=0,
        ge=0,
        description="Steps of linear warmup from 0 to the peak learning rate; at most totalSteps.",
    )
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        default="constant",
        description=("Learning-rate shape after warmup; 'linear' and 'cosine' decay to 0 at totalSteps."),
    )
    max_grad_norm: float = Field(
        default=1.0,
        ge=0,
        description="Gradients are rescaled so their global L2 norm is at most this; 0 disables clipping.",
    )
    weight_decay: float = Field(
        default=0.0,
        ge=0,
        description=(
            "AdamW's decoupled weight decay of the actor and the critic: each optimizer step also "
            "shrinks every trained weight by learningRate * weightDecay of itself. 0 (the default) "
            "turns it off. FSDP decays every trained parameter alike (as veRL's FSDP workers); "
            "megatron leaves biases and norm weights undecayed (megatron-core's parameter groups)."
        ),
    )
    precision: Literal["bf16", "fp32"] = Field(
        default="bf16",
        description=(
            "Compute precision of forward and backward passes; master weights and optimizer state stay "
            "fp32 either way."
        ),
    )
    activation_checkpointing: bool = Field(
        default=False,
        description=(
            "Recompute each decoder layer's activations in the backward pass instead of keeping them "
            "from the forward: activation memory of about one layer instead of all of them, for about "
            "one more forward pass of compute per update. Same gradients either way. FSDP: transformers' "
            "gradient checkpointing (non-reentrant); megatron: full recompute of every layer."
        ),
    )
    shared_prompt_min_tokens: int = Field(
        default=DEFAULT_SHARED_PROMPT_MIN_TOKENS,
        ge=0,
        description=(
            "backend 'fsdp', padded passes (not packSequences): rows of a micro-batch that carry the same "
            "prompt (the samplesPerPrompt responses of one prompt) run it once, with its keys and values "
            "shared, when that saves at least this many prompt tokens in the micro-batch; below it the "
            "second forward pass this takes costs more than it saves (measured on CPU: even at about "
            "500 tokens). Results equal the unshared ones up to floating-point summation order, with "
            "activationCheckpointing too."
        ),
    )
    compile: bool = Field(
        default=False,
        description=(
            "backend 'fsdp': compile the trained and scoring models' forward passes (and so their "
            "backward) with torch.compile, in regions FSDP leaves whole: the whole decoder body when "
            "its layers share the root FSDP unit (small models), else each decoder layer. The first "
            "passes pay the compile (one per mode and shape, tens of seconds each on a CPU), kept in the "
            "compile cache beside the checkpoints for a resumed attempt; reported as the step phase "
            "'compile'. Results equal eager up to floating-point reassociation. Off by default: on the "
            "tiny CPU demo it does not pay back its compile (docs/benchmarks.md)."
        ),
    )
    fsdp_unit_min_parameters: int = Field(
        default=DEFAULT_FSDP_UNIT_MIN_PARAMETERS,
        ge=0,
        description=(
            "FSDP: consecutive decoder layers are sharded as one unit (one all-gather and one "
            "reduce-scatter per unit and pass) until the unit holds at least this many parameters; "
            "layers too few to fill a unit join the root unit. Bigger units mean fewer collectives "
            "(each has a fixed latency) and more memory gathered at once; 0 makes every layer its "
            "own unit. The default 100M gives one unit per layer to 7B-size models (about 200M "
            "parameters per layer) and groups the layers of smaller ones. Same results at any value. Ignored by megatron."
        ),
    )
    offload_during_generation: OffloadSpec = Field(
        default=OffloadSpec(),
        description=(
            "Frees the device memory of the actor's training state for generation (KV cache, the "
            "engine's weights): moved to pinned host memory after the weight sync and back after "
            "generation, every step; results are the same, each step pays two host copies."
        ),
    )
    tensor_parallel_size: int = Field(
        default=1,
        ge=1,
        description="Tensor-parallel size of each trained model; above 1 needs backend 'megatron'.",
    )
    pipeline_parallel_size: int = Field(
        default=1,
        ge=1,
        description="Pipeline-parallel size of each trained model; above 1 needs backend 'megatron'.",
    )
    sequence_parallel_size: int = Field(
        default=1,
        ge=1,
        description=(
            "backend 'fsdp': Ulysses sequence parallelism for the actor and the reference. Groups of this "
            "many consecutive ranks get the same rows and split every sequence's columns between them "
            "(attention swaps heads for columns with two all-to-alls per layer), so each rank holds the "
            "activations of 1/size of the tokens: longer responses fit in the same memory. The data-parallel "
            "size becomes the pool's GPUs / size; FSDP still shards the weights over the whole pool. Same "
            "results as size 1 up to floating-point summation order. Must divide the actor's (and the "
            "reference's) pool and the model's attention and key-value head counts (checked at load). "
            "Not with packSequences, compile or a critic (value models run data-parallel over whole "
            "sequences); the reward and cost models score whole sequences, and sharedPromptMinTokens is "
            "not used. docs/sequence-parallel.md."
        ),
    )
    seed: int = Field(
        default=0,
        ge=0,
        description="Seed of weight initialization (critic value head) and of sampling during rollouts.",
    )
    lora: LoRASpec | None = Field(
        default=None,
        description=(
            "Train the actor (and optionally the critic) as a LoRA adapter on its frozen base: only the "
            "adapter's parameters train and hold optimizer state, the reference policy is the base with "
            "the adapter switched off (no reference model is loaded), and each weight sync moves the "
            "adapter alone. backend 'fsdp' only. docs/lora.md."
        ),
    )


TRAINING_RULES: tuple[CrossFieldRule[TrainingSpec], ...] = (
    CrossFieldRule[TrainingSpec](
        name="token-budget-needs-fsdp",
        node_path="spec.training",
        field_path=".maxTokensPerMicroBatch",
        cel="self.backend == 'fsdp' || !has(self.maxTokensPerMicroBatch)",
        message="is supported with backend 'fsdp' only (megatron's pipeline needs equal micro-batch shapes)",
        holds=lambda training: training.backend == "fsdp" or training.max_tokens_per_micro_batch is None,
        observed=lambda training: f"{training.max_tokens_per_micro_batch} with backend {training.backend!r}",
    ),
    CrossFieldRule[TrainingSpec](
        name="compile-needs-fsdp",
        node_path="spec.training",
        field_path=".compile",
        cel="self.backend == 'fsdp' || !self.compile",
        message="is supported with backend 'fsdp' only (megatron-core fuses its own kernels)",
        holds=lambda training: training.backend == "fsdp" or not training.compile,
        observed=lambda training: f"true with backend {training.backend!r}",
    ),
    CrossFieldRule[TrainingSpec](
        name="packing-needs-fsdp",
        node_path="spec.training",
        field_path=".packSequences",
        cel="self.backend == 'fsdp' || !self.packSequences",
        message="is supported with backend 'fsdp' only (megatron's pipeline needs equal micro-batch shapes)",
        holds=lambda training: training.backend == "fsdp" or not training.pack_sequences,
        observed=lambda training: f"true with backend {training.backend!r}",
    ),
    CrossFieldRule[TrainingSpec](
        name="lora-needs-fsdp",
        node_path="spec.training",
        field_path=".lora",
        cel="self.backend == 'fsdp' || !has(self.lora)",
        message="is supported with backend 'fsdp' only (megatron-core's LoRA is not wired to the 3D-HybridEngine)",
        holds=lambda training: training.backend == "fsdp" or training.lora is None,
        observed=lambda training: f"set with backend {training.backend!r}",
    ),
    CrossFieldRule[TrainingSpec](
        name="sequence-parallel-needs-fsdp",
        node_path="spec.training",
        field_path=".sequenceParallelSize",
        cel="self.backend == 'fsdp' || self.sequenceParallelSize == 1",
        message=(
            "must be 1 with backend 'megatron'; Ulysses sequence parallelism is implemented for backend "
            "'fsdp' (megatron splits long sequences with its tensor parallelism instead)"
        ),
        holds=lambda training: training.backend == "fsdp" or training.sequence_parallel_size == 1,
        observed=lambda training: f"{training.sequence_parallel_size} with backend {training.backend!r}",
    ),
    CrossFieldRule[TrainingSpec](
        name="sequence-parallel-not-with-packing",
        node_path="spec.training",
        field_path=".sequenceParallelSize",
        cel="self.sequenceParallelSize == 1 || !self.packSequences",
        message=(
            "must be 1 with packSequences: Ulysses attention splits the columns of padded rows under one "
            "causal mask, and packed rows would need each sequence's boundaries across the ranks' slices"
        ),
        holds=lambda training: training.sequence_parallel_size == 1 or not training.pack_sequences,
        observed=lambda training: f"{training.sequence_parallel_size} with packSequences true",
    ),
    CrossFieldRule[TrainingSpec](
        name="sequence-parallel-not-with-compile",
        node_path="spec.training",
        field_path=".sequenceParallelSize",
        cel="self.sequenceParallelSize == 1 || !self.compile",
        message=(
            "must be 1 with compile: Ulysses attention (all-to-alls inside every layer, a context installed "
            "per micro-batch) is not supported under torch.compile"
        ),
        holds=lambda training: training.sequence_parallel_size == 1 or not training.compile,
        observed=lambda training: f"{training.sequence_parallel_size} with compile true",
    ),
    CrossFieldRule[TrainingSpec](
        name="warmup-within-total-steps",
        node_path="spec.training",
        field_path=".warmupSteps",
        cel="self.warmupSteps <= self.totalSteps",
        message="must not exceed totalSteps",
        holds=lambda training: training.warmup_steps <= training.total_steps,
        observed=lambda training: f"{training.warmup_steps} with totalSteps {training.total_steps}",
    ),
    CrossFieldRule[TrainingSpec](
        name="tensor-parallel-needs-megatron",
        node_path="spec.training",
        field_path=".tensorParallelSize",
        cel="self.backend == 'megatron' || self.tensorParallelSize == 1",
        message="must be 1 with backend 'fsdp', which shards by data parallelism only; tensor parallelism needs backend 'megatron'",
        holds=lambda training: training.backend == "megatron" or training.tensor_parallel_size == 1,
        observed=lambda training: f"{training.tensor_parallel_size} with backend {training.backend!r}",
    ),
    CrossFieldRule[TrainingSpec](
        name="pipeline-parallel-needs-megatron",
        node_path="spec.training",
        field_path=".pipelineParallelSize",
        cel="self.backend == 'megatron' || self.pipelineParallelSize == 1",
        message="must be 1 with backend 'fsdp'; pipeline parallelism needs backend 'megatron'",
        holds=lambda training: training.backend == "megatron" or training.pipeline_parallel_size == 1,
        observed=lambda training: f"{training.pipeline_parallel_size} with backend {training.backend!r}",
    ),
)
