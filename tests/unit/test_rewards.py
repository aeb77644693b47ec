"""Rule-based rewards, their registry and resolution, and the toy prompt sets."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from hybridflow.rewards import RULE_REWARDS, TOY_TASKS, make_toy_dataset, resolve_reward_function
from hybridflow.rewards.rules import (
    copy_reward,
    count_char_reward,
    extract_final_answer,
    gsm8k_reward,
    parse_number,
    target_char_reward,
)

pytestmark = pytest.mark.unit


def always_half(
    data_source: str, response: str, ground_truth: str, extra_info: Mapping[str, Any] | None
) -> float:
    """A user-defined reward function, resolved through this module's import path."""
    return 0.5


class Scorer:
    """Holds a reward function one attribute deep, for nested import paths."""

    @staticmethod
    def score(
        data_source: str, response: str, ground_truth: str, extra_info: Mapping[str, Any] | None
    ) -> float:
        return 1.0


# --------------------------------------------------------------------------- GSM8K


@pytest.mark.parametrize(
    ("response", "ground_truth", "expected"),
    [
        ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72", 1.0),
        ("so the total is 72", "72", 1.0),  # last number in the text
        ("#### 71", "72", 0.0),  # wrong
        ("I think #### 72, though 5 came up earlier and 9 later", "72", 1.0),  # '####' beats the last number
        ("The answer is \\boxed{72}.", "72", 1.0),
        ("\\boxed{\\$1,234}", "1234", 1.0),  # a number inside the box, with '$' and comma
        ("\\boxed{\\frac{1}{2}} or 3", "3", 0.0),  # the box wins; 2 is not 3
        ("#### 1,234", "1234", 1.0),  # thousands comma
        ("It costs $1,234.00.", "1,234", 1.0),  # '$', comma, trailing '.0' and period
        ("#### 42.0", "42", 1.0),
        ("#### -5", "-5", 1.0),
        ("I do not know", "72", 0.0),  # no number at all
        ("", "72", 0.0),
        ("#### 18", "Janet eats 3 and bakes 4: 16 - 3 - 4 = 9, 9 * 2 = 18\n#### 18", 1.0),  # full solution
        ("\\boxed{72", "72", 1.0),  # cut-off box: falls back to the last number
    ],
)
def test_gsm8k_reward(response: str, ground_truth: str, expected: float) -> None:
    assert gsm8k_reward("openai/gsm8k", response, ground_truth, None) == expected


def test_gsm8k_format_score_only_for_a_readable_wrong_answer() -> None:
    assert gsm8k_reward("gsm8k", "#### 71", "72", None, format_score=0.1) == 0.1
    assert gsm8k_reward("gsm8k", "no idea", "72", None, format_score=0.1) == 0.0
    assert gsm8k_reward("gsm8k", "#### 72", "72", None, format_score=0.1) == 1.0


def test_extract_final_answer_and_parse_number() -> None:
    assert extract_final_answer("a 1 b 2, c") == "2"
    assert extract_final_answer("#### 7 then 8") == "7"
    assert extract_final_answer("\\boxed{x + {y}}") is None  # box without a number, none elsewhere
    assert extract_final_answer("nothing") is None
    assert parse_number("$1,234.") == 1234.0
    assert parse_number("12 apples") is None


# --------------------------------------------------------------------------- toy tasks


@pytest.mark.parametrize(
    ("response", "expected"),
    [("abcd", 1.0), (" abcdef", 1.0), ("abxx", 0.5), ("xbcd", 0.0), ("", 0.0), ("ab", 0.5)],
)
def test_copy_reward_is_prefix_fraction(response: str, expected: float) -> None:
    assert copy_reward("copy", response, "abcd", None) == expected


@pytest.mark.parametrize(
    ("response", "expected"),
    [("3", 1.0), ("3. It is three", 1.0), ("4", 0.0), ("three", 0.0), ("", 0.0), ("  3", 1.0)],
)
def test_count_char_reward_checks_first_word(response: str, expected: float) -> None:
    assert count_char_reward("count_char", response, "3", None) == expected


def test_target_char_reward_is_fraction_of_non_space_characters() -> None:
    assert target_char_reward("target_char", "aaab", "a", None) == 0.75
    assert target_char_reward("target_char", "a a a", "a", None) == 1.0
    assert target_char_reward("target_char", "   ", "a", None) == 0.0
    assert target_char_reward("target_char", "", "a", None) == 0.0
    # Rises by a step with each extra target character: the smooth signal the task exists for.
    rewards = [target_char_reward("target_char", "a" * k + "b" * (8 - k), "a", None) for k in range(9)]
    assert rewards == sorted(rewards)
    assert rewards[0] == 0.0
    assert rewards[-1] == 1.0


