"""``spec.evaluation``: when the policy is scored on ``spec.data.valFiles``, and how.

The prompts of the validation files are generated with the job's rollout engine and scored
with the job's reward functions (and reward model); nothing trains on them. A greedy pass
(temperature 0: one response per prompt, the same every time for the same weights) and a
sampled pass (the rollout's sampling settings, ``samples`` responses per prompt) each give
their own ``val/<pass>/...`` metrics. With ``spec.data.valFiles`` set and this section left
out, the defaults apply: both passes, after the last step only.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from hybridflow.spec.base import SpecModel
from hybridflow.spec.rules import CrossFieldRule

EvaluationPass = Literal["greedy", "sampled"]
"""The two passes over the validation prompts; each names its metrics (``val/<pass>/...``)."""


class EvaluationSpec(SpecModel):
    """How often the validation prompts are scored, and with which passes."""

    every_steps: int = Field(
        default=0,
        ge=0,
        description=(
            "Evaluate after every this many training steps, and after the last step; 0: after the last "
            "step only."
        ),
    )
    at_start: bool = Field(
        default=False,
        description="Evaluate the initial policy too, before the first step (recorded as step 0).",
    )
    greedy: bool = Field(
        default=True,
        description="Run the greedy pass: temperature 0, one response per prompt (val/greedy/... metrics).",
    )
    samples: int = Field(
        default=1,
        ge=0,
        le=64,
        description=(
            "Responses per prompt of the sampled pass, drawn with spec.rollout's temperature, topP and topK "
            "(val/sampled/... metrics); 0: no sampled pass."
        ),
    )
    max_prompts: int | None = Field(
        default=None,
        ge=1,
        description="Evaluate on the first this many validation prompts only (file order); unset: all of them.",
    )

    @property
    def passes(self) -> tuple[EvaluationPass, ...]:
        """The passes that run, in the order they run: ``greedy`` then ``sampled``."""
        chosen: list[EvaluationPass] = []
        if self.greedy:
            chosen.append("greedy")
        if self.samples > 0:
            chosen.append("sampled")
        return tuple(chosen)


EVALUATION_RULES: tuple[CrossFieldRule[EvaluationSpec], ...] = (
    CrossFieldRule[EvaluationSpec](
        name="evaluation-has-a-pass",
        node_path="spec.evaluation",
        field_path=".samples",
        cel="self.greedy || self.samples > 0",
        message="must be at least 1 when greedy is false: an evaluation needs a greedy or a sampled pass",
        holds=lambda evaluation: evaluation.greedy or evaluation.samples > 0,
        observed=lambda evaluation: f"samples {evaluation.samples} with greedy false",
    ),
)
"""Rules within ``spec.evaluation`` (the one across sections, valFiles, sits with ``RLHFJobSpec``)."""
