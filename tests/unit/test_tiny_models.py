"""Tiny random models and the byte-level tokenizer: built from code, saved as HF directories, reloaded."""

from __future__ import annotations

import json
import os
import string
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hybridflow.models import (
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    IM_END_TOKEN_ID,
    IM_START_TOKEN_ID,
    PAD_TOKEN_ID,
    TOKENIZER_VOCAB_SIZE,
    build_tiny_model,
    build_tokenizer,
    padded_vocab_size,
    tiny,
    write_tiny_model,
)

pytestmark = pytest.mark.unit

ASCII_SAMPLES = [
    string.printable,
    "Hello, world!",
    "  leading, double  and trailing spaces  ",
    "tabs\tand\r\nnewlines\n\n",
    "What is 12 * 7? Answer: 84",
]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
]
EXPECTED_CHAT_PROMPT = "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"


def state_dicts_equal(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor]) -> bool:
    return left.keys() == right.keys() and all(torch.equal(left[name], right[name]) for name in left)


# --------------------------------------------------------------------------- tokenizer


@pytest.mark.parametrize("text", ASCII_SAMPLES)
def test_ascii_text_round_trips_one_token_per_byte(text: str) -> None:
    tokenizer = build_tokenizer()
    ids = tokenizer(text)["input_ids"]
    assert ids == list(text.encode())  # token id = byte value, no special tokens added
    assert tokenizer.decode(ids) == text


def test_any_unicode_text_round_trips() -> None:
    tokenizer = build_tokenizer()
    text = "naïve café, 你好, emoji 🙂"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


def test_special_tokens_have_fixed_ids_and_are_recognised_in_text() -> None:
    tokenizer = build_tokenizer()
    assert len(tokenizer) == TOKENIZER_VOCAB_SIZE
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (
        BOS_TOKEN_ID,
        EOS_TOKEN_ID,
        PAD_TOKEN_ID,
    )
    assert tokenizer("<|im_start|>a<|im_end|>")["input_ids"] == [IM_START_TOKEN_ID, 97, IM_END_TOKEN_ID]
    assert tokenizer.decode([IM_START_TOKEN_ID, 97, IM_END_TOKEN_ID], skip_special_tokens=True) == "a"


def test_chat_template_renders_chatml() -> None:
    tokenizer = build_tokenizer()
    rendered = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert rendered == EXPECTED_CHAT_PROMPT
    without_prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=False, tokenize=False)
    assert without_prompt == EXPECTED_CHAT_PROMPT.removesuffix("<|im_start|>assistant\n")
    ids = tokenizer(rendered)["input_ids"]
    assert ids[0] == IM_START_TOKEN_ID and ids.count(IM_END_TOKEN_ID) == 2
    assert tokenizer.decode(ids) == rendered


@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_side_is_configurable(side: str) -> None:
    tokenizer = build_tokenizer(padding_side=side)  # type: ignore[arg-type]
    batch = tokenizer(["a", "abc"], padding=True)
    if side == "left":
        assert batch["input_ids"][0] == [PAD_TOKEN_ID, PAD_TOKEN_ID, 97]
        assert batch["attention_mask"][0] == [0, 0, 1]
    else:
        assert batch["input_ids"][0] == [97, PAD_TOKEN_ID, PAD_TOKEN_ID]
        assert batch["attention_mask"][0] == [1, 0, 0]


# --------------------------------------------------------------------------- model


def test_vocab_padding_rounds_up_to_a_multiple_of_128() -> None:
    assert padded_vocab_size() == 384
    assert padded_vocab_size(256) == 256


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_model_is_deterministic_for_a_seed_and_leaves_the_global_rng_alone(arch: str) -> None:
    rng_before = torch.get_rng_state()
    first = build_tiny_model(arch, 384, seed=3)  # type: ignore[arg-type]
    assert torch.equal(torch.get_rng_state(), rng_before)
    torch.rand(5)  # whatever ran in between must not matter
    second = build_tiny_model(arch, 384, seed=3)  # type: ignore[arg-type]
    other = build_tiny_model(arch, 384, seed=4)  # type: ignore[arg-type]
    assert state_dicts_equal(first.state_dict(), second.state_dict())
    assert not torch.equal(first.lm_head.weight, other.lm_head.weight)
    config = first.config
    assert config.tie_word_embeddings is False
    assert not torch.equal(
        first.state_dict()["lm_head.weight"], first.state_dict()["model.embed_tokens.weight"]
    )
    assert config.hidden_size // config.num_attention_heads == 32
    assert first.lm_head.weight.shape == (384, 64)
    assert first.dtype == torch.float32


