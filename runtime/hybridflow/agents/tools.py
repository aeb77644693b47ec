"""Tools the model may call: the plugin API, the built-ins, and how one call is run.

A tool is any object with

* ``name`` (str): what the model writes in a call;
* ``description`` (str) and ``parameters`` (a JSON schema of the arguments object): shown to
  the model (:func:`tool_schemas`, in the OpenAI function format chat templates take);
* ``__call__(arguments: dict) -> str``: the result, as text for the model. It may raise; it may
  block (it runs on a thread of the agent loop's pool, under ``agent.toolTimeoutSeconds``).

``spec.agent.tools`` names built-ins (:data:`BUILTIN_TOOLS`) or import paths
``package.module:Tool`` (a class, constructed with no arguments, or an instance).
:func:`call_tool` runs one call under the spec's timeout and retries and always returns a
:class:`ToolOutcome`: a tool that raises, hangs or returns something other than text answers
the model with an error, and the step goes on.
"""

from __future__ import annotations

import ast
import concurrent.futures
import math
import operator
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from hybridflow.agents.sandbox import SandboxLimits, SandboxResult, run_python
from hybridflow.plugins import import_attribute

__all__ = [
    "BUILTIN_TOOLS",
    "Calculator",
    "PythonTool",
    "Tool",
    "ToolOutcome",
    "call_tool",
    "load_tools",
    "tool_schemas",
]

RESULT_CHARACTERS = 4000
"""A tool result longer than this is cut (and says so): the response budget is the model's."""


@runtime_checkable
class Tool(Protocol):
    name: str
    description: str
    parameters: Mapping[str, Any]

    def __call__(self, arguments: dict[str, Any]) -> str: ...


class Calculator:
    """Arithmetic on numbers: + - * / // % **, parentheses, and a few math functions. No names, no calls else."""

    name = "calculator"
    description = "Evaluate an arithmetic expression, e.g. '(17 * 23) % 7' or 'sqrt(2) * 3'."
    parameters: Mapping[str, Any] = {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "The expression to evaluate."}},
        "required": ["expression"],
    }
    _operators: Mapping[type, Callable[..., Any]] = {
        ast.Add: operator.add,
        ast.Sub: operator.sub,
        ast.Mult: operator.mul,
        ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv,
        ast.Mod: operator.mod,
        ast.Pow: operator.pow,
        ast.USub: operator.neg,
        ast.UAdd: operator.pos,
    }
    _functions: Mapping[str, Callable[..., Any]] = {
        "sqrt": math.sqrt,
        "abs": abs,
        "round": round,
        "floor": math.floor,
        "ceil": math.ceil,
        "log": math.log,
        "exp": math.exp,
    }

    def __call__(self, arguments: dict[str, Any]) -> str:
        expression = arguments.get("expression")
        if not isinstance(expression, str) or not expression.strip():
            raise ValueError("'expression' must be a non-empty string")
        if len(expression) > 500:
            raise ValueError("the expression is longer than 500 characters")
        value = self._evaluate(ast.parse(expression, mode="eval").body)
        return str(
            int(value) if isinstance(value, float) and value.is_integer() and abs(value) < 1e15 else value
        )

    def _evaluate(self, node: ast.AST) -> Any:
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, int | float)
            and not isinstance(node.value, bool)
        ):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in self._operators:
            left, right = self._evaluate(node.left), self._evaluate(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 1000:
                raise ValueError("exponents above 1000 are refused")
            return self._operators[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in self._operators:
            return self._operators[type(node.op)](self._evaluate(node.operand))
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in self._functions
            and not node.keywords
        ):
            return self._functions[node.func.id](*(self._evaluate(argument) for argument in node.args))
        raise ValueError(f"unsupported expression element: {ast.dump(node)[:80]}")


class PythonTool:
    """Runs the model's code in the sandbox (``hybridflow.agents.sandbox``); the result is what it printed."""

    name = "python"
    description = (
        "Run Python 3 code (standard library only, no network, no files outside its own directory) "
        "and return what it prints."
    )
    parameters: Mapping[str, Any] = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "The program; print the answer."}},
        "required": ["code"],
    }

    def __init__(self, limits: SandboxLimits | None = None, runner: SandboxRunner = run_python) -> None:
        self.limits = limits or SandboxLimits()
        self.runner = runner

    def __call__(self, arguments: dict[str, Any]) -> str:
        code = arguments.get("code")
        if not isinstance(code, str):
            raise ValueError("'code' must be a string")
        return self.runner(code, self.limits).as_tool_text(RESULT_CHARACTERS)


