"""Escape attempts against the Python tool's sandbox, and what containing each one means.

The unit tests (``tests/unit/test_sandbox.py``) and ``bench/agentic.py`` (its
``sandbox_escapes_tried`` / ``sandbox_escapes_contained``) run this one list, so the figures a
bench reports are the attempts the tests hold to. :func:`try_escapes` sets up what the attempts
aim at (a file and a directory outside the working directory, a listening TCP socket on this
host), runs each attempt through :func:`~hybridflow.agents.sandbox.run_python`, and judges it.

An attempt is contained when all of these hold:

* its result is an error the model can read (``as_tool_text()`` starts with ``error:``), of the
  kind the attempt expects (a memory error for memory exhaustion, a CPU or wall-clock stop for a
  busy loop, a cut for endless output, a ``PermissionError`` for the file system);
* nothing it aimed at was reached: the secret file's text is not in its output, the file it
  tried to write does not exist, the socket accepted no connection;
* no process of it is left once it returned (looked up in ``/proc``: a sandbox process runs
  from a ``hybridflow-sandbox-*`` directory).
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hybridflow.agents.sandbox import SandboxLimits, SandboxResult, run_python

__all__ = [
    "ESCAPE_ATTEMPTS",
    "ESCAPE_LIMITS",
    "EscapeAttempt",
    "EscapeReport",
    "sandbox_processes",
    "try_escapes",
]

ESCAPE_LIMITS = SandboxLimits(
    wall_seconds=3.0,
    cpu_seconds=1,
    memory_bytes=256 * 2**20,
    processes=8,
    file_bytes=2**20,
    output_bytes=1000,
)
"""The limits the tests and the bench run the attempts under: small, so that each stops in seconds."""


@dataclass(frozen=True)
class Targets:
    """What the attempts aim at, outside the sandbox."""

    secret_file: Path
    secret_text: str
    forbidden_file: Path
    port: int
    accepted: list[object]


@dataclass(frozen=True)
class EscapeAttempt:
    name: str
    code: Callable[[Targets], str]
    expected: tuple[str, ...]
    """The outcomes (``SandboxResult.outcome``) that count as stopped."""
    needs_permission_error: bool = False
    """A file-system attempt: Landlock's refusal must be what stopped it (not, say, a typo)."""


ESCAPE_ATTEMPTS: tuple[EscapeAttempt, ...] = (
    EscapeAttempt(
        "fork bomb",
        lambda t: "import os\nwhile True:\n    os.fork()",
        ("error", "killed", "timeout", "cpu_limit"),
    ),
    EscapeAttempt("memory exhaustion", lambda t: "x = bytearray(2 * 1024**3)", ("memory_limit",)),
    EscapeAttempt("infinite loop", lambda t: "while True:\n    pass", ("cpu_limit", "timeout")),
    EscapeAttempt("endless output", lambda t: "while True:\n    print('x' * 1000)", ("output_limit",)),
    EscapeAttempt(
        "TCP to this host",
        lambda t: (
            f"import socket\nsocket.create_connection(('127.0.0.1', {t.port}), timeout=2)\nprint('connected')"
        ),
        ("error",),
    ),
    EscapeAttempt(
        "read a file outside", lambda t: f"print(open({str(t.secret_file)!r}).read())", ("error",), True
    ),
    EscapeAttempt("read /etc/passwd", lambda t: "print(open('/etc/passwd').read())", ("error",), True),
    EscapeAttempt(
        "write a file outside", lambda t: f"open({str(t.forbidden_file)!r}, 'w').write('x')", ("error",), True
    ),
    EscapeAttempt("list /", lambda t: "import os\nprint(os.listdir('/'))", ("error",), True),
)


@dataclass(frozen=True)
class EscapeReport:
    name: str
    contained: bool
    outcome: str
    reason: str
    """Why it does not count as contained; empty when it does."""
    seconds: float


def sandbox_processes() -> list[int]:
    """Pids of processes running from a sandbox's working directory (``/proc``; no dependency)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if b"hybridflow-sandbox-" in cmdline:
            found.append(int(entry.name))
    return found


def _judge(attempt: EscapeAttempt, result: SandboxResult, targets: Targets) -> str:
    if not result.as_tool_text().startswith("error:"):
        return f"the call ended {result.outcome!r}, not as an error for the model"
    if result.outcome not in attempt.expected:
        return f"stopped as {result.outcome!r}, expected one of {', '.join(attempt.expected)}"
    if attempt.needs_permission_error and "PermissionError" not in result.stderr:
        return "not refused with a PermissionError: " + result.stderr.strip()[-120:]
    if targets.secret_text in result.stdout:
        return "the secret file's text is in its output"
    if targets.forbidden_file.exists():
        return f"{targets.forbidden_file} was written"
    if targets.accepted:
        return "the listening socket accepted its connection"
    deadline = time.monotonic() + 5
    while sandbox_processes() and time.monotonic() < deadline:
        time.sleep(0.1)
    if sandbox_processes():
        return f"processes left behind: {sandbox_processes()}"
    return ""


def try_escapes(
    limits: SandboxLimits, *, namespaces: bool, attempts: tuple[EscapeAttempt, ...] = ESCAPE_ATTEMPTS
) -> list[EscapeReport]:
    """Run each attempt once under ``limits`` and judge it (the module docstring says how)."""
    reports = []
    with tempfile.TemporaryDirectory(prefix="hybridflow-escape-targets-") as outside:
        server = socket.create_server(("127.0.0.1", 0))
        accepted: list[object] = []

        def accept() -> None:
            with contextlib.suppress(OSError):  # the socket is closed at the end
                accepted.append(server.accept())

        threading.Thread(target=accept, daemon=True).start()
        secret = Path(outside) / "secret.txt"
        secret.write_text("escape-token-7f3a")
        targets = Targets(
            secret, "escape-token-7f3a", Path(outside) / "written.txt", server.getsockname()[1], accepted
        )
        try:
            for attempt in attempts:
                result = run_python(attempt.code(targets), limits, namespaces=namespaces)
                reason = _judge(attempt, result, targets)
                reports.append(EscapeReport(attempt.name, not reason, result.outcome, reason, result.seconds))
        finally:
            server.close()
    return reports
