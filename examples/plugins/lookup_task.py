"""The lookup task of ``examples/grpo-tiny-lookup.yaml`` and ``bench/agentic.py``: answering needs a
letter that only a tool returns.

Each prompt names a key (``"key 417: which letter?"``); its answer is one of :data:`LETTERS`,
a hash of the key (:func:`secret_of`), which the model cannot compute and the ``lookup`` tool
returns. The answer is scored by the built-in ``target_char`` reward (the fraction of the last
model turn's characters that are the letter), so a model without the tool can at best guess:
``1 / len(LETTERS)``.

The plugins, loaded by import path in the rollout service (``examples/plugins`` on ``PYTHONPATH``):

* :class:`Lookup` (``agent.tools``): the tool. It writes the letter :data:`REPEAT` times: a
  two-layer model learns to copy a run of letters far sooner than one letter thirteen tokens
  back (measured with ``bench/agentic.py``, 150 steps: with one letter the model called on
  every trajectory and its reward stayed at the guess, 0.24; with sixteen it reached 0.49).
* :class:`LookupLoop` (``agent.loop``): the built-in tool-calling loop plus a short call: a model
  turn holding ``?`` calls ``lookup`` on the prompt's key. A byte-level random model never
  writes ``<tool_call>{"name": "lookup", ...}</tool_call>`` (forty exact bytes); a pretrained
  model knows that format, the tiny one gets a one-byte call instead. Hermes calls still work.
* :func:`called_lookup` (a reward function): 1 when the trajectory called a tool, the format
  reward tool-RL recipes use (``bench/agentic.py`` says why the bench needs it).

And what the job needs before it starts, ``python examples/plugins/lookup_task.py outputs/lookup``:
the prompts (:func:`make_rows`) and a random tiny model after the format warm-up
(:func:`warm_up`: supervised steps on what a turn looks like, never on an answer).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hybridflow.agents.loop import Finish, Insert, ToolCallingLoop, TurnContext
from hybridflow.agents.tools import call_tool

LETTERS = "abcd"
REPEAT = 16
ASK = "?"
TURN_TOKENS = 16
"""``agent.maxTurnTokens`` of the example, and the length of the warm-up's answer turns."""
TOOL_TURN = "\n<|im_start|>tool\n{result}<|im_end|>\n<|im_start|>assistant\n"
"""The example's ``toolResponseFormat``: ChatML's tool turn (Qwen2's template has the role)."""
WARM_UP_STEPS = 30
WARM_UP_LEARNING_RATE = 5e-3


def secret_of(key: str) -> str:
    """The letter of ``key``: a hash, so that no rule the model could learn gives it."""
    return LETTERS[hashlib.sha256(f"lookup:{key}".encode()).digest()[0] % len(LETTERS)]


def make_rows(count: int, seed: int) -> list[dict[str, Any]]:
    """``count`` prompts in the job's dataset schema; the key also in ``extra_info`` for the loop."""
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        key = str(rng.randrange(10_000))
        rows.append(
            {
                "prompt": [{"role": "user", "content": f"key {key}: which letter?"}],
                "data_source": "lookup",
                "reward_model": {"style": "rule", "ground_truth": secret_of(key)},
                "extra_info": {"index": index, "key": key},
            }
        )
    return rows


class Lookup:
    name = "lookup"
    description = "The letter of a key."
    parameters: Mapping[str, Any] = {
        "type": "object",
        "properties": {"key": {"type": "string", "description": "The key, as the question gives it."}},
        "required": ["key"],
    }

    def __call__(self, arguments: dict[str, Any]) -> str:
        key = arguments.get("key")
        if not isinstance(key, str) or not key.isdigit():
            raise ValueError(f"'key' must be the digits of a key, got {key!r}")
        return secret_of(key) * REPEAT


class LookupLoop(ToolCallingLoop):
    """``loop: tools`` with one more call syntax: a turn holding :data:`ASK` looks up the prompt's key."""

    def after_turn(self, context: TurnContext) -> Finish | Insert:
        if context.final is not None or ASK not in context.text or self.parse(context.text).wants_tools:
            return super().after_turn(context)
        outcome = call_tool(
            self.tools,
            Lookup.name,
            {"key": str(context.row["extra_info"]["key"])},
            timeout_seconds=self.spec.tool_timeout_seconds,
            retries=self.spec.tool_retries,
            pool=self._calls,
        )
        return Insert(self.spec.tool_response_format, [outcome], result=outcome.text)


def called_lookup(
    data_source: str, response: str, ground_truth: str, extra_info: Mapping[str, Any] | None
) -> float:
    """1.0 when the trajectory made a tool call (``extra_info["agent"]["tool_calls"]``), else 0."""
    agent = (extra_info or {}).get("agent") or {}
    return 1.0 if agent.get("tool_calls", 0) > 0 else 0.0


def warm_up(model_dir: Path, out: Path, rows: list[dict[str, Any]], steps: int, *, tool: bool) -> Path:
    """The format warm-up: supervised steps on the format of a call, never on an answer.

    With ``tool``, the first turn is :data:`ASK` (the loop's call) and the turn after the tool turn
    (whose result is empty here) is random printable text; without, the one turn is random
    printable text. Random text keeps the answer turn as undecided as the random model's (the
    answer letters are 4 of 95 characters), so that which letter to write, and that it is the
    tool's, is left to RL. The loss is on the model's turns only. Writes the model to ``out``.
    """
    import torch  # here: the rollout service imports this module for its plugins alone
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=WARM_UP_LEARNING_RATE, weight_decay=0.0)
    rng = random.Random(1)

    def encode(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    examples = []
    for row in rows[:64]:
        prompt = str(tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False))
        answer = encode(
            "".join(chr(rng.randrange(32, 127)) for _ in range(TURN_TOKENS)) + tokenizer.eos_token
        )
        parts = [(encode(prompt), False)]
        if tool:
            parts += [(encode(ASK + tokenizer.eos_token), True)]
            parts += [(encode(TOOL_TURN.replace("{result}", "")), False)]
        parts.append((answer, True))
        ids = [token for part, _ in parts for token in part]
        labels = [token if trained else -100 for part, trained in parts for token in part]
        examples.append((torch.tensor([ids]), torch.tensor([labels])))
    for _ in range(steps):
        optimizer.zero_grad()
        for input_ids, targets in examples:
            (model(input_ids=input_ids, labels=targets).loss / len(examples)).backward()
        optimizer.step()
    shutil.copytree(model_dir, out)
    model.save_pretrained(out)
    return out


def prepare(directory: Path, warm_up_steps: int = WARM_UP_STEPS) -> tuple[Path, Path]:
    """``directory/lookup.jsonl`` (512 prompts) and ``directory/warm-model`` (the random tiny model
    after :func:`warm_up` with the tool): what ``examples/grpo-tiny-lookup.yaml`` reads."""
    from hybridflow.models.tiny import write_tiny_model

    directory.mkdir(parents=True, exist_ok=True)
    rows = make_rows(512, seed=0)
    data = directory / "lookup.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    random_model = write_tiny_model(directory / "tiny-model")
    shutil.rmtree(directory / "warm-model", ignore_errors=True)
    return data, warm_up(random_model, directory / "warm-model", rows, warm_up_steps, tool=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="the lookup task's prompts and warmed-up tiny model")
    parser.add_argument("directory", type=Path, help="where to write them (the example reads outputs/lookup)")
    parser.add_argument("--warm-up-steps", type=int, default=WARM_UP_STEPS)
    arguments = parser.parse_args()
    print(*prepare(arguments.directory, arguments.warm_up_steps))
