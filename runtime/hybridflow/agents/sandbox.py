"""Run untrusted Python (a model's tool call) in a confined process, and say what became of it.

The code is the model's, and the caller is not: a Ray worker (or the controller) holding the job's
secrets, its service-account token, the Ray cluster's token and its checkpoint volume. So the
caller never trusts anything the code could have touched:

* the code travels to the launcher on a pipe, and its output, and the launcher's report of what
  confines it, come back on pipes the caller made before the code ran: no file of the work
  directory is ever opened by the caller, so a symlink, a FIFO or an endless file in place of one
  reaches nothing; every pipe is read with a size bound and the call's deadline;
* everything the call started ends with it (a PID namespace, and in strict mode a cgroup the call
  has to itself), and :func:`run_python` never raises and never waits past ``wall_seconds`` plus a
  few seconds: whatever the code does, the caller gets a :class:`SandboxResult`.

Isolation (``spec.agent.sandbox.isolation``; ``sandbox_launcher.py`` applies it):

* ``strict`` (the default): namespaces (mount, PID, network, IPC, UTS; a user namespace unless the
  caller is root), a private read-only root with only the interpreter's standard library and the
  system libraries, a size-capped ``/work`` (and ``/tmp``) as the only writable place, an
  unprivileged uid that owns nothing of the host, rlimits, Landlock, a seccomp filter, and a
  cgroup per call (``sandbox_cgroup.py``) holding memory, processes and CPU time of all the call's
  processes together. A machine or pod that cannot give all of it refuses to run code: the call
  is a ``sandbox_error`` naming what is missing (``isolation()`` reports it once).
* ``weak`` (an explicit opt-in): what the machine allows of namespaces, rlimits per process,
  Landlock, and the host file system as the code's view (read-only outside its directory only
  through Landlock); refused where Landlock is missing and the caller holds credentials
  (:func:`landlock_required`).

``docs/agents.md`` states what each mode guarantees and on which kernels.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Literal

from hybridflow.agents import sandbox_cgroup

__all__ = [
    "Isolation",
    "SandboxLimits",
    "SandboxResult",
    "isolation",
    "landlock_required",
    "probe",
    "run_python",
]

Outcome = Literal[
    "ok", "error", "timeout", "cpu_limit", "memory_limit", "output_limit", "killed", "sandbox_error"
]
IsolationMode = Literal["strict", "weak"]
LAUNCHER = Path(__file__).with_name("sandbox_launcher.py")
EXIT_REFUSED = 125  # sandbox_launcher.EXIT_REFUSED (the launcher imports nothing of ours)
STATUS_BYTES = 1 << 16
DRAIN_SECONDS = 0.2
"""After the launcher exits, how long its pipes are still read."""
REAP_SECONDS = 5.0
"""After the wall clock, how long the caller waits for the call's processes to be gone."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one call may use (``spec.agent.sandbox`` sets them): all the call's processes together
    in strict mode (its cgroup and its ``/work``), each process in weak mode."""

    wall_seconds: float = 10.0
    cpu_seconds: int = 5
    memory_bytes: int = 512 * 2**20
    processes: int = 16
    file_bytes: int = 16 * 2**20
    """Largest file, and how much output is read before the call is stopped."""
    open_files: int = 64
    output_bytes: int = 16 * 2**10
    disk_bytes: int = 64 * 2**20
    """Size of the call's ``/work`` (strict mode): every file it writes, together."""
    isolation: IsolationMode = "strict"


