"""``spec.models``: where each model's weights and tokenizer are, as local Hugging Face directories.

There is no model hub at run time: every path names a directory that already exists where the
job runs (on a laptop, a local directory; in a cluster, a path inside the pods, typically on a
volume from ``spec.volumes``). Which models are required depends on the algorithm; the
cross-field rules on the spec check that.
"""

from __future__ import annotations

from pydantic import Field

from hybridflow.spec.base import SpecModel

LOCAL_PATH_HELP = (
    "Relative paths resolve against the manifest's directory when run with `hybridflow run`; "
    "in a cluster use absolute paths inside the pods."
)


class ModelSource(SpecModel):
    """A model in Hugging Face format (config.json plus safetensors) and the tokenizer to use with it."""

    path: str = Field(
        min_length=1,
        max_length=4096,
        description=f"Directory of the model in Hugging Face format. {LOCAL_PATH_HELP}",
    )
    tokenizer_path: str | None = Field(
        default=None,
        min_length=1,
        max_length=4096,
        description=f"Directory of the tokenizer, when it is not stored with the model. {LOCAL_PATH_HELP}",
    )


class ModelsSpec(SpecModel):
    """The models of the job, by role. Only the actor is always required."""

    actor: ModelSource = Field(
        description=(
            "The policy being trained; its tokenizer is the job's tokenizer for prompts and responses."
        ),
    )
    reference: ModelSource | None = Field(
        default=None,
        description=(
            "Frozen model the KL penalty compares the policy against. Defaults to the actor's initial "
            "weights (the same path)."
        ),
    )
    critic: ModelSource | None = Field(
        default=None,
        description=(
            "Value model trained alongside the actor; required by ppo and safe-rlhf, rejected by the "
            "algorithms that do not use one. Usually initialized from the reward model or the actor."
        ),
    )
    reward: ModelSource | None = Field(
        default=None,
        description=(
            "Reward model scoring whole responses; its score is added with weight 1 to the weighted "
            "spec.rewards functions. Either this or spec.rewards must be set."
        ),
    )
    cost: ModelSource | None = Field(
        default=None,
        description="Cost model for the safety constraint; required by safe-rlhf and used by nothing else.",
    )

    @property
    def reference_or_actor(self) -> ModelSource:
        """The reference model to load: the explicit one, else the actor's starting weights."""
        return self.reference if self.reference is not None else self.actor
