"""``spec.training.sequenceParallelSize: 2`` through the real job: roles, meshes, workers and backend on Ray.

``run_training`` in this process on the suite's shared Ray, GRPO on the tiny model over two
simulated GPUs, once at size 1 (two data-parallel ranks) and once at size 2 (one Ulysses pair):
the actor and the reference are deployed under ``DeviceMesh.training(2, tp=2)``, the pair gets
the same rows, the actor scores the old log-probs and trains, the reference scores the KL's.
One mini-batch of the whole step and two PPO epochs, so both layouts update on the same rows
(with two mini-batches the data-parallel split would mix different rows into each) and the
separate old-log-prob pass runs. The rollout is the same in both (same weights, same seeds), so
the first step's rewards are equal and its update agrees to float summation order.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from hybridflow.models.tiny import write_tiny_model
from hybridflow.rewards import make_toy_dataset
from hybridflow.spec import parse_job_manifest
from hybridflow.trainer.runner import run_training

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("sequence-parallel-job")
    write_tiny_model(base / "model", "qwen2", seed=0)
    rows = make_toy_dataset("target_char", 64, seed=0)
    (base / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return base


def train(tiny: Path, out: Path, size: int) -> list[dict[str, Any]]:
    doc = yaml.safe_load((ROOT / "examples" / "grpo-tiny.yaml").read_text())
    spec = doc["spec"]
    spec["models"] = {"actor": {"path": str(tiny / "model")}}
    spec["data"]["trainFiles"] = [str(tiny / "prompts.jsonl")]
    spec["algorithm"]["ppoEpochs"] = 2
    spec["rollout"]["maxResponseTokens"] = 8
    spec["training"].update(totalSteps=1, miniBatchSize=64, sequenceParallelSize=size)
    spec["outputDir"] = str(out)
    run_training(parse_job_manifest(doc, "test").spec, simulated=True, on_step=lambda line: None)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.usefixtures("ray_cluster")
def test_a_sequence_parallel_step_equals_the_data_parallel_one(tiny: Path, tmp_path: Path) -> None:
    [plain] = train(tiny, tmp_path / "size1", 1)
    [split] = train(tiny, tmp_path / "size2", 2)
    assert split["reward/mean"] == plain["reward/mean"]  # the same rollout
    for name in ("actor/grad_norm", "actor/policy_loss", "actor/approx_kl_k3", "actor/entropy"):
        assert split[name] == pytest.approx(plain[name], rel=1e-4, abs=1e-6), name
    assert split["actor/grad_norm"] > 0
