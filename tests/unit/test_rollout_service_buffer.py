"""The rollout service's bookkeeping without replicas: what enters the buffer, the refill cap, what a step gets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from transformers import AutoTokenizer

from hybridflow.agents.loop import Finish, Insert, TurnContext
from hybridflow.controller import Batch
from hybridflow.engines.continuous import RequestResult, SampleResult
from hybridflow.models.tiny import write_tiny_model
from hybridflow.rewards.rules import environment_reward
from hybridflow.rollout.service import RolloutService
from hybridflow.rollout.trajectories import TrajectoryDriver
from hybridflow.spec import load_job_manifest
from hybridflow.spec.agent import AgentSpec

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def service(
    model_dir: Path,
    tmp_path: Path,
    rewards: list[list[float]],
    trajectories: TrajectoryDriver | None = None,
    **rollout: Any,
) -> RolloutService:
    """A service over no replicas (nothing is routed); ``rewards`` are the scores of the groups in order."""
    doc = yaml.safe_load((ROOT / "examples" / "grpo-tiny-server.yaml").read_text())
    doc["spec"]["models"] = {"actor": {"path": str(model_dir)}}
    doc["spec"]["data"]["trainFiles"] = [str(tmp_path / "unused.jsonl")]
    doc["spec"]["rollout"].update({"maxResponseTokens": 4, **rollout})
    doc["spec"]["training"].update({"promptsPerStep": 2, "miniBatchSize": 16})
    doc["spec"]["outputDir"] = str(tmp_path)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    spec = load_job_manifest(path).spec
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    scores = iter(rewards)
    return RolloutService(
        spec,
        placement=None,  # type: ignore[arg-type]  # no replicas: the bookkeeping alone
        actor=None,  # type: ignore[arg-type]
        actor_host=None,
        tokenizer=tokenizer,
        pad_id=int(tokenizer.pad_token_id or 0),
        prompts_for=lambda count: prompts(count),
        score=lambda batch: torch.tensor(next(scores)),
        log=lambda line: None,
        trajectories=trajectories,
    )


def prompts(count: int) -> Batch:
    return Batch.from_dict(
        {
            "uid": [f"p{i}" for i in range(count)],
            "prompt_token_ids": [[10 + i, 11, 12] for i in range(count)],
            "prompt_text": ["x"] * count,
            "data_source": ["target_char"] * count,
            "ground_truth": ["a"] * count,
        },
        meta={"samples": 8},
    )


def finish(svc: RolloutService, versions: tuple[int, ...] = (0, 0)) -> None:
    """The oldest open request ends: 8 samples of 2 tokens, made with ``versions``."""
    request_id = next(iter(svc._open))
    request = svc._open[request_id].request
    samples = [SampleResult([65, 66], [-1.0, -2.0], list(versions), "length") for _ in range(8)]
    svc._finished(RequestResult(request, samples))


def test_uninformative_groups_are_dropped_and_refilled_up_to_the_cap(model_dir: Path, tmp_path: Path) -> None:
    equal, differ = [1.0] * 8, [0.0] * 7 + [1.0]
    svc = service(
        model_dir,
        tmp_path,
        [equal, equal, differ, equal, equal, equal],
        dynamicSampling={"enabled": True, "maxTries": 2},
    )
    svc._fill(trainer_version=0)  # maxStaleness 2: 3 steps of 2 groups
    assert len(svc._open) == 6
    finish(svc)
    finish(svc)
    finish(svc)
    assert len(svc.buffer) == 1 and svc.counters.dropped_uninformative == 2
    svc._fill(trainer_version=0)  # the two dropped groups' places are refilled
    assert len(svc._open) == 5
    for _ in range(3):
        finish(svc)
    # maxTries 2: one refill per accepted or awaited group. Two more equal groups are dropped
    # (3 and 4 refills of 1 + 4, then 1 + 3 allowed); the third finds the cap reached and is kept.
    assert svc.counters.dropped_uninformative == 4 and len(svc.buffer) == 2
    assert svc.step_metrics()["rollout/dropped_uninformative_fraction"] > 0


def test_a_step_gets_the_oldest_groups_packed_with_their_oldest_token_version(
    model_dir: Path, tmp_path: Path
) -> None:
    svc = service(model_dir, tmp_path, [])
    svc._fill(trainer_version=0)
    finish(svc, versions=(1, 2))
    finish(svc, versions=(0, 1))
    finish(svc, versions=(2, 2))
    prompts_batch, responses = svc.next_batch(trainer_version=2)
    assert len(prompts_batch) == 2 and len(responses) == 16
    assert responses.tensors["policy_version"].tolist() == [0] * 8 + [1] * 8  # oldest groups first
    assert svc.step_metrics()["staleness/samples/2"] == 8
    assert len(svc.buffer) == 1


def test_groups_dropped_as_stale_free_their_places_for_fresh_ones(model_dir: Path, tmp_path: Path) -> None:
    """Rule 1 counts groups "accepted or on their way, not dropped". Counting the stale-dropped
    ones shrank the window for good, and a run's last step then waited for groups never drawn."""
    svc = service(model_dir, tmp_path, [])
    svc._fill(trainer_version=0)  # maxStaleness 2, 2 groups a step: 6
    for _ in range(6):
        finish(svc)
    assert svc.buffer.drop_stale(trainer_version=3) == 6  # version 0 is 3 updates old: past the bound
    svc._fill(trainer_version=3)
    assert len(svc._open) == (3 + 1 + 2) * 2  # the whole window again, none held by the dropped


