"""Escape attempts against the Python tool's sandbox, and what containing each one means.

The unit tests (``tests/unit/test_sandbox.py``) and ``bench/agentic.py`` (its
``sandbox_escapes_tried`` / ``sandbox_escapes_contained``) run this one list, so the figures a
bench reports are the attempts the tests hold to. :func:`try_escapes` sets up what the attempts
aim at (a secret file, a file of the caller's, TCP, UDP and UNIX sockets listening on this host,
an abstract UNIX socket), runs each attempt through :func:`~hybridflow.agents.sandbox.run_python`
in one of the sandbox's modes (:data:`MODES`), and judges it. Each attempt says in which modes the
sandbox guarantees to contain it (``strict`` all of them; ``docs/agents.md`` lists what ``weak``
leaves open).

An attempt is contained when all of these hold:

* its result is what the attempt expects: an error the model can read, of the expected kind (a
  memory error for memory exhaustion, a CPU or wall-clock stop for a busy loop, a cut for endless
  output, a refusal by the file system), or, for an attempt on the caller rather than on the
  machine (a result file swapped for a link or a FIFO), any answer at all, in time;
* nothing it aimed at was reached: the secret's text is in no output, no file outside was written
  or changed, no listening socket accepted or received anything, no System V object it made is
  left, and the report of what confined it is the launcher's, not one the code forged;
* it returned within its wall-clock limit and a few seconds, no process of it is left (in a
  nested PID namespace, or running the sandbox's code, or from a sandbox's directory), and no
  directory of it either.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import sysconfig
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from hybridflow.agents.sandbox import REAP_SECONDS, SandboxLimits, SandboxResult, run_python

__all__ = [
    "ESCAPE_ATTEMPTS",
    "ESCAPE_LIMITS",
    "MODES",
    "EscapeAttempt",
    "EscapeReport",
    "sandbox_processes",
    "try_escapes",
]

Mode = Literal["strict", "weak", "weak-no-namespaces"]
MODES: dict[Mode, tuple[Literal["strict", "weak"], bool]] = {
    "strict": ("strict", True),
    "weak": ("weak", True),
    "weak-no-namespaces": ("weak", False),
}
"""Each mode as ``(spec.agent.sandbox.isolation, namespaces)``: weak without namespaces is a pod whose
seccomp profile refuses ``unshare``."""
ALL: tuple[Mode, ...] = ("strict", "weak", "weak-no-namespaces")
WITH_NAMESPACES: tuple[Mode, ...] = ("strict", "weak")
STRICT: tuple[Mode, ...] = ("strict",)

ESCAPE_LIMITS = SandboxLimits(
    wall_seconds=3.0,
    cpu_seconds=1,
    memory_bytes=256 * 2**20,
    processes=8,
    file_bytes=2**20,
    output_bytes=1000,
    disk_bytes=4 * 2**20,
)
"""The limits the tests and the bench run the attempts under: small, so that each stops in seconds."""
SHM_KEY = 0x48465358  # "HFSX": the System V key the IPC attempt leaves behind


@dataclass
class Targets:
    """What the attempts aim at, outside the sandbox, and what reached them."""

    secret_file: Path
    secret_text: str
    forbidden_file: Path
    owned_file: Path
    owned_mode: int
    tcp_port: int
    udp_port: int
    unix_path: Path
    abstract_name: str
    reached: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class EscapeAttempt:
    name: str
    code: Callable[[Targets], str]
    expected: tuple[str, ...]
    """The outcomes (``SandboxResult.outcome``) that count as stopped ("ok": the call may end well)."""
    file_system: bool = False
    """A file-system attempt: the file system's refusal must be what stopped it (not, say, a typo)."""
    modes: tuple[Mode, ...] = ALL
    """Where the sandbox guarantees to contain it."""
    cpu_seconds: int | None = None
    """The CPU limit it runs under where another limit is its subject: touching hundreds of MiB at
    the memory limit costs the kernel's reclaim CPU time, which may reach the tests' 1 s first."""


