"""The Python tool's sandbox (``hybridflow.agents.sandbox``): escape attempts, each contained and reported.

Every attempt of the catalogue (``hybridflow.agents.escapes``) runs in each mode the sandbox
guarantees to contain it in: strict isolation, weak with namespaces, and weak without them (a pod
whose seccomp profile refuses ``unshare``). Each must end as what it expects, leave no process
behind, touch nothing outside and keep the caller well. A machine that cannot give a mode fails
these tests, naming what is missing; ``HYBRIDFLOW_SANDBOX_MAY_SKIP=1`` skips them instead (a
developer's machine, never CI).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from hybridflow.agents.escapes import (
    ESCAPE_ATTEMPTS,
    ESCAPE_LIMITS,
    MODES,
    EscapeAttempt,
    sandbox_processes,
    try_escapes,
)
from hybridflow.agents.sandbox import SandboxLimits, probe, run_python

pytestmark = pytest.mark.unit

# For code that ends on its own: room for an interpreter's start on a machine the suite's background
# scenarios keep busy (2 s timed out there, 2026-12-07). The escapes run under ESCAPE_LIMITS.
LIMITS = SandboxLimits(wall_seconds=10.0, cpu_seconds=5, memory_bytes=256 * 2**20, processes=8)
MAY_SKIP = "HYBRIDFLOW_SANDBOX_MAY_SKIP"


def _needed(mode: str) -> None:
    """Fail (or, with HYBRIDFLOW_SANDBOX_MAY_SKIP=1, skip) where this machine cannot give ``mode``."""
    isolation, namespaces = MODES[mode]  # type: ignore[index]
    applied, why = probe(isolation)
    if not why and namespaces and applied is not None and not applied.namespaces:
        why = "user namespaces (unshare refused)"
    if not why and (applied is None or applied.landlock_abi < 6):
        why = f"Landlock ABI >= 6 (this kernel: {applied.landlock_abi if applied else None})"
    if why:
        message = f"this machine cannot give the sandbox's {mode} mode: {why}"
        if os.environ.get(MAY_SKIP) == "1":
            pytest.skip(message)
        pytest.fail(f"{message} (set {MAY_SKIP}=1 to skip on a machine known to lack it)")


CASES = [(mode, attempt) for attempt in ESCAPE_ATTEMPTS for mode in MODES if mode in attempt.modes]


@pytest.mark.parametrize(
    ("mode", "attempt"), CASES, ids=[f"{m}-{a.name.replace(' ', '-')}" for m, a in CASES]
)
def test_each_escape_attempt_is_contained_and_reported(mode: str, attempt: EscapeAttempt) -> None:
    """The catalogue bench/agentic.py counts, in each mode that guarantees it."""
    _needed(mode)
    [report] = try_escapes(ESCAPE_LIMITS, mode, attempts=(attempt,))  # type: ignore[arg-type]
    assert report.contained, report
    assert not sandbox_processes()


@pytest.mark.parametrize("isolation", ["strict", "weak"])
def test_code_runs_and_may_use_its_working_directory(isolation: str) -> None:
    _needed(isolation)
    limits = SandboxLimits(**{**vars(LIMITS), "isolation": isolation})
    result = run_python("open('f.txt', 'w').write('hi')\nprint(open('f.txt').read(), 6 * 7)", limits)
    assert result.ok and result.stdout == "hi 42\n" and result.as_tool_text() == "hi 42\n"
    assert result.isolation is not None and result.isolation.mode == isolation
    assert result.isolation.private_root == (isolation == "strict")


def test_strict_isolation_is_everything_at_once() -> None:
    _needed("strict")
    applied, _ = probe("strict")
    assert applied is not None and applied.namespaces and applied.private_root and applied.seccomp
    assert applied.capabilities_dropped and applied.landlock_abi >= 1 and applied.cgroup in (1, 2)


def test_an_exception_is_an_error_message_with_its_last_lines() -> None:
    _needed("strict")
    result = run_python("raise ValueError('boom')", LIMITS)
    assert result.outcome == "error" and "ValueError: boom" in result.as_tool_text()


def test_endless_output_is_cut_at_the_output_limit() -> None:
    _needed("strict")
    result = run_python("while True:\n    print('x' * 1000)", ESCAPE_LIMITS)
    assert result.outcome == "output_limit" and len(result.stdout) == ESCAPE_LIMITS.output_bytes


def test_the_judge_counts_an_attempt_that_got_out_as_not_contained() -> None:
    """The judge can fail: code that prints the secret's text (as if it had read it) and exits 0."""
    _needed("weak-no-namespaces")
    leaked = EscapeAttempt("leak", lambda targets: f"print({targets.secret_text!r})", ("error",))
    wrong_kind = EscapeAttempt("wrong kind", lambda targets: "raise ValueError('no')", ("error",), True)
    reports = try_escapes(ESCAPE_LIMITS, "weak-no-namespaces", attempts=(leaked, wrong_kind))
    assert [report.contained for report in reports] == [False, False]
    assert "not as an error" in reports[0].reason and "file system" in reports[1].reason


def test_a_caller_that_gets_no_cgroup_is_refused_with_what_is_missing() -> None:
    """As a pod's process: an unprivileged uid, no writable cgroup (``tests/sandbox_unprivileged.py``).
    Strict refuses, naming it; the launcher alone builds its namespaces and private root for it."""
    system_python = Path("/usr/bin/python3")
    if os.geteuid() != 0 or not system_python.exists():
        pytest.fail("this test runs as root with Debian's python3 (to become an unprivileged uid)")
    done = subprocess.run(
        [
            "setpriv",
            "--reuid",
            "65534",
            "--regid",
            "65534",
            "--clear-groups",
            str(system_python),
            str(Path(__file__).resolve().parents[1] / "sandbox_unprivileged.py"),
        ],
        env={"PYTHONPATH": str(Path(__file__).resolve().parents[2] / "runtime"), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tempfile.gettempdir(),
        check=True,
    )
    answer = json.loads(done.stdout.splitlines()[-1])
    assert "cgroup" in answer["refused"] and "isolation: weak" in answer["stderr"]
    assert answer["alone"] == "1000 ['main.py']\n" and answer["private_root"]


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


def test_strict_isolation_refuses_where_landlock_is_missing_whoever_calls() -> None:
    result = _caller_without_landlock("strict")
    # (what it names first: this caller, root without capabilities, gets no cgroup either)
    assert result["outcome"] == "sandbox_error" and result["stdout"] == ""
    assert "isolation strict needs" in str(result["stderr"])


def test_with_landlock_the_code_cannot_read_its_callers_environment() -> None:
    _needed("weak-no-namespaces")
    weak = SandboxLimits(**{**vars(LIMITS), "isolation": "weak"})
    result = run_python(
        "import os\nprint(open(f'/proc/{os.getppid()}/environ').read())", weak, namespaces=False
    )
    assert result.outcome == "error" and "PermissionError" in result.stderr
