"""Multi-turn trajectories in the rollout service: one request per model turn, the agent loop in between.

The service hands a group (a prompt and its ``n`` samples) to :class:`TrajectoryDriver`, which
turns each sample into a :class:`~hybridflow.agents.trajectory.Trajectory` and each of its model
turns into a one-sample :class:`~hybridflow.engines.continuous.GenerationRequest` on the
trajectory's session (the router keeps a session on one replica, for its prefix cache). The
service routes those requests like any other (so aborts at weight updates, replica
replacement and re-routing work unchanged) and gives their results back
(:meth:`TrajectoryDriver.turn_finished`). After each turn the driver asks the agent loop what
comes next, on a thread of its pool (tools take seconds; generation never waits for them), and
:meth:`TrajectoryDriver.advance` collects the answers: the next turns to route, and the groups
whose trajectories have all ended, as the group's :class:`RequestResult` with token-exact
samples (``loss_mask``: which tokens the engine generated; ``answer_span``: the last model
turn, what the reward reads).

Protocol (all calls from the service's thread): :meth:`begin` a group, route the requests it
returns; pass every turn's result to :meth:`turn_finished`; call :meth:`advance` in the
service's loop and route/finish what it returns. Limits enforced here, whatever the loop says:
``agent.maxTurns``, the response budget, ``agent.trajectoryTimeoutSeconds`` (a trajectory past
it ends with what it has, its pending loop call abandoned). The turn that reaches ``maxTurns`` or
spends the budget still goes to the loop, marked ``TurnContext.final`` (an environment steps it
and scores the episode); the trajectory then ends whatever the loop answers
(:mod:`hybridflow.agents.loop` states the rule).
"""

from __future__ import annotations

import concurrent.futures
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from hybridflow.agents.loop import AgentLoop, Finish, Insert, TurnContext
from hybridflow.agents.trajectory import Trajectory
from hybridflow.engines.continuous import GenerationRequest, RequestResult, SampleResult
from hybridflow.spec.agent import AgentSpec

__all__ = ["TrajectoryDriver", "TrajectorySource", "TrajectoryStats", "group_result", "trajectory_metrics"]

_MASK63 = (1 << 63) - 1


@dataclass(frozen=True)
class TrajectoryStats:
    """What one trajectory did, for the step's metrics (kept on the group request's ``tag``)."""

    turns: int
    tool_calls: int
    tool_errors: int
    tool_seconds: tuple[float, ...]
    response_tokens: int
    masked_tokens: int
    finish_reason: str
    reward: float | None = None
    env_steps: int = 0

    def as_extra_info(self) -> dict[str, Any]:
        """What reward functions find in ``extra_info["agent"]``."""
        return {
            "turns": self.turns,
            "tool_calls": self.tool_calls,
            "tool_errors": self.tool_errors,
            "env_steps": self.env_steps,
            "finish_reason": self.finish_reason,
            "reward": self.reward,
        }


class TrajectorySource(Protocol):
    """What the service drives: :class:`TrajectoryDriver`, or the chat endpoint's sessions (``endpoint.py``)."""

    def begin(self, request: GenerationRequest, row: Mapping[str, Any]) -> list[GenerationRequest]: ...

    def turn_finished(self, result: RequestResult) -> None: ...

    def advance(self) -> tuple[list[GenerationRequest], list[RequestResult]]: ...

    @property
    def running(self) -> int: ...

    def close(self) -> None: ...


@dataclass
class _Sample:
    group_id: str
    index: int
    trajectory: Trajectory
    session: str
    pending: concurrent.futures.Future[Finish | Insert] | None = None
    final: str | None = None
    """Set when the pending call answers the trajectory's last turn (``TurnContext.final``)."""


@dataclass
class _Group:
    request: GenerationRequest
    row: Mapping[str, Any]
    samples: list[_Sample] = field(default_factory=list)


