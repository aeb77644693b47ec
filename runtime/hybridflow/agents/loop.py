"""Agent loops: what happens between two model turns of a trajectory.

The rollout service (``hybridflow.rollout.service``) owns the trajectory's tokens and generates
every model turn; after each one it asks the job's agent loop what comes next, on a thread of
its own (a loop may block: tools take seconds), and applies the answer:

* :class:`Finish`: the trajectory ends here (the model answered; an environment may score it);
* :class:`Insert`: text to append as a turn the model did not write (tool results, an
  environment's observation), encoded once and masked out of the loss and the KL; then the
  model's next turn. What the tools or the environment produced (``Insert.result``) is encoded
  as plain text: special-token strings in it cannot forge a turn.

The API a plugin (``spec.agent.loop: package.module:Loop``) implements is :class:`AgentLoop`:
a class constructed with the job's :class:`~hybridflow.spec.agent.AgentSpec`, whose
``after_turn(context)`` returns one of the two. The service enforces the limits whatever the
loop says: ``maxTurns`` model turns, the response budget (``rollout.maxResponseTokens`` for all
tokens after the prompt), and ``trajectoryTimeoutSeconds``.

Every model turn reaches the loop, the last one included: the ``maxTurns``-th turn, or a turn
that spent the budget, comes with ``context.final`` set (``"max_turns"``, ``"budget"``), so that
an environment steps its last action and scores the episode. After a final turn the trajectory
ends whatever the loop returns: a :class:`Finish` gives its reward (and, unless the budget is
spent, its reason); an :class:`Insert` is dropped, its ``reward`` kept. Only a turn that ends
past ``trajectoryTimeoutSeconds`` is not given to the loop.

``context.text`` is the turn as the reward functions read it (``response_text``): the tokenizer's
decoding with the special tokens removed (eos, pad, ``<|im_end|>``;
:func:`hybridflow.workers.rollout.response_texts`). A tool-call markup the tokenizer counts as
special would be removed too: the built-in parser's ``<tool_call>`` is ordinary text in Qwen2.5's
tokenizer.

:class:`ToolCallingLoop` (``loop: tools``) parses tool calls with the job's parser, runs them
(:func:`~hybridflow.agents.tools.call_tool`: timeouts, retries, errors as text), and inserts
their results in ``agent.toolResponseFormat``; a turn without a call is the answer.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from hybridflow.agents.sandbox import SandboxLimits, run_python
from hybridflow.agents.tool_calls import load_parser
from hybridflow.agents.tools import SandboxRunner, Tool, ToolOutcome, call_tool, load_tools
from hybridflow.plugins import import_attribute
from hybridflow.spec.agent import AgentSpec

__all__ = [
    "AgentLoop",
    "Environment",
    "EnvironmentLoop",
    "Finish",
    "Insert",
    "ToolCallingLoop",
    "TurnContext",
    "load_agent_loop",
    "sandbox_limits",
]


@dataclass(frozen=True)
class TurnContext:
    """What a loop sees after a model turn."""

    turn: int
    """Model turns so far, this one included (1 after the first)."""
    text: str
    """This model turn, decoded for reading (the trajectory keeps the engine's token ids)."""
    row: Mapping[str, Any]
    """The prompt's dataset fields (``prompt``, ``ground_truth``, ``data_source``, ...)."""
    tokens_left: int
    """Response tokens the trajectory may still take (inserted and generated alike)."""
    trajectory: str = ""
    """The trajectory's id, the same at each of its turns (an environment's episode key)."""
    final: str | None = None
    """``None`` when another model turn may follow; else why none can: ``"max_turns"`` (this is
    the ``maxTurns``-th turn) or ``"budget"`` (the response budget is spent). The trajectory ends
    after this call whatever it returns (module docstring): a tool loop runs no calls for it."""


@dataclass(frozen=True)
class Finish:
    reason: str = "answer"
    reward: float | None = None
    """An environment's score of the episode: the built-in reward function ``environment`` returns
    it, and every reward function finds it in ``extra_info["agent"]["reward"]``."""
    env_step: bool = False
    """This answer came from an environment's ``step`` (counted in ``agent/env_steps_per_trajectory``)."""


@dataclass(frozen=True)
class Insert:
    text: str
    tool_calls: list[ToolOutcome] = field(default_factory=list)
    """The calls this turn made (for the metrics: calls, errors, latency)."""
    reward: float | None = None
    """The episode's score so far (an environment's summed rewards): the trajectory's reward if
    it ends before the loop answers again (the insertion does not fit the budget, the time runs
    out, or this answered a final turn)."""
    env_step: bool = False
    """This answer came from an environment's ``step`` (counted in ``agent/env_steps_per_trajectory``)."""
    result: str | None = None
    """What a tool or an environment produced, inserted where ``text`` has ``{result}``. It is
    tokenized as plain text: a special token's string in it (``<|im_end|>``, printed by the model's
    code) stays text and never becomes a control token that forges a turn; ``text`` itself, the
    job's markup around it, keeps its special tokens. A loop that builds the whole ``text`` itself
    (``result`` None) is trusted with all of it."""

    @property
    def rendered(self) -> str:
        """The inserted text as one string (the result in its place)."""
        return "".join(text for text, _ in self.segments())

    def segments(self) -> list[tuple[str, bool]]:
        """``(text, plain)`` pieces in order: the markup (special tokens parsed) and the result (plain)."""
        if self.result is None:
            return [(self.text, False)]
        before, placeholder, after = self.text.partition("{result}")
        if not placeholder:
            return [(self.text, False), (self.result, True)]
        return [(before, False), (self.result, True), (after, False)]


class AgentLoop(Protocol):
    """The plugin API (see the module docstring). Called from several threads, one trajectory per call."""

    def after_turn(self, context: TurnContext) -> Finish | Insert: ...


def sandbox_limits(spec: AgentSpec) -> SandboxLimits:
    sandbox = spec.sandbox
    return SandboxLimits(
        wall_seconds=sandbox.wall_seconds,
        cpu_seconds=sandbox.cpu_seconds,
        memory_bytes=sandbox.memory_mib * 2**20,
        processes=sandbox.processes,
        output_bytes=sandbox.output_kib * 2**10,
        file_bytes=64 * sandbox.output_kib * 2**10,
        disk_bytes=sandbox.disk_mib * 2**20,
        isolation=sandbox.isolation,
    )


class ToolCallingLoop:
    """``loop: tools``: parse, call, insert the results; no call is the answer."""

    def __init__(
        self, spec: AgentSpec, tools: Mapping[str, Tool] | None = None, runner: SandboxRunner = run_python
    ) -> None:
        self.spec = spec
        self.parse = load_parser(spec.tool_parser)
        self.tools = (
            dict(tools) if tools is not None else load_tools(spec.tools, sandbox_limits(spec), runner)
        )
        self._calls = concurrent.futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="tool-call")

    def after_turn(self, context: TurnContext) -> Finish | Insert:
        parsed = self.parse(context.text)
        if not parsed.wants_tools:
            return Finish("answer")
        if context.final is not None:
            return Finish(context.final)  # nothing could read the results: the calls are not run
        outcomes = [
            call_tool(
                self.tools,
                call.name,
                call.arguments,
                timeout_seconds=self.spec.tool_timeout_seconds,
                retries=self.spec.tool_retries,
                pool=self._calls,
            )
            for call in parsed.calls
        ]
        outcomes += [ToolOutcome(message, False, 0.0, 0) for message in parsed.errors]
        results = "\n".join(outcome.text for outcome in outcomes)
        return Insert(self.spec.tool_response_format, outcomes, result=results)