SandboxRunner = Callable[[str, SandboxLimits], SandboxResult]
"""Runs code in the sandbox: :func:`run_python` here, or a sandbox worker (``sandbox_pool.py``)."""

BUILTIN_TOOLS: Mapping[str, Callable[[SandboxLimits, SandboxRunner], Tool]] = {
    "calculator": lambda limits, runner: Calculator(),
    "python": PythonTool,
}


def load_tools(
    names: tuple[str, ...] | list[str],
    sandbox: SandboxLimits | None = None,
    runner: SandboxRunner = run_python,
) -> dict[str, Tool]:
    """The tools ``spec.agent.tools`` names, by their ``name``; errors name the entry and what is wrong."""
    tools: dict[str, Tool] = {}
    for entry in names:
        if entry in BUILTIN_TOOLS:
            tool = BUILTIN_TOOLS[entry](sandbox or SandboxLimits(), runner)
        else:
            tool = _import_tool(entry)
        if tool.name in tools:
            raise ValueError(f"spec.agent.tools: {entry!r}: a tool named {tool.name!r} is already listed")
        tools[tool.name] = tool
    return tools


def _import_tool(path: str) -> Tool:
    target = import_attribute(path, "spec.agent.tools")
    tool = target() if isinstance(target, type) else target
    missing = [field for field in ("name", "description", "parameters") if not hasattr(tool, field)]
    if missing or not callable(tool):
        raise ValueError(
            f"spec.agent.tools: {path!r} is not a tool: it needs name, description, parameters and "
            f"__call__(arguments) (missing: {', '.join(missing) or '__call__'})"
        )
    return tool


def tool_schemas(tools: Mapping[str, Tool]) -> list[dict[str, Any]]:
    """The tools in the OpenAI function format (what ``apply_chat_template(tools=...)`` takes)."""
    return [
        {
            "type": "function",
            "function": {
                "name": tool.name,
                "description": tool.description,
                "parameters": dict(tool.parameters),
            },
        }
        for tool in tools.values()
    ]


@dataclass(frozen=True)
class ToolOutcome:
    """One call's answer to the model, and how it went."""

    text: str
    ok: bool
    seconds: float
    attempts: int


def call_tool(
    tools: Mapping[str, Tool],
    name: str,
    arguments: Any,
    *,
    timeout_seconds: float,
    retries: int,
    pool: concurrent.futures.Executor,
) -> ToolOutcome:
    """Run one call on ``pool`` under the timeout, retrying one that raised; never raises.

    A call past its timeout is abandoned (a thread cannot be killed; the sandboxed Python tool
    stops itself at its own wall-clock limit) and answered with an error, not retried: a tool
    that hangs would hang again.
    """
    started = time.monotonic()
    tool = tools.get(name)
    if tool is None:
        known = ", ".join(sorted(tools)) or "none"
        return ToolOutcome(f"error: no tool named {name!r} (tools: {known})", False, 0.0, 0)
    if not isinstance(arguments, dict):
        return ToolOutcome(f"error: the arguments of {name!r} must be a JSON object", False, 0.0, 0)
    attempts = 0
    error = ""
    while attempts <= retries:
        attempts += 1
        future = pool.submit(tool, arguments)
        try:
            result = future.result(timeout=timeout_seconds)
        except concurrent.futures.TimeoutError:
            future.cancel()
            return ToolOutcome(
                f"error: {name} did not answer within {timeout_seconds:g} s",
                False,
                time.monotonic() - started,
                attempts,
            )
        except Exception as raised:  # the tool's own failure: retried, then told to the model
            error = f"error: {name} failed: {type(raised).__name__}: {str(raised)[:500]}"
            continue
        if not isinstance(result, str):
            return ToolOutcome(
                f"error: {name} returned {type(result).__name__}, not text",
                False,
                time.monotonic() - started,
                attempts,
            )
        ok = not result.startswith("error:")
        if len(result) > RESULT_CHARACTERS:
            result = result[:RESULT_CHARACTERS] + f"\n[cut: {len(result)} characters]"
        return ToolOutcome(result, ok, time.monotonic() - started, attempts)
    return ToolOutcome(error, False, time.monotonic() - started, attempts)
