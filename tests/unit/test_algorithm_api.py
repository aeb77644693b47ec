"""The algorithm API: which work a step needs, plugin step functions, and the parallel reward scorer."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hybridflow.algorithms.api import load_step_function, needs_old_log_probs, needs_reference
from hybridflow.controller import Batch
from hybridflow.rewards.scorer import RewardFunctionError, RewardScorer
from hybridflow.spec import RLHFJobSpec
from hybridflow.trainer.roles import job_roles
from hybridflow.trainer.runner import ALGORITHM_STEPS, UnsupportedAlgorithmError, step_function

pytestmark = pytest.mark.unit


def _spec(
    algorithm: dict[str, Any] | None = None, rewards: list[dict[str, Any]] | None = None, **training: Any
) -> RLHFJobSpec:
    return RLHFJobSpec.model_validate(
        {
            "models": {"actor": {"path": "/models/actor"}},
            "data": {"trainFiles": ["/data/prompts.jsonl"]},
            "algorithm": {"name": "grpo", "samplesPerPrompt": 4, **(algorithm or {})},
            "training": {"totalSteps": 10, "promptsPerStep": 4, "miniBatchSize": 16, **training},
            "rewards": rewards or [{"function": "target_char"}],
        }
    )


def test_the_reference_is_deployed_and_run_only_for_a_kl_term() -> None:
    assert needs_reference(_spec()) and "reference" in job_roles(_spec())
    no_kl = _spec({"kl": {"coef": 0.0}})
    assert not needs_reference(no_kl)
    assert "reference" not in job_roles(no_kl)


@pytest.mark.parametrize(
    ("algorithm", "training", "needed"),
    [
        ({}, {}, False),  # one mini-batch of all 16 sequences, one epoch: on-policy
        ({"ppoEpochs": 2}, {}, True),
        ({}, {"miniBatchSize": 8}, True),
        ({"kl": {"mode": "reward", "coef": 0.1}}, {}, True),  # the reward penalty reads old log-probs
        ({"kl": {"mode": "reward", "coef": 0.0}}, {}, False),
    ],
)
def test_old_log_probs_are_computed_only_off_policy_or_for_a_kl_reward(
    algorithm: dict[str, Any], training: dict[str, Any], needed: bool
) -> None:
    assert needs_old_log_probs(_spec(algorithm, **training)) is needed


def test_step_functions_are_built_ins_or_import_paths() -> None:
    assert step_function("grpo") is ALGORITHM_STEPS["grpo"]
    assert step_function("hybridflow.algorithms.rloo:train_step") is ALGORITHM_STEPS["rloo"]
    with pytest.raises(UnsupportedAlgorithmError, match="module 'no_such_module' could not be imported"):
        step_function("no_such_module:train_step")
    with pytest.raises(ValueError, match="has no function 'nope'"):
        load_step_function("hybridflow.algorithms.grpo:nope")
    assert _spec({"name": "my_pkg.algos:train_step"}).algorithm.name == "my_pkg.algos:train_step"


def _rollout(texts: list[str]) -> Batch:
    n = len(texts)
    return Batch.from_dict(
        {
            "response_text": texts,
            "data_source": ["target_char"] * n,
            "ground_truth": ["a"] * n,
            "extra_info": [None] * n,
            "uid": [f"p{i // 2}-{i % 2}" for i in range(n)],
            "response_mask": torch.ones(n, 3),
        }
    )


def test_rule_rewards_run_in_a_process_pool_and_match_a_plain_loop() -> None:
    from hybridflow.rewards import resolve_reward_function

    texts = ["aaaa", "abab", "cccc", "a", "", "aaxa", "hgfe", "aaaa"]
    spec = _spec(rewards=[{"function": "target_char", "weight": 2.0}])
    with RewardScorer(spec, None, processes=2) as scorer:
        scores, metrics = scorer.scores(_rollout(texts))
    plain = torch.tensor([resolve_reward_function("target_char")("target_char", t, "a", {}) for t in texts])
    torch.testing.assert_close(scores, 2.0 * plain.float())
    assert metrics["reward/target_char"] == pytest.approx(float(plain.mean()))


def test_a_raising_reward_function_names_itself_and_the_sample() -> None:
    spec = _spec(rewards=[{"function": "user_rewards:fails_on_b"}])
    with RewardScorer(spec, None, processes=2) as scorer, pytest.raises(RewardFunctionError) as failure:
        scorer.scores(_rollout(["aa", "cc", "dd", "xx", "ab", "ee"]))
    message = str(failure.value)
    assert "'user_rewards:fails_on_b' failed on sample p2-0" in message
    assert "'ab'" in message and "KeyError" in message and "no b allowed" in message