class Environment(Protocol):
    """A multi-turn task without tools (a game, a simulated user): one instance per trajectory.

    ``reset(row)`` starts the episode for the prompt's dataset row (the model's first turn
    answers the dataset's prompt); ``step(action)`` takes a model turn's text and returns the
    observation the model reads next, the step's reward and whether the episode is over.
    Every model turn is a step, the last one allowed included; ``action`` is the turn as the
    reward functions read it (special tokens removed, see the module docstring).
    """

    def reset(self, row: Mapping[str, Any]) -> None: ...

    def step(self, action: str) -> tuple[str, float, bool]: ...


class EnvironmentLoop:
    """An :class:`Environment` class as an agent loop: observations inserted in
    ``agent.toolResponseFormat``; the episode's summed reward is the trajectory's
    (``Finish(reward=...)``: the reward function ``environment`` returns it), whatever ended it:
    ``done``, ``maxTurns`` (the last turn is stepped too), the budget or the timeout (the sum of
    the steps taken)."""

    def __init__(self, spec: AgentSpec, environment: Callable[[], Environment]) -> None:
        self.spec = spec
        self.environment = environment
        self._episodes: dict[str, tuple[Environment, float]] = {}
        self._lock = threading.Lock()

    def after_turn(self, context: TurnContext) -> Finish | Insert:
        with self._lock:
            episode = self._episodes.get(context.trajectory)
        if episode is None:
            environment = self.environment()
            environment.reset(context.row)
            episode = (environment, 0.0)
        environment, total = episode
        observation, reward, done = environment.step(context.text)
        total += float(reward)
        with self._lock:
            if done or context.final is not None:
                self._episodes.pop(context.trajectory, None)
            else:
                self._episodes[context.trajectory] = (environment, total)
        if done:
            return Finish("answer", reward=total, env_step=True)
        if context.final is not None:
            return Finish(context.final, reward=total, env_step=True)
        return Insert(self.spec.tool_response_format, result=str(observation), reward=total, env_step=True)


def load_agent_loop(spec: AgentSpec, runner: SandboxRunner = run_python) -> AgentLoop | None:
    """The job's loop: ``None`` for single-turn, the built-in, or the plugin the import path names.

    ``runner`` runs the sandboxed tools' code (the job's sandbox workers, when it has any).
    """
    if spec.loop == "single-turn":
        return None
    if spec.loop == "tools":
        return ToolCallingLoop(spec, runner=runner)
    target = import_attribute(spec.loop, "spec.agent.loop")
    if (
        isinstance(target, type)
        and callable(getattr(target, "reset", None))
        and callable(getattr(target, "step", None))
    ):
        return EnvironmentLoop(spec, target)
    loop = target(spec) if isinstance(target, type) else target
    if not callable(getattr(loop, "after_turn", None)):
        raise ValueError(
            f"spec.agent.loop: {spec.loop!r} is neither an agent loop (after_turn(context)) nor an "
            "environment (reset(row), step(action)): docs/agents.md has both APIs"
        )
    return loop