def test_target_char_rejects_a_ground_truth_that_is_not_one_character() -> None:
    with pytest.raises(ValueError, match="single character, got 'ab'"):
        target_char_reward("target_char", "aaa", "ab", None)


# --------------------------------------------------------------------------- resolution


def test_resolve_registered_names() -> None:
    for name, function in RULE_REWARDS.items():
        assert resolve_reward_function(name) is function


def test_resolve_import_paths() -> None:
    assert resolve_reward_function(f"{__name__}:always_half") is always_half
    assert resolve_reward_function(f"{__name__}:Scorer.score")("d", "r", "g", None) == 1.0
    assert resolve_reward_function("hybridflow.rewards.rules:gsm8k_reward") is gsm8k_reward


def test_resolve_unknown_name_lists_registered_names() -> None:
    with pytest.raises(ValueError) as raised:
        resolve_reward_function("gsm9k")
    message = str(raised.value)
    assert "'gsm9k' is not known" in message
    for name in RULE_REWARDS:
        assert name in message
    assert "'module.sub:function'" in message


@pytest.mark.parametrize("value", [":always_half", "math:", ""])
def test_resolve_rejects_incomplete_paths(value: str) -> None:
    with pytest.raises(ValueError, match="is not known"):
        resolve_reward_function(value)


def test_resolve_missing_module_names_it() -> None:
    with pytest.raises(ValueError, match=r"module 'no_such_module_xyz\.sub' could not be imported"):
        resolve_reward_function("no_such_module_xyz.sub:score")


def test_resolve_missing_attribute_names_module_and_attribute() -> None:
    with pytest.raises(ValueError, match=r"module 'math' has no attribute 'no_such_function'"):
        resolve_reward_function("math:no_such_function")
    with pytest.raises(ValueError, match=rf"{__name__}:Scorer has no attribute 'missing'"):
        resolve_reward_function(f"{__name__}:Scorer.missing")


def test_resolve_rejects_a_non_callable() -> None:
    with pytest.raises(ValueError, match="'pi' in 'math' is a float, not a function"):
        resolve_reward_function("math:pi")


# --------------------------------------------------------------------------- toy datasets


@pytest.mark.parametrize("task", TOY_TASKS)
def test_toy_dataset_rows_follow_the_schema_and_are_solvable(task: str) -> None:
    rows = make_toy_dataset(task, n=20, seed=3)
    assert len(rows) == 20
    reward = RULE_REWARDS[task]
    for index, row in enumerate(rows):
        assert set(row) == {"prompt", "data_source", "reward_model", "extra_info"}
        assert row["data_source"] == task
        assert row["extra_info"] == {"index": index}
        assert row["reward_model"]["style"] == "rule"
        [message] = row["prompt"]
        assert message["role"] == "user"
        assert isinstance(message["content"], str)
        assert message["content"]
        ground_truth = row["reward_model"]["ground_truth"]
        perfect_response = ground_truth * 4 if task == "target_char" else ground_truth
        assert reward(task, perfect_response, ground_truth, row["extra_info"]) == 1.0


def test_toy_dataset_is_deterministic_per_seed_and_can_use_plain_prompts() -> None:
    assert make_toy_dataset("copy", 10, seed=1) == make_toy_dataset("copy", 10, seed=1)
    assert make_toy_dataset("copy", 10, seed=1) != make_toy_dataset("copy", 10, seed=2)
    plain = make_toy_dataset("count_char", 5, seed=0, as_chat=False)
    assert all(isinstance(row["prompt"], str) for row in plain)
    assert make_toy_dataset("target_char", 0, seed=0) == []


def test_toy_dataset_rejects_unknown_task() -> None:
    with pytest.raises(
        ValueError, match="toy task 'sort' is not known; use one of copy, count_char, target_char"
    ):
        make_toy_dataset("sort", 4, seed=0)


def test_first_char_scores_the_first_character_whatever_the_length() -> None:
    from hybridflow.rewards.rules import first_char_reward

    assert first_char_reward("target_char", "  abc", "a", None) == 1.0
    assert first_char_reward("target_char", "a" + "b" * 60, "a", None) == 1.0
    assert first_char_reward("target_char", "ba", "a", None) == 0.0
    assert first_char_reward("target_char", "   ", "a", None) == 0.0
    with pytest.raises(ValueError, match="single character"):
        first_char_reward("target_char", "a", "ab", None)
