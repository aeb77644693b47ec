"""An OpenAI-compatible ``/v1/chat/completions`` endpoint: agent frameworks drive the job's rollouts.

``spec.agent.loop: endpoint`` hands each sample of a prompt to ``spec.agent.runner``, a function
``run(base_url, api_key, row) -> float | None`` of the user's (an existing agent, pointed at the
job with ``OpenAI(base_url=base_url, api_key=api_key)``). Each sample is a *session*: its own
API key, which both authenticates the calls and names the session. The endpoint serves the
calls from the rollout service's replicas and records the session token-exactly; when the
runner returns, the session is the sample's trajectory (a returned number is its environment
reward, ``Finish(reward=...)`` of the agent-loop API), scored by the job's reward functions and
trained on like any other.

**Token-exact records.** The first call's messages, rendered by the tokenizer's chat template
with the generation prompt, are the session's prompt. Each reply is the engine's tokens as
generated (never re-encoded). A later call must resend the conversation so far (the messages
the endpoint saw and the assistant messages it returned, in order, as agents do) plus new
messages: the new part is what the chat template renders after the conversation so far, and
is appended as an inserted turn (masked out of the loss), together with the template's end of
the previous assistant turn where the engine did not generate it (the newline after
``<|im_end|>`` in ChatML). A call whose messages do not extend the session's is refused (400),
as is one past the session's budget (``rollout.maxResponseTokens``) or a prompt longer than
``data.maxPromptTokens``.

Replies carry ``content`` (the text without tool-call markup) and, when the turn holds calls
in ``agent.toolParser``'s format, ``tool_calls``. Concurrency: sessions run in parallel; a
session's own calls must come one at a time (409 otherwise). Calls are served from threads of
the HTTP server and handed to the service through :meth:`EndpointDriver.advance`, which the
service runs in its loop: a call waits while the trainer updates the actor, as every request
does.

Security: the server listens on the controller's pod (``agent.endpointPort``); in the cluster a
Service of that port selects the head pod, and the job's NetworkPolicy admits only the job's own
pods. Keys are random and valid for their session only.
"""

from __future__ import annotations

import concurrent.futures
import json
import queue
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from hybridflow.agents.tool_calls import load_parser
from hybridflow.agents.trajectory import Trajectory
from hybridflow.engines.continuous import GenerationRequest, RequestResult, SampleResult
from hybridflow.plugins import import_attribute
from hybridflow.rollout.trajectories import group_result
from hybridflow.spec.agent import AgentSpec

__all__ = ["EndpointDriver", "EndpointError", "SessionRunner", "load_session_runner"]

SessionRunner = Callable[[str, str, Mapping[str, Any]], "float | None"]
"""``run(base_url, api_key, row) -> reward or None``: drives one session (see the module docstring)."""

_MASK63 = (1 << 63) - 1