class TrajectoryDriver:
    """See the module docstring."""

    def __init__(
        self,
        spec: AgentSpec,
        loop: AgentLoop,
        *,
        encode: Callable[[str], list[int]],
        decode: Callable[[list[int]], str],
        budget: int,
        encode_plain: Callable[[str], list[int]] | None = None,
        threads: int = 32,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.spec = spec
        self.loop = loop
        self.encode = encode
        self.encode_plain = encode_plain or encode
        """Encodes what tools and environments produced: special-token strings stay text."""
        self.decode = decode
        self.budget = budget
        self.clock = clock
        self._groups: dict[str, _Group] = {}
        self._turns: dict[str, _Sample] = {}  # turn request id -> its sample
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=threads, thread_name_prefix="agent-loop"
        )
        self._turn_ids = 0

    # ------------------------------------------------------------------ the service's calls

    def begin(self, request: GenerationRequest, row: Mapping[str, Any]) -> list[GenerationRequest]:
        """Start a group's ``n`` trajectories; their first turns' requests."""
        group = _Group(request, row)
        self._groups[request.request_id] = group
        now = self.clock()
        for index in range(request.params.n):
            trajectory = Trajectory(list(request.prompt_token_ids), self.budget, now)
            group.samples.append(
                _Sample(request.request_id, index, trajectory, f"{request.request_id}/{index}")
            )
        return [self._turn(sample) for sample in group.samples]

    def turn_finished(self, result: RequestResult) -> None:
        """A model turn ended: record its tokens, then end the trajectory or ask the loop."""
        sample = self._turns.pop(result.request.request_id)
        (turn,) = result.samples
        trajectory = sample.trajectory
        trajectory.add_model_turn(list(turn.token_ids), list(turn.logprobs), list(turn.versions))
        if self._timed_out(trajectory):
            trajectory.finish_reason = "timeout"
            return
        if trajectory.tokens_left <= 0:
            sample.final = "budget"
        elif trajectory.turns >= self.spec.max_turns:
            sample.final = "max_turns"
        start, end = trajectory.last_turn
        context = TurnContext(
            turn=trajectory.turns,
            text=self.decode(trajectory.token_ids[start:end]),
            row=self._groups[sample.group_id].row,
            tokens_left=trajectory.tokens_left,
            trajectory=sample.session,
            final=sample.final,
        )
        sample.pending = self._pool.submit(self.loop.after_turn, context)

    def advance(self) -> tuple[list[GenerationRequest], list[RequestResult]]:
        """The next turns to route and the groups that have ended (each its group's result)."""
        turns: list[GenerationRequest] = []
        for group in self._groups.values():
            for sample in group.samples:
                if sample.pending is None or sample.trajectory.finish_reason is not None:
                    continue
                if not sample.pending.done():
                    if self._timed_out(sample.trajectory):
                        sample.trajectory.finish_reason = "timeout"  # the loop's call is abandoned
                        sample.pending = None
                    continue
                turn = self._after(sample)
                if turn is not None:
                    turns.append(turn)
        done = [group_id for group_id, group in self._groups.items() if self._ended(group)]
        return turns, [self._result(self._groups.pop(group_id)) for group_id in done]

    @property
    def running(self) -> int:
        """Trajectories not ended yet."""
        return sum(s.trajectory.finish_reason is None for g in self._groups.values() for s in g.samples)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ internals

    def _after(self, sample: _Sample) -> GenerationRequest | None:
        """Apply the loop's answer to a trajectory; its next turn's request, if it goes on."""
        assert sample.pending is not None
        trajectory = sample.trajectory
        try:
            action = sample.pending.result()
        except Exception as error:  # a broken loop ends this trajectory, not the step
            action = Finish(f"loop_error: {type(error).__name__}: {error}"[:200])
        sample.pending = None
        trajectory.env_steps += action.env_step
        if action.reward is not None:
            trajectory.reward = action.reward
        if isinstance(action, Insert):  # calls a loop ran count, even if a last turn drops them
            trajectory.tool_calls += len(action.tool_calls)
            trajectory.tool_errors += sum(not outcome.ok for outcome in action.tool_calls)
            trajectory.tool_seconds += [outcome.seconds for outcome in action.tool_calls]
        if isinstance(action, Finish) or sample.final is not None:
            trajectory.finish_reason = _end_reason(action, sample.final)
            return None
        if self._timed_out(trajectory):
            trajectory.finish_reason = "timeout"
            return None
        ids = [
            token
            for text, plain in action.segments()
            if text
            for token in (self.encode_plain(text) if plain else self.encode(text))
        ]
        if not trajectory.insert(ids):
            return None  # no room for another model turn: ended ("budget")
        return self._turn(sample)

    def _turn(self, sample: _Sample) -> GenerationRequest:
        group = self._groups[sample.group_id]
        params = group.request.params
        trajectory = sample.trajectory
        seed = params.seed
        if seed is not None:
            seed = (seed * 1_000_003 + sample.index * 10_007 + trajectory.turns) & _MASK63
        limit = trajectory.tokens_left
        if self.spec.max_turn_tokens is not None:
            limit = min(limit, self.spec.max_turn_tokens)
        turn_params = replace(params, n=1, seed=seed, max_new_tokens=limit)
        self._turn_ids += 1
        request = GenerationRequest(
            f"{sample.session}/t{self._turn_ids}",
            trajectory.context_ids,
            turn_params,
            session_id=sample.session,
        )
        self._turns[request.request_id] = sample
        return request

    def _timed_out(self, trajectory: Trajectory) -> bool:
        return self.clock() - trajectory.started_at > self.spec.trajectory_timeout_seconds

    def _ended(self, group: _Group) -> bool:
        return all(sample.trajectory.finish_reason is not None for sample in group.samples)

    def _result(self, group: _Group) -> RequestResult:
        return group_result(group.request, [sample.trajectory for sample in group.samples])


