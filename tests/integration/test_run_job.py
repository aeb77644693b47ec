"""``hybridflow run`` end to end on CPU: GRPO and PPO train, checkpoints resume exactly, bad input exits 2.

What is about the command (resuming in a new process, exit codes, messages) runs a fresh
``hybridflow`` process with its own embedded Ray, as a user runs it. What is about the job (each
algorithm, the reward and cost models, compiled hot paths) runs ``run_training`` in this process
on the suite's shared Ray (``tests/conftest.py``): the same code from the manifest on, without
the seconds of a new interpreter and a new Ray per run. All on a tiny model written once per
session. Step counts are kept small: these tests check behaviour, the learning figures live in
bench/learning.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from hybridflow.models.tiny import write_tiny_model
from hybridflow.spec import load_job_manifest
from hybridflow.trainer.runner import RunSummary, run_training

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "hybridflow.cli"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("tiny")
    subprocess.run(
        [
            *CLI,
            "make-tiny",
            "--model-dir",
            str(base / "model"),
            "--reward-model-dir",
            str(base / "reward-model"),
            "--data-dir",
            str(base / "data"),
            "--prompts",
            "64",
        ],
        check=True,
        capture_output=True,
    )
    return base


def manifest(tiny: Path, out: Path, example: str, **training: int) -> Path:
    doc = yaml.safe_load((ROOT / "examples" / example).read_text())
    spec = doc["spec"]
    spec["models"] = {role: {"path": str(tiny / "model")} for role in spec["models"]}
    spec["data"]["trainFiles"] = [str(tiny / "data" / "target_char.jsonl")]
    spec["rollout"]["maxResponseTokens"] = 8
    spec["training"].update(training)
    spec["checkpoint"]["intervalSteps"] = 2
    spec["outputDir"] = str(out)
    path = out.with_suffix(".yaml")
    path.write_text(yaml.safe_dump(doc))
    return path


def run(path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [*CLI, "run", str(path), *extra], capture_output=True, text=True, timeout=600, env=env, check=False
    )


def train_in_process(path: Path, stop_after_steps: int | None = None) -> RunSummary:
    """``run_training`` of the manifest at ``path`` on the shared Ray (the ``ray_cluster`` fixture)."""
    return run_training(
        load_job_manifest(path).spec,
        simulated=True,
        on_step=lambda line: None,
        stop_after_steps=stop_after_steps,
    )


def metrics(out: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def actor_parameters(checkpoint: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    single = checkpoint.parent / f"{checkpoint.name}.pt"
    dcp_to_torch_save(str(checkpoint / "actor"), str(single))
    state = torch.load(single, weights_only=False)
    return {k: v for k, v in state["model"].items() if isinstance(v, torch.Tensor)}


@pytest.mark.usefixtures("ray_cluster")
def test_overlapped_grpo_is_one_step_off_policy_and_resumes_exactly(tiny: Path, tmp_path: Path) -> None:
    """The rollout on its own pool (1 + 1 simulated GPUs), rollout.maxStaleness 1.

    Step k's samples come from the policy before step k-1's update (staleness 1 from step 2 on:
    they were generated while that update ran), the weights reach the rollout pool after every
    update (step 1's samples, made by the same weights the trainer scores them with, have no
    log-prob gap), and a run stopped after step 2 and resumed by a new ``hybridflow run`` process
    equals the uninterrupted one (the first two runs in this process), its evaluations included
    (valFiles after steps 2 and 4, on the rollout pool after the step's push).
    """
    val_file, evaluation = (
        tiny / "data" / "target_char.val.jsonl",
        {"everySteps": 2, "samples": 2, "maxPrompts": 6},
    )
    straight = manifest(tiny, tmp_path / "straight", "grpo-tiny-overlap.yaml", totalSteps=4)
    train_in_process(with_validation(straight, val_file, **evaluation))
    records = metrics(tmp_path / "straight")
    assert [r["staleness/samples/0"] for r in records] == [64.0, 0.0, 0.0, 0.0]
    assert [r["staleness/samples/1"] for r in records] == [0.0, 64.0, 64.0, 64.0]
    assert all(r["staleness/max"] <= 1 for r in records)
    assert records[0]["off_policy/kl"] < 1e-6 and records[0]["off_policy/is_weight_mean"] == pytest.approx(
        1.0
    )
    assert all(r["off_policy/kl"] > 0 for r in records[1:])  # one update old: the policies differ
    for record in records:
        assert (
            0 <= record["pool/train/idle_fraction"] <= 1 and 0 <= record["pool/generate/idle_fraction"] <= 1
        )
        assert record["reshard/bytes_received_per_rank"] > 0  # the push reached the rollout pool
    assert (tmp_path / "straight" / "checkpoints" / "step_000002" / "rollout_ahead.pt").is_file()

    resumed = with_validation(
        manifest(tiny, tmp_path / "resumed", "grpo-tiny-overlap.yaml", totalSteps=4), val_file, **evaluation
    )
    assert train_in_process(resumed, stop_after_steps=2).last_step == 2
    second = run(resumed)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stdout and "step 3/4" in second.stdout
    again = metrics(tmp_path / "resumed")
    assert [m["step"] for m in again] == [1, 2, 3, 4]
    for x, y in zip(records, again, strict=True):
        for key in ("reward/mean", "actor/policy_loss", "off_policy/kl", "staleness/mean"):
            assert x[key] == y[key], (x["step"], key)
        assert ("val/greedy/reward/mean" in x) == (x["step"] in (2, 4))
        for key in (k for k in x if k.startswith("val/") and k != "val/seconds"):
            assert x[key] == y[key], (x["step"], key)
    straight_params = actor_parameters(tmp_path / "straight" / "checkpoints" / "step_000004")
    resumed_params = actor_parameters(tmp_path / "resumed" / "checkpoints" / "step_000004")
    assert straight_params.keys() == resumed_params.keys() and straight_params
    for name, tensor in straight_params.items():
        assert torch.equal(tensor, resumed_params[name]), name


def with_validation(path: Path, val_file: Path, **evaluation: Any) -> Path:
    """The manifest at ``path`` with ``val_file`` as spec.data.valFiles and ``evaluation`` in spec.evaluation."""
    doc = yaml.safe_load(path.read_text())
    doc["spec"]["data"]["valFiles"] = [str(val_file)]
    doc["spec"].setdefault("evaluation", {}).update(evaluation)
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.mark.usefixtures("ray_cluster")
def test_grpo_resumes_exactly_and_evaluation_changes_no_training_result(tiny: Path, tmp_path: Path) -> None:
    """Three runs of 4 GRPO steps: ``plain`` (grpo-tiny.yaml), ``straight`` (its validation example:
    valFiles scored before training and after steps 2 and 4, greedy and 2 samples per prompt, on 6
    of make-tiny's validation prompts) and ``resumed`` (the same, stopped after step 2 here, then
    ``hybridflow run``: a new process resuming from the checkpoint).

    Evaluation touches no training state (every run trains to the same figures and weights), and
    the resumed run evaluates step 4 exactly as the uninterrupted one did (greedy: the same
    responses for the same weights; sampled: seeded by the step). e2e's test_local_faults.py runs
    a whole chain as new processes, SIGTERM and SIGKILL included.
    """
    val_file = tiny / "data" / "target_char.val.jsonl"  # hybridflow make-tiny's validation prompts
    evaluation = {"everySteps": 2, "samples": 2, "maxPrompts": 6}
    plain = manifest(tiny, tmp_path / "plain", "grpo-tiny.yaml", totalSteps=4)
    straight, resumed = (
        with_validation(
            manifest(tiny, tmp_path / name, "grpo-tiny-validation.yaml", totalSteps=4), val_file, **evaluation
        )
        for name in ("straight", "resumed")
    )
    train_in_process(plain)
    train_in_process(straight)
    assert train_in_process(resumed, stop_after_steps=2).last_step == 2
    second = run(resumed)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stdout and "step 3/4" in second.stdout

    a, b = metrics(tmp_path / "straight"), metrics(tmp_path / "resumed")
    assert [m["step"] for m in a] == [m["step"] for m in b] == [0, 1, 2, 3, 4]
    for mode in ("greedy", "sampled"):
        assert [m["step"] for m in a if f"val/{mode}/reward/mean" in m] == [0, 2, 4]
    for record in (r for r in a if "val/prompts" in r):
        assert record["val/prompts"] == 6.0 and record["val/seconds"] > 0
        assert record["val/greedy/target_char/reward/mean"] == record["val/greedy/reward/mean"]
        assert 0 <= record["val/sampled/reward/mean"] <= record["val/sampled/reward/best_of_n_mean"] <= 1
        assert 0 < record["val/greedy/response/length_mean"] <= 8
    assert set(a[0]) == {"step"} | {key for key in a[0] if key.startswith("val/")}
    for x, y in zip(a, b, strict=True):
        for key in (k for k in x if k.startswith("val/") and k != "val/seconds"):
            assert x[key] == y[key], (x["step"], key)
    # A synchronous job measures the train-inference mismatch every step too; the torch engine
    # generates from the actor's own fp32 module (equal dtypes): a gap of float rounding only, and
    # no correction.
    for x, y, z in zip(metrics(tmp_path / "plain"), a[1:], b[1:], strict=True):
        assert x["off_policy/abs_log_prob_diff_max"] < 1e-4 and x["off_policy/kl"] < 1e-8
        assert "off_policy/is_weight_mean" not in x
        for key in ("reward/mean", "actor/policy_loss"):
            assert x[key] == y[key] == z[key], (x["step"], key)
    plain_params = actor_parameters(tmp_path / "plain" / "checkpoints" / "step_000004")
    assert plain_params
    for other in ("straight", "resumed"):
        params = actor_parameters(tmp_path / other / "checkpoints" / "step_000004")
        assert params.keys() == plain_params.keys()
        for name, tensor in plain_params.items():
            assert torch.equal(tensor, params[name]), (other, name)


@pytest.mark.usefixtures("ray_cluster")
def test_ppo_trains_actor_and_critic_with_token_rewards_dual_clip_and_decay(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PPO's actor and critic, with a token-level reward that reads the token ids, dual-clip,
    weight decay and mini-batches of 24 + 8 over a step's 32 sequences (issue 42), in one job."""
    monkeypatch.syspath_prepend(str(ROOT / "tests" / "unit"))  # user_rewards, for the reward processes
    path = manifest(
        tiny,
        tmp_path / "ppo",
        "ppo-tiny.yaml",
        totalSteps=2,
        miniBatchSize=24,
        microBatchSizePerGpu=4,
        weightDecay=0.01,
    )
    doc = yaml.safe_load(path.read_text())
    doc["spec"]["algorithm"]["clipRatioC"] = 3.0
    doc["spec"]["rewards"].append({"function": "user_rewards:token_ids_as_rewards", "weight": 0.001})
    path.write_text(yaml.safe_dump(doc))
    train_in_process(path)
    records = metrics(tmp_path / "ppo")
    assert len(records) == 2
    for key in (
        "critic/value_loss",
        "actor/policy_loss",
        "actor/dual_clipfrac",
        "kl/coef",
        "reward/mean",
        "reward/user_rewards:token_ids_as_rewards",
    ):
        assert key in records[-1], key
    assert records[-1]["reward/user_rewards:token_ids_as_rewards"] > 0
    assert (tmp_path / "ppo" / "checkpoints" / "step_000002" / "critic").is_dir()


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("algorithm", ["rloo", "reinforce++", "remax"])
def test_critic_free_algorithms_take_a_step(tiny: Path, tmp_path: Path, algorithm: str) -> None:
    path = manifest(tiny, tmp_path / "job", "grpo-tiny.yaml", totalSteps=1)
    doc = yaml.safe_load(path.read_text())
    doc["spec"]["algorithm"]["name"] = algorithm
    if algorithm == "reinforce++":
        doc["spec"]["algorithm"]["kl"]["mode"] = "reward"
    path.write_text(yaml.safe_dump(doc))
    train_in_process(path)
    (record,) = metrics(tmp_path / "job")
    assert "actor/policy_loss" in record
    if algorithm == "remax":
        assert "reward/greedy_baseline" in record
    if algorithm == "reinforce++":
        assert record["kl/coef"] > 0


@pytest.mark.usefixtures("ray_cluster")
def test_safe_rlhf_constrains_with_the_cost_model(tiny: Path, tmp_path: Path) -> None:
    path = manifest(tiny, tmp_path / "safe", "ppo-tiny.yaml", totalSteps=2)
    doc = yaml.safe_load(path.read_text())
    doc["spec"]["algorithm"].update(name="safe-rlhf", costLimit=-10.0)
    doc["spec"]["models"]["cost"] = {"path": str(tiny / "reward-model")}
    path.write_text(yaml.safe_dump(doc))
    train_in_process(path)
    first, second = metrics(tmp_path / "safe")
    # the cost always exceeds a limit of -10, so the multiplier (updated before each policy step) grows
    assert second["cost/lambda"] > first["cost/lambda"] > 1.0
    assert "critic/value_loss" in second and "cost_critic/value_loss" in second
    assert (tmp_path / "safe" / "checkpoints" / "step_000002" / "cost_critic").is_dir()


@pytest.mark.usefixtures("ray_cluster")
def test_reward_model_worker_scores_the_rollouts(tiny: Path, tmp_path: Path) -> None:
    path = manifest(tiny, tmp_path / "rm", "grpo-tiny.yaml", totalSteps=1)
    doc = yaml.safe_load(path.read_text())
    doc["spec"]["models"]["reward"] = {"path": str(tiny / "reward-model")}
    doc["spec"]["rewards"] = []
    path.write_text(yaml.safe_dump(doc))
    train_in_process(path)
    (record,) = metrics(tmp_path / "rm")
    assert record["reward/model"] == record["reward/mean"]
    assert record["reward/std"] > 0  # a real scorer: different responses, different scores


def test_user_errors_exit_2_without_a_traceback(tiny: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "apiVersion: hybridflow.io/v1alpha1\nkind: RLHFJob\nmetadata: {name: x}\nspec:\n  algorithm: {name: ppo2}\n"
    )
    result = run(bad)
    assert result.returncode == 2
    assert "spec.algorithm.name: 'ppo2' is not one of" in result.stderr
    assert "Traceback" not in result.stderr

    path = manifest(tiny, tmp_path / "missing", "grpo-tiny.yaml", totalSteps=1)
    doc = yaml.safe_load(path.read_text())
    doc["spec"]["models"]["actor"]["path"] = str(tmp_path / "no-model")
    doc["spec"]["data"]["valFiles"] = [str(tmp_path / "no-val.jsonl")]
    path.write_text(yaml.safe_dump(doc))
    result = run(path)
    assert result.returncode == 2
    assert f"spec.models.actor.path: {tmp_path / 'no-model'} does not exist" in result.stderr
    assert f"spec.data.valFiles[0]: {tmp_path / 'no-val.jsonl'} does not exist" in result.stderr
    assert "Traceback" not in result.stderr
    del doc["spec"]["data"]["valFiles"]

    small = tmp_path / "small-vocab-model"
    shutil.copytree(tiny / "model", small)
    config = json.loads((small / "config.json").read_text())
    config["vocab_size"] = 128
    (small / "config.json").write_text(json.dumps(config))
    doc["spec"]["models"]["actor"]["path"] = str(small)
    path.write_text(yaml.safe_dump(doc))
    result = run(path)
    assert result.returncode == 2
    assert "spec.models.actor: the tokenizer at" in result.stderr and "128 embedding rows" in result.stderr


def test_the_documented_plugin_algorithm_runs_without_reference_or_old_log_prob_pass(
    tiny: Path, tmp_path: Path
) -> None:
    plugin = (ROOT / "examples" / "plugins" / "my_reinforce.py").read_text()
    documented = (ROOT / "docs" / "algorithms.md").read_text()
    assert f"```python\n{plugin}```" in documented, "docs/algorithms.md shows the plugin as it is"
    assert len(plugin.strip().splitlines()) <= 20
    path = manifest(tiny, tmp_path / "plugin", "reinforce-plugin-tiny.yaml", totalSteps=2)
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(ROOT / "examples" / "plugins")}
    env["PYTHONPATH"] += os.pathsep + os.environ.get("PYTHONPATH", "")
    result = subprocess.run(
        [*CLI, "run", str(path)], capture_output=True, text=True, timeout=600, env=env, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = metrics(tmp_path / "plugin")
    assert [r["step"] for r in records] == [1, 2]
    assert "actor/policy_loss" in records[-1] and "kl/actor_ref" not in records[-1]
    assert records[-1]["actor/approx_kl_k3"] == 0.0  # on-policy: the ratio is exactly 1


@pytest.mark.usefixtures("ray_cluster")
def test_packing_checkpointing_and_offload_change_no_result(tiny: Path, tmp_path: Path) -> None:
    """The memory and padding options through the real job (2 ranks, own engine copies)."""
    runs = {}
    for name, options in {
        "plain": {},
        "options": {
            "packSequences": True,
            "activationCheckpointing": True,
            "offloadDuringGeneration": {"parameters": True, "optimizerState": True},
        },
    }.items():
        path = manifest(tiny, tmp_path / name, "grpo-tiny.yaml", totalSteps=2)
        doc = yaml.safe_load(path.read_text())
        doc["spec"]["training"].update(options)
        path.write_text(yaml.safe_dump(doc))
        train_in_process(path)
        runs[name] = metrics(tmp_path / name)
    plain, options = runs["plain"], runs["options"]
    # Same initial weights, same seeds: the first rollout is the same; the update agrees to
    # float summation order (packing), the checkpointed recompute and the offload are exact.
    assert options[0]["reward/mean"] == plain[0]["reward/mean"]
    assert options[0]["actor/policy_loss"] == pytest.approx(plain[0]["actor/policy_loss"], rel=1e-4, abs=1e-6)
    assert options[0]["actor/grad_norm"] == pytest.approx(plain[0]["actor/grad_norm"], rel=1e-4)
    assert all(m["offload/bytes_per_rank"] > 0 for m in options) and "offload/seconds" not in plain[0]


@pytest.mark.usefixtures("ray_cluster")
def test_compiled_job_reports_its_compile_and_a_resumed_attempt_reuses_the_cache(
    tiny: Path, tmp_path: Path
) -> None:
    """rollout.compile and training.compile in the real job (one simulated GPU: the engine decodes
    with the actor's own FSDP module), stopped after step 1 and resumed: the second attempt finds
    every graph in the compile cache beside the checkpoints and writes no new one."""
    path = manifest(tiny, tmp_path / "compiled", "grpo-tiny.yaml", totalSteps=2)
    doc = yaml.safe_load(path.read_text())
    spec = doc["spec"]
    # One decoder layer: compiling is a C++ build per fused kernel on CPU, and a layer adds a
    # dozen kernels that prove nothing more here (each compiled region is one graph).
    one_layer = write_tiny_model(tmp_path / "one-layer", "qwen2", seed=0, layers=1)
    spec["models"] = {"actor": {"path": str(one_layer)}}
    spec["resourcePools"] = [{"name": "default", "nodes": 1, "gpusPerNode": 1}]
    spec["algorithm"]["kl"]["coef"] = 0.0  # no reference model: one trained model to compile
    spec["training"].update(
        {"compile": True, "miniBatchSize": 64, "microBatchSizePerGpu": 64, "promptsPerStep": 8}
    )
    spec["checkpoint"]["intervalSteps"] = 1
    spec["rollout"]["compile"] = True
    path.write_text(yaml.safe_dump(doc))
    assert train_in_process(path, stop_after_steps=1).last_step == 1
    cache = tmp_path / "compiled" / "checkpoints" / "compile-cache"
    graphs = {p.relative_to(cache) for p in (cache / "fxgraph").rglob("*") if p.is_file()}
    assert graphs, "the first attempt compiled into the job's cache"
    # The next attempt's workers are new processes (a new deployment), as after a restart.
    assert train_in_process(path).resumed_from == "step_000001"
    assert {p.relative_to(cache) for p in (cache / "fxgraph").rglob("*") if p.is_file()} == graphs
    step_one, step_two = metrics(tmp_path / "compiled")
    assert step_one["timing/compile"] > 0 and step_two["timing/compile"] >= 0
    for record in (step_one, step_two):
        phases = sum(v for k, v in record.items() if k.startswith("timing/") and k != "timing/checkpoint")
        assert phases == pytest.approx(record["perf/step_seconds"])
        assert 0 <= record["controller/overhead_fraction"] < 1


@pytest.mark.usefixtures("ray_cluster")
def test_a_lora_job_trains_and_syncs_the_adapter_alone_and_exports_it_gated(
    tiny: Path, tmp_path: Path
) -> None:
    """``training.lora`` end to end, with ``checkpoint.export`` of the adapter after the last step.

    The reference is the actor's base (no reference role; the KL moves off 0 once the adapter
    does), each sync moves the adapter alone into the engine and the sync check matches every
    adapter tensor, only adapter parameters change in the checkpoint, and the export passes its
    parity gate and is listed as the job's artifact (what the in-cluster status push sends).
    """
    from hybridflow.checkpoint.exports import read_artifacts
    from hybridflow.export import verify_export
    from hybridflow.incluster.status import progress_status

    path = manifest(tiny, tmp_path / "lora", "grpo-tiny.yaml", totalSteps=2, learningRate=2e-2)
    doc = yaml.safe_load(path.read_text())
    doc["spec"]["training"]["lora"] = {
        "rank": 4,
        "alpha": 8,
        "targetModules": ["q_proj", "v_proj", "down_proj"],
    }
    doc["spec"]["checkpoint"]["export"] = {"kind": "adapter", "dtype": "float32"}
    path.write_text(yaml.safe_dump(doc))
    spec = load_job_manifest(path).spec
    reports: list[Any] = []
    summary = run_training(spec, simulated=True, on_step=lambda line: None, on_report=reports.append)
    assert summary.last_step == 2
    records = metrics(tmp_path / "lora")
    adapter_tensors = 2 * 3 * 2  # 2 layers x 3 modules x (A, B)
    for record in records:
        assert record["weight_sync/checked_tensors"] == adapter_tensors
        assert record["weight_sync/unverified_tensors"] == 0
        # The adapter alone crosses the all-gather, each of the 2 ranks sending its half: rank 4 A and
        # B of q and v (64 -> 64) and down (128 -> 64), 2 layers, fp32.
        adapter_bytes = 4 * 2 * 4 * ((64 + 64) * 2 + (128 + 64))
        assert record["reshard/bytes_sent_per_rank"] * 2 == adapter_bytes
    assert records[0]["kl/actor_ref"] == 0.0 and records[1]["kl/actor_ref"] > 0.0

    before = actor_parameters(tmp_path / "lora" / "checkpoints" / "step_000002")
    assert any("lora_B" in name and tensor.abs().sum() > 0 for name, tensor in before.items())
    base = load_file_state(tiny / "model")
    for name, tensor in base.items():
        assert torch.equal(before[name], tensor), f"the frozen base weight {name} changed"

    [artifact] = read_artifacts(spec.checkpoint_dir)
    assert artifact.step == 2 and artifact.kind == "adapter" and artifact.parity_max_abs_diff < 1e-4
    manifest_ = verify_export(artifact.path)
    assert {entry.path for entry in manifest_.files} >= {"adapter_config.json", "adapter_model.safetensors"}
    status = progress_status(reports[-1], datetime.now(UTC))["status"]
    assert status["artifacts"] == [artifact.status()]


def load_file_state(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))
