"""Every refusal ``hybridflow validate`` and ``run`` make before Ray starts (``hybridflow.preflight``).

Each case is a manifest one edit away from a good one, driven through the CLI in-process:
exit 2, a message naming the field and the value, and no traceback. ``run`` refuses before it
imports Ray's controller (a case that got past the preflight would start a run and fail the
exit-code assertion). The models are directories holding a real tiny ``config.json`` and the
tiny tokenizer: the checks read nothing else.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from hybridflow import preflight
from hybridflow.cli import EXIT_USER_ERROR, main
from hybridflow.models.tiny import build_tokenizer, padded_vocab_size, tiny_config
from hybridflow.rewards import make_toy_dataset
from hybridflow.spec import parse_job_manifest

ROOT = Path(__file__).resolve().parents[2]
Edit = Callable[[dict[str, Any], Path], None]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``model/`` (qwen2, 2 heads, 1 KV head, 2 layers, with its tokenizer) and ``data/prompts.jsonl``."""
    base = tmp_path_factory.mktemp("preflight")
    write_model(base / "model")
    build_tokenizer().save_pretrained(str(base / "model"))
    (base / "data").mkdir()
    rows = make_toy_dataset("target_char", 4, seed=0)
    (base / "data" / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return base


def write_model(directory: Path, sizes: dict[str, int] | None = None, **changes: Any) -> Path:
    """A model directory with only a tiny ``config.json``: ``sizes`` for ``tiny_config``, ``changes`` of its keys."""
    directory.mkdir(parents=True, exist_ok=True)
    config = tiny_config("qwen2", padded_vocab_size(), **(sizes or {"heads": 2, "kv_heads": 1})).to_dict()
    (directory / "config.json").write_text(json.dumps({**config, **changes}))
    return directory


def manifest(files: Path, example: str = "grpo-tiny.yaml") -> dict[str, Any]:
    document = yaml.safe_load((ROOT / "examples" / example).read_text())
    spec = document["spec"]
    spec["models"] = {"actor": {"path": str(files / "model")}}
    spec["data"]["trainFiles"] = [str(files / "data" / "prompts.jsonl")]
    spec["outputDir"] = str(files / "out")
    return document


def set_path(document: dict[str, Any], dotted: str, value: Any) -> None:
    node = document["spec"]
    *parents, leaf = dotted.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value


def cli(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, document: dict[str, Any], command: str
) -> tuple[int, str]:
    path = tmp_path / f"{command}.yaml"
    path.write_text(yaml.safe_dump(document))
    code = main([command, str(path)])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def no_model_dir(document: dict[str, Any], tmp: Path) -> None:
    set_path(document, "models.actor.path", str(tmp / "nowhere"))


def model_dir_without_config(document: dict[str, Any], tmp: Path) -> None:
    (tmp / "empty").mkdir()
    set_path(document, "models.actor.path", str(tmp / "empty"))


def no_tokenizer_dir(document: dict[str, Any], tmp: Path) -> None:
    set_path(document, "models.actor.tokenizerPath", str(tmp / "no-tokenizer"))


def no_train_file(document: dict[str, Any], tmp: Path) -> None:
    document["spec"]["data"]["trainFiles"].append(str(tmp / "missing.jsonl"))


FILE_CASES: dict[str, tuple[Edit, str]] = {
    "model directory missing": (no_model_dir, "spec.models.actor.path: {tmp}/nowhere does not exist"),
    "model directory without config.json": (
        model_dir_without_config,
        "spec.models.actor.path: {tmp}/empty is not a Hugging Face model directory (no config.json)",
    ),
    "tokenizer directory missing": (
        no_tokenizer_dir,
        "spec.models.actor.tokenizerPath: {tmp}/no-tokenizer does not exist",
    ),
    "train file missing": (no_train_file, "spec.data.trainFiles[1]: {tmp}/missing.jsonl does not exist"),
}


@pytest.mark.parametrize("case", FILE_CASES)
def test_run_refuses_missing_files_and_validate_notes_them(
    case: str, files: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    edit, expected = FILE_CASES[case]
    document = manifest(files)
    edit(document, tmp_path)
    message = expected.format(tmp=tmp_path)
    code, output = cli(capsys, tmp_path, document, "run")
    assert code == EXIT_USER_ERROR, output
    assert f"error: {tmp_path}/run.yaml: {message}" in output
    assert "Traceback" not in output
    code, output = cli(capsys, tmp_path, document, "validate")
    assert code == 0, output  # the model may come later, or live on another machine
    assert f"note: here: {message}" in output


def other_model(sizes: dict[str, int] | None = None, **changes: Any) -> Edit:
    def edit(document: dict[str, Any], tmp: Path) -> None:
        set_path(document, "models.actor.path", str(write_model(tmp / "other", sizes, **changes)))
        set_path(document, "models.actor.tokenizerPath", document["spec"]["models"]["actor"]["path"])

    return edit


def edits(*changes: tuple[str, Any], model: Edit | None = None) -> Edit:
    def edit(document: dict[str, Any], tmp: Path) -> None:
        if model is not None:
            model(document, tmp)
        for dotted, value in changes:
            set_path(document, dotted, value)

    return edit


def with_tokenizer_of(files: Path) -> Edit:
    """The tiny tokenizer (260 tokens) with a model of 128 embedding rows."""

    def edit(document: dict[str, Any], tmp: Path) -> None:
        set_path(document, "models.actor.path", str(write_model(tmp / "small", vocab_size=128)))
        set_path(document, "models.actor.tokenizerPath", str(files / "model"))

    return edit


MEGATRON = ("training.backend", "megatron")
MODEL_CASES: dict[str, tuple[Edit, str]] = {
    "sequence parallel vs KV heads": (
        edits(("training.sequenceParallelSize", 2)),
        "spec.training.sequenceParallelSize: 2 does not split the attention heads of {files}/model "
        "(num_key_value_heads=1 is smaller than the sequence-parallel size 2",
    ),
    "sequence parallel vs attention heads": (
        edits(("training.sequenceParallelSize", 2), model=other_model({"hidden": 96, "heads": 3})),
        "spec.training.sequenceParallelSize: 2 does not split the attention heads of {tmp}/other "
        "(num_attention_heads=3 is not divisible by the sequence-parallel size 2",
    ),
    "megatron tensor parallel vs KV heads": (
        edits(MEGATRON, ("training.tensorParallelSize", 2)),
        "spec.training.tensorParallelSize: 2 does not fit {files}/model: tensor parallel size 2 must "
        "divide num_key_value_heads=1",
    ),
    "megatron pipeline parallel vs layers": (
        edits(
            MEGATRON, ("training.pipelineParallelSize", 2), model=other_model({"layers": 3, "kv_heads": 2})
        ),
        "spec.training.pipelineParallelSize: 2 does not fit {tmp}/other: pipeline parallel size 2 must "
        "divide num_hidden_layers=3",
    ),
    "megatron and tied embeddings": (
        edits(MEGATRON, model=other_model(tie_word_embeddings=True)),
        "spec.models.actor.path: {tmp}/other: tie_word_embeddings=True is not supported by the megatron backend",
    ),
    "megatron and an architecture it lacks": (
        edits(MEGATRON, model=other_model(model_type="mistral")),
        "spec.models.actor.path: {tmp}/other: model_type='mistral' is not supported by the megatron backend",
    ),
    "vLLM tensor parallel vs KV heads": (
        edits(("rollout.engine", "vllm"), ("rollout.tensorParallelSize", 2)),
        "spec.rollout.tensorParallelSize: 2: num_key_value_heads=1 does not split 2 ways",
    ),
    "tokenizer larger than the embedding": (
        None,  # with_tokenizer_of(files), built in the test
        "spec.models.actor: the tokenizer at {files}/model has 260 tokens but the model at {tmp}/small "
        "has only 128 embedding rows",
    ),
}


@pytest.mark.parametrize("case", MODEL_CASES)
@pytest.mark.parametrize("command", ["validate", "run"])
def test_what_loading_the_model_would_refuse_is_refused_first(
    case: str, command: str, files: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    edit, expected = MODEL_CASES[case]
    document = manifest(files)
    (edit or with_tokenizer_of(files))(document, tmp_path)
    code, output = cli(capsys, tmp_path, document, command)
    assert code == EXIT_USER_ERROR, output
    assert expected.format(files=files, tmp=tmp_path) in output
    assert "Traceback" not in output


def test_the_good_manifest_has_no_problem(files: Path) -> None:
    for example in ("grpo-tiny.yaml", "grpo-tiny-agent.yaml"):
        spec = parse_job_manifest(manifest(files, example), source=example).spec
        assert preflight.problems(spec) == []


PLUGIN_CASES: dict[str, tuple[str, tuple[tuple[str, Any], ...], str]] = {
    "algorithm": (
        "grpo-tiny.yaml",
        (("algorithm.name", "no_such_plugin:train_step"),),
        "spec.algorithm.name: 'no_such_plugin:train_step': module 'no_such_plugin' could not be imported "
        "(No module named 'no_such_plugin')",
    ),
    "algorithm that is no function": (
        "grpo-tiny.yaml",
        (("algorithm.name", "math:pi"),),
        "spec.algorithm.name: 'math:pi' names a float, not a function or class",
    ),
    "second reward function": (
        "grpo-tiny.yaml",
        (("rewards", [{"function": "target_char"}, {"function": "json:no_such_score"}]),),
        "spec.rewards[1].function: 'json:no_such_score': module 'json' has no attribute 'no_such_score'",
    ),
    "unregistered reward": (
        "grpo-tiny.yaml",
        (("rewards", [{"function": "gsm9k"}]),),
        "spec.rewards[0].function: 'gsm9k' is not known; use a registered name",
    ),
    "tool": (
        "grpo-tiny-agent.yaml",
        (("agent.tools", ["calculator", "no_such_plugin.tools:Search"]),),
        "spec.agent.tools[1]: 'no_such_plugin.tools:Search': module 'no_such_plugin.tools' could not be imported",
    ),
    "tool parser": (
        "grpo-tiny-agent.yaml",
        (("agent.toolParser", "no_such_plugin:parse"),),
        "spec.agent.toolParser: 'no_such_plugin:parse': module 'no_such_plugin' could not be imported",
    ),
    "environment or agent loop": (
        "grpo-tiny-agent.yaml",
        (("agent.loop", "no_such_plugin:Env"), ("agent.tools", [])),
        "spec.agent.loop: 'no_such_plugin:Env': module 'no_such_plugin' could not be imported",
    ),
    "endpoint runner": (
        "grpo-tiny-agent.yaml",
        (("agent.loop", "endpoint"), ("agent.tools", []), ("agent.runner", "no_such_plugin:run")),
        "spec.agent.runner: 'no_such_plugin:run': module 'no_such_plugin' could not be imported",
    ),
}


@pytest.mark.parametrize("case", PLUGIN_CASES)
def test_import_paths_that_do_not_resolve_are_refused_before_ray(
    case: str, files: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    example, changes, expected = PLUGIN_CASES[case]
    document = manifest(files, example)
    for dotted, value in changes:
        set_path(document, dotted, copy.deepcopy(value))
    for command in ("validate", "run"):
        code, output = cli(capsys, tmp_path, document, command)
        assert code == EXIT_USER_ERROR, output
        assert f"error: {tmp_path}/{command}.yaml: {expected}" in output
        assert "Traceback" not in output
    # In a cluster the job's image is what must import them: a note, not an error, here.
    path = tmp_path / "validate.yaml"
    assert main(["validate", "--in-cluster", str(path)]) in (0, EXIT_USER_ERROR)
    assert f"note: here: {path}: {expected}" in capsys.readouterr().err


def test_a_resolving_plugin_passes(files: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    document = manifest(files)
    set_path(document, "rewards", [{"function": "hybridflow.rewards.rules:gsm8k_reward"}])
    code, output = cli(capsys, tmp_path, document, "validate")
    assert code == 0, output
    assert "error" not in output
