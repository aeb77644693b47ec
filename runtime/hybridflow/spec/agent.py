"""``spec.agent``: how a trajectory unfolds: one turn, or turns with tool calls in between.

The default, ``single-turn``, is a prompt and one response, as every job before multi-turn
rollouts. ``tools`` is the built-in tool-calling loop (``hybridflow.agents.loop``): after each
model turn it parses tool calls, runs them and appends their results as a tool turn, until the
model answers without a call, ``maxTurns`` model turns, or the response budget
(``spec.rollout.maxResponseTokens``: every model and tool token of a trajectory counts). An
import path ``package.module:Loop`` names a loop of the user's, against the same API. Multi-turn
loops run in the rollout service (``rollout.mode: server``), where each trajectory advances on
its own; docs/agents.md has the loop, the APIs and the sandbox's guarantees.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from hybridflow.spec.base import SpecModel
from hybridflow.spec.resources import MEMORY_QUANTITY_PATTERN
from hybridflow.spec.rules import CrossFieldRule

BUILTIN_LOOPS: tuple[str, ...] = ("single-turn", "tools", "endpoint")
BUILTIN_TOOLS: tuple[str, ...] = ("calculator", "python")
BUILTIN_TOOL_PARSERS: tuple[str, ...] = ("hermes",)
SANDBOX_GROUP = "sandbox"
"""The RayJob worker group of the sandbox pods (no resource pool may take the name)."""
SANDBOX_RESOURCE = "hybridflow-sandbox"
"""The Ray custom resource a sandbox pod advertises (one unit) and a sandbox worker asks for."""
SANDBOXED_TOOLS: tuple[str, ...] = ("python",)
"""Built-in tools whose calls run in the sandbox (on the sandbox workers, when there are any)."""

_IMPORT_PATH = "^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_.]*$"

HERMES_TOOL_RESPONSE = (
    "\n<|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
)
"""The tool turn of Qwen2.5/Hermes chat templates, appended after the model's end-of-turn token."""


ToolName = Annotated[str, Field(min_length=1, max_length=256)]


class SandboxSpec(SpecModel):
    """Limits of one call of the Python tool (``hybridflow.agents.sandbox``)."""

    wall_seconds: float = Field(default=10.0, gt=0, le=600, description="Wall-clock limit of one call.")
    cpu_seconds: int = Field(
        default=5,
        ge=1,
        le=600,
        description="CPU time of one call, all its processes together (strict; per process when weak).",
    )
    memory_mib: int = Field(
        default=512,
        ge=64,
        le=65536,
        description="Memory of one call, MiB, all its processes together (strict; per process when weak).",
    )
    processes: int = Field(
        default=16,
        ge=1,
        le=4096,
        description="Processes (threads included) one call may run: a fork bomb stops there.",
    )
    output_kib: int = Field(
        default=16,
        ge=1,
        le=1024,
        description="Output returned to the model, KiB; writing past 64 times it stops the call.",
    )
    disk_mib: int = Field(
        default=64,
        ge=1,
        le=65536,
        description="Size of one call's writable directory, MiB (strict isolation: every file it writes, together).",
    )
    isolation: Literal["strict", "weak"] = Field(
        default="strict",
        description=(
            "strict: namespaces, a private read-only root with the standard library only, an unprivileged "
            "uid, Landlock, seccomp and a cgroup per call; a machine or pod that cannot give all of it "
            "refuses to run code (the job fails naming what is missing). weak: whatever of that the "
            "machine allows, limits per process, the host file system visible through Landlock only: "
            "code the model writes can reach more of the host (docs/agents.md lists what)."
        ),
    )
    workers: int = Field(
        default=2,
        ge=0,
        le=256,
        description=(
            "Sandbox workers, when a tool runs code ('python'): Ray workers that run the calls, each in "
            "a confined process of its own; in the cluster, the pods of a CPU worker group 'sandbox' of "
            "the job's RayJob, Pod Security restricted, egress denied. 0: the calls run beside the "
            "controller."
        ),
    )
    cpus_per_worker: int = Field(
        default=1, ge=1, le=64, description="CPU cores requested and limited per sandbox pod. Cluster only."
    )
    memory_per_worker: str = Field(
        default="2Gi",
        pattern=MEMORY_QUANTITY_PATTERN,
        max_length=32,
        description="Memory requested and limited per sandbox pod, a Kubernetes quantity. Cluster only.",
    )


