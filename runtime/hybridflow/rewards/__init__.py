"""Rewards computed without a model: rule-based scorers and the toy prompt sets they score.

Model-based rewards (a reward or cost model) are a worker role, not this package.
"""

from hybridflow.rewards.rules import (
    RULE_REWARDS,
    TOY_TASKS,
    RewardFunction,
    make_toy_dataset,
    resolve_reward_function,
)

__all__ = ["RULE_REWARDS", "TOY_TASKS", "RewardFunction", "make_toy_dataset", "resolve_reward_function"]
