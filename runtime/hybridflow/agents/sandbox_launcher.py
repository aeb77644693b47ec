"""The sandbox's launcher: it confines itself, then becomes the model's code. Standard library only.

Run by ``hybridflow.agents.sandbox.run_python`` as ``python -I -S sandbox_launcher.py``, the same
uid as its caller, in the call's cgroup (the caller puts it there before it writes the
configuration). Nothing of the caller's is imported: a module of the job's would run in the
process the code becomes.

Protocol with the caller:

* stdin: one JSON object, then EOF (:data:`CONFIG_KEYS`); the code itself travels in it, so no
  file the caller wrote can be swapped before the launcher reads it;
* ``status_fd``: one JSON line before the code runs, ``{"applied": {...}}`` (what confines it) or
  ``{"refused": "<what is missing>"}`` (then the launcher exits with :data:`EXIT_REFUSED`); the
  descriptor is closed before the code starts;
* ``stdout_fd``, ``stderr_fd``: the caller's pipes, the code's 1 and 2;
* the exit status: the code's, or ``128 + signal`` when it died of one inside its PID namespace.

Strict mode (what ``spec.agent.sandbox.isolation: strict`` means), in this order:

1. namespaces: mount, PID, network, IPC and UTS, and a user namespace unless the caller is root
   (root makes them as root, then runs the code as an unprivileged uid that owns nothing on the
   host, :data:`ROOT_CALLER_UID_BASE` plus a per-call offset); a caller that is not root maps its
   own uid to 1000 inside, where the code runs without capabilities;
2. a new root: a small tmpfs with the interpreter's installation, the system libraries and the
   loader cache bound read-only (the installation's ``site-packages`` hidden under an empty
   read-only tmpfs: only the standard library is importable), ``/dev/null``, ``/dev/zero`` and
   ``/dev/urandom``, and ``/work`` (also ``/tmp``): a tmpfs of ``disk_bytes``, the only writable
   place. No ``/proc``, no host socket, no other file of the host exists there;
3. the code runs as PID 2 under a PID 1 that ends with it, so every process it starts ends with
   the call; rlimits (address space, CPU seconds, file size, open files, processes), Landlock
   (read-only and read-write paths; from ABI 4 no TCP; from ABI 6 no signal or abstract UNIX
   socket outside its own domain) and a seccomp filter (:func:`seccomp_program`: no socket family
   but UNIX, no keyrings, ptrace, bpf, perf events, io_uring, userfaultfd, namespace or mount
   calls, module loading), then ``exec``.

Weak mode (``isolation: weak``, an explicit opt-in): the earlier confinement, whatever the
machine allows of it: user, network and PID namespaces when ``unshare`` is permitted, rlimits,
Landlock when the kernel has it (refused where the caller holds credentials and it has not),
and as root an emptied capability bounding set; the code runs in the caller's work directory on
the host file system.
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import resource
import struct
import sys
from collections.abc import Callable

EXIT_REFUSED = 125
CONFIG_KEYS = (
    "code",
    "python",
    "mode",
    "namespaces",
    "require_landlock",
    "read_only",
    "hidden",
    "work",
    "cpu_seconds",
    "memory_bytes",
    "file_bytes",
    "disk_bytes",
    "open_files",
    "processes",
    "status_fd",
    "stdout_fd",
    "stderr_fd",
)
ROOT_CALLER_UID_BASE = 2_000_000_000
"""Where a root caller's code runs, plus an offset per call: a uid no file or process of the host
has, so nothing it could reach is its own (and RLIMIT_NPROC counts its call's processes alone)."""
INSIDE_UID = 1000

CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC = 0x20000, 0x02000000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
CLONE_NAMESPACES = (
    CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET
)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, PR_CAPBSET_DROP, SECCOMP_MODE_FILTER = 38, 22, 24, 2

libc = ctypes.CDLL(None, use_errno=True)


class Refused(Exception):
    """Strict mode cannot be given here: the message names what is missing."""


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount(source: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(
        libc.mount(
            source.encode(),
            target.encode(),
            fstype.encode() if fstype else None,
            ctypes.c_ulong(flags),
            data.encode() if data else None,
        ),
        f"mount {target}",
    )


def _write(path: str, text: str) -> None:
    with open(path, "w") as handle:
        handle.write(text)


# --------------------------------------------------------------------------- the new root


def _mount_point(root: str, path: str, directory: bool) -> str:
    target = root + path
    if directory:
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if not os.path.exists(target):
            open(target, "w").close()
    return target


MS_NOEXEC, MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 8, 1024, 2048, 1 << 21
_KEPT_FLAGS = (
    (os.ST_NOEXEC, MS_NOEXEC),
    (os.ST_NOATIME, MS_NOATIME),
    (os.ST_NODIRATIME, MS_NODIRATIME),
    (os.ST_RELATIME, MS_RELATIME),
)


def _bind_read_only(root: str, path: str) -> None:
    """A read-only bind of the host's ``path``. A remount must keep the flags of the mount it comes
    from (in a user namespace they are locked, and dropping one is EPERM): they are read first."""
    target = _mount_point(root, path, os.path.isdir(path))
    _mount(path, target, None, MS_BIND | MS_REC)
    kept = os.statvfs(target).f_flag
    flags = MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV
    flags |= sum(mount_flag for stat_flag, mount_flag in _KEPT_FLAGS if kept & stat_flag)
    _mount(path, target, None, flags)


def build_root(config: dict, root: str, owner: tuple[int, int]) -> None:
    """Step 2 of the module docstring, at ``root`` (an empty directory on the host)."""
    _mount("none", "/", None, MS_REC | MS_PRIVATE)
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=4m,mode=0755")
    for path in config["read_only"]:
        if os.path.exists(path):
            _bind_read_only(root, path)
    for path in config["hidden"]:
        if os.path.isdir(root + path):
            _mount("tmpfs", root + path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k,mode=0555")
    for device in ("/dev/null", "/dev/zero", "/dev/urandom"):
        _mount(device, _mount_point(root, device, False), None, MS_BIND | MS_NOSUID)
    work = _mount_point(root, "/work", True)
    uid, gid = owner
    _mount(
        "tmpfs",
        work,
        "tmpfs",
        MS_NOSUID | MS_NODEV,
        f"size={config['disk_bytes']},mode=0700,uid={uid},gid={gid}",
    )
    _mount(work, _mount_point(root, "/tmp", True), None, MS_BIND | MS_NOSUID | MS_NODEV)
    with open(work + "/main.py", "w") as handle:
        handle.write(config["code"])
    os.chown(work + "/main.py", uid, gid)


def _map_own_ids(uid: int, gid: int) -> None:
    """In a user namespace just made: the caller's own uid and gid (read before) as 1000."""
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"{INSIDE_UID} {uid} 1")
    _write("/proc/self/gid_map", f"{INSIDE_UID} {gid} 1")


def enter_strict_namespaces(config: dict) -> tuple[tuple[int, int], bool]:
    """Steps 1 and 2: the namespaces and the new root; the uid and gid the code will run as, and
    whether the launcher is privileged on the host (root with its capabilities: no user namespace
    then, and the code runs as an unowned uid) or not (a user namespace maps its own uid)."""
    uid, gid = os.getuid(), os.getgid()
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
    privileged = libc.unshare(flags) == 0
    if not privileged and libc.unshare(flags | CLONE_NEWUSER) != 0:
        errno = ctypes.get_errno()
        raise Refused(
            f"mount, PID, network and IPC namespaces in a user namespace: unshare refused ({os.strerror(errno)})"
        )
    if privileged:
        owner = (ROOT_CALLER_UID_BASE + random.randrange(1_000_000),) * 2
    else:
        _map_own_ids(uid, gid)
        owner = (INSIDE_UID, INSIDE_UID)
    try:
        build_root(config, config["work"], owner)
    except OSError as error:
        raise Refused(f"a private root file system: {error}") from None
    libc.sethostname(b"sandbox", 7)
    return owner, privileged


# --------------------------------------------------------------------------- confinement of the code


def set_limits(config: dict, processes: int) -> None:
    def limit(kind: int, value: int) -> None:
        resource.setrlimit(kind, (value, value))

    limit(resource.RLIMIT_CORE, 0)
    resource.setrlimit(resource.RLIMIT_CPU, (config["cpu_seconds"], config["cpu_seconds"] + 1))
    limit(resource.RLIMIT_AS, config["memory_bytes"])
    limit(resource.RLIMIT_FSIZE, config["file_bytes"])
    limit(resource.RLIMIT_NOFILE, config["open_files"])
    limit(resource.RLIMIT_NPROC, processes)


def landlock(read_only: list[str], writable: list[str]) -> dict:
    """Landlock (uapi/linux/landlock.h; the same syscall numbers on every architecture): what it
    applied, ``{"abi": 0}`` when the kernel has none."""
    create, add_rule, restrict = 444, 445, 446
    abi = libc.syscall(create, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    if abi < 1:
        return {"abi": 0, "scoped": False}
    handled_fs = (1 << {1: 13, 2: 14, 3: 15}.get(abi, 16)) - 1
    handled_net = 3 if abi >= 4 else 0  # bind and connect TCP
    scoped = 3 if abi >= 6 else 0  # abstract UNIX sockets and signals
    read = (1 << 0) | (1 << 2) | (1 << 3)  # execute, read file, read dir
    attr = struct.pack("=QQQ", handled_fs, handled_net, scoped)
    size = 24 if abi >= 6 else (16 if abi >= 4 else 8)
    ruleset = libc.syscall(create, ctypes.c_char_p(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset")
    for paths, access in ((read_only, read), (writable, handled_fs)):
        for path in paths:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue
            allowed = access & handled_fs
            if not os.path.isdir(path):  # a file takes file rights only (else EINVAL)
                allowed &= (1 << 0) | (1 << 1) | (1 << 2) | (1 << 14) | (1 << 15)
            rule = struct.pack("=Qi", allowed, fd)
            _check(libc.syscall(add_rule, ruleset, 1, ctypes.c_char_p(rule), 0), f"landlock_add_rule {path}")
            os.close(fd)
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    _check(libc.syscall(restrict, ruleset, 0), "landlock_restrict_self")
    return {"abi": abi, "scoped": bool(scoped)}


# x86_64 and aarch64 (the kernel's syscall tables); None: the call does not exist there.
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
SYSCALLS = {
    "socket": (41, 198),
    "clone": (56, 220),
    "clone3": (435, 435),
    "ptrace": (101, 117),
    "process_vm_readv": (310, 270),
    "process_vm_writev": (311, 271),
    "keyctl": (250, 219),
    "add_key": (248, 217),
    "request_key": (249, 218),
    "bpf": (321, 280),
    "perf_event_open": (298, 241),
    "userfaultfd": (323, 282),
    "io_uring_setup": (425, 425),
    "io_uring_enter": (426, 426),
    "io_uring_register": (427, 427),
    "unshare": (272, 97),
    "setns": (308, 268),
    "mount": (165, 40),
    "umount2": (166, 39),
    "pivot_root": (155, 41),
    "chroot": (161, 51),
    "open_tree": (428, 428),
    "move_mount": (429, 429),
    "fsopen": (430, 430),
    "fsconfig": (431, 431),
    "fsmount": (432, 432),
    "fspick": (433, 433),
    "mount_setattr": (442, 442),
    "kexec_load": (246, 104),
    "init_module": (175, 105),
    "finit_module": (313, 273),
    "delete_module": (176, 106),
}
EPERM, ENOSYS, EAFNOSUPPORT = 1, 38, 97
AF_UNIX = 1


def seccomp_program(machine: str) -> bytes | None:
    """The BPF filter of strict mode for ``machine`` (``os.uname().machine``), or None (unknown
    architecture): another architecture is killed, ``socket`` of any family but AF_UNIX fails with
    EAFNOSUPPORT, ``clone`` with a namespace flag and every call of :data:`SYSCALLS` but ``socket``,
    ``clone`` and ``clone3`` fail with EPERM, ``clone3`` with ENOSYS (glibc then uses ``clone``)."""
    if machine not in AUDIT_ARCH:
        return None
    index = list(AUDIT_ARCH).index(machine)
    numbers = {name: pair[index] for name, pair in SYSCALLS.items()}
    ld_w, jeq, jset, ret = 0x20, 0x15, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JSET|K, BPF_RET|K
    allow, kill = 0x7FFF0000, 0x80000000  # SECCOMP_RET_ALLOW, SECCOMP_RET_KILL_PROCESS

    def errno(value: int) -> int:
        return 0x00050000 | value  # SECCOMP_RET_ERRNO

    program: list[tuple[int, int, int, int]] = [
        (ld_w, 0, 0, 4),
        (jeq, 1, 0, AUDIT_ARCH[machine]),
        (ret, 0, 0, kill),
    ]
    program.append((ld_w, 0, 0, 0))  # seccomp_data.nr
    denied = [name for name in SYSCALLS if name not in ("socket", "clone", "clone3")]
    for name in denied:
        program += [(jeq, 0, 1, numbers[name]), (ret, 0, 0, errno(EPERM))]
    program += [(jeq, 0, 1, numbers["clone3"]), (ret, 0, 0, errno(ENOSYS))]
    # socket(domain, ...): args[0] at offset 16 (its low 32 bits, little-endian).
    program += [
        (jeq, 0, 4, numbers["socket"]),
        (ld_w, 0, 0, 16),
        (jeq, 1, 0, AF_UNIX),
        (ret, 0, 0, errno(EAFNOSUPPORT)),
        (ret, 0, 0, allow),
    ]
    program += [
        (jeq, 0, 3, numbers["clone"]),
        (ld_w, 0, 0, 16),
        (jset, 0, 1, CLONE_NAMESPACES),
        (ret, 0, 0, errno(EPERM)),
    ]
    program.append((ret, 0, 0, allow))
    return b"".join(struct.pack("=HBBI", *instruction) for instruction in program)


def install_seccomp(program: bytes) -> None:
    buffer = ctypes.create_string_buffer(program)
    fprog = struct.pack("@HP", len(program) // 8, ctypes.addressof(buffer))  # struct sock_fprog
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    _check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.c_char_p(fprog), 0, 0), "seccomp")


# --------------------------------------------------------------------------- running the code


def report(config: dict, body: dict) -> None:
    os.write(config["status_fd"], (json.dumps(body) + "\n").encode())
    os.close(config["status_fd"])


def exec_code(config: dict, cwd: str) -> None:
    os.dup2(config["stdout_fd"], 1)
    os.dup2(config["stderr_fd"], 2)
    os.closerange(3, 1 << 16)
    os.chdir(cwd)
    env = {"PATH": "/usr/bin:/bin", "HOME": cwd, "TMPDIR": cwd, "LANG": "C.UTF-8"}
    os.execve(config["python"], [config["python"], "-I", "-S", os.path.join(cwd, "main.py")], env)


def run_as_pid_one(child: Callable[[], None]) -> None:
    """This process is PID 1 of a new PID namespace: run ``child`` as PID 2 and end with it (the
    kernel then kills whatever else the code started), with its status as this exit status."""
    code = os.fork()
    if code == 0:
        try:
            child()
        except BaseException:  # a bug of the launcher's: the caller reads its stderr
            import traceback

            traceback.print_exc()
        os._exit(127)
    _, status = os.waitpid(code, 0)
    os._exit(os.waitstatus_to_exitcode(status) % 256 if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))


def strict(config: dict) -> None:
    program = seccomp_program(os.uname().machine)
    if program is None:
        raise Refused(f"a seccomp filter for {os.uname().machine} (only x86_64 and aarch64 have one)")
    owner, privileged = enter_strict_namespaces(config)
    read_only = [*config["read_only"], "/dev/null", "/dev/zero", "/dev/urandom"]

    def code() -> None:
        os.chroot(config["work"])
        os.chdir("/work")
        if privileged:
            os.setgroups([])
            os.setgid(owner[1])
            os.setuid(owner[0])  # root to an unowned uid: no capability is left
        set_limits(config, config["processes"])
        applied = landlock(read_only, ["/work", "/tmp", "/dev/null"])
        if not applied["abi"]:
            raise Refused("Landlock (Linux >= 5.13 with Landlock among its LSMs)")
        install_seccomp(program)
        report(
            config,
            {
                "applied": {
                    "mode": "strict",
                    "namespaces": True,
                    "private_root": True,
                    "seccomp": True,
                    "landlock_abi": applied["abi"],
                    "landlock_scoped": applied["scoped"],
                    "capabilities_dropped": True,
                }
            },
        )
        exec_code(config, "/work")

    _as_pid_one_and_wait(config, code)


def _as_pid_one_and_wait(config: dict, code: Callable[[], None]) -> None:
    """Fork PID 1 of the new PID namespace (it runs ``code`` as PID 2), keep none of the caller's
    descriptors (so the caller's reads end with the code), and exit as it does."""
    if os.fork() == 0:
        run_as_pid_one(lambda: _refusing(config, code))
    for fd in (config["status_fd"], config["stdout_fd"], config["stderr_fd"]):
        os.close(fd)
    _, status = os.wait()
    os._exit(os.waitstatus_to_exitcode(status) % 256 if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))


def _refusing(config: dict, step: Callable[[], None]) -> None:
    try:
        step()
    except Refused as refusal:
        report(config, {"refused": str(refusal)})
        os._exit(EXIT_REFUSED)
    except OSError as error:
        report(config, {"refused": f"the sandbox could not confine the code: {error}"})
        os._exit(EXIT_REFUSED)


def weak(config: dict) -> None:
    uid, gid = os.getuid(), os.getgid()
    applied = {
        "mode": "weak",
        "namespaces": False,
        "private_root": False,
        "seccomp": False,
        "landlock_abi": 0,
        "landlock_scoped": False,
        "capabilities_dropped": False,
    }
    if config["namespaces"] and libc.unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC) == 0:
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"0 {uid} 1")
        _write("/proc/self/gid_map", f"0 {gid} 1")
        applied["namespaces"] = True
        processes = config["processes"]  # counted in the new user namespace alone
    else:
        processes = _running(uid) + config["processes"]  # counted per user over the host
    with open(os.path.join(config["work"], "main.py"), "w") as handle:
        handle.write(config["code"])

    def code() -> None:
        set_limits(config, processes)
        landlocked = landlock(config["read_only"], [config["work"], "/dev/null"])
        if config["require_landlock"] and not landlocked["abi"]:
            raise Refused(
                "Landlock is not available (Linux < 5.13, Landlock not among the kernel's LSMs, or a "
                "seccomp profile that denies it), and without it the code could read what its caller "
                "can, the Ray token in /proc/<pid>/environ included"
            )
        applied.update(landlock_abi=landlocked["abi"], landlock_scoped=landlocked["scoped"])
        if not applied["namespaces"] and os.geteuid() == 0:
            for capability in range(64):  # root without a user namespace: no capability at exec
                libc.prctl(PR_CAPBSET_DROP, capability, 0, 0, 0)
            applied["capabilities_dropped"] = True
        report(config, {"applied": applied})
        exec_code(config, config["work"])

    if applied["namespaces"]:
        _as_pid_one_and_wait(config, code)
    _refusing(config, code)


def _running(uid: int) -> int:
    """Processes and threads of ``uid`` on the host now (RLIMIT_NPROC counts them all)."""
    count = 0
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/status") as handle:
                fields = dict(line.split(":", 1) for line in handle.read().splitlines() if ":" in line)
        except OSError:
            continue
        if fields.get("Uid", "").split()[:1] == [str(uid)]:
            count += int(fields.get("Threads", "1").strip() or 1)
    return count


def main() -> None:
    config = json.loads(sys.stdin.buffer.read(1 << 24))
    try:
        if config["mode"] == "strict":
            strict(config)
        else:
            weak(config)
    except Refused as refusal:
        report(config, {"refused": str(refusal)})
        os._exit(EXIT_REFUSED)


if __name__ == "__main__":
    main()
