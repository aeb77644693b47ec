"""The algorithm API: which work a step needs, plugin step functions, the parallel reward scorer,
and the step breakdown (``timing/<phase>``) each algorithm reports, on fake worker groups."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridflow.algorithms.api import (
    AlgorithmState,
    JobWorkers,
    StepTimer,
    load_step_function,
    needs_old_log_probs,
    needs_reference,
)
from hybridflow.algorithms.timing import unmeasured_seconds
from hybridflow.controller import Batch
from hybridflow.metrics.catalogue import CHECKPOINT_PHASE, OTHER_PHASE, PHASES, STEP_PHASES
from hybridflow.rewards.scorer import RewardFunctionError, RewardScorer
from hybridflow.spec import RLHFJobSpec
from hybridflow.trainer.roles import job_roles
from hybridflow.trainer.runner import ALGORITHM_STEPS, UnsupportedAlgorithmError, step_function
from hybridflow.trainer.step_accounting import PHASE_OF_CALL as RUNNER_PHASE_OF_CALL

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def _spec(
    algorithm: dict[str, Any] | None = None,
    rewards: list[dict[str, Any]] | None = None,
    models: dict[str, Any] | None = None,
    **training: Any,
) -> RLHFJobSpec:
    return RLHFJobSpec.model_validate(
        {
            "models": {"actor": {"path": "/models/actor"}, **(models or {})},
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


def _rollout_with_tokens() -> Batch:
    """Three responses in the engine layout (prompt 2, response 4 columns): 4, 2 and 3 tokens."""
    responses = torch.tensor([[5, 3, 3, 2], [3, 2, 0, 0], [7, 8, 9, 0]])
    lengths = torch.tensor([4, 2, 3])
    response_attention = (torch.arange(4) < lengths[:, None]).long()
    return Batch.from_dict(
        {
            "responses": responses,
            "attention_mask": torch.cat([torch.ones(3, 2, dtype=torch.long), response_attention], dim=1),
            # Row 0's column 2 is a token the policy did not generate (a tool result).
            "response_mask": torch.tensor([[1, 1, 0, 1], [1, 1, 0, 0], [1, 1, 1, 0]]),
            "response_text": ["x", "y", "z"],
            "finish_reason": ["stop", "stop", "length"],
            "data_source": ["t"] * 3,
            "ground_truth": [None] * 3,
            "extra_info": [None] * 3,
            "uid": ["a", "b", "c"],
        }
    )


def test_reward_functions_that_ask_get_the_token_ids_and_finish_reason() -> None:
    from user_rewards import fails_on_b, one_value_too_many, stop_and_token_count, token_ids_as_rewards

    from hybridflow.rewards.parallel import accepted_extras

    assert accepted_extras(fails_on_b) == ()  # the four-argument functions are called as before
    assert accepted_extras(stop_and_token_count) == ("response_token_ids", "finish_reason")
    assert accepted_extras(token_ids_as_rewards) == ("response_token_ids", "finish_reason")
    assert accepted_extras(one_value_too_many) == ("response_token_ids",)
    spec = _spec(rewards=[{"function": "user_rewards:stop_and_token_count"}])
    with RewardScorer(spec, None, processes=2) as scorer:
        scores, token_scores, _ = scorer.score_tokens(_rollout_with_tokens())
    # [5, 3, 3, 2] stopped: 10 - 2; [3, 2] stopped: 10 - 1; [7, 8, 9] cut at the length limit: 0.
    torch.testing.assert_close(scores, torch.tensor([8.0, 9.0, 0.0]))
    assert token_scores is None  # numbers only: the algorithms place them on the last token as before


def test_a_token_level_reward_lands_on_its_tokens_and_sums_to_the_score() -> None:
    spec = _spec(
        rewards=[
            {"function": "user_rewards:token_ids_as_rewards", "weight": 0.5},
            {"function": "user_rewards:stop_and_token_count"},
        ]
    )
    with RewardScorer(spec, None, processes=2) as scorer:
        scores, token_scores, metrics = scorer.score_tokens(_rollout_with_tokens())
    # Half of each token's id where it falls; row 0's tool token (column 2, masked) goes to column 1,
    # the number of the second function on each row's last valid token.
    expected = torch.tensor(
        [[2.5, 1.5 + 1.5, 0.0, 1.0 + 8.0], [1.5, 1.0 + 9.0, 0.0, 0.0], [3.5, 4.0, 4.5, 0.0]]
    )
    assert token_scores is not None
    torch.testing.assert_close(token_scores, expected)
    torch.testing.assert_close(scores, expected.sum(dim=1))  # what GRPO & co. see: the sum
    assert metrics["reward/user_rewards:token_ids_as_rewards"] == pytest.approx((13 + 5 + 24) / 3)


def test_a_token_level_reward_of_the_wrong_length_names_the_sample_and_the_lengths() -> None:
    spec = _spec(rewards=[{"function": "user_rewards:one_value_too_many"}])
    with RewardScorer(spec, None, processes=1) as scorer, pytest.raises(RewardFunctionError) as failure:
        scorer.scores(_rollout_with_tokens())
    assert "failed on sample a" in str(failure.value)
    assert "returned 5 values for a response of 4 tokens" in str(failure.value)


def test_ppo_token_rewards_are_the_token_scores_when_a_reward_was_token_level() -> None:
    from hybridflow.algorithms.common import kl_penalized_token_rewards

    state = AlgorithmState(_spec({"name": "ppo"}, models={"critic": {"path": "/models/critic"}}))
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    scores = torch.tensor([1.0, 2.0])
    outcome = Batch.from_dict({"response_mask": mask, "scores": scores})
    expected = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    torch.testing.assert_close(kl_penalized_token_rewards(outcome, scores, state, {}), expected)
    token_level = outcome.with_fields(token_scores=torch.tensor([[0.5, 0.0, 0.5], [2.0, 0.0, 0.0]]))
    rewards = kl_penalized_token_rewards(token_level, scores, state, {})
    torch.testing.assert_close(rewards, token_level.tensors["token_scores"])


# -- the step breakdown each algorithm reports ------------------------------------------------

WORK_SECONDS = 0.005  # every fake worker call takes at least this long
RESPONSE_TOKENS = 3


class FakeFuture:
    def __init__(self, value: Any) -> None:
        self._value = value

    def result(self) -> Any:
        return self._value


class FakeMethod:
    """``group.method(...)`` and ``group.method.submit(...)``; the work happens on the call (then sleeps)."""

    def __init__(self, group: FakeGroup, name: str) -> None:
        self._group, self._name = group, name

    def __call__(self, *args: Any) -> Any:
        self._group.calls.append(f"{self._group.role}.{self._name}")
        time.sleep(WORK_SECONDS)
        return getattr(self._group, f"_{self._name}")(*args)

    def submit(self, *args: Any) -> FakeFuture:
        return FakeFuture(self(*args))


class FakeGroup:
    """A worker group of two DP ranks whose methods return the fields the real workers would."""

    def __init__(self, role: str, calls: list[str]) -> None:
        self.role, self.calls = role, calls

    def __getattr__(self, name: str) -> FakeMethod:
        if name.startswith("_"):
            raise AttributeError(name)
        return FakeMethod(self, name)

    def _sync_weights(self) -> None:
        return None

    def _generate_sequences(self, prompts: Batch) -> Batch:
        samples = int(prompts.meta["samples"])
        rows = len(prompts) * samples
        return Batch.from_dict(
            {
                "uid": [f"p{row // samples}" for row in range(rows)],
                "response_mask": torch.ones(rows, RESPONSE_TOKENS),
                "attention_mask": torch.ones(rows, 2 + RESPONSE_TOKENS),
            }
        )

    def _rows(self, batch: Batch, name: str, *shape: int) -> Batch:
        generator = torch.Generator().manual_seed(len(self.calls))
        return Batch.from_dict({name: torch.randn(len(batch), *shape, generator=generator) * 0.1})

    def _compute_log_probs(self, batch: Batch) -> Batch:
        return self._rows(batch, "old_log_probs", RESPONSE_TOKENS)

    def _compute_ref_log_probs(self, batch: Batch) -> Batch:
        return self._rows(batch, "ref_log_probs", RESPONSE_TOKENS)

    def _compute_values(self, batch: Batch) -> Batch:
        return self._rows(batch, "values", RESPONSE_TOKENS)

    def _compute_costs(self, batch: Batch) -> Batch:
        return self._rows(batch, "cost_scores")

    def _update_policy(self, batch: Batch) -> list[dict[str, float]]:
        assert "advantages" in batch.tensors
        return [{"actor/policy_loss": 0.1}, {"actor/policy_loss": 0.3}]

    def _update_critic(self, batch: Batch) -> list[dict[str, float]]:
        assert "returns" in batch.tensors
        return [{f"{self.role}/value_loss": 0.2}] * 2


class FakeScorer:
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def scores(self, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        self.calls.append("scorer.scores")
        time.sleep(WORK_SECONDS)
        return torch.arange(len(batch), dtype=torch.float32) % 3, {"reward/target_char": 1.0}

    def score_tokens(self, batch: Batch) -> tuple[torch.Tensor, None, dict[str, float]]:
        scores, metrics = self.scores(batch)
        return scores, None, metrics


def fake_workers(spec: RLHFJobSpec, calls: list[str]) -> JobWorkers:
    """The roles the trainer would deploy for ``spec`` (``job_roles``), as fakes."""
    roles = set(job_roles(spec))
    groups = {role: FakeGroup(role, calls) for role in roles}
    return JobWorkers(
        **{role: groups.get(role) for role in ("reference", "critic", "reward", "cost", "cost_critic")},
        actor=groups["actor"],
        rollout=groups["rollout"],
    )


WITH_CRITIC = {"critic": {"path": "/models/critic"}}
SAFE = {"critic": {"path": "/models/critic"}, "cost": {"path": "/models/cost"}}
ROLLOUT = ("weight_sync", "generate")
# (algorithm spec, training overrides, models, the phases in the order the step ran them,
#  the worker calls besides sync/generate/scores).
STEP_CASES: dict[str, tuple[dict[str, Any], dict[str, Any], dict[str, Any], tuple[str, ...], set[str]]] = {
    "grpo, no KL, on-policy": (
        {"kl": {"coef": 0.0}},
        {},
        {},
        (*ROLLOUT, "reward", "advantages", "actor_update"),
        {"actor.update_policy"},
    ),
    "grpo, KL loss, off-policy": (
        {"ppoEpochs": 2},
        {},
        {},
        (*ROLLOUT, "old_log_probs", "ref_log_probs", "reward", "advantages", "actor_update"),
        {"actor.compute_log_probs", "reference.compute_ref_log_probs", "actor.update_policy"},
    ),
    "rloo, KL reward": (
        {"name": "rloo", "kl": {"mode": "reward", "coef": 0.05}},
        {},
        {},
        (*ROLLOUT, "old_log_probs", "ref_log_probs", "reward", "advantages", "actor_update"),
        {"actor.compute_log_probs", "reference.compute_ref_log_probs", "actor.update_policy"},
    ),
    "reinforce++, KL loss, on-policy": (
        {"name": "reinforce++"},
        {},
        {},
        (*ROLLOUT, "ref_log_probs", "reward", "advantages", "actor_update"),
        {"reference.compute_ref_log_probs", "actor.update_policy"},
    ),
    "remax, no KL": (
        {"name": "remax", "kl": {"coef": 0.0}},
        {},
        {},
        (*ROLLOUT, "reward", "advantages", "actor_update"),
        {"actor.update_policy"},
    ),
    "ppo, KL reward": (
        {"name": "ppo", "kl": {"mode": "reward", "coef": 0.05}},
        {},
        WITH_CRITIC,
        (
            *ROLLOUT,
            "old_log_probs",
            "ref_log_probs",
            "reward",
            "values",
            "advantages",
            "critic_update",
            "actor_update",
        ),
        {
            "actor.compute_log_probs",
            "reference.compute_ref_log_probs",
            "critic.compute_values",
            "critic.update_critic",
            "actor.update_policy",
        },
    ),
    "ppo, no KL, on-policy": (
        {"name": "ppo", "kl": {"coef": 0.0}},
        {},
        WITH_CRITIC,
        (*ROLLOUT, "reward", "values", "advantages", "critic_update", "actor_update"),
        {"critic.compute_values", "critic.update_critic", "actor.update_policy"},
    ),
    "safe-rlhf, KL reward, off-policy": (
        {"name": "safe-rlhf", "kl": {"mode": "reward", "coef": 0.05}, "costLimit": 0.1},
        {"miniBatchSize": 8},
        SAFE,
        (
            *ROLLOUT,
            "old_log_probs",
            "ref_log_probs",
            "reward",
            "cost",
            "values",
            "cost_values",
            "advantages",
            "critic_update",
            "cost_critic_update",
            "actor_update",
        ),
        {
            "actor.compute_log_probs",
            "reference.compute_ref_log_probs",
            "cost.compute_costs",
            "critic.compute_values",
            "cost_critic.compute_values",
            "critic.update_critic",
            "cost_critic.update_critic",
            "actor.update_policy",
        },
    ),
    "the documented plugin": (
        {"name": "my_reinforce:train_step", "kl": {"coef": 0.0}},
        {},
        {},
        (*ROLLOUT, "reward", "advantages", "actor_update"),
        {"actor.update_policy"},
    ),
}


@pytest.mark.parametrize("case", list(STEP_CASES))
def test_a_step_reports_exactly_the_phases_it_ran(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    algorithm, training, models, phases, worker_calls = STEP_CASES[case]
    monkeypatch.syspath_prepend(str(ROOT / "examples" / "plugins"))
    spec = _spec(algorithm, models=models, **training)
    calls: list[str] = []
    workers = fake_workers(spec, calls)
    prompts = Batch.from_dict({"prompt": [f"q{i}" for i in range(4)]}, meta={"samples": 4, "seed": 1})

    started = time.monotonic()
    step = step_function(spec.algorithm.name)
    metrics = step(workers, prompts, FakeScorer(calls), AlgorithmState(spec))
    elapsed = time.monotonic() - started

    timing = {key.removeprefix("timing/"): v for key, v in metrics.items() if key.startswith("timing/")}
    assert tuple(timing) == phases
    assert (
        set(calls) - {"rollout.sync_weights", "rollout.generate_sequences", "scorer.scores"} == worker_calls
    )
    # Every worker call (and the scoring) was inside the phase named for it, which holds its time.
    for phase in set(phases) - {"advantages"}:
        assert timing[phase] >= WORK_SECONDS, phase
    assert {PHASE_OF_CALL[call] for call in calls} == set(phases) - {"advantages"}
    # The trainer moves a call's compile seconds out of the same phase (step_accounting.py).
    assert all(RUNNER_PHASE_OF_CALL[call] == PHASE_OF_CALL[call] for call in calls if call != "scorer.scores")
    # Disjoint intervals inside the step: the rest is `other`, and together they are the step.
    assert sum(timing.values()) <= elapsed
    other = unmeasured_seconds(metrics, elapsed)
    assert other + sum(timing.values()) == pytest.approx(elapsed)
    assert "actor/policy_loss" in metrics and "reward/mean" in metrics


PHASE_OF_CALL = {
    "rollout.sync_weights": "weight_sync",
    "rollout.generate_sequences": "generate",
    "scorer.scores": "reward",
    "actor.compute_log_probs": "old_log_probs",
    "reference.compute_ref_log_probs": "ref_log_probs",
    "critic.compute_values": "values",
    "cost.compute_costs": "cost",
    "cost_critic.compute_values": "cost_values",
    "critic.update_critic": "critic_update",
    "cost_critic.update_critic": "cost_critic_update",
    "actor.update_policy": "actor_update",
}


def test_the_step_timer_takes_only_catalogued_phases_and_no_nesting() -> None:
    timer = StepTimer()
    unknown = r"timing phase 'update': not one of the catalogue's step phases"
    with pytest.raises(ValueError, match=unknown), timer.phase("update"):
        pass
    # `other` is the trainer's remainder, not a phase a step may time.
    with pytest.raises(ValueError, match="'other'"), timer.phase("other"):
        pass
    with (
        timer.phase("generate"),
        pytest.raises(RuntimeError, match="phases do not nest"),
        timer.phase("reward"),
    ):
        pass
    with timer.phase("generate"):
        time.sleep(WORK_SECONDS)
    assert list(timer.metrics()) == ["timing/generate"]  # a phase entered twice adds up
    assert timer.metrics()["timing/generate"] >= WORK_SECONDS
    names = [phase.name for phase in PHASES]
    assert names == [*(phase.name for phase in STEP_PHASES), OTHER_PHASE.name, CHECKPOINT_PHASE.name]
    assert len(set(names)) == len(names)


def test_other_is_the_step_less_its_phases() -> None:
    metrics = {"timing/generate": 1.5, "timing/actor_update": 0.25, "timing/other": 9.0, "reward/mean": 4.0}
    assert unmeasured_seconds(metrics, 2.0) == 0.25
    assert unmeasured_seconds({"timing/generate": 3.0}, 2.0) == 0.0  # overlapping figures of its own


@pytest.mark.parametrize("gpus", [1, 2])
@pytest.mark.parametrize("engine", ["torch", "vllm"])
@pytest.mark.parametrize("own_pool", [False, True])
def test_the_controller_skips_the_sync_exactly_where_the_rollout_shares_the_actors_module(
    gpus: int, engine: str, own_pool: bool
) -> None:
    from types import SimpleNamespace

    from hybridflow.algorithms.api import needs_weight_sync
    from hybridflow.workers.rollout import shares_actor_module

    pools = [{"name": "train", "nodes": 1, "gpusPerNode": gpus}]
    roles = {"actor": "train"}
    if own_pool:
        pools.append({"name": "generate", "nodes": 1, "gpusPerNode": 1})
        roles["rollout"] = "generate"
    spec = RLHFJobSpec.model_validate(
        {
            **_spec().model_dump(by_alias=True, exclude_none=True),
            "rollout": {"engine": engine, "maxStaleness": 1 if own_pool else 0},
            "resourcePools": pools,
            "roles": roles,
        }
    )
    rollout_rank = SimpleNamespace(world_size=1 if own_pool else gpus)  # the rollout pool's size
    shared = shares_actor_module(spec, rollout_rank)  # type: ignore[arg-type]
    assert needs_weight_sync(spec) is not shared
    assert shared == (gpus == 1 and engine == "torch" and not own_pool)
