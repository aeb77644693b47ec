"""Rule-based rewards: score a decoded response against a ground truth with no model.

Protocol: the reward worker decodes each response and calls
``fn(data_source, response, ground_truth, extra_info) -> float`` once per response, with the
row's ``data_source``, ``reward_model["ground_truth"]`` and ``extra_info`` from the dataset
(veRL's schema; ``extra_info`` may be ``None``). A function that names the keyword parameters
``response_token_ids`` or ``finish_reason`` (or takes ``**kwargs``) gets them too, and a
function may return one score per response token instead of one number (both:
:mod:`hybridflow.rewards.parallel`). Functions are pure and cheap; they must not
raise on malformed responses (a policy early in training emits garbage), only return a low
score. Which function runs is a config value resolved once at startup by
``resolve_reward_function``: a name registered in ``RULE_REWARDS`` or a
``"module.sub:function"`` import path to the user's own function.

Besides GSM8K, this module defines toy tasks that a tiny random model can learn on a CPU in a
few dozen RL steps; the end-to-end tests and the README's tiny example train on them to show
that the reward actually goes up. ``make_toy_dataset`` writes their prompts.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Mapping
from typing import Any

from hybridflow.plugins import import_attribute

RewardFunction = Callable[[str, str, str, Mapping[str, Any] | None], float]
"""``(data_source, response, ground_truth, extra_info) -> score``; see the module docstring."""


# --------------------------------------------------------------------------- GSM8K

# A signed decimal with optional "$" and thousands commas; never ends in a comma ("72," -> "72").
_NUMBER = re.compile(r"-?\$?\d(?:[\d,]*\d)?(?:\.\d+)?|-?\.\d+")
_BOXED_OPENING = "\\boxed{"


def _last_boxed_content(text: str) -> str | None:
    """The content of the last ``\\boxed{...}``, with nested braces balanced; None if there is none."""
    start = text.rfind(_BOXED_OPENING)
    if start < 0:
        return None
    depth = 1
    position = start + len(_BOXED_OPENING)
    for index in range(position, len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            depth -= 1
            if depth == 0:
                return text[position:index]
    return None  # unbalanced: the response was cut off inside the box


def parse_number(text: str) -> float | None:
    """Read a GSM8K-style number: ignores ``$``, thousands commas, spaces and a trailing ``.``.

    ``"$1,234.0"`` -> 1234.0, ``"42."`` -> 42.0; anything else that is not a plain decimal
    number -> None.
    """
    cleaned = text.strip().replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
    try:
        return float(cleaned)
    except ValueError:
        return None


def extract_final_answer(text: str) -> str | None:
    """The final answer a math response commits to, as written (not yet normalized).

    In order of precedence: the number after the last ``####`` (GSM8K's own answer marker),
    the content of the last ``\\boxed{...}`` (the convention of math-tuned models), else the
    last number anywhere in the text. None when there is no number at all.
    """
    marker = text.rfind("####")
    if marker >= 0:
        after = _NUMBER.search(text, marker + 4)
        if after is not None:
            return after.group()
    boxed = _last_boxed_content(text)
    if boxed is not None:
        if parse_number(boxed) is not None:
            return boxed
        numbers_in_box = _NUMBER.findall(boxed)
        if numbers_in_box:
            return str(numbers_in_box[-1])
    numbers = _NUMBER.findall(text)
    return str(numbers[-1]) if numbers else None


def gsm8k_reward(
    data_source: str,
    response: str,
    ground_truth: str,
    extra_info: Mapping[str, Any] | None,
    format_score: float = 0.0,
) -> float:
    """GSM8K answer check: 1.0 when the response's final answer equals the ground truth numerically.

    The ground truth may be the bare answer (``"72"``) or a full GSM8K solution ending in
    ``#### 72``. A response whose final answer can be read but is wrong scores
    ``format_score`` (default 0; a small positive value rewards answering in a checkable
    form early in training); a response with no number scores 0.
    """
    expected_text = extract_final_answer(ground_truth) if "####" in ground_truth else ground_truth
    expected = parse_number(expected_text) if expected_text is not None else None
    answer_text = extract_final_answer(response)
    if answer_text is None:
        return 0.0
    answer = parse_number(answer_text)
    if answer is None or expected is None:
        return format_score
    return 1.0 if abs(answer - expected) <= 1e-6 * max(1.0, abs(expected)) else format_score


# --------------------------------------------------------------------------- toy tasks


def copy_reward(
    data_source: str, response: str, ground_truth: str, extra_info: Mapping[str, Any] | None
) -> float:
    """Fraction of ``ground_truth`` reproduced, character by character, at the start of the response.

    Exists as a toy task with partial credit: a tiny model first learns the first character,
    then the next, so the reward climbs in steps rather than jumping from 0 to 1. Leading
    whitespace of the response is ignored (detokenizers often emit a leading space).
    """
    if not ground_truth:
        return 1.0
    text = response.lstrip()
    matched = 0
    for expected, produced in zip(ground_truth, text, strict=False):
        if expected != produced:
            break
        matched += 1
    return matched / len(ground_truth)


def count_char_reward(
    data_source: str, response: str, ground_truth: str, extra_info: Mapping[str, Any] | None
) -> float:
    """1.0 when the response's first word is the count in ``ground_truth`` (e.g. ``"3"``), else 0.0.

    Exists as a toy task with a sparse, all-or-nothing reward that depends on the prompt, the
    opposite of ``target_char``: it exercises outcome-only advantages (GRPO, RLOO) where most
    groups score all-zero early on. Trailing punctuation on the first word is ignored.
    """
    words = response.split()
    if not words:
        return 0.0
    return 1.0 if words[0].strip(".,;:!?") == ground_truth.strip() else 0.0


def target_char_reward(
    data_source: str, response: str, ground_truth: str, extra_info: Mapping[str, Any] | None
) -> float:
    """Fraction of the response's non-whitespace characters equal to the target character ``ground_truth``.

    The smoke test of RL itself: the reward is dense and in [0, 1], and its expectation
    rises smoothly as the policy moves probability mass onto the token(s) that spell the
    target character, whatever the prompt says. A tiny random model on a CPU shows a
    clearly rising reward within a few dozen steps, so an end-to-end run that does not
    improve here has a bug, not a hard task. Whitespace is ignored so a word-level
    tokenizer's separators do not cap the reward below 1. An empty response scores 0. A
    ground truth that is not one character is a dataset bug and raises ``ValueError``.
    """
    if len(ground_truth) != 1:
        raise ValueError(f"target_char: ground_truth must be a single character, got {ground_truth!r}")
    characters = [character for character in response if not character.isspace()]
    if not characters:
        return 0.0
    return sum(character == ground_truth for character in characters) / len(characters)


def first_char_reward(
    data_source: str, response: str, ground_truth: str, extra_info: Mapping[str, Any] | None
) -> float:
    """1.0 when the response's first non-whitespace character is the target character ``ground_truth``.

    ``target_char``'s prompts scored on one decision: the reward neither grows nor shrinks with
    the response's length, so RL leaves the policy's length distribution alone. The async
    rollout bench uses it to keep a long tail of response lengths through training. An empty
    response scores 0; a ground truth that is not one character raises ``ValueError``.
    """
    if len(ground_truth) != 1:
        raise ValueError(f"first_char: ground_truth must be a single character, got {ground_truth!r}")
    stripped = response.lstrip()
    return 1.0 if stripped[:1] == ground_truth else 0.0


def environment_reward(
    data_source: str, response: str, ground_truth: str, extra_info: Mapping[str, Any] | None = None
) -> float:
    """A multi-turn trajectory's score from its environment (``Finish(reward=...)`` of the agent loop); 0 without one."""
    agent = (extra_info or {}).get("agent") or {}
    reward = agent.get("reward")
    return float(reward) if reward is not None else 0.0