def _code(*lines: str) -> str:
    return "\n".join(lines)


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
        "endless error output",
        lambda t: "import sys\nwhile True:\n    sys.stderr.write('x' * 1000)",
        ("output_limit",),
    ),
    EscapeAttempt(
        "TCP to this host",
        lambda t: (
            f"import socket\nsocket.create_connection(('127.0.0.1', {t.tcp_port}), timeout=2)\nprint('connected')"
        ),
        ("error",),
    ),
    EscapeAttempt(
        "MPTCP to this host",
        lambda t: _code(
            "import socket",
            "s = socket.socket(socket.AF_INET, socket.SOCK_STREAM, 262)",
            "s.settimeout(2)",
            f"s.connect(('127.0.0.1', {t.tcp_port}))",
            "print('connected')",
        ),
        ("error",),
        modes=WITH_NAMESPACES,
    ),
    EscapeAttempt(
        "UDP to this host",
        lambda t: _code(
            "import socket",
            "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)",
            "for _ in range(20):",
            f"    s.sendto(b'escaped', ('127.0.0.1', {t.udp_port}))",
            "print('sent')",
        ),
        ("error",),
        modes=WITH_NAMESPACES,
    ),
    EscapeAttempt(
        "abstract UNIX socket of this host",
        lambda t: _code(
            "import socket",
            "s = socket.socket(socket.AF_UNIX)",
            f"s.connect('\\0{t.abstract_name}')",
            "print('connected')",
        ),
        ("error",),
    ),
    EscapeAttempt(
        "UNIX socket file of this host",
        lambda t: (
            f"import socket\nsocket.socket(socket.AF_UNIX).connect({str(t.unix_path)!r})\nprint('connected')"
        ),
        ("error",),
        modes=STRICT,
    ),
    EscapeAttempt(
        "read a file outside", lambda t: f"print(open({str(t.secret_file)!r}).read())", ("error",), True
    ),
    EscapeAttempt("read /etc/passwd", lambda t: "print(open('/etc/passwd').read())", ("error",), True),
    EscapeAttempt(
        "write a file outside", lambda t: f"open({str(t.forbidden_file)!r}, 'w').write('x')", ("error",), True
    ),
    EscapeAttempt("list /", lambda t: "import os\nprint(os.listdir('/'))", ("error",), True),
    EscapeAttempt(
        "chmod a file of the caller's",
        lambda t: f"import os\nos.chmod({str(t.owned_file)!r}, 0o777)\nprint('changed')",
        ("error",),
        True,
        modes=STRICT,
    ),
    EscapeAttempt(
        "chmod the interpreter",
        lambda t: "import os, sys\nos.chmod(sys.executable, 0o777)\nprint('changed')",
        ("error",),
        True,
        modes=STRICT,
    ),
    EscapeAttempt(
        "a result file swapped for a link to a secret",
        lambda t: _code(
            "import os",
            "for name in ('.stdout', '.stderr', '.sandbox.json', '.config.json'):",
            "    if os.path.lexists(name):",
            "        os.remove(name)",
            f"    os.symlink({str(t.secret_file)!r}, name)",
            "print('swapped')",
        ),
        ("ok",),
    ),
    EscapeAttempt(
        "a result file swapped for a FIFO",
        lambda t: _code(
            "import os",
            "for name in ('.stdout', '.stderr', '.sandbox.json'):",
            "    if os.path.lexists(name):",
            "        os.remove(name)",
            "    os.mkfifo(name)",
            "print('swapped')",
        ),
        ("ok",),
    ),
    EscapeAttempt(
        "a forged report of the confinement",
        lambda t: _code(
            "open('.sandbox.json', 'w').write('{\"namespaces\": true, \"landlock_abi\": 99}')",
            'print(\'{"applied": {"landlock_abi": 99}}\')',
        ),
        ("ok",),
    ),
    EscapeAttempt(
        "deeply nested directories left behind",
        lambda t: _code(
            "import os", "for _ in range(1500):", "    os.mkdir('d')", "    os.chdir('d')", "print('deep')"
        ),
        ("ok", "error", "cpu_limit", "timeout"),
    ),
    EscapeAttempt(
        "signal the caller",
        lambda t: "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nprint('sent')",
        ("ok", "error", "killed"),
    ),
    EscapeAttempt(
        "an orphan that outlives the call",
        lambda t: _code(
            "import os, sys",
            "if os.fork() == 0:",
            "    os.setsid()",
            "    if os.fork() == 0:",
            "        os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)'])",
            "    os._exit(0)",
            "print('left one behind')",
        ),
        ("ok",),
        modes=WITH_NAMESPACES,
    ),
    EscapeAttempt(
        "System V shared memory that outlives the call",
        lambda t: _code(
            "import ctypes",
            "libc = ctypes.CDLL(None, use_errno=True)",
            f"segment = libc.shmget({SHM_KEY}, 4096, 0o1000 | 0o666)",
            "print('made' if segment >= 0 else 'refused')",
        ),
        ("ok", "error"),
        modes=WITH_NAMESPACES,
    ),
    EscapeAttempt(
        "import a package of the caller's environment",
        lambda t: _code(
            "import sys",
            f"sys.path[:0] = {_package_dirs()!r}",
            "import yaml",
            "print('imported')",
        ),
        ("error",),
        modes=STRICT,
    ),
    EscapeAttempt(
        "memory across processes",
        lambda t: _code(
            "import os, time",
            "children = []",
            "for _ in range(4):",
            "    pid = os.fork()",
            "    if pid == 0:",
            "        x = bytearray(100 * 2**20)",
            "        time.sleep(1)",
            "        os._exit(0)",
            "    children.append(pid)",
            "for pid in children:",
            "    os.waitpid(pid, 0)",
            "print('400 MiB held together')",
        ),
        ("memory_limit",),
        modes=STRICT,
        cpu_seconds=30,
    ),
    EscapeAttempt(
        "CPU across processes",
        lambda t: _code(
            "import os, time",
            "children = []",
            "for _ in range(4):",
            "    pid = os.fork()",
            "    if pid == 0:",
            "        while time.process_time() < 0.8:",
            "            pass",
            "        os._exit(0)",
            "    children.append(pid)",
            "for pid in children:",
            "    os.waitpid(pid, 0)",
            "print('3.2 CPU-seconds used')",
        ),
        ("cpu_limit", "timeout"),
        modes=STRICT,
    ),
    EscapeAttempt(
        "disk across files",
        lambda t: _code(
            "for index in range(8):",
            "    open(f'part-{index}', 'wb').write(b'x' * 900 * 1024)",
            "print('7 MiB written')",
        ),
        ("error", "output_limit"),
        modes=STRICT,
    ),
)


