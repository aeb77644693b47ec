"""A process on which Landlock is denied, as on a node whose kernel or seccomp profile refuses it.

``python tests/landlock_denied.py <require: yes|no|auto|strict>`` installs a seccomp filter that answers
``landlock_create_ruleset`` (syscall 444 on every architecture, ``uapi/asm-generic/unistd.h``) with
ENOSYS, what a kernel without Landlock answers, then runs one sandbox call whose code prints the
environment of the process that called the sandbox (``/proc/<that pid>/environ``) in weak isolation
without namespaces (``yes|no|auto``: whether Landlock is required) or in strict isolation, and prints the
call's outcome and output as JSON. Run as root, it first drops every capability. The filter is inherited by the launcher and the code, so the
sandbox meets a machine without Landlock for real; nothing in the product is replaced.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys

LANDLOCK_CREATE_RULESET = 444
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
ENOSYS = 38


class _SockFilter(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_ushort),
        ("jt", ctypes.c_ubyte),
        ("jf", ctypes.c_ubyte),
        ("k", ctypes.c_uint32),
    ]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def deny_landlock() -> None:
    """Make every Landlock ruleset creation of this process and its children fail with ENOSYS."""
    program = (_SockFilter * 4)(
        _SockFilter(0x20, 0, 0, 0),  # BPF_LD | BPF_W | BPF_ABS: seccomp_data.nr
        _SockFilter(0x15, 0, 1, LANDLOCK_CREATE_RULESET),  # BPF_JMP | BPF_JEQ | BPF_K
        _SockFilter(0x06, 0, 0, 0x00050000 | ENOSYS),  # BPF_RET: SECCOMP_RET_ERRNO | ENOSYS
        _SockFilter(0x06, 0, 0, 0x7FFF0000),  # BPF_RET: SECCOMP_RET_ALLOW
    )
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(_SockFprog(4, program)), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")


READ_CALLER_ENVIRONMENT = "import os\nprint(open(f'/proc/{os.getppid()}/environ').read())"


PR_CAPBSET_DROP, PR_SET_SECUREBITS = 24, 28
SECBIT_NOROOT, SECBIT_NOROOT_LOCKED = 1 << 0, 1 << 1


def without_capabilities() -> None:
    """Run this script again as a process with no capabilities, when it runs as root with them.

    A job's pod runs its caller and the sandboxed code as one uid without capabilities; root with
    capabilities would keep code (whose capability bounding set the launcher empties) out of its
    ``/proc/<pid>/environ`` anyway. ``SECBIT_NOROOT`` makes ``execve`` grant root nothing, and the
    bounding set is emptied: the re-executed script holds no capability, as the pod's processes.
    """
    if os.geteuid() != 0 or os.environ.get("LANDLOCK_DENIED_REEXEC"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_SECUREBITS, SECBIT_NOROOT | SECBIT_NOROOT_LOCKED, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECUREBITS)")
    for capability in range(64):
        libc.prctl(PR_CAPBSET_DROP, capability, 0, 0, 0)  # EINVAL past the last one
    os.environ["LANDLOCK_DENIED_REEXEC"] = "1"
    os.execv(sys.executable, [sys.executable, *sys.argv])


def main(require: str) -> int:
    without_capabilities()
    deny_landlock()
    from hybridflow.agents.sandbox import SandboxLimits, run_python

    if require == "strict":  # strict isolation needs Landlock whoever calls
        result = run_python(READ_CALLER_ENVIRONMENT, SandboxLimits(isolation="strict"))
    else:
        required = {"yes": True, "no": False, "auto": None}[require]
        weak = SandboxLimits(isolation="weak")
        result = run_python(READ_CALLER_ENVIRONMENT, weak, namespaces=False, require_landlock=required)
    landlock = result.isolation.landlock_abi if result.isolation is not None else None
    print(
        json.dumps(
            {
                "outcome": result.outcome,
                "stdout": result.stdout,
                "stderr": result.stderr,
                "landlock": landlock,
            }
        )
    )
    return 0


if __name__ == "__main__":
    os.environ.pop("PYTHONSAFEPATH", None)
    raise SystemExit(main(sys.argv[1]))