def test_qwen2_has_attention_biases_and_llama_does_not() -> None:
    qwen = build_tiny_model("qwen2", 384)
    llama = build_tiny_model("llama", 384)
    assert "model.layers.0.self_attn.q_proj.bias" in qwen.state_dict()
    assert "model.layers.0.self_attn.q_proj.bias" not in llama.state_dict()


def test_grouped_query_attention_is_available() -> None:
    model = build_tiny_model("llama", 384, heads=2, kv_heads=1)
    assert model.state_dict()["model.layers.0.self_attn.k_proj.weight"].shape == (32, 64)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"arch": "gpt2"}, "arch='gpt2' is not supported"),
        ({"vocab_size": 100}, "vocab_size=100 is smaller"),
        ({"hidden": 64, "heads": 4}, "head_dim 16"),
        ({"hidden": 96, "heads": 2}, "head_dim 48"),
        ({"heads": 2, "kv_heads": 3}, "kv_heads=3 must divide heads=2"),
        ({"layers": 0}, "layers=0 must be positive"),
    ],
)
def test_sizes_the_engines_cannot_load_are_rejected_with_the_parameter(
    kwargs: dict[str, object], message: str
) -> None:
    arguments: dict[str, object] = {"arch": "qwen2", "vocab_size": 384, **kwargs}
    with pytest.raises(ValueError, match=message):
        build_tiny_model(**arguments)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- directory


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_written_directory_reloads_with_auto_classes(tmp_path: Path, arch: str) -> None:
    path = write_tiny_model(tmp_path / "tiny", arch=arch, seed=5)  # type: ignore[arg-type]
    assert path == tmp_path / "tiny"
    assert (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file()

    model = AutoModelForCausalLM.from_pretrained(path)
    reference = build_tiny_model(arch, padded_vocab_size(), seed=5)  # type: ignore[arg-type]
    assert state_dicts_equal(model.state_dict(), reference.state_dict())
    assert model.generation_config.eos_token_id == [EOS_TOKEN_ID, BOS_TOKEN_ID]
    assert model.generation_config.pad_token_id == PAD_TOKEN_ID

    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer.padding_side == "left"
    assert tokenizer.pad_token_id == PAD_TOKEN_ID and tokenizer.eos_token_id == EOS_TOKEN_ID
    for text in ASCII_SAMPLES:
        assert tokenizer(text)["input_ids"] == list(text.encode())
    assert (
        tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
        == EXPECTED_CHAT_PROMPT
    )


def test_writing_again_keeps_the_existing_directory(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path / "tiny", seed=1)
    weights = path / "model.safetensors"
    written_at = weights.stat().st_mtime_ns
    assert write_tiny_model(tmp_path / "tiny", seed=1) == path
    assert weights.stat().st_mtime_ns == written_at
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]  # no staging directory left


def test_other_parameters_or_foreign_files_are_never_overwritten(tmp_path: Path) -> None:
    write_tiny_model(tmp_path / "tiny", seed=1)
    with pytest.raises(FileExistsError, match=r"arch: 'qwen2' != 'llama'.*seed: 1 != 2"):
        write_tiny_model(tmp_path / "tiny", arch="llama", seed=2)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not a tiny model"):
        write_tiny_model(foreign)
    assert (foreign / "notes.txt").read_text() == "mine"


def test_an_empty_directory_is_filled(tmp_path: Path) -> None:
    (tmp_path / "tiny").mkdir()
    path = write_tiny_model(tmp_path / "tiny")
    assert (path / "config.json").is_file()


def test_a_writer_that_loses_the_race_returns_the_winners_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "tiny"
    real_build = tiny.build_tiny_model

    def build_while_a_rival_writes(*args: object, **kwargs: object) -> object:
        # Another process finishes writing the same model while this one is still building.
        monkeypatch.setattr(tiny, "build_tiny_model", real_build)
        write_tiny_model(target)
        return real_build(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(tiny, "build_tiny_model", build_while_a_rival_writes)
    assert write_tiny_model(target) == target
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]
    assert (target / "hybridflow_tiny.json").is_file()


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused(tmp_path: Path) -> None:
    from hybridflow.models.compat import tokenizer_model_mismatch

    model_dir = write_tiny_model(tmp_path / "model")
    assert tokenizer_model_mismatch(model_dir, model_dir) is None
    config_file = model_dir / "config.json"
    config = json.loads(config_file.read_text())
    config["vocab_size"] = 128  # fewer rows than the tokenizer's 260 tokens
    config_file.write_text(json.dumps(config))
    problem = tokenizer_model_mismatch(model_dir, model_dir)
    assert (
        problem is not None and "has 260 tokens but the model" in problem and "128 embedding rows" in problem
    )
