"""The Python tool's sandbox (``hybridflow.agents.sandbox``): escape attempts, each contained and reported.

Every attempt runs twice: with the namespaces this machine allows, and without them (as in a pod
whose seccomp profile refuses ``unshare``: rlimits, Landlock and, as root, an empty capability
bounding set). Each must end as an error the model can read, leave no process behind and touch
nothing outside its working directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybridflow.agents.escapes import (
    ESCAPE_ATTEMPTS,
    ESCAPE_LIMITS,
    EscapeAttempt,
    sandbox_processes,
    try_escapes,
)
from hybridflow.agents.sandbox import SandboxLimits, isolation, run_python

pytestmark = pytest.mark.unit

LIMITS = SandboxLimits(wall_seconds=2.0, cpu_seconds=1, memory_bytes=256 * 2**20, processes=8)


@pytest.fixture(scope="module", autouse=True)
def confined() -> None:
    applied = isolation()
    if applied is None or applied.landlock_abi < 4:
        pytest.skip(f"this kernel cannot confine the sandbox's files and sockets (Landlock: {applied})")


@pytest.fixture(params=[True, False], ids=["namespaces", "no-namespaces"])
def namespaces(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


def test_code_runs_and_may_use_its_working_directory(namespaces: bool) -> None:
    result = run_python(
        "open('f.txt', 'w').write('hi')\nprint(open('f.txt').read(), 6 * 7)", LIMITS, namespaces=namespaces
    )
    assert result.ok and result.stdout == "hi 42\n" and result.as_tool_text() == "hi 42\n"
    assert result.isolation is not None and result.isolation.namespaces == namespaces


def test_an_exception_is_an_error_message_with_its_last_lines(namespaces: bool) -> None:
    result = run_python("raise ValueError('boom')", LIMITS, namespaces=namespaces)
    assert result.outcome == "error" and "ValueError: boom" in result.as_tool_text()


@pytest.mark.parametrize("attempt", ESCAPE_ATTEMPTS, ids=lambda attempt: attempt.name.replace(" ", "-"))
def test_each_escape_attempt_is_contained_and_reported(namespaces: bool, attempt: EscapeAttempt) -> None:
    """The catalogue bench/agentic.py counts: an error for the model, the target untouched, no process left."""
    [report] = try_escapes(ESCAPE_LIMITS, namespaces=namespaces, attempts=(attempt,))
    assert report.contained, report
    assert not sandbox_processes()


def test_endless_output_is_cut_at_the_output_limit() -> None:
    result = run_python("while True:\n    print('x' * 1000)", ESCAPE_LIMITS)
    assert result.outcome == "output_limit" and len(result.stdout) == ESCAPE_LIMITS.output_bytes


def test_the_judge_counts_an_attempt_that_got_out_as_not_contained() -> None:
    """The judge can fail: code that prints the secret's text (as if it had read it) and exits 0."""
    leaked = EscapeAttempt("leak", lambda targets: f"print({targets.secret_text!r})", ("error",))
    wrong_kind = EscapeAttempt("wrong kind", lambda targets: "raise ValueError('no')", ("error",), True)
    reports = try_escapes(ESCAPE_LIMITS, namespaces=False, attempts=(leaked, wrong_kind))
    assert [report.contained for report in reports] == [False, False]
    assert "not as an error" in reports[0].reason and "PermissionError" in reports[1].reason


TESTS = Path(__file__).resolve().parents[1]
TOKEN = "ray-token-0f3c9e"


def _caller_without_landlock(require: str, **env: str) -> dict[str, object]:
    """One call from a process on which Landlock is denied (``tests/landlock_denied.py``), whose
    environment holds ``env``; what the call returned."""
    clean = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_TOKEN", "KUBERNETES_SERVICE_HOST")}
    done = subprocess.run(
        [sys.executable, str(TESTS / "landlock_denied.py"), require],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    answer: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    return answer


def test_without_landlock_the_code_reads_its_callers_token() -> None:
    """What the refusal below prevents: with no Landlock, the code of the same uid reads the
    environment of the process that called the sandbox (a sandbox worker holds the Ray token)."""
    result = _caller_without_landlock("no", RAY_AUTH_TOKEN=TOKEN)
    assert result["landlock"] == 0 and result["outcome"] == "ok" and TOKEN in str(result["stdout"])


@pytest.mark.parametrize("credential", ["RAY_AUTH_TOKEN", "KUBERNETES_SERVICE_HOST"])
def test_a_caller_with_credentials_gets_no_call_where_landlock_is_missing(credential: str) -> None:
    result = _caller_without_landlock("auto", **{credential: TOKEN})
    assert result["outcome"] == "sandbox_error" and result["stdout"] == ""
    assert "Landlock is not available" in str(result["stderr"]) and TOKEN not in str(result["stderr"])


def test_a_caller_without_credentials_still_runs_code_where_landlock_is_missing() -> None:
    """On a laptop the tool keeps working unconfined by the file system, and says so (landlock 0)."""
    result = _caller_without_landlock("auto")
    assert result["outcome"] == "ok" and result["landlock"] == 0


def test_with_landlock_the_code_cannot_read_its_callers_environment() -> None:
    result = run_python(
        "import os\nprint(open(f'/proc/{os.getppid()}/environ').read())", LIMITS, namespaces=False
    )
    assert result.outcome == "error" and "PermissionError" in result.stderr
