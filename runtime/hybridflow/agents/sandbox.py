"""Run untrusted Python (a model's tool call) in a confined process, and say what became of it.

Each call gets a process of its own and a fresh working directory, removed afterwards. The
process is confined before the model's code runs, in this order, by a small launcher
(:data:`_LAUNCHER`, run with ``python -I -S``) that then ``exec``s the interpreter on the code,
so nothing of the launcher stays in the code's process:

1. **Namespaces, where the kernel lets an unprivileged process make them** (``unshare`` of a
   user, network and PID namespace): no network at all (the new network namespace has only a
   loopback that is down), and the code's processes live in a PID namespace whose init is the
   launcher's child, so that when it ends every process the code started ends with it. Inside a
   pod with the default seccomp profile ``unshare`` is refused; the launcher then goes on
   without, and :func:`isolation` reports it (the job's NetworkPolicy denies egress there).
2. **rlimits**: CPU seconds, address space, process count (counted in the new user namespace;
   without one, over the user's processes on the host, so the limit is what runs now plus the
   allowance), file size, open files, no core dumps. A launcher that runs as root outside a user
   namespace empties its capability bounding set, so that the code cannot raise its limits.
3. **Landlock** (Linux >= 5.13, unprivileged): the code may read and write beneath its
   working directory, only read the interpreter's installation and the system's shared
   libraries, and (Landlock ABI >= 4) neither bind nor connect TCP sockets. Nothing else of the
   file system is visible: the job's files, credentials, other calls' directories.
4. A wall-clock limit enforced from outside: the launcher's process group is killed.

Where the caller holds credentials (the Ray token, a pod's service account: :func:`landlock_required`)
a machine that cannot apply Landlock gets no call at all: the launcher stops before the code
runs, and the call ends as a ``sandbox_error`` saying why. Without Landlock, code of the same uid
reads its caller's environment through ``/proc/<ppid>/environ``.

Output goes to files in the working directory, capped by the file-size limit, and the first
:attr:`SandboxLimits.output_bytes` come back. Every way the code can end (an exception, a
limit, a signal, the wall clock) is a :class:`SandboxResult`, never an exception here: the
agent loop turns it into the tool's answer to the model.

The launcher applies what the machine allows and writes what it applied to a status file;
:func:`isolation` runs it once to report the machine's guarantees (``docs/agents.md`` lists
them).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Literal

__all__ = ["Isolation", "SandboxLimits", "SandboxResult", "isolation", "run_python"]

Outcome = Literal[
    "ok", "error", "timeout", "cpu_limit", "memory_limit", "output_limit", "killed", "sandbox_error"
]


@dataclass(frozen=True)
class SandboxLimits:
    """What one call may use (``spec.agent.sandbox`` sets them)."""

    wall_seconds: float = 10.0
    cpu_seconds: int = 5
    memory_bytes: int = 512 * 2**20
    processes: int = 16
    file_bytes: int = 16 * 2**20
    open_files: int = 64
    output_bytes: int = 16 * 2**10


@dataclass(frozen=True)
class Isolation:
    """The confinement the launcher applied (what this machine allows)."""

    namespaces: bool
    """User, network and PID namespaces: no network at all, and the call's processes end with it."""
    landlock_abi: int
    """0: no Landlock (the file system is not confined); >= 4: TCP bind/connect denied too."""
    capabilities_dropped: bool
    """Root without namespaces: the code runs as root with no capabilities (cannot raise its limits)."""


@dataclass(frozen=True)
class SandboxResult:
    outcome: Outcome
    exit_code: int | None
    stdout: str
    stderr: str
    seconds: float
    isolation: Isolation | None

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