class EndpointError(Exception):
    """A call the endpoint refuses: the HTTP status and the message the client gets."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class _Session:
    key: str
    group_id: str
    index: int
    lock: threading.Lock = field(default_factory=threading.Lock)
    trajectory: Trajectory | None = None
    messages: list[Any] = field(default_factory=list)
    """The conversation so far, as the client sent it and with the assistant messages returned."""
    tail: str = ""
    """What the chat template renders after the last reply that the engine did not generate."""
    calls: int = 0
    ended: bool = False
    reward: float | None = None
    failure: str | None = None


@dataclass
class _Group:
    request: GenerationRequest
    sessions: list[_Session]
    threads: list[threading.Thread]


class EndpointDriver:
    """The trajectory source of ``loop: endpoint`` (the :class:`~hybridflow.rollout.trajectories.TrajectoryDriver` protocol)."""

    def __init__(
        self,
        spec: AgentSpec,
        runner: SessionRunner,
        *,
        tokenizer: Any,
        budget: int,
        max_prompt_tokens: int,
        temperature: float,
        host: str = "127.0.0.1",
        port: int = 0,
        advertised_host: str | None = None,
    ) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "spec.agent.loop 'endpoint' needs a tokenizer with a chat template (the model's has none)"
            )
        self.spec = spec
        self.runner = runner
        self.tokenizer = tokenizer
        self.budget = budget
        self.max_prompt_tokens = max_prompt_tokens
        self.temperature = temperature
        self.parse = load_parser(spec.tool_parser)
        self._assistant_end = _assistant_end(tokenizer)
        self._eos_text = str(tokenizer.eos_token or "")
        self._sessions: dict[str, _Session] = {}
        self._groups: dict[str, _Group] = {}
        self._calls: queue.Queue[tuple[GenerationRequest, concurrent.futures.Future[SampleResult]]] = (
            queue.Queue()
        )
        self._waiting: dict[str, concurrent.futures.Future[SampleResult]] = {}
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer((host, port), _handler(self))
        self._server.daemon_threads = True
        self._serving = threading.Thread(target=self._server.serve_forever, name="chat-endpoint", daemon=True)
        self._serving.start()
        self.base_url = f"http://{advertised_host or host}:{self._server.server_address[1]}/v1"

    # ------------------------------------------------------------------ the service's calls

    def begin(self, request: GenerationRequest, row: Mapping[str, Any]) -> list[GenerationRequest]:
        """Start the group's sessions, each a runner thread; turns come later, from their calls."""
        sessions = []
        threads = []
        for index in range(request.params.n):
            session = _Session(secrets.token_urlsafe(24), request.request_id, index)
            with self._lock:
                self._sessions[session.key] = session
            thread = threading.Thread(
                target=self._run,
                args=(session, dict(row)),
                name=f"agent-{request.request_id}/{index}",
                daemon=True,
            )
            sessions.append(session)
            threads.append(thread)
        self._groups[request.request_id] = _Group(request, sessions, threads)
        for thread in threads:
            thread.start()
        return []

    def turn_finished(self, result: RequestResult) -> None:
        future = self._waiting.pop(result.request.request_id)
        future.set_result(result.samples[0])

    def advance(self) -> tuple[list[GenerationRequest], list[RequestResult]]:
        turns = []
        while True:
            try:
                request, future = self._calls.get_nowait()
            except queue.Empty:
                break
            self._waiting[request.request_id] = future
            turns.append(request)
        done = [group_id for group_id, group in self._groups.items() if all(s.ended for s in group.sessions)]
        return turns, [self._result(self._groups.pop(group_id)) for group_id in done]

    @property
    def running(self) -> int:
        return sum(not s.ended for g in self._groups.values() for s in g.sessions)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        for future in self._waiting.values():
            future.cancel()

    # ------------------------------------------------------------------ sessions

    def _run(self, session: _Session, row: dict[str, Any]) -> None:
        try:
            reward = self.runner(self.base_url, session.key, row)
            session.reward = None if reward is None else float(reward)
        except Exception as error:  # the agent failed: its session ends with what it has
            session.failure = f"{type(error).__name__}: {error}"[:300]
        finally:
            with session.lock:
                session.ended = True

    def complete(self, key: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """Serve one ``/v1/chat/completions`` call (an HTTP server thread); raises :class:`EndpointError`."""
        with self._lock:
            session = self._sessions.get(key)
        if session is None:
            raise EndpointError(401, "unknown API key: each session's key comes with its run")
        if not session.lock.acquire(blocking=False):
            raise EndpointError(
                409, "this session has a call in progress: a session's calls come one at a time"
            )
        try:
            if session.ended:
                raise EndpointError(410, "this session has ended")
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise EndpointError(400, "'messages' must be a non-empty list")
            if body.get("n", 1) != 1:
                raise EndpointError(400, "'n' must be 1: each sample is a session of its own")
            turn = self._next_turn(session, messages, body.get("tools"), body)
            future: concurrent.futures.Future[SampleResult] = concurrent.futures.Future()
            self._calls.put((turn, future))
            try:
                sample = future.result(timeout=self.spec.trajectory_timeout_seconds)
            except concurrent.futures.TimeoutError as error:
                raise EndpointError(504, "no reply within agent.trajectoryTimeoutSeconds") from error
            return self._reply(session, sample)
        finally:
            session.lock.release()

    def _next_turn(
        self, session: _Session, messages: list[Any], tools: Any, body: Mapping[str, Any]
    ) -> GenerationRequest:
        render = self._render
        if session.trajectory is None:
            prompt = self._encode(render(messages, tools, generation_prompt=True))
            if len(prompt) > self.max_prompt_tokens:
                raise EndpointError(
                    400,
                    f"the first messages are {len(prompt)} tokens, more than spec.data.maxPromptTokens={self.max_prompt_tokens}",
                )
            session.trajectory = Trajectory(prompt, self.budget, time.monotonic())
        else:
            seen = len(session.messages)
            if len(messages) <= seen or not _same_conversation(messages[:seen], session.messages):
                raise EndpointError(
                    400,
                    "the messages must repeat this session's conversation (as sent, with the assistant "
                    "messages as returned) and add new ones",
                )
            before = render(messages[:seen], tools, generation_prompt=False)
            after = render(messages, tools, generation_prompt=True)
            if not after.startswith(before):
                raise EndpointError(
                    400, "the chat template does not render this conversation as an extension of its start"
                )
            if not session.trajectory.insert(self._encode(session.tail + after[len(before) :])):
                raise EndpointError(
                    400, f"the session's budget of {self.budget} tokens (rollout.maxResponseTokens) is spent"
                )
        session.messages = list(messages)
        session.calls += 1
        trajectory = session.trajectory
        limit = trajectory.tokens_left
        for name in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(name), int) and body[name] > 0:
                limit = min(limit, int(body[name]))
        if self.spec.max_turn_tokens is not None:
            limit = min(limit, self.spec.max_turn_tokens)
        group = self._groups[session.group_id].request.params
        seed = (
            None
            if group.seed is None
            else (group.seed * 1_000_003 + session.index * 10_007 + session.calls) & _MASK63
        )
        params = replace(group, n=1, seed=seed, max_new_tokens=limit, temperature=self.temperature)
        return GenerationRequest(
            f"{session.group_id}/{session.index}/c{session.calls}",
            trajectory.context_ids,
            params,
            session_id=f"{session.group_id}/{session.index}",
        )

    def _reply(self, session: _Session, sample: SampleResult) -> dict[str, Any]:
        trajectory = session.trajectory
        assert trajectory is not None
        trajectory.add_model_turn(list(sample.token_ids), list(sample.logprobs), list(sample.versions))
        generated = str(self.tokenizer.decode(sample.token_ids, skip_special_tokens=False))
        ended_turn = bool(self._eos_text) and generated.endswith(self._eos_text)
        text = generated[: -len(self._eos_text)] if ended_turn else generated
        # The template closes an assistant turn with its end marker and what follows it; the part
        # the engine did not generate goes in before the next call's new messages.
        end = self._assistant_end
        session.tail = end[len(self._eos_text) :] if ended_turn and end.startswith(self._eos_text) else end
        parsed = self.parse(text)
        content = text.split("<tool_call>")[0].strip() if parsed.calls else text
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if parsed.calls:
            message["tool_calls"] = [
                {
                    "id": f"call_{uuid.uuid4().hex[:12]}",
                    "type": "function",
                    "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
                }
                for call in parsed.calls
            ]
        session.messages.append(message)
        reason = "tool_calls" if parsed.calls else ("stop" if ended_turn else "length")
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": "hybridflow-policy",
            "choices": [{"index": 0, "message": message, "finish_reason": reason, "logprobs": None}],
            "usage": {
                "prompt_tokens": len(trajectory.context_ids) - len(sample.token_ids),
                "completion_tokens": len(sample.token_ids),
                "total_tokens": len(trajectory.context_ids),
            },
        }

    def _render(self, messages: list[Any], tools: Any, *, generation_prompt: bool) -> str:
        try:
            return str(
                self.tokenizer.apply_chat_template(
                    messages, tools=tools or None, add_generation_prompt=generation_prompt, tokenize=False
                )
            )
        except Exception as error:
            raise EndpointError(400, f"the chat template cannot render these messages: {error}") from error

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _result(self, group: _Group) -> RequestResult:
        trajectories = []
        for session in group.sessions:
            trajectory = session.trajectory or Trajectory(
                list(group.request.prompt_token_ids), self.budget, 0.0
            )
            trajectory.finish_reason = (
                "answer" if session.failure is None else f"agent_error: {session.failure}"
            )
            trajectory.reward = session.reward
            trajectories.append(trajectory)
            with self._lock:
                self._sessions.pop(session.key, None)
        return group_result(group.request, trajectories, own_prompts=True)