@dataclass(frozen=True)
class Isolation:
    """The confinement the launcher applied (what this machine allows)."""

    namespaces: bool
    """User (or root's), network, PID and IPC namespaces: no network, and the call's processes end with it."""
    landlock_abi: int
    """0: no Landlock (the file system is not confined); >= 4: TCP bind/connect denied too."""
    capabilities_dropped: bool
    """The code runs with no capability (as an unprivileged uid, or root with its bounding set emptied)."""
    mode: IsolationMode = "weak"
    private_root: bool = False
    """Strict mode: a read-only root of the interpreter and system libraries, ``/work`` writable."""
    seccomp: bool = False
    landlock_scoped: bool = False
    """Landlock ABI >= 6: no signal and no abstract UNIX socket outside the call."""
    cgroup: int = 0
    """The version of the call's own cgroup (memory, processes, CPU time of the call together); 0: none."""


@dataclass(frozen=True)
class SandboxResult:
    outcome: Outcome
    exit_code: int | None
    stdout: str
    stderr: str
    seconds: float
    isolation: Isolation | None
    refused: str = field(default="")
    """Why the machine could not confine the code as asked (then nothing of it ran)."""

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"

    def as_tool_text(self, limit: int = 2000) -> str:
        """What the model reads: the output, or the error and why the call ended."""
        if self.ok:
            return self.stdout[:limit] if self.stdout else "(no output)"
        reasons = {
            "error": f"the code raised or exited with status {self.exit_code}",
            "timeout": "the call ran past its wall-clock limit and was stopped",
            "cpu_limit": "the call used up its CPU time and was stopped",
            "memory_limit": "the call ran out of memory",
            "output_limit": "the call wrote more output than allowed and was stopped",
            "killed": f"the call was killed by signal {-(self.exit_code or 0)}",
            "sandbox_error": "the sandbox could not run the call",
        }
        tail = self.stderr.strip().splitlines()[-3:]
        return f"error: {reasons[self.outcome]}" + (f"\n{chr(10).join(tail)}"[:limit] if tail else "")


def _hidden(read_only: list[str]) -> list[str]:
    """Package directories under the read-only paths, hidden in strict mode: the standard library only."""
    found: set[str] = set()
    for root in read_only:
        for pattern in (
            "lib/python3*/site-packages",
            "lib/python3*/dist-packages",
            "python3*/site-packages",
            "python3*/dist-packages",
            "python3/dist-packages",
        ):
            found.update(str(p) for p in Path(root).glob(pattern) if p.is_dir())
    return sorted(found)


def _read_only_paths(mode: IsolationMode) -> list[str]:
    """What the interpreter needs to start: its installation and the shared libraries (never a
    virtual environment's packages: the standard library only)."""
    paths = {
        sys.base_prefix,
        sysconfig.get_paths()["stdlib"],
        str(Path(_python()).parent),
        "/usr/lib",
        "/usr/lib64",
        "/lib",
        "/lib64",
        "/etc/ld.so.cache",
        "/usr/local/lib",
    }
    if mode == "strict":  # bound at the same paths in a new root: no path inside another one
        paths = {p for p in paths if not any(p != q and p.startswith(q.rstrip("/") + "/") for q in paths)}
    return sorted(p for p in paths if Path(p).exists())


def _python() -> str:
    """The base interpreter (not a virtual environment's shim: its ``pyvenv.cfg`` is outside the allowed paths)."""
    base = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    return str(base if base.exists() else Path(sys.executable).resolve())


CREDENTIAL_ENV = ("RAY_AUTH_TOKEN", "KUBERNETES_SERVICE_HOST")
"""What says the caller holds credentials worth reading: the Ray cluster's token (every Ray process
of a job with token authentication has it in its environment) or being in a Kubernetes pod (the
kubelet sets ``KUBERNETES_SERVICE_HOST`` in every container; the pod may hold a service-account
token, the job's Secrets, its volumes)."""


def landlock_required(env: Mapping[str, str]) -> bool:
    """Whether a weak-mode call must be refused where Landlock cannot confine it: when its caller
    holds credentials (:data:`CREDENTIAL_ENV`). On a laptop without them, code still runs unconfined
    by the file system, and :func:`isolation` says so. (Strict mode always needs Landlock.)"""
    return any(env.get(name) for name in CREDENTIAL_ENV)


