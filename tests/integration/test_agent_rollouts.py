"""Multi-turn trajectories with a real engine and in real jobs (``hybridflow.rollout.trajectories``).

* Token identity with the torch engine: a trajectory's model turns and inserted turns, packed for
  training, are the engine's ids and the inserted ids exactly, and a training forward pass over
  them gives the engine's log-probs at every model token (so the trainer scores the tokens the
  engine sampled, in the context the engine saw, tool turns included).
* ``examples/grpo-tiny-agent.yaml`` (the tool-calling loop, calculator and sandboxed Python)
  trains; a job whose samples an openai-client agent drives through the chat endpoint trains on
  sessions of two turns, the inserted tokens masked.
* ``examples/grpo-tiny-lookup.yaml`` (learning tool use from a random model) runs as documented.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from agent_plugins import ObservationLoop
from transformers import AutoTokenizer

from hybridflow.engines.base import RolloutOutput, SamplingParams
from hybridflow.engines.continuous import ContinuousBatcher, GenerationRequest, RequestResult
from hybridflow.engines.layout import response_tensors
from hybridflow.engines.torch_engine import TorchRolloutEngine
from hybridflow.models.tiny import write_tiny_model
from hybridflow.rewards import make_toy_dataset
from hybridflow.rollout.trajectories import TrajectoryDriver
from hybridflow.spec import load_job_manifest
from hybridflow.spec.agent import AgentSpec
from hybridflow.trainer.runner import run_training

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("tiny-agent")
    write_tiny_model(base / "model")
    (base / "data").mkdir()
    rows = make_toy_dataset("target_char", 32, seed=0)
    (base / "data" / "target_char.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return base


def test_trajectory_tokens_are_the_engines_and_the_trainer_scores_them_as_the_engine_did(tiny: Path) -> None:
    engine = TorchRolloutEngine(tiny / "model", device="cpu", dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tiny / "model")
    spec = AgentSpec(loop="agent_plugins:ObservationLoop", max_turns=3, max_turn_tokens=6)
    budget = 96
    driver = TrajectoryDriver(
        spec,
        ObservationLoop(spec),
        encode=lambda text: list(tokenizer.encode(text, add_special_tokens=False)),
        decode=lambda ids: str(tokenizer.decode(ids)),
        budget=budget,
    )
    batcher = ContinuousBatcher(
        engine.model,
        slots=4,
        max_sequence=16 + budget,
        eos_token_ids=engine.eos_token_ids,
        pad_token_id=engine.pad_token_id,
    )
    prompt = list(tokenizer.encode("Which letter?", add_special_tokens=False))
    group = GenerationRequest(
        "g0", prompt, SamplingParams(max_new_tokens=budget, n=2, seed=3, return_logprobs=True)
    )
    inserted: list[list[int]] = []
    for turn in driver.begin(group, {}):
        batcher.add(turn)
    done: list[RequestResult] = []
    while not done:
        batcher.step()
        for result in batcher.take_finished():
            driver.turn_finished(result)
        turns, done = driver.advance()
        for turn in turns:
            inserted.append(turn.prompt_token_ids)
            batcher.add(turn)
    (result,) = done
    for sample in result.samples:
        assert sample.loss_mask is not None and 0 in sample.loss_mask
        assert (
            0 < sample.loss_mask.index(0) <= 6
        )  # the first turn: at most maxTurnTokens, then an observation
    assert [stats.finish_reason for stats in result.request.tag] == ["max_turns", "max_turns"]
    assert [stats.turns for stats in result.request.tag] == [3, 3]
    output = RolloutOutput(
        [s.token_ids for s in result.samples],
        ["stop"] * 2,
        [s.logprobs for s in result.samples],
        [list(s.loss_mask or []) for s in result.samples],
    )
    packed = response_tensors(
        [prompt], output, pad_id=engine.pad_token_id, max_prompt_len=16, max_response_len=budget
    )
    for row, sample in enumerate(result.samples):
        assert packed["responses"][row, : len(sample.token_ids)].tolist() == sample.token_ids
    with torch.no_grad():
        logits = engine.model(
            input_ids=packed["input_ids"],
            attention_mask=packed["attention_mask"],
            position_ids=packed["position_ids"],
        ).logits.float()
    scored = logits[:, 15:-1].log_softmax(-1).gather(-1, packed["responses"].unsqueeze(-1)).squeeze(-1)
    mask = packed["response_mask"].bool()
    engine_logprobs = torch.zeros_like(scored)
    for row, sample in enumerate(result.samples):
        engine_logprobs[row, : len(sample.logprobs)] = torch.tensor(sample.logprobs)
    assert torch.allclose(scored[mask], engine_logprobs[mask], atol=1e-4)


def manifest(tiny: Path, out: Path, **agent: Any) -> Path:
    doc = yaml.safe_load((ROOT / "examples" / "grpo-tiny-agent.yaml").read_text())
    spec = doc["spec"]
    spec["models"] = {"actor": {"path": str(tiny / "model")}}
    spec["data"]["trainFiles"] = [str(tiny / "data" / "target_char.jsonl")]
    spec["rollout"]["maxResponseTokens"] = 96
    spec["agent"].update(agent)
    spec["training"].update({"totalSteps": 2, "promptsPerStep": 2, "miniBatchSize": 8})
    spec["outputDir"] = str(out)
    path = out.with_suffix(".yaml")
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.mark.usefixtures("ray_cluster")
def test_the_agent_example_trains(tiny: Path, tmp_path: Path) -> None:
    """examples/grpo-tiny-agent.yaml as written (the tool loop, calculator and sandboxed Python on
    two sandbox workers); the random model rarely calls a tool, so trajectories of several turns
    in a real job are the chat-endpoint test's."""
    out = tmp_path / "agent"
    path = manifest(tiny, out, maxTurnTokens=8)
    said: list[str] = []
    summary = run_training(load_job_manifest(path).spec, simulated=True, on_step=said.append)
    assert summary.last_step == 2
    assert any(
        line.startswith("sandbox: 2 sandbox worker(s); confinement: ") and "mode='strict'" in line
        for line in said
    ), said
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    assert all(row["agent/turns_mean"] >= 1 and row["agent/trajectory_tokens_mean"] > 0 for row in rows)