# The launcher: runs as `python -I -S -c _LAUNCHER <config.json>` with the working directory as
# its cwd. Written for the standard library only, and to fail closed: a step the machine
# refuses is recorded as not applied, never retried in a weaker form than reported.
_LAUNCHER = r"""
import ctypes, json, os, resource, sys
config = json.load(open(sys.argv[1]))
work = config["work"]
LANDLOCK_REFUSAL = config["landlock_refusal"]
applied = {"namespaces": False, "landlock_abi": 0, "capabilities_dropped": False}
libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWUSER, CLONE_NEWNET, CLONE_NEWPID = 0x10000000, 0x40000000, 0x20000000

def write(path, text):
    with open(path, "w") as f:
        f.write(text)

uid, gid = os.getuid(), os.getgid()
if config["namespaces"] and libc.unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWPID) == 0:
    write("/proc/self/setgroups", "deny")
    write("/proc/self/uid_map", f"0 {uid} 1")
    write("/proc/self/gid_map", f"0 {gid} 1")
    applied["namespaces"] = True
    processes = config["processes"]  # counted in the new user namespace alone
else:
    # Counted per user over the whole host (threads included): allow what runs now plus the limit.
    running = 0
    for pid in os.listdir("/proc"):
        try:
            status = open(f"/proc/{pid}/status").read()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if fields.get("Uid", "").split()[:1] == [str(uid)]:
            running += int(fields.get("Threads", "1").strip() or 1)
    processes = running + config["processes"]

def limit(kind, value):
    resource.setrlimit(kind, (value, value))

limit(resource.RLIMIT_CORE, 0)
resource.setrlimit(resource.RLIMIT_CPU, (config["cpu_seconds"], config["cpu_seconds"] + 1))
limit(resource.RLIMIT_AS, config["memory_bytes"])
limit(resource.RLIMIT_FSIZE, config["file_bytes"])
limit(resource.RLIMIT_NOFILE, config["open_files"])
limit(resource.RLIMIT_NPROC, processes)

# Landlock (uapi/linux/landlock.h): the same syscall numbers on every architecture.
CREATE, ADD_RULE, RESTRICT = 444, 445, 446
abi = libc.syscall(CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
if abi >= 1:
    fs_bits = {1: 13, 2: 14, 3: 15}.get(abi, 16)
    handled_fs = (1 << fs_bits) - 1
    handled_net = 3 if abi >= 4 else 0
    READ = (1 << 0) | (1 << 2) | (1 << 3)  # execute, read file, read dir
    class RulesetAttr(ctypes.Structure):
        _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64)]
    class PathBeneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed", ctypes.c_uint64), ("fd", ctypes.c_int32)]
    attr = RulesetAttr(handled_fs, handled_net)
    size = ctypes.sizeof(attr) if abi >= 4 else 8
    ruleset = libc.syscall(CREATE, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset")
    def allow(path, access):
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            return
        if not os.path.isdir(path):  # a file takes file rights only (else EINVAL)
            access &= (1 << 0) | (1 << 1) | (1 << 2) | (1 << 14) | (1 << 15)
        rule = PathBeneath(access & handled_fs, fd)
        if libc.syscall(ADD_RULE, ruleset, 1, ctypes.byref(rule), 0) != 0:
            raise OSError(ctypes.get_errno(), f"landlock_add_rule {path}")
        os.close(fd)
    for path in config["read_only"]:
        allow(path, READ)
    for path in ("/dev/null", "/dev/urandom", "/dev/zero"):
        allow(path, READ | (1 << 1))
    allow(work, handled_fs)
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    if libc.syscall(RESTRICT, ruleset, 0) != 0:
        raise OSError(ctypes.get_errno(), "landlock_restrict_self")
    applied["landlock_abi"] = abi
if config["require_landlock"] and not applied["landlock_abi"]:
    sys.stderr.write(LANDLOCK_REFUSAL)
    sys.exit(2)
if not applied["namespaces"] and os.geteuid() == 0:
    # Root outside a user namespace: empty the capability bounding set, so that the code's
    # interpreter gets no capabilities at exec (it could otherwise raise its own limits).
    for capability in range(64):
        libc.prctl(24, capability, 0, 0, 0)  # PR_CAPBSET_DROP; EINVAL past the last one
    applied["capabilities_dropped"] = True
write(os.path.join(work, ".sandbox.json"), json.dumps(applied))
argv = [config["python"], "-I", "-S", os.path.join(work, "main.py")]
out = os.open(os.path.join(work, ".stdout"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
err = os.open(os.path.join(work, ".stderr"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
if applied["namespaces"]:
    # The next child is init of the new PID namespace: it runs the code in a grandchild and
    # ends when that ends; the kernel then kills whatever else the code left running.
    init = os.fork()
    if init == 0:
        code = os.fork()
        if code == 0:
            os.dup2(out, 1)
            os.dup2(err, 2)
            os.execv(argv[0], argv)
        _, status = os.waitpid(code, 0)
        os._exit(os.waitstatus_to_exitcode(status) % 256 if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))
    _, status = os.waitpid(init, 0)
    code = os.waitstatus_to_exitcode(status)
    os._exit(code if code >= 0 else 128 - code)
os.dup2(out, 1)
os.dup2(err, 2)
os.execv(argv[0], argv)
"""