@dataclass
class _Stream:
    """One pipe the caller reads: the first ``keep`` bytes are kept, reading stops at ``stop``."""

    fd: int
    keep: int
    stop: int
    data: bytearray = field(default_factory=bytearray)
    seen: int = 0
    closed: bool = False

    def read(self) -> None:
        try:
            chunk = os.read(self.fd, 65536)
        except OSError:
            chunk = b""
        if not chunk:
            self.close()
            return
        self.seen += len(chunk)
        if len(self.data) < self.keep:
            self.data += chunk[: self.keep - len(self.data)]
        if self.seen > self.stop:
            self.close()  # the writer's next write fails (SIGPIPE): the call is stopped

    def close(self) -> None:
        if not self.closed:
            os.close(self.fd)
            self.closed = True

    @property
    def overflowed(self) -> bool:
        return self.seen > self.stop

    def text(self) -> str:
        return bytes(self.data).decode(errors="replace")


def run_python(
    code: str,
    limits: SandboxLimits | None = None,
    *,
    namespaces: bool = True,
    require_landlock: bool | None = None,
) -> SandboxResult:
    """Run ``code`` as ``python -I -S main.py``, confined as ``limits.isolation`` says (the module
    docstring); never raises. ``namespaces`` (weak mode) tries without them, as in a pod whose
    seccomp profile refuses ``unshare``; ``require_landlock`` (weak mode; default:
    :func:`landlock_required` of this process's environment) refuses the call where Landlock
    cannot be applied."""
    limits = limits or SandboxLimits()
    started = time.monotonic()
    try:
        return _Call(code, limits, namespaces, require_landlock).run()
    except Exception as error:  # the caller is never the one to fail
        message = f"the sandbox failed: {type(error).__name__}: {error}"[: limits.output_bytes]
        return SandboxResult("sandbox_error", None, "", message, time.monotonic() - started, None)