@pytest.mark.usefixtures("ray_cluster")
def test_sandbox_workers_run_calls_and_a_killed_one_is_an_error_then_restarted() -> None:
    """The python tool's calls on the job's sandbox workers (``agents/sandbox_pool.py``)."""
    import ray

    from hybridflow.agents.sandbox import SandboxLimits
    from hybridflow.agents.sandbox_pool import SandboxPool

    pool = SandboxPool(1, in_cluster=False)
    try:
        limits = SandboxLimits(wall_seconds=20.0)
        assert pool.run("print(6 * 7)", limits).stdout == "42\n"
        assert all(applied is not None and applied.landlock_abi >= 1 for applied in pool.isolation())
        ray.kill(pool._workers[0], no_restart=False)  # the pod died: Ray starts the worker again
        deadline = time.monotonic() + 120
        answer = pool.run("print('after')", limits)
        while not answer.ok and time.monotonic() < deadline:
            # A call that meets the dead or restarting worker: an error for the model, not an exception.
            assert answer.outcome == "sandbox_error" and "sandbox worker 0" in answer.stderr, answer
            time.sleep(1.0)
            answer = pool.run("print('after')", limits)
        assert answer.ok and answer.stdout == "after\n", answer
    finally:
        pool.shutdown()


@pytest.mark.usefixtures("ray_cluster")
def test_an_agent_driving_the_chat_endpoint_with_the_openai_client_trains_the_job(
    tiny: Path, tmp_path: Path
) -> None:
    """loop 'endpoint': ``agent_plugins.chat_agent`` runs each sample through the job's
    /v1/chat/completions with the openai client, two turns; the sessions are what the job trains on."""
    pytest.importorskip("openai", reason="the agent's client")
    out = tmp_path / "endpoint"
    path = manifest(tiny, out, loop="endpoint", runner="agent_plugins:chat_agent", tools=[])
    summary = run_training(load_job_manifest(path).spec, simulated=True, on_step=lambda line: None)
    assert summary.last_step == 2
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        assert row["agent/turns_mean"] == 2 and row["agent/masked_token_fraction"] > 0


def test_the_tool_learning_example_runs_as_documented(tmp_path: Path) -> None:
    """docs/agents.md's two commands: the lookup task's preparation (2 warm-up steps here, not 30),
    then ``PYTHONPATH=examples/plugins hybridflow run examples/grpo-tiny-lookup.yaml`` (2 steps)."""
    plugins = ROOT / "examples" / "plugins"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(plugins), os.environ.get("PYTHONPATH")]))
    prepare = [
        sys.executable,
        str(plugins / "lookup_task.py"),
        str(tmp_path / "lookup"),
        "--warm-up-steps",
        "2",
    ]
    subprocess.run(prepare, check=True, capture_output=True, env=env, timeout=300)
    doc = yaml.safe_load((ROOT / "examples" / "grpo-tiny-lookup.yaml").read_text())
    spec = doc["spec"]
    spec["models"]["actor"]["path"] = str(tmp_path / "lookup" / "warm-model")
    spec["data"]["trainFiles"] = [str(tmp_path / "lookup" / "lookup.jsonl")]
    spec["training"].update({"totalSteps": 2, "promptsPerStep": 2, "miniBatchSize": 16})
    spec["outputDir"] = str(tmp_path / "out")
    path = tmp_path / "lookup.yaml"
    path.write_text(yaml.safe_dump(doc))
    run = [sys.executable, "-m", "hybridflow.cli", "run", str(path)]
    result = subprocess.run(run, capture_output=True, text=True, env=env, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    # The warm-up makes calls common from the first step; the second turn reads the tool's letters.
    assert all(row["agent/tool_calls_per_trajectory"] > 0 and row["agent/turns_mean"] > 1 for row in rows)
    assert all(row["agent/env_steps_per_trajectory"] == 0 for row in rows)