def _end_reason(action: Finish | Insert, final: str | None) -> str:
    """Why a trajectory ends on the loop's answer: a spent budget whatever the loop says, else
    the loop's :class:`Finish` reason, else (an ``Insert`` after the last turn) ``max_turns``."""
    if final == "budget":
        return final
    if isinstance(action, Finish):
        return action.reason
    return final or "max_turns"


def group_result(
    request: GenerationRequest, trajectories: list[Trajectory], *, own_prompts: bool = False
) -> RequestResult:
    """The group's result from its ended trajectories: token-exact samples, their stats on ``tag``.

    ``own_prompts``: each trajectory's prompt is its own (the chat endpoint's sessions), not the
    group's; the samples carry it.
    """
    samples: list[SampleResult] = []
    stats: list[TrajectoryStats] = []
    for trajectory in trajectories:
        reason = trajectory.finish_reason or "answer"
        samples.append(
            SampleResult(
                list(trajectory.token_ids),
                list(trajectory.logprobs),
                list(trajectory.versions),
                "stop" if reason == "answer" else "length",
                loss_mask=list(trajectory.loss_mask),
                answer_span=trajectory.last_turn,
                prompt_token_ids=list(trajectory.prompt_ids) if own_prompts else None,
            )
        )
        stats.append(
            TrajectoryStats(
                trajectory.turns,
                trajectory.tool_calls,
                trajectory.tool_errors,
                tuple(trajectory.tool_seconds),
                len(trajectory.token_ids),
                trajectory.masked_tokens,
                reason,
                trajectory.reward,
                trajectory.env_steps,
            )
        )
    return RequestResult(replace(request, tag=stats), samples)


def trajectory_metrics(stats: list[TrajectoryStats]) -> dict[str, float]:
    """The step's agent metrics over the trajectories it trained on (the catalogue's ``agent`` group)."""
    if not stats:
        return {}
    count = len(stats)
    latencies = sorted(seconds for s in stats for seconds in s.tool_seconds)
    calls = sum(s.tool_calls for s in stats)
    tokens = sum(s.response_tokens for s in stats)
    metrics = {
        "agent/turns_mean": sum(s.turns for s in stats) / count,
        "agent/turns_max": float(max(s.turns for s in stats)),
        "agent/tool_calls_per_trajectory": calls / count,
        "agent/env_steps_per_trajectory": sum(s.env_steps for s in stats) / count,
        "agent/tool_errors": float(sum(s.tool_errors for s in stats)),
        "agent/tool_error_fraction": sum(s.tool_errors for s in stats) / max(calls, 1),
        "agent/trajectory_tokens_mean": tokens / count,
        "agent/trajectory_tokens_max": float(max(s.response_tokens for s in stats)),
        "agent/masked_token_fraction": sum(s.masked_tokens for s in stats) / max(tokens, 1),
        "agent/timeouts": float(sum(s.finish_reason == "timeout" for s in stats)),
    }
    if latencies:
        metrics["agent/tool_latency_p50_seconds"] = _quantile(latencies, 0.5)
        metrics["agent/tool_latency_p99_seconds"] = _quantile(latencies, 0.99)
    return metrics


def _quantile(ordered: list[float], q: float) -> float:
    """The nearest-rank quantile of an ascending list."""
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]