class _Call:
    """One call of :func:`run_python`: its work directory, cgroup, pipes and launcher."""

    def __init__(
        self, code: str, limits: SandboxLimits, namespaces: bool, require_landlock: bool | None
    ) -> None:
        self.code, self.limits = code, limits
        self.namespaces = namespaces
        self.require_landlock = (
            landlock_required(os.environ) if require_landlock is None else require_landlock
        )
        self.started = time.monotonic()

    def run(self) -> SandboxResult:
        cgroup: sandbox_cgroup.CallCgroup | None = None
        if self.limits.isolation == "strict":
            try:
                cgroup = sandbox_cgroup.create(self.limits.memory_bytes, self.limits.processes)
            except sandbox_cgroup.CgroupUnavailable as unavailable:
                return self._refused(f"a cgroup of its own for the call: {unavailable}")
        work = Path(tempfile.mkdtemp(prefix="hybridflow-sandbox-"))
        try:
            return self._launch(work, cgroup)
        finally:
            if cgroup is not None:
                cgroup.remove()
            _remove_tree(work)

    def _refused(self, what: str) -> SandboxResult:
        message = (
            f"the sandbox refuses to run code here: isolation {self.limits.isolation} needs {what}; "
            "set spec.agent.sandbox.isolation: weak to run with what this machine gives (docs/agents.md)"
        )
        return SandboxResult(
            "sandbox_error", None, "", message, time.monotonic() - self.started, None, refused=what
        )

    def _config(self, work: Path, fds: Mapping[str, int]) -> bytes:
        mode = self.limits.isolation
        read_only = _read_only_paths(mode)
        return json.dumps(
            {
                "code": self.code,
                "python": _python(),
                "mode": mode,
                "namespaces": self.namespaces,
                "require_landlock": self.require_landlock,
                "read_only": read_only,
                "hidden": _hidden(read_only),
                "work": str(work),
                "cpu_seconds": self.limits.cpu_seconds,
                "memory_bytes": self.limits.memory_bytes,
                "file_bytes": self.limits.file_bytes,
                "disk_bytes": self.limits.disk_bytes,
                "open_files": self.limits.open_files,
                "processes": self.limits.processes,
                **fds,
            }
        ).encode()

    def _launch(self, work: Path, cgroup: sandbox_cgroup.CallCgroup | None) -> SandboxResult:
        pipes = {name: os.pipe() for name in ("stdout", "stderr", "status", "launcher")}
        child_ends = {name: pipe[1] for name, pipe in pipes.items()}
        try:
            process = subprocess.Popen(
                [_python(), "-I", "-S", str(LAUNCHER)],
                cwd=work,
                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=child_ends["launcher"],
                pass_fds=(child_ends["stdout"], child_ends["stderr"], child_ends["status"]),
                start_new_session=True,
            )
        except BaseException:
            for read_end, _ in pipes.values():
                os.close(read_end)
            raise
        finally:
            for fd in child_ends.values():
                os.close(fd)
        streams = {
            "stdout": _Stream(pipes["stdout"][0], self.limits.output_bytes, self.limits.file_bytes),
            "stderr": _Stream(pipes["stderr"][0], self.limits.output_bytes, self.limits.file_bytes),
            "status": _Stream(pipes["status"][0], STATUS_BYTES, STATUS_BYTES),
            "launcher": _Stream(pipes["launcher"][0], STATUS_BYTES, 1 << 20),
        }
        try:
            if cgroup is not None:
                cgroup.add(process.pid)  # before it reads its configuration: all it starts is counted
            assert process.stdin is not None
            fds = {
                "status_fd": child_ends["status"],
                "stdout_fd": child_ends["stdout"],
                "stderr_fd": child_ends["stderr"],
            }
            with contextlib.suppress(BrokenPipeError):
                process.stdin.write(self._config(work, fds))
            process.stdin.close()
            why = self._watch(process, streams, cgroup)
        finally:
            _end(process, cgroup)
            for stream in streams.values():
                stream.close()
        return self._result(process, streams, cgroup, why)

    def _watch(
        self,
        process: subprocess.Popen[bytes],
        streams: dict[str, _Stream],
        cgroup: sandbox_cgroup.CallCgroup | None,
    ) -> str:
        """Read every pipe until the call ends; why it was stopped ("" when it ended by itself)."""
        deadline = self.started + self.limits.wall_seconds
        drained_by: float | None = None
        while True:
            open_fds = {s.fd: s for s in streams.values() if not s.closed}
            if process.poll() is not None:
                # The launcher is gone: what is written is read for a moment, no longer (a process
                # the code left outside a PID namespace may hold a pipe open for ever).
                drained_by = drained_by or time.monotonic() + DRAIN_SECONDS
                if not open_fds or time.monotonic() >= drained_by:
                    return ""
            now = time.monotonic()
            if now >= deadline:
                return "timeout"
            if cgroup is not None and cgroup.cpu_seconds() > self.limits.cpu_seconds:
                return "cpu_limit"
            if any(s.overflowed for name, s in streams.items() if name in ("stdout", "stderr")):
                return "output_limit"
            if not open_fds:
                time.sleep(min(0.05, deadline - now))
                continue
            ready, _, _ = select.select(list(open_fds), [], [], min(0.05, deadline - now))
            for fd in ready:
                open_fds[fd].read()

    def _result(
        self,
        process: subprocess.Popen[bytes],
        streams: dict[str, _Stream],
        cgroup: sandbox_cgroup.CallCgroup | None,
        stopped: str,
    ) -> SandboxResult:
        seconds = time.monotonic() - self.started
        report = _parse_status(streams["status"].text())
        status = process.returncode
        if "refused" in report:
            return self._refused(str(report["refused"])[:2000])
        applied = report.get("applied")
        isolation = _isolation(applied, cgroup) if isinstance(applied, dict) else None
        stdout, stderr = streams["stdout"].text(), streams["stderr"].text()
        if isolation is None and not stopped:
            detail = (
                streams["launcher"].text()[-self.limits.output_bytes :]
                or f"the launcher exited with {status}"
            )
            return SandboxResult("sandbox_error", status, "", detail, seconds, None)
        outcome = stopped or _outcome(status, stderr, cgroup)
        return SandboxResult(outcome, status, stdout, stderr, seconds, isolation)  # type: ignore[arg-type]


