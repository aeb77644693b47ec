"""The lookup task of ``bench/agentic.py``: answering needs a letter that only a tool returns.

Each prompt names a key (``"key 417: which letter?"``); its answer is one of :data:`LETTERS`,
a hash of the key (:func:`secret_of`), which the model cannot compute and the ``lookup`` tool
returns. The answer is scored by the built-in ``target_char`` reward (the fraction of the last
model turn's characters that are the letter), so a model without the tool can at best guess:
``1 / len(LETTERS)``.

The plugins, loaded by import path in the rollout service (``bench/`` is on ``PYTHONPATH``):

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
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping
from typing import Any

from hybridflow.agents.loop import Finish, Insert, ToolCallingLoop, TurnContext
from hybridflow.agents.tools import call_tool

LETTERS = "abcd"
REPEAT = 16
ASK = "?"


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
