"""``spec.algorithm``: which RL algorithm runs and the coefficients of its loss.

One section serves all algorithms so a manifest switches algorithm by changing ``name``; a
field that an algorithm does not use says so in its description and is ignored by it,
rather than rejected, so sweeping algorithms over one manifest stays easy. The models an
algorithm needs (a critic for ppo, a cost model for safe-rlhf) are checked on the spec.
"""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import Field

from hybridflow.spec.base import SpecModel
from hybridflow.spec.rules import CrossFieldRule

AlgorithmName = Literal["ppo", "grpo", "remax", "safe-rlhf", "rloo", "reinforce++"]
BUILTIN_ALGORITHMS: tuple[str, ...] = get_args(AlgorithmName)
PLUGIN_PATTERN = r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*"
"""``package.module:function``: a user's step function over the same worker API as the built-ins."""
ALGORITHM_NAME_PATTERN = (
    "^(" + "|".join(name.replace("+", "\\+") for name in BUILTIN_ALGORITHMS) + "|" + PLUGIN_PATTERN + ")$"
)
CRITIC_ALGORITHMS: tuple[str, ...] = ("ppo", "safe-rlhf")
"""Algorithms whose advantages come from a learned value function (GAE), so they train a critic."""
GROUP_BASELINE_ALGORITHMS: tuple[str, ...] = ("grpo", "rloo")
"""Algorithms whose baseline is computed from the other responses to the same prompt."""


class KLSpec(SpecModel):
    """The KL term that keeps the policy close to the reference model."""

    coef: float = Field(
        default=0.001,
        ge=0,
        description="Weight of the KL term (the initial one with the adaptive controller); 0 disables it.",
    )
    estimator: Literal["k1", "k2", "k3"] = Field(
        default="k3",
        description=(
            "Per-token KL estimator from sampled tokens: k1 = log p - log q (unbiased, noisy), "
            "k2 = (log p - log q)^2 / 2, k3 = q/p - log(q/p) - 1 (unbiased, never negative)."
        ),
    )
    mode: Literal["reward", "loss"] = Field(
        default="loss",
        description=(
            "'reward' subtracts coef * KL from the per-token reward before advantages (InstructGPT-style "
            "PPO); 'loss' adds coef * KL to the policy loss (GRPO-style)."
        ),
    )
    controller: Literal["fixed", "adaptive"] = Field(
        default="fixed",
        description=(
            "'fixed' keeps coef constant; 'adaptive' scales it each step towards targetKl "
            "(Ziegler et al., 2019)."
        ),
    )
    target_kl: float = Field(
        default=0.1,
        gt=0,
        description="KL per response the adaptive controller steers towards; unused with 'fixed'.",
    )
    horizon: int = Field(
        default=10000,
        ge=1,
        description=(
            "Adaptive controller time constant, in responses: larger means coef changes more slowly. "
            "Unused with 'fixed'."
        ),
    )


KL_RULES: tuple[CrossFieldRule[KLSpec], ...] = (
    CrossFieldRule[KLSpec](
        name="adaptive-kl-needs-positive-coef",
        node_path="spec.algorithm.kl",
        field_path=".coef",
        cel="self.controller != 'adaptive' || self.coef > 0.0",
        message="must be > 0 with controller 'adaptive', which scales coef and cannot move it away from 0",
        holds=lambda kl: kl.controller != "adaptive" or kl.coef > 0.0,
        observed=lambda kl: f"{kl.coef} with controller {kl.controller!r}",
    ),
)


