"""The pure parts of evaluation on spec.data.valFiles (``hybridflow.trainer.evaluation``).

The passes themselves run against deployed workers in tests/integration/test_run_job.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hybridflow.data import PromptDataError
from hybridflow.models.tiny import build_tokenizer
from hybridflow.rewards import make_toy_dataset
from hybridflow.spec import parse_job_manifest
from hybridflow.trainer.evaluation import (
    EVALUATION_SEED_OFFSET,
    PassResult,
    ValidationSet,
    evaluation_due,
    metric_segment,
    pass_metrics,
    prompt_chunks,
    sampled_pass_seed,
)

pytestmark = pytest.mark.unit


def test_evaluation_is_due_every_n_steps_and_at_the_last() -> None:
    assert [s for s in range(1, 11) if evaluation_due(s, 10, 4)] == [4, 8, 10]
    assert [s for s in range(1, 11) if evaluation_due(s, 10, 5)] == [5, 10]
    assert [s for s in range(1, 11) if evaluation_due(s, 10, 0)] == [10]
    assert [s for s in range(1, 4) if evaluation_due(s, 3, 7)] == [3]


def test_sampled_pass_seeds_depend_on_the_step_not_on_history_and_avoid_training_seeds() -> None:
    seeds = {
        sampled_pass_seed(seed, step, chunk) for seed in (0, 1) for step in range(50) for chunk in range(4)
    }
    assert len(seeds) == 2 * 50 * 4  # no two (training seed, step, chunk) share a stream
    assert sampled_pass_seed(3, 10, 2) == sampled_pass_seed(3, 10, 2)
    # Training seeds are training.seed * 100_003 + step; the rollout multiplies by 1000 and adds the rank.
    assert min(seeds) >= EVALUATION_SEED_OFFSET > 1_000_000 * 100_003 + 10**6
    assert sampled_pass_seed(2**31, 10**6, 65_535) * 1000 + 1000 < 2**63
    with pytest.raises(ValueError, match="chunk 65536"):
        sampled_pass_seed(0, 1, 1 << 16)


def test_prompt_chunks_cover_every_prompt_once_in_order() -> None:
    assert prompt_chunks(7, 3) == [range(0, 3), range(3, 6), range(6, 7)]
    assert prompt_chunks(6, 3) == [range(0, 3), range(3, 6)]
    assert prompt_chunks(2, 8) == [range(0, 2)]
    with pytest.raises(ValueError, match="chunk_size 0"):
        prompt_chunks(4, 0)


def test_a_data_source_becomes_one_key_segment() -> None:
    assert metric_segment("target_char") == "target_char"
    assert metric_segment("openai/gsm8k") == "openai_gsm8k"
    assert metric_segment("lighteval/MATH-Hard v2") == "lighteval_MATH-Hard_v2"
    assert metric_segment("") == "unknown"


def test_greedy_pass_metrics_by_hand() -> None:
    result = PassResult(
        scores=(1.0, 0.0, 0.5, 0.5),
        lengths=(4.0, 8.0, 2.0, 2.0),
        data_sources=("math", "math", "openai/gsm8k", "openai/gsm8k"),
        samples=1,
    )
    metrics = pass_metrics("greedy", result)
    # mean 0.5; sample std sqrt(((0.5)^2 + (0.5)^2 + 0 + 0) / 3) = sqrt(1/6)
    assert metrics == pytest.approx(
        {
            "val/greedy/reward/mean": 0.5,
            "val/greedy/reward/std": (1 / 6) ** 0.5,
            "val/greedy/response/length_mean": 4.0,
            "val/greedy/math/reward/mean": 0.5,
            "val/greedy/openai_gsm8k/reward/mean": 0.5,
        }
    )


def test_sampled_pass_reports_the_best_of_each_prompts_responses() -> None:
    # Two prompts, three samples each, rows interleaved per prompt.
    result = PassResult((0.0, 1.0, 0.2, 0.3, 0.1, 0.2), (1.0,) * 6, ("a",) * 6, samples=3)
    metrics = pass_metrics("sampled", result)
    assert metrics["val/sampled/reward/best_of_n_mean"] == pytest.approx((1.0 + 0.3) / 2)
    assert metrics["val/sampled/reward/mean"] == pytest.approx(1.8 / 6)
    assert "val/greedy/reward/mean" not in metrics
    one = pass_metrics("sampled", PassResult((0.4,), (3.0,), ("a",), samples=1))
    assert one["val/sampled/reward/std"] == 0.0 and "val/sampled/reward/best_of_n_mean" not in one
    with pytest.raises(ValueError, match="5 responses do not split into prompts of 2"):
        pass_metrics("sampled", PassResult((0.0,) * 5, (1.0,) * 5, ("a",) * 5, samples=2))


def test_every_key_a_pass_reports_is_catalogued() -> None:
    from hybridflow.metrics.catalogue import find_definition

    result = PassResult((0.0, 1.0), (1.0, 2.0), ("openai/gsm8k", "x"), samples=2)
    for key in [
        *pass_metrics("sampled", result),
        *pass_metrics("greedy", result),
        "val/prompts",
        "val/seconds",
    ]:
        found = find_definition(key)
        assert found is not None and found[0].group == "validation", key


def job(tmp_path: Path, **evaluation: Any) -> Any:
    rows = make_toy_dataset("target_char", 10, seed=5, as_chat=False)
    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps(row) + "\n" for row in rows))
    manifest: dict[str, Any] = {
        "apiVersion": "hybridflow.io/v1alpha1",
        "kind": "RLHFJob",
        "metadata": {"name": "val"},
        "spec": {
            "models": {"actor": {"path": "/models/tiny"}},
            "data": {"trainFiles": ["/data/train.jsonl"], "valFiles": [str(val)], "maxPromptTokens": 512},
            "algorithm": {"name": "grpo", "samplesPerPrompt": 4},
            "training": {"totalSteps": 10},
            "rewards": [{"function": "target_char"}],
        },
    }
    if evaluation:
        manifest["spec"]["evaluation"] = evaluation
    return parse_job_manifest(manifest, "test").spec


def test_validation_set_reads_the_first_max_prompts_rows_in_file_order(tmp_path: Path) -> None:
    tokenizer = build_tokenizer()
    everything = ValidationSet.load(job(tmp_path), tokenizer)
    assert everything is not None and len(everything.dataset) == 10
    capped = ValidationSet.load(job(tmp_path, maxPrompts=4, samples=0), tokenizer)
    assert capped is not None and capped.settings.passes == ("greedy",)
    assert [p.row.uid for p in capped.dataset] == [p.row.uid for p in everything.dataset][:4]


def test_validation_prompts_that_all_run_too_long_name_the_field(tmp_path: Path) -> None:
    spec = job(tmp_path)
    spec = spec.model_copy(update={"data": spec.data.model_copy(update={"max_prompt_tokens": 2})})
    with pytest.raises(PromptDataError, match=r"^spec\.data\.valFiles: every one of the 10 prompts"):
        ValidationSet.load(spec, build_tokenizer())


def test_validate_shows_the_evaluation_and_notes_a_missing_val_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import yaml

    from hybridflow.cli import main

    manifest = yaml.safe_load(
        (Path(__file__).resolve().parents[2] / "examples" / "grpo-tiny.yaml").read_text()
    )
    manifest["spec"]["data"]["valFiles"] = [str(tmp_path / "no-val.jsonl")]
    manifest["spec"]["evaluation"] = {"everySteps": 2, "samples": 0}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest))
    assert main(["validate", str(path)]) == 0  # the files of a cluster job live in its pods
    out, err = capsys.readouterr()
    assert "evaluation: greedy on spec.data.valFiles, every 2 steps and after the last step" in out
    assert f"note: here: spec.data.valFiles[0]: {tmp_path / 'no-val.jsonl'} does not exist" in err


def test_the_validation_example_is_grpo_tiny_plus_its_validation_set() -> None:
    """examples/grpo-tiny-validation.yaml trains exactly as grpo-tiny.yaml (the integration test compares them)."""
    import yaml

    examples = Path(__file__).resolve().parents[2] / "examples"
    plain = yaml.safe_load((examples / "grpo-tiny.yaml").read_text())
    validated = yaml.safe_load((examples / "grpo-tiny-validation.yaml").read_text())
    assert validated["spec"].pop("evaluation") == {
        "everySteps": 10,
        "atStart": True,
        "greedy": True,
        "samples": 4,
    }
    assert validated["spec"]["data"].pop("valFiles") == ["../outputs/tiny-data/target_char.val.jsonl"]
    for key in ("metadata", "spec.outputDir"):
        *parents, leaf = key.split(".")
        for doc in (plain, validated):
            node = doc
            for parent in parents:
                node = node[parent]
            node.pop(leaf)
    assert validated == plain