class AgentSpec(SpecModel):
    """The agent loop of each trajectory: single-turn, tool calling, or a plugin."""

    loop: str = Field(
        default="single-turn",
        min_length=1,
        max_length=256,
        description=(
            "'single-turn': one response per prompt. 'tools': the built-in tool-calling loop (needs "
            "rollout.mode 'server' and at least one tool). 'endpoint': an agent of yours (agent.runner) "
            "drives each sample through an OpenAI-compatible endpoint. Or an import path "
            "'package.module:Loop' naming an agent loop class (docs/agents.md has its API)."
        ),
    )
    runner: str | None = Field(
        default=None,
        max_length=256,
        description=(
            "With loop 'endpoint': the import path 'package.module:run' of a function run(base_url, "
            "api_key, row) -> reward or None that drives one sample's session through the job's "
            "OpenAI-compatible /v1/chat/completions endpoint (an existing agent framework, pointed at "
            "base_url). docs/agents.md has the protocol."
        ),
    )
    endpoint_port: int = Field(
        default=8000,
        ge=1024,
        le=65535,
        description=(
            "With loop 'endpoint': the port of the chat endpoint on the controller's pod (a Service "
            "<job>-agent that only the job's own pods reach). Cluster only; locally a free port."
        ),
    )
    max_turns: int = Field(
        default=4,
        ge=1,
        le=256,
        description=(
            "Model turns per trajectory at most (the first answers the prompt). The last one still "
            "reaches the loop: an environment's step() takes it and its reward counts; the tool loop "
            "runs no calls for it. Nothing is inserted after it: the trajectory ends there."
        ),
    )
    max_turn_tokens: int | None = Field(
        default=None,
        ge=1,
        description=(
            "Tokens one model turn may generate at most (unset: what is left of the response budget, "
            "spec.rollout.maxResponseTokens, which all turns and tool results share)."
        ),
    )
    tools: tuple[ToolName, ...] = Field(
        default=(),
        max_length=64,
        description=(
            "The tools shown to the model: built-in names ('calculator', 'python': code run in the "
            "sandbox) or import paths 'package.module:Tool' (docs/agents.md has the API)."
        ),
    )
    tool_parser: str = Field(
        default="hermes",
        min_length=1,
        max_length=256,
        description=(
            'How tool calls are found in a model turn: \'hermes\' (<tool_call>{"name": ..., "arguments": '
            "{...}}</tool_call>, the Qwen/Hermes convention) or an import path 'package.module:parse'."
        ),
    )
    tool_response_format: str = Field(
        default=HERMES_TOOL_RESPONSE,
        min_length=1,
        max_length=1024,
        description=(
            "The tokens appended after a model turn with tool calls, or an environment's observation, "
            "as text with '{result}' where the results go. The default is ChatML (Qwen/Hermes: "
            "<|im_start|>user ... <|im_end|>): a model whose chat template is not ChatML needs its own. "
            "Encoded once per inserted turn; the model's own tokens are never decoded and encoded again."
        ),
    )
    trajectory_timeout_seconds: int = Field(
        default=600,
        ge=1,
        description="Wall-clock limit of one trajectory; past it the trajectory ends with what it has.",
    )
    tool_timeout_seconds: float = Field(
        default=30.0,
        gt=0,
        description="Wall-clock limit of one tool call; a call past it answers the model with an error.",
    )
    tool_retries: int = Field(
        default=1,
        ge=0,
        le=10,
        description="Retries of a tool call that raised (not of one that timed out) before the error goes to the model.",
    )
    sandbox: SandboxSpec = Field(default=SandboxSpec(), description="Limits of each Python tool call.")

    @property
    def multi_turn(self) -> bool:
        return self.loop != "single-turn"

    @property
    def runs_code(self) -> bool:
        """A listed tool runs the model's code (``python``), in a multi-turn loop: the sandbox is needed."""
        return self.multi_turn and any(t in SANDBOXED_TOOLS for t in self.tools)

    @property
    def sandbox_workers(self) -> int:
        """Sandbox workers the job starts: ``sandbox.workers`` when a listed tool runs code, else none."""
        return self.sandbox.workers if self.runs_code else 0


AGENT_RULES: tuple[CrossFieldRule[AgentSpec], ...] = (
    CrossFieldRule[AgentSpec](
        name="tool-loop-needs-tools",
        node_path="spec.agent",
        field_path=".tools",
        cel="self.loop != 'tools' || size(self.tools) > 0",
        message="must name at least one tool with loop 'tools' (built-ins: 'calculator', 'python')",
        holds=lambda agent: agent.loop != "tools" or bool(agent.tools),
        observed=lambda agent: "[] with loop 'tools'",
    ),
    CrossFieldRule[AgentSpec](
        name="tool-response-has-a-result",
        node_path="spec.agent",
        field_path=".toolResponseFormat",
        cel="self.toolResponseFormat.contains('{result}')",
        message="must contain '{result}', where the tool results go",
        holds=lambda agent: "{result}" in agent.tool_response_format,
        observed=lambda agent: repr(agent.tool_response_format[:80]),
    ),
    CrossFieldRule[AgentSpec](
        name="endpoint-loop-needs-a-runner",
        node_path="spec.agent",
        field_path=".runner",
        cel=f"self.loop != 'endpoint' || (has(self.runner) && self.runner.matches('{_IMPORT_PATH}'))",
        message="must be an import path 'package.module:run' with loop 'endpoint': the agent that drives each session",
        holds=lambda agent: (
            agent.loop != "endpoint" or (agent.runner is not None and _is_import_path(agent.runner))
        ),
        observed=lambda agent: f"{agent.runner!r} with loop 'endpoint'",
    ),
    CrossFieldRule[AgentSpec](
        name="agent-tools-are-known",
        node_path="spec.agent",
        field_path=".tools",
        cel=f"self.tools.all(t, t in {list(BUILTIN_TOOLS)} || t.matches('{_IMPORT_PATH}'))",
        message=f"each must be a built-in tool ({', '.join(BUILTIN_TOOLS)}) or an import path 'package.module:Tool'",
        holds=lambda agent: all(tool in BUILTIN_TOOLS or _is_import_path(tool) for tool in agent.tools),
        observed=lambda agent: repr(
            [t for t in agent.tools if t not in BUILTIN_TOOLS and not _is_import_path(t)]
        ),
    ),
    CrossFieldRule[AgentSpec](
        name="agent-loop-is-known",
        node_path="spec.agent",
        field_path=".loop",
        cel=f"self.loop in {list(BUILTIN_LOOPS)} || self.loop.matches('{_IMPORT_PATH}')",
        message="must be 'single-turn', 'tools' or an import path 'package.module:Loop'",
        holds=lambda agent: agent.loop in BUILTIN_LOOPS or _is_import_path(agent.loop),
        observed=lambda agent: repr(agent.loop),
    ),
)


def _is_import_path(value: str) -> bool:
    module, separator, attribute = value.partition(":")
    parts = [*module.split("."), *attribute.split(".")]
    return bool(separator) and all(part.isidentifier() for part in parts)