class Episode:
    """An environment: one observation after the first turn, then a score."""

    def after_turn(self, context: TurnContext) -> Finish | Insert:
        return Insert("OBS") if context.turn == 1 else Finish("answer", reward=0.75)


def test_a_multi_turn_step_is_packed_token_exact_with_its_inserted_tokens_masked_and_its_score(
    model_dir: Path, tmp_path: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    driver = TrajectoryDriver(
        AgentSpec(loop="tools", tools=("calculator",)),
        Episode(),
        encode=lambda text: list(tokenizer.encode(text, add_special_tokens=False)),
        decode=lambda ids: str(tokenizer.decode(ids)),
        budget=16,
    )
    svc = service(model_dir, tmp_path, [], trajectories=driver, maxResponseTokens=16, maxStaleness=0)
    svc._fill(trainer_version=0)
    while any(opened.turn for opened in svc._open.values()) or driver.running:
        for opened in list(svc._open.values()):
            if opened.turn:
                # "AB" first; "CDE" after the observation ("OBS" ends with 83)
                ids = [67, 68, 69] if opened.request.prompt_token_ids[-1] == 83 else [65, 66]
                svc._finished(
                    RequestResult(
                        opened.request, [SampleResult(ids, [-1.0] * len(ids), [0] * len(ids), "stop")]
                    )
                )
        svc._advance_trajectories()
    _, responses = svc.next_batch(trainer_version=0)
    obs = list(tokenizer.encode("OBS", add_special_tokens=False))
    row = responses.tensors["responses"][0, :8].tolist()
    assert row == [65, 66, *obs, 67, 68, 69]
    assert responses.tensors["response_mask"][0, :9].tolist() == [1, 1, 0, 0, 0, 1, 1, 1, 0]
    assert responses.tensors["attention_mask"][0, -16:-7].tolist() == [1] * 8 + [0]
    assert responses.non_tensors["response_text"][0] == "CDE"  # the last model turn: what rewards read
    info = responses.non_tensors["extra_info"][0]
    assert info["agent"]["turns"] == 2 and environment_reward("x", "CDE", "a", info) == 0.75
    metrics = svc.step_metrics()
    assert metrics["agent/turns_mean"] == 2 and metrics["agent/masked_token_fraction"] == pytest.approx(3 / 8)
