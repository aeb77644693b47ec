"""Prompt datasets: reading veRL rows, rendering and tokenizing, filtering, shuffling and resuming."""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridflow.data import (
    BATCH_FIELD_NAMES,
    ChatMessage,
    PromptDataError,
    PromptDataset,
    PromptRow,
    PromptSampler,
    SamplerStateError,
    epoch_order,
    plain_chat_text,
    read_prompt_file,
    read_prompt_files,
)
from hybridflow.spec.data import DataSpec

pytestmark = pytest.mark.unit

CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def char_tokenizer(*, chat_template: str | None) -> Any:
    """A character-level tokenizer over printable ASCII plus ChatML's special tokens, built offline."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {token: i for i, token in enumerate([*specials, *string.printable])}
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.Split(tokenizers.Regex(r"[\s\S]"), behavior="isolated")
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=model,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        additional_special_tokens=specials[1:],
        chat_template=chat_template,
    )


@pytest.fixture(scope="module")
def chat_tokenizer() -> Any:
    return char_tokenizer(chat_template=CHATML_TEMPLATE)


@pytest.fixture(scope="module")
def plain_tokenizer() -> Any:
    return char_tokenizer(chat_template=None)


class OrdTokenizer:
    """The smallest :class:`PromptTokenizer`: one id per character, no chat template."""

    chat_template = None

    def apply_chat_template(
        self, conversation: list[ChatMessage], *, add_generation_prompt: bool, tokenize: bool
    ) -> Any:
        raise AssertionError("a tokenizer without a chat template is never asked to apply one")

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        return [ord(c) for c in text]


def row(index: int, *, chat: bool = True, **overrides: Any) -> dict[str, Any]:
    text = f"Question {index}?"
    record: dict[str, Any] = {
        "prompt": [{"role": "user", "content": text}] if chat else text,
        "data_source": "toy",
        "reward_model": {"style": "rule", "ground_truth": str(index)},
        "extra_info": {"index": index, "split": "train"},
    }
    record.update(overrides)
    return record


def write_jsonl(path: Path, records: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def write_parquet(path: Path, records: list[dict[str, Any]]) -> Path:
    pq.write_table(pa.Table.from_pylist(records), path)
    return path


# -- reading ---------------------------------------------------------------------------------


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "string"])
def test_parquet_and_jsonl_read_the_same_rows(tmp_path: Path, chat: bool) -> None:
    records = [row(i, chat=chat) for i in range(5)]
    from_jsonl = read_prompt_file(write_jsonl(tmp_path / "train.jsonl", records))
    from_parquet = read_prompt_file(write_parquet(tmp_path / "train.parquet", records))
    assert from_jsonl == from_parquet
    assert from_jsonl[3] == PromptRow(
        file_index=0,
        row_index=3,
        prompt=records[3]["prompt"],
        data_source="toy",
        ground_truth="3",
        reward_style="rule",
        extra_info={"index": 3, "split": "train"},
    )


def test_rows_of_several_files_get_file_and_row_uids(tmp_path: Path) -> None:
    first = write_jsonl(tmp_path / "a.jsonl", [row(0), row(1)])
    second = write_parquet(tmp_path / "b.parquet", [row(2)])
    rows = read_prompt_files([first, second])
    assert [r.uid for r in rows] == ["0:0", "0:1", "1:0"]


def test_blank_lines_are_skipped_and_optional_fields_may_be_absent(tmp_path: Path) -> None:
    minimal = {"prompt": "hi", "data_source": "toy", "reward_model": {"ground_truth": 7}}
    path = tmp_path / "train.jsonl"
    path.write_text("\n" + json.dumps(minimal) + "\n\n" + json.dumps(row(1)) + "\n")
    rows = read_prompt_file(path)
    assert [(r.row_index, r.ground_truth, r.reward_style, r.extra_info) for r in rows] == [
        (0, 7, None, None),
        (1, "1", "rule", {"index": 1, "split": "train"}),
    ]


def test_the_prompt_column_is_configurable(tmp_path: Path) -> None:
    record = row(0)
    record["question"] = record.pop("prompt")
    rows = read_prompt_file(write_jsonl(tmp_path / "train.jsonl", [record]), prompt_key="question")
    assert rows[0].prompt == [{"role": "user", "content": "Question 0?"}]


# -- error messages ----------------------------------------------------------------------------


def test_a_missing_prompt_names_file_row_and_the_columns_present(tmp_path: Path) -> None:
    records = [row(i) for i in range(20)]
    del records[17]["prompt"]
    path = write_jsonl(tmp_path / "train.jsonl", records)
    with pytest.raises(
        PromptDataError, match=r"train\.jsonl row 17 \(line 18\): 'prompt' is missing"
    ) as error:
        read_prompt_file(path)
    assert "'data_source'" in str(error.value) and "promptKey" in str(error.value)


def test_a_missing_ground_truth_names_the_nested_field(tmp_path: Path) -> None:
    records = [row(0), row(1, reward_model={"style": "rule"})]
    with pytest.raises(
        PromptDataError, match=r"train\.jsonl row 1 \(line 2\): 'reward_model\.ground_truth' is missing"
    ):
        read_prompt_file(write_jsonl(tmp_path / "train.jsonl", records))
    # Parquet fills the absent struct field with null, which counts as missing.
    with pytest.raises(
        PromptDataError, match=r"train\.parquet row 1: 'reward_model\.ground_truth' is missing"
    ):
        read_prompt_file(write_parquet(tmp_path / "train.parquet", records))


def test_invalid_json_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(row(0)) + "\n" + json.dumps(row(1)) + "\n{'prompt': 'single quotes'}\n")
    with pytest.raises(PromptDataError, match=r"train\.jsonl line 3 is not valid JSON"):
        read_prompt_file(path)


def test_an_unknown_extension_says_which_are_allowed(tmp_path: Path) -> None:
    path = tmp_path / "train.csv"
    path.write_text("prompt\nhi\n")
    with pytest.raises(
        PromptDataError, match=r"train\.csv: unsupported file type '\.csv'; .*\.parquet or \.jsonl"
    ):
        read_prompt_file(path)


def test_a_missing_file_and_a_damaged_parquet_file_are_named(tmp_path: Path) -> None:
    with pytest.raises(PromptDataError, match=r"absent\.jsonl: no such file"):
        read_prompt_file(tmp_path / "absent.jsonl")
    damaged = tmp_path / "damaged.parquet"
    damaged.write_bytes(b"not parquet at all")
    with pytest.raises(PromptDataError, match=r"damaged\.parquet: not a readable parquet file"):
        read_prompt_file(damaged)


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ([1, 2], r"row 0 \(line 1\): a row must be an object with named fields, got list"),
        (row(0, data_source=None), r"row 0 \(line 1\): 'data_source' is missing"),
        (row(0, data_source=3), r"'data_source' must be a string, got int"),
        (row(0, reward_model=None), r"'reward_model' is missing"),
        (row(0, reward_model="42"), r"'reward_model' must be an object with 'ground_truth', got str"),
        (row(0, extra_info=[1]), r"'extra_info' must be an object or null, got list"),
        (
            row(0, prompt=5),
            r"'prompt' must be a string or a list of chat messages \{role, content\}, got int",
        ),
        (row(0, prompt=[]), r"'prompt' is an empty list of chat messages"),
        (row(0, prompt=["hi"]), r"'prompt\[0\]' must be an object with 'role' and 'content', got str"),
        (row(0, prompt=[{"role": "user"}]), r"'prompt\[0\]\.content' is missing"),
        (row(0, prompt=[{"role": 1, "content": "x"}]), r"'prompt\[0\]\.role' must be a string, got int"),
    ],
)
def test_schema_errors_name_the_row_and_the_field(tmp_path: Path, record: Any, message: str) -> None:
    with pytest.raises(PromptDataError, match=message):
        read_prompt_file(write_jsonl(tmp_path / "train.jsonl", [record]))


# -- rendering and tokenizing ------------------------------------------------------------------


def test_chat_prompts_use_the_chat_template(tmp_path: Path, chat_tokenizer: Any) -> None:
    path = write_jsonl(tmp_path / "train.jsonl", [row(0)])
    prompt = PromptDataset.from_files([path], chat_tokenizer, max_prompt_tokens=100)[0]
    assert prompt.text == "<|im_start|>user\nQuestion 0?<|im_end|>\n<|im_start|>assistant\n"
    assert list(prompt.token_ids) == chat_tokenizer.encode(prompt.text, add_special_tokens=False)
    assert len(prompt.token_ids) == 3 + len("user\nQuestion 0?\nassistant\n")  # 3 special tokens


def test_chat_prompts_without_a_template_use_the_plain_format(tmp_path: Path, plain_tokenizer: Any) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    path = write_jsonl(tmp_path / "train.jsonl", [row(0, prompt=messages)])
    prompt = PromptDataset.from_files([path], plain_tokenizer, max_prompt_tokens=100)[0]
    assert prompt.text == plain_chat_text(messages) == "system: Be brief.\nuser: Hi\nassistant:"
    assert list(prompt.token_ids) == plain_tokenizer.encode(prompt.text)


def test_string_prompts_are_used_as_written_even_with_a_template(tmp_path: Path, chat_tokenizer: Any) -> None:
    path = write_jsonl(tmp_path / "train.jsonl", [row(0, chat=False)])
    prompt = PromptDataset.from_files([path], chat_tokenizer, max_prompt_tokens=100)[0]
    assert prompt.text == "Question 0?"
    assert len(prompt.token_ids) == len("Question 0?")


def test_over_long_prompts_are_dropped_and_counted(tmp_path: Path) -> None:
    records = [row(0, chat=False, prompt="x" * length) for length in (3, 9, 4, 10, 5)]
    dataset = PromptDataset.from_files(
        [write_jsonl(tmp_path / "train.jsonl", records)], OrdTokenizer(), max_prompt_tokens=5
    )
    assert dataset.filtered_too_long == 2
    assert [p.row.row_index for p in dataset] == [0, 2, 4]  # uids still name the original rows


def test_an_error_when_every_prompt_is_too_long(tmp_path: Path) -> None:
    records = [row(0, chat=False, prompt="x" * length) for length in (12, 9)]
    path = write_jsonl(tmp_path / "train.jsonl", records)
    with pytest.raises(
        PromptDataError,
        match=r"every one of the 2 prompts in .*train\.jsonl is longer than max_prompt_tokens=8 "
        r"\(the shortest has 9 tokens\)",
    ):
        PromptDataset.from_files([path], OrdTokenizer(), max_prompt_tokens=8)


def test_an_empty_file_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    path.write_text("\n")
    with pytest.raises(PromptDataError, match=r"train\.jsonl holds no prompts"):
        PromptDataset.from_files([path], OrdTokenizer(), max_prompt_tokens=8)


def test_the_dataset_follows_the_job_spec(tmp_path: Path) -> None:
    record = row(0, chat=False)
    record["question"] = record.pop("prompt")
    path = write_parquet(tmp_path / "train.parquet", [record, {**record, "question": "x" * 50}])
    spec = DataSpec(train_files=(str(path),), prompt_key="question", max_prompt_tokens=20)
    dataset = PromptDataset.from_spec(spec, OrdTokenizer())
    assert (len(dataset), dataset.filtered_too_long, dataset[0].text) == (1, 1, "Question 0?")


# -- batches -------------------------------------------------------------------------------------


def small_dataset(size: int) -> PromptDataset:
    rows = [
        PromptRow(
            file_index=0,
            row_index=i,
            prompt=[{"role": "user", "content": f"q{i}"}],
            data_source="toy",
            ground_truth=str(i),
            reward_style="rule",
            extra_info={"index": i},
        )
        for i in range(size)
    ]
    return PromptDataset.from_rows(rows, OrdTokenizer(), max_prompt_tokens=1000)


def test_batch_fields_are_one_dimensional_object_arrays() -> None:
    batch = small_dataset(4).take([2, 0, 2])
    fields = batch.to_batch_fields()
    assert tuple(fields) == BATCH_FIELD_NAMES
    for array in fields.values():
        assert array.dtype == object and array.shape == (3,)
    assert fields["uid"].tolist() == ["0:2", "0:0", "0:2"]
    assert fields["prompt_token_ids"][1] == [ord(c) for c in "user: q0\nassistant:"]
    assert fields["ground_truth"].tolist() == ["2", "0", "2"]
    assert fields["extra_info"][0] == {"index": 2}

    torch_batch = pytest.importorskip("hybridflow.controller.batch")
    assert len(torch_batch.Batch.from_dict(fields)) == 3


def test_a_batch_owns_its_values() -> None:
    dataset = small_dataset(2)
    batch = dataset.take([1])
    batch.extra_infos[0]["index"] = 99  # type: ignore[index]
    batch.prompt_token_ids[0].append(0)
    assert dataset.take([1]).extra_infos == [{"index": 1}]
    assert dataset.take([1]).prompt_token_ids == [list(dataset[1].token_ids)]


# -- order and resume ----------------------------------------------------------------------------


def test_epoch_order_is_a_deterministic_permutation_that_changes_every_epoch() -> None:
    first = epoch_order(50, seed=3, epoch=0)
    assert sorted(first.tolist()) == list(range(50))
    assert np.array_equal(first, epoch_order(50, seed=3, epoch=0))
    assert not np.array_equal(first, epoch_order(50, seed=3, epoch=1))
    assert not np.array_equal(first, epoch_order(50, seed=4, epoch=0))
    assert epoch_order(5, seed=3, epoch=7, shuffle=False).tolist() == [0, 1, 2, 3, 4]


def test_batches_run_across_epochs_in_each_epochs_order() -> None:
    sampler = PromptSampler(small_dataset(5), seed=1)
    drawn = [index for _ in range(4) for index in sampler.next_indices(3)]
    expected = [
        *epoch_order(5, seed=1, epoch=0),
        *epoch_order(5, seed=1, epoch=1),
        *epoch_order(5, seed=1, epoch=2),
    ]
    assert drawn == expected[:12]
    assert sampler.state_dict() == {"epoch": 2, "position": 2, "seed": 1}


def test_a_batch_larger_than_the_dataset_spans_several_epochs() -> None:
    sampler = PromptSampler(small_dataset(2), seed=0, shuffle=False)
    assert sampler.next_batch(5).uids == ["0:0", "0:1", "0:0", "0:1", "0:0"]
    assert sampler.state_dict() == {"epoch": 2, "position": 1, "seed": 0}


@settings(max_examples=60, deadline=None)
@given(
    size=st.integers(1, 9),
    seed=st.integers(0, 3),
    shuffle=st.booleans(),
    batch_sizes=st.lists(st.integers(1, 20), min_size=1, max_size=12),
    data=st.data(),
)
def test_resuming_from_a_state_gives_the_uninterrupted_batches(
    size: int, seed: int, shuffle: bool, batch_sizes: list[int], data: st.DataObject
) -> None:
    dataset = small_dataset(size)
    uninterrupted = PromptSampler(dataset, seed=seed, shuffle=shuffle)
    expected = [uninterrupted.next_batch(n) for n in batch_sizes]

    stop = data.draw(st.integers(0, len(batch_sizes)), label="stop")
    before = PromptSampler(dataset, seed=seed, shuffle=shuffle)
    for n in batch_sizes[:stop]:
        before.next_batch(n)
    checkpoint = json.loads(json.dumps(before.state_dict()))  # as a checkpoint stores it

    resumed = PromptSampler(dataset, seed=seed, shuffle=shuffle)
    resumed.load_state_dict(checkpoint)
    assert [resumed.next_batch(n) for n in batch_sizes[stop:]] == expected[stop:]
    assert resumed.state_dict() == uninterrupted.state_dict()


def test_a_state_taken_at_an_epochs_end_starts_the_next_epoch() -> None:
    sampler = PromptSampler(small_dataset(4), seed=2)
    sampler.load_state_dict({"epoch": 0, "position": 4, "seed": 2})
    assert sampler.state_dict() == {"epoch": 1, "position": 0, "seed": 2}


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ({"epoch": 0, "position": 0, "seed": 9}, r"shuffled with seed 9 but this run uses seed 2"),
        ({"epoch": 1, "position": 5, "seed": 2}, r"stopped at prompt 5 .* the dataset now has 4 prompts"),
        ({"epoch": 1, "seed": 2}, r"sampler state lacks \['position'\]"),
        ({"epoch": -1, "position": 0, "seed": 2}, r"'epoch' must be an integer >= 0, got -1"),
    ],
)
def test_a_state_that_cannot_resume_this_sampler_is_refused(state: dict[str, int], message: str) -> None:
    sampler = PromptSampler(small_dataset(4), seed=2)
    with pytest.raises(SamplerStateError, match=message):
        sampler.load_state_dict(state)


def test_the_toy_task_datasets_load(tmp_path: Path, chat_tokenizer: Any) -> None:
    from hybridflow.rewards.rules import make_toy_dataset

    path = write_parquet(tmp_path / "copy.parquet", make_toy_dataset("copy", 8, seed=0))
    dataset = PromptDataset.from_files([path], chat_tokenizer, max_prompt_tokens=64)
    assert len(dataset) == 8 and dataset[0].text.startswith("<|im_start|>user\nCopy: ")
