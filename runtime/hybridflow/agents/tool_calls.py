"""Finding tool calls in a model turn's text.

A parser takes the turn's text (decoded for reading only: the trajectory keeps the engine's
token ids) and returns a :class:`ParsedTurn`: the calls, in order, and the malformed ones as
messages for the model. ``spec.agent.toolParser`` picks one: ``hermes`` (:func:`parse_hermes`,
the convention of Qwen2.5 and Hermes chat templates) or an import path ``package.module:parse``
to a function with the same signature.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hybridflow.plugins import import_attribute

__all__ = ["ParsedTurn", "ToolCall", "load_parser", "parse_hermes"]


@dataclass(frozen=True)
class ToolCall:
    """One call the model wrote (docs/agents.md has the table of these fields)."""

    name: str
    """The tool's ``name`` as ``agent.tools`` lists it; an unknown one answers ``error: no tool named ...``."""
    arguments: Any
    """What the tool's ``__call__`` receives: for the built-in tools, the JSON object the model wrote."""


@dataclass(frozen=True)
class ParsedTurn:
    """What a parser found in one model turn; empty (no calls, no errors) means the turn is the answer."""

    calls: list[ToolCall] = field(default_factory=list)
    """The calls in the order the model wrote them; each runs and its result is a line of the tool turn."""
    errors: list[str] = field(default_factory=list)
    """One message per malformed call, for the model, after the results (each counts as a failed tool call)."""

    @property
    def wants_tools(self) -> bool:
        """A call or a malformed one: the loop inserts a tool turn; else the turn is the answer."""
        return bool(self.calls or self.errors)


Parser = Callable[[str], ParsedTurn]

_HERMES = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str) -> ParsedTurn:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (an unclosed last one counts).

    ``arguments`` may also be a JSON string holding the object (some models write it so).
    """
    calls: list[ToolCall] = []
    errors: list[str] = []
    for match in _HERMES.finditer(text):
        body = match.group(1).strip()
        try:
            call = json.loads(body)
        except json.JSONDecodeError as error:
            errors.append(f"error: a tool call is not valid JSON ({error.msg} at character {error.pos})")
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            errors.append('error: a tool call must be an object with a "name" and "arguments"')
            continue
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                errors.append(f"error: the arguments of {call['name']!r} are not a JSON object")
                continue
        calls.append(ToolCall(call["name"], arguments))
    return ParsedTurn(calls, errors)


BUILTIN_PARSERS: dict[str, Parser] = {"hermes": parse_hermes}


def load_parser(name: str) -> Parser:
    """The parser ``spec.agent.toolParser`` names; errors name the value and what is wrong."""
    if name in BUILTIN_PARSERS:
        return BUILTIN_PARSERS[name]
    if ":" not in name:
        raise ValueError(
            f"spec.agent.toolParser: {name!r} is neither a built-in ({', '.join(BUILTIN_PARSERS)}) "
            "nor an import path 'package.module:parse'"
        )
    function = import_attribute(name, "spec.agent.toolParser")
    if not callable(function):
        raise ValueError(f"spec.agent.toolParser: {name!r} is not a function")
    parser: Parser = function
    return parser