RULE_REWARDS: dict[str, RewardFunction] = {
    "environment": environment_reward,
    "gsm8k": gsm8k_reward,
    "copy": copy_reward,
    "count_char": count_char_reward,
    "target_char": target_char_reward,
    "first_char": first_char_reward,
}
"""Reward functions selectable by name in the job config; a toy task's name is also its ``data_source``."""


def resolve_reward_function(name_or_path: str, field: str = "reward function") -> RewardFunction:
    """The reward function a config value names: a key of ``RULE_REWARDS`` or ``"module.sub:function"``.

    An import path may name a nested attribute (``"pkg.mod:Scorer.score"``). Raises
    ``ValueError`` with a message for the person who wrote the config: ``field`` (the config
    value's field path, ``spec.rewards[1].function``), the value, what was missing (module or
    attribute) and what is allowed. Errors raised while importing an
    existing module other than ``ImportError`` propagate unchanged: they are bugs in the
    user's module, and its traceback is the useful message.
    """
    if name_or_path in RULE_REWARDS:
        return RULE_REWARDS[name_or_path]
    allowed = f"a registered name ({', '.join(sorted(RULE_REWARDS))}) or an import path 'module.sub:function'"
    module_name, separator, attribute_path = name_or_path.partition(":")
    if not separator or not module_name or not attribute_path:
        raise ValueError(f"{field}: {name_or_path!r} is not known; use {allowed}")
    target = import_attribute(name_or_path, field)
    if not callable(target):
        raise ValueError(
            f"{field}: {name_or_path!r}: {attribute_path!r} in {module_name!r} is a "
            f"{type(target).__name__}, not a function"
        )
    function: RewardFunction = target
    return function