def _read_only_paths() -> list[str]:
    """What the interpreter needs to start: its installation and the shared libraries."""
    paths = {
        sys.base_prefix,
        sysconfig.get_paths()["stdlib"],
        sysconfig.get_paths()["platstdlib"],
        str(Path(sys.executable).resolve().parent),
        "/usr/lib",
        "/usr/lib64",
        "/lib",
        "/lib64",
        "/etc/ld.so.cache",
        "/usr/local/lib",
    }
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
LANDLOCK_REFUSAL = (
    "the sandbox refuses to run code here: Landlock is not available (Linux < 5.13, Landlock not "
    "among the kernel's LSMs, or a seccomp profile that denies it), and without it the code could "
    "read what its caller can, the Ray token in /proc/<pid>/environ included"
)


def landlock_required(env: Mapping[str, str]) -> bool:
    """Whether a call must be refused where Landlock cannot confine it: when its caller holds
    credentials (:data:`CREDENTIAL_ENV`). On a laptop without them, code still runs unconfined
    by the file system, and :func:`isolation` says so."""
    return any(env.get(name) for name in CREDENTIAL_ENV)


def run_python(
    code: str,
    limits: SandboxLimits | None = None,
    *,
    namespaces: bool = True,
    require_landlock: bool | None = None,
) -> SandboxResult:
    """Run ``code`` as ``python -I -S main.py`` in a fresh confined directory (see the module docstring).

    ``require_landlock`` (default: :func:`landlock_required` of this process's environment) refuses
    the call, as a ``sandbox_error`` naming why, where Landlock cannot be applied."""
    limits = limits or SandboxLimits()
    if require_landlock is None:
        require_landlock = landlock_required(os.environ)
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="hybridflow-sandbox-"))
    try:
        (work / "main.py").write_text(code)
        config_path = work / ".config.json"
        config_path.write_text(
            json.dumps(
                {
                    "work": str(work),
                    "python": _python(),
                    "read_only": _read_only_paths(),
                    "namespaces": namespaces,
                    "require_landlock": require_landlock,
                    "landlock_refusal": LANDLOCK_REFUSAL,
                    "cpu_seconds": limits.cpu_seconds,
                    "memory_bytes": limits.memory_bytes,
                    "file_bytes": limits.file_bytes,
                    "open_files": limits.open_files,
                    "processes": limits.processes,
                }
            )
        )
        for path in (work / "main.py", config_path):
            path.chmod(0o644)
        process = subprocess.Popen(
            [_python(), "-I", "-S", "-c", _LAUNCHER, str(config_path)],
            cwd=work,
            env={"PATH": "/usr/bin:/bin", "HOME": str(work), "TMPDIR": str(work), "LANG": "C.UTF-8"},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        timed_out = False
        try:
            _, launcher_error = process.communicate(timeout=limits.wall_seconds)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(process.pid)
            _, launcher_error = process.communicate()
        status = process.returncode
        applied = _applied(work)
        stdout, stdout_full = _read(work / ".stdout", limits.output_bytes)
        stderr, _ = _read(work / ".stderr", limits.output_bytes)
        if applied is None:  # the launcher failed before the code ran
            stderr = launcher_error.decode(errors="replace")[-limits.output_bytes :]
        outcome = _outcome(status, timed_out, applied is None, stderr, limits, stdout_full)
        return SandboxResult(outcome, status, stdout, stderr, time.monotonic() - started, applied)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # already gone
        os.killpg(pid, signal.SIGKILL)


def _applied(work: Path) -> Isolation | None:
    try:
        data = json.loads((work / ".sandbox.json").read_text())
    except (OSError, ValueError):
        return None
    return Isolation(bool(data["namespaces"]), int(data["landlock_abi"]), bool(data["capabilities_dropped"]))


def _read(path: Path, limit: int) -> tuple[str, int]:
    """The first ``limit`` bytes of ``path`` as text, and the file's full size."""
    try:
        with path.open("rb") as handle:
            data = handle.read(limit)
            size = path.stat().st_size
    except OSError:
        return "", 0
    return data.decode(errors="replace"), size


def _outcome(
    status: int | None,
    timed_out: bool,
    launcher_failed: bool,
    stderr: str,
    limits: SandboxLimits,
    written: int,
) -> Outcome:
    """Why the call ended. A signal shows as ``-signal`` (the launcher exec'd the code) or ``128 + signal``
    (the code ran in a PID namespace under the launcher, which reports its status so)."""
    if timed_out:
        return "timeout"
    if launcher_failed:
        return "sandbox_error"
    signalled = None
    if status is not None and status < 0:
        signalled = -status
    elif status is not None and status > 128:
        signalled = status - 128
    if signalled == signal.SIGXFSZ or written >= limits.file_bytes:
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


@cache
def isolation() -> Isolation | None:
    """What confinement this machine gives a call (one trial run; ``None``: the sandbox cannot run here)."""
    return run_python("pass").isolation