def _package_dirs() -> list[str]:
    """Where the caller's environment keeps packages (its virtual environment, the installation's)."""
    paths = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    paths |= {str(p) for p in Path(os.__file__).parent.glob("site-packages")}
    return sorted(paths)


@dataclass(frozen=True)
class EscapeReport:
    name: str
    mode: Mode
    contained: bool
    outcome: str
    reason: str
    """Why it does not count as contained; empty when it does."""
    seconds: float


def sandbox_processes() -> list[int]:
    """Pids of processes a sandbox call may have left: in a nested PID namespace, running a
    sandbox's code, or from a sandbox's directory (``/proc``; no dependency)."""
    found = []
    own_cgroups = Path("/proc/self/cgroup").read_bytes()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            status = (entry / "status").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        nested = any(line.startswith("NSpid:") and len(line.split()) > 2 for line in status.splitlines())
        if nested and _container_engines_own(entry, own_cgroups):
            continue  # a podman/Docker container's process on the same host, not a sandbox's
        with contextlib.suppress(OSError):
            cmdline += os.readlink(entry / "cwd").encode()
        if nested or b"hybridflow-sandbox-" in cmdline or b"/work/main.py" in cmdline:
            found.append(int(entry.name))
    return found


CONTAINER_CGROUPS = (b"libpod", b"buildah", b"docker", b"containerd", b"crio")
"""Cgroup path parts of container engines' processes, which also run in nested PID namespaces."""


def _container_engines_own(entry: Path, own: bytes) -> bool:
    """Whether the process is another container's on this host (its cgroup names a container engine
    that this process's own cgroup does not: inside a pod, both name the pod's) rather than a sandbox's."""
    try:
        cgroups = (entry / "cgroup").read_bytes()
    except OSError:
        return False
    if b"hybridflow-sandbox" in cgroups:
        return False
    return any(part in cgroups and part not in own for part in CONTAINER_CGROUPS)


def _work_directories() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).glob("hybridflow-sandbox-*")}


