"""``spec.rewards``: rule-based reward functions, combined as a weighted sum.

Only the shape of a function reference is checked here; whether the name is registered or the
import path resolves is checked by the runtime at startup (``hybridflow.rewards``), because
the spec must stay importable without the user's code.
"""

from __future__ import annotations

from pydantic import Field

from hybridflow.spec.base import SpecModel

REWARD_FUNCTION_PATTERN = r"^([a-z0-9_]+|[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_.]*)$"
"""A registered name (``gsm8k``) or an import path ``package.module:function``."""


class RewardFunctionSpec(SpecModel):
    """One reward function and its weight in the sum."""

    function: str = Field(
        pattern=REWARD_FUNCTION_PATTERN,
        max_length=512,
        description=(
            "A rule registered in hybridflow.rewards (e.g. 'gsm8k') or an import path "
            "'package.module:function' to a function (data_source, response, ground_truth, extra_info) "
            "-> float, importable in the job's image. response is the decoded text without special "
            "tokens; a function that declares the keyword parameters response_token_ids (the "
            "response's token ids, special tokens included) or finish_reason ('stop': ended on its end "
            "token, 'length': cut at rollout.maxResponseTokens), or **kwargs, gets them too. It may "
            "return one float per response token instead: a token-level reward, which ppo, safe-rlhf "
            "and reinforce++ credit to those tokens and the other algorithms sum (docs/algorithms.md)."
        ),
    )
    weight: float = Field(
        default=1.0,
        description="Multiplier of this function's score in the total reward.",
    )