def load_session_runner(path: str) -> SessionRunner:
    """The function ``spec.agent.runner`` names; errors name the value and what is wrong."""
    function = import_attribute(path, "spec.agent.runner")
    if not callable(function):
        raise ValueError(f"spec.agent.runner: {path!r} is not a function")
    runner: SessionRunner = function
    return runner


def _assistant_end(tokenizer: Any) -> str:
    """What the chat template renders after an assistant message's content (``<|im_end|>\\n`` in ChatML)."""
    probe = "\x00probe\x00"
    text = str(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "u"}, {"role": "assistant", "content": probe}], tokenize=False
        )
    )
    return text[text.rindex(probe) + len(probe) :]


def _same_conversation(sent: list[Any], recorded: list[Any]) -> bool:
    """Whether the client resent the recorded conversation: the same roles and texts, in order.

    Tool-call lists are not compared (clients rewrite their ids, some drop them): an assistant
    turn's tokens are the engine's whatever the client sends back for it.
    """

    def key(message: Any) -> tuple[Any, ...]:
        if not isinstance(message, Mapping):
            return (None,)
        return (message.get("role"), str(message.get("content") or "").strip())

    return [key(m) for m in sent] == [key(m) for m in recorded]


def _handler(driver: EndpointDriver) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            if self.path.rstrip("/") not in ("/v1/chat/completions", "/chat/completions"):
                self._send(404, {"error": {"message": f"no route {self.path}; POST /v1/chat/completions"}})
                return
            authorization = self.headers.get("Authorization", "")
            key = authorization.removeprefix("Bearer ").strip()
            try:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                if not isinstance(body, dict):
                    raise EndpointError(400, "the body must be a JSON object")
                if body.get("stream"):
                    raise EndpointError(400, "'stream' is not supported")
                self._send(200, driver.complete(key, body))
            except EndpointError as error:
                self._send(error.status, {"error": {"message": str(error), "type": "invalid_request_error"}})
            except json.JSONDecodeError as error:
                self._send(400, {"error": {"message": f"the body is not JSON: {error}"}})
            except (
                Exception
            ) as error:  # a bug of ours: the client gets a 500 with the cause, the server goes on
                self._send(500, {"error": {"message": f"{type(error).__name__}: {error}"[:500]}})

        def do_GET(self) -> None:
            if self.path.rstrip("/") == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": "hybridflow-policy", "object": "model"}]})
            else:
                self._send(404, {"error": {"message": f"no route {self.path}"}})

        def _send(self, status: int, payload: Mapping[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:  # the job's log is not an access log
            return

    return Handler