def _remove_shm() -> None:
    """Remove a segment of :data:`SHM_KEY` a run before this one left (``shmctl(IPC_RMID)``)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    segment = libc.shmget(SHM_KEY, 0, 0)
    if segment >= 0:
        libc.shmctl(segment, 0, None)  # IPC_RMID


def _shm_left() -> bool:
    with contextlib.suppress(OSError):
        for line in Path("/proc/sysvipc/shm").read_text().splitlines()[1:]:
            if int(line.split()[0]) == SHM_KEY:
                return True
    return False


def _judge(attempt: EscapeAttempt, result: SandboxResult, targets: Targets, limits: SandboxLimits) -> str:
    if "ok" not in attempt.expected and not result.as_tool_text().startswith("error:"):
        return f"the call ended {result.outcome!r}, not as an error for the model"
    if result.outcome not in attempt.expected:
        return f"stopped as {result.outcome!r}, expected one of {', '.join(attempt.expected)}: {result.stderr[-200:]}"
    refusals = ("PermissionError", "FileNotFoundError", "Read-only file system")
    if attempt.file_system and not any(word in result.stderr for word in refusals):
        return "not refused by the file system: " + result.stderr.strip()[-120:]
    if targets.secret_text in result.stdout + result.stderr:
        return "the secret file's text is in its output"
    if targets.forbidden_file.exists():
        return f"{targets.forbidden_file} was written"
    if targets.owned_file.stat().st_mode & 0o777 != targets.owned_mode:
        return f"{targets.owned_file}'s mode was changed"
    if targets.reached:
        return f"reached: {', '.join(targets.reached)}"
    if _shm_left():
        return "a System V shared memory segment it made is left"
    if result.isolation is not None and result.isolation.landlock_abi == 99:
        return "the report of its confinement is the one it forged"
    if result.seconds > limits.wall_seconds + 2 * REAP_SECONDS:
        return f"the caller waited {result.seconds:.1f} s for it"
    deadline = time.monotonic() + 5
    while sandbox_processes() and time.monotonic() < deadline:
        time.sleep(0.1)
    if sandbox_processes():
        return f"processes left behind: {sandbox_processes()}"
    return ""


@contextlib.contextmanager
def _targets() -> Iterator[Targets]:
    with tempfile.TemporaryDirectory(prefix="hybridflow-escape-targets-") as outside:
        directory = Path(outside)
        reached: list[str] = []
        tcp = socket.create_server(("127.0.0.1", 0))
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        udp.bind(("127.0.0.1", 0))
        unix = socket.socket(socket.AF_UNIX)
        unix.bind(str(directory / "caller.sock"))
        unix.listen()
        abstract_name = f"hybridflow-escape-{uuid.uuid4().hex}"
        abstract = socket.socket(socket.AF_UNIX)
        abstract.bind("\0" + abstract_name)
        abstract.listen()

        def listen(server: socket.socket, what: str, datagram: bool = False) -> None:
            with contextlib.suppress(OSError):  # closed at the end
                server.recv(64) if datagram else server.accept()
                reached.append(what)

        for server, what, datagram in (
            (tcp, "the TCP socket", False),
            (udp, "the UDP socket", True),
            (unix, "the UNIX socket file", False),
            (abstract, "the abstract UNIX socket", False),
        ):
            threading.Thread(target=listen, args=(server, what, datagram), daemon=True).start()
        secret = directory / "secret.txt"
        secret.write_text("escape-token-7f3a")
        owned = directory / "owned.txt"
        owned.write_text("the caller's")
        owned.chmod(0o600)
        try:
            yield Targets(
                secret,
                "escape-token-7f3a",
                directory / "written.txt",
                owned,
                0o600,
                tcp.getsockname()[1],
                udp.getsockname()[1],
                directory / "caller.sock",
                abstract_name,
                reached,
            )
        finally:
            for server in (tcp, udp, unix, abstract):
                server.close()


def try_escapes(
    limits: SandboxLimits,
    mode: Mode,
    attempts: tuple[EscapeAttempt, ...] = ESCAPE_ATTEMPTS,
) -> list[EscapeReport]:
    """Run each attempt that ``mode`` guarantees to contain once under ``limits`` and judge it
    (the module docstring says how)."""
    isolation, namespaces = MODES[mode]
    limits = dataclasses.replace(limits, isolation=isolation)
    reports = []
    for attempt in attempts:
        if mode not in attempt.modes:
            continue
        _remove_shm()
        before = _work_directories()
        attempt_limits = dataclasses.replace(limits, cpu_seconds=attempt.cpu_seconds or limits.cpu_seconds)
        with _targets() as targets:
            result = run_python(attempt.code(targets), attempt_limits, namespaces=namespaces)
            time.sleep(0.05)  # a datagram sent at the last moment is in
            reason = _judge(attempt, result, targets, attempt_limits)
        left = _work_directories() - before
        reason = reason or (f"left its directory behind: {sorted(left)}" if left else "")
        reports.append(EscapeReport(attempt.name, mode, not reason, result.outcome, reason, result.seconds))
    return reports