class AlgorithmSpec(SpecModel):
    """The algorithm and its loss coefficients."""

    name: str = Field(
        pattern=ALGORITHM_NAME_PATTERN,
        description=(
            "The RL algorithm: one of " + ", ".join(BUILTIN_ALGORITHMS) + ", or a plugin "
            "'package.module:train_step' (a step function over the same worker API, importable by the "
            "controller; it gets a critic when models.critic is set). ppo and safe-rlhf train a critic "
            "(safe-rlhf adds a cost model, a cost critic and a Lagrangian constraint); grpo and rloo use "
            "the other responses to the same prompt as the baseline; remax uses the greedy response's "
            "reward; reinforce++ uses a batch-normalized return."
        ),
    )
    gamma: float = Field(
        default=1.0,
        ge=0,
        le=1,
        description="Discount factor over response tokens; 1 treats the response as one decision.",
    )
    gae_lambda: float = Field(
        default=1.0,
        ge=0,
        le=1,
        description="GAE lambda of the critic-based advantage (ppo, safe-rlhf): 1 = Monte-Carlo returns.",
    )
    clip_ratio_low: float = Field(
        default=0.2,
        ge=0,
        lt=1,
        description="Lower clip of the policy ratio: ratios below 1 - clipRatioLow stop pushing the loss.",
    )
    clip_ratio_high: float = Field(
        default=0.2,
        ge=0,
        description=(
            "Upper clip of the policy ratio: ratios above 1 + clipRatioHigh stop pushing the loss. "
            "A value above clipRatioLow ('clip-higher') leaves more room to raise rare tokens."
        ),
    )
    clip_ratio_c: float | None = Field(
        default=None,
        gt=1,
        description=(
            "Dual-clip PPO (Ye et al., 2020): where a token's advantage is negative, its policy loss is "
            "also capped at clipRatioC * -advantage, so a ratio far above 1 + clipRatioHigh (an "
            "off-policy or stale sample) cannot drive an unbounded update; 3 is the usual value. "
            "Unset: off. Reported as actor/dual_clipfrac."
        ),
    )
    value_clip: float = Field(
        default=0.5,
        gt=0,
        description=(
            "Critic updates move each value at most this far from its rollout-time estimate (ppo, safe-rlhf)."
        ),
    )
    entropy_coef: float = Field(
        default=0.0,
        ge=0,
        description="Weight of the entropy bonus in the policy loss; 0 disables it.",
    )
    kl: KLSpec = Field(
        default=KLSpec(),
        description="The KL term against the reference model.",
    )
    samples_per_prompt: int = Field(
        default=1,
        ge=1,
        le=256,
        description=(
            "Responses generated per prompt. grpo and rloo need at least 2, since their baseline is "
            "the other responses of the group."
        ),
    )
    ppo_epochs: int = Field(
        default=1,
        ge=1,
        description="Passes over each step's responses by the optimizer (each pass in mini-batches).",
    )
    loss_aggregation: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = Field(
        default="token-mean",
        description=(
            "How per-token losses (policy, entropy, KL, value) reduce over a mini-batch: 'token-mean' "
            "(every token weighs the same; veRL/DAPO), 'seq-mean-token-mean' (every sequence weighs the "
            "same; the PPO/GRPO papers), 'seq-mean-token-sum' (token sums averaged over sequences; "
            "Dr. GRPO). Counts are global over micro-batches and data-parallel ranks, so neither split "
            "changes the result."
        ),
    )
    target_kl: float | None = Field(
        default=None,
        gt=0,
        description=(
            "Early stop: an actor update ends its remaining ppoEpochs once a mini-batch's k3 estimate of "
            "KL(rollout policy || updated policy) exceeds this. Unset: always run every epoch."
        ),
    )
    cost_limit: float = Field(
        default=0.0,
        description="safe-rlhf only: the expected cost per response the constraint allows.",
    )
    lagrangian_learning_rate: float = Field(
        default=0.05,
        gt=0,
        description=(
            "safe-rlhf only: Adam step size on log(lambda) of the Lagrange multiplier, which grows while "
            "the measured episode cost exceeds costLimit and shrinks towards 0 while it is below."
        ),
    )


ALGORITHM_RULES: tuple[CrossFieldRule[AlgorithmSpec], ...] = (
    CrossFieldRule[AlgorithmSpec](
        name="group-baseline-needs-samples",
        node_path="spec.algorithm",
        field_path=".samplesPerPrompt",
        cel=f"!(self.name in {list(GROUP_BASELINE_ALGORITHMS)!r}) || self.samplesPerPrompt >= 2",
        message="must be >= 2 for grpo and rloo, whose baseline is the other responses to the same prompt",
        holds=lambda algo: algo.name not in GROUP_BASELINE_ALGORITHMS or algo.samples_per_prompt >= 2,
        observed=lambda algo: f"{algo.samples_per_prompt} with name {algo.name!r}",
    ),
)