# --------------------------------------------------------------------------- toy prompt sets

TOY_TASKS: tuple[str, ...] = ("copy", "count_char", "target_char")
"""Tasks ``make_toy_dataset`` can write; each is also the ``RULE_REWARDS`` name that scores it."""

_TOY_ALPHABET = "abcdefgh"
TOY_TARGET_CHAR = "a"
"""The character the ``target_char`` task rewards. Fixed across the dataset so the policy has
one direction to move in regardless of the prompt."""


def _toy_prompt_and_answer(task: str, rng: random.Random) -> tuple[str, str]:
    """One (prompt text, ground truth) pair for ``task``."""
    if task == "copy":
        word = "".join(rng.choice(_TOY_ALPHABET) for _ in range(rng.randint(3, 6)))
        return f"Copy: {word}", word
    if task == "count_char":
        letter = rng.choice(_TOY_ALPHABET[:2])
        word = "".join(rng.choice(_TOY_ALPHABET[:3]) for _ in range(rng.randint(3, 8)))
        return f"How many '{letter}' in {word}?", str(word.count(letter))
    # target_char: the filler only varies the prompts; the answer never depends on it.
    filler = " ".join(rng.choice(_TOY_ALPHABET) for _ in range(rng.randint(2, 5)))
    return f"Say {TOY_TARGET_CHAR} many times. {filler}", TOY_TARGET_CHAR


def make_toy_dataset(task: str, n: int, seed: int, *, as_chat: bool = True) -> list[dict[str, Any]]:
    """``n`` rows of a toy task in veRL's dataset schema, deterministic for a given ``seed``.

    Each row is ``{"prompt": ..., "data_source": task, "reward_model": {"style": "rule",
    "ground_truth": ...}, "extra_info": {"index": i}}``, where ``prompt`` is a one-message
    chat (``[{"role": "user", "content": ...}]``) or, with ``as_chat=False``, the bare text
    (for tokenizers without a chat template, such as the tiny test tokenizers).
    """
    if task not in TOY_TASKS:
        raise ValueError(f"toy task {task!r} is not known; use one of {', '.join(TOY_TASKS)}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    for index in range(n):
        text, ground_truth = _toy_prompt_and_answer(task, rng)
        prompt: str | list[dict[str, str]] = [{"role": "user", "content": text}] if as_chat else text
        rows.append(
            {
                "prompt": prompt,
                "data_source": task,
                "reward_model": {"style": "rule", "ground_truth": ground_truth},
                "extra_info": {"index": index},
            }
        )
    return rows