def _parse_status(text: str) -> dict[str, object]:
    try:
        report = json.loads(text.splitlines()[0]) if text else {}
    except (ValueError, IndexError):
        return {}
    return report if isinstance(report, dict) else {}


def _isolation(applied: dict[str, object], cgroup: sandbox_cgroup.CallCgroup | None) -> Isolation:
    def flag(name: str) -> bool:
        return applied.get(name) is True

    abi = applied.get("landlock_abi")
    return Isolation(
        namespaces=flag("namespaces"),
        landlock_abi=abi if isinstance(abi, int) else 0,
        capabilities_dropped=flag("capabilities_dropped"),
        mode="strict" if applied.get("mode") == "strict" else "weak",
        private_root=flag("private_root"),
        seccomp=flag("seccomp"),
        landlock_scoped=flag("landlock_scoped"),
        cgroup=cgroup.version if cgroup is not None else 0,
    )


def _outcome(status: int | None, stderr: str, cgroup: sandbox_cgroup.CallCgroup | None) -> Outcome:
    """Why a call that was not stopped ended. A signal shows as ``-signal`` (the launcher exec'd the
    code) or ``128 + signal`` (the code ran in a PID namespace under a launcher that reports so)."""
    signalled = (
        -status if status is not None and status < 0 else (status - 128 if status and status > 128 else None)
    )
    if cgroup is not None and cgroup.oom_killed():
        return "memory_limit"
    if signalled == signal.SIGXFSZ or signalled == signal.SIGPIPE:
        return "output_limit"
    if signalled == signal.SIGXCPU:
        return "cpu_limit"
    if signalled is not None:
        return "killed"
    if status == 0:
        return "ok"
    if "MemoryError" in stderr:
        return "memory_limit"
    return "error"


def _end(process: subprocess.Popen[bytes], cgroup: sandbox_cgroup.CallCgroup | None) -> None:
    """Whatever state the call is in: every process of it killed, the launcher reaped."""
    if cgroup is not None:
        cgroup.kill()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    try:
        process.wait(timeout=REAP_SECONDS)
    except subprocess.TimeoutExpired:
        process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=REAP_SECONDS)


def _remove_tree(root: Path) -> None:
    """Remove ``root`` whatever the code left there (any depth, any file type, odd modes), without
    following a link and without recursion; best effort, never raises."""
    stack, seen = [str(root)], set()
    while stack:
        directory = stack[-1]
        if directory not in seen:
            seen.add(directory)
            with contextlib.suppress(OSError):
                os.chmod(directory, 0o700)
            try:
                entries = list(os.scandir(directory))
            except OSError:
                entries = []
            for entry in entries:
                with contextlib.suppress(OSError):
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
                    else:
                        os.unlink(entry.path)
            continue
        stack.pop()
        with contextlib.suppress(OSError):
            os.rmdir(directory)


@cache
def probe(mode: IsolationMode = "strict") -> tuple[Isolation | None, str]:
    """What confinement this machine gives a call in ``mode``, or why it cannot (one trial run)."""
    result = run_python("pass", SandboxLimits(isolation=mode))
    why = result.refused or (result.stderr.strip() if result.isolation is None else "")
    return result.isolation, why


def isolation(mode: IsolationMode = "strict") -> Isolation | None:
    """What confinement this machine gives a call in ``mode`` (``None``: it cannot run here)."""
    return probe(mode)[0]
