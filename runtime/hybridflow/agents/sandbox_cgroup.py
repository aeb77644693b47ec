"""One cgroup per sandbox call: its memory, processes and CPU time counted together, not per process.

A call's processes (the launcher and everything the code starts) go into a cgroup of their own,
made for the call and removed after it: ``memory`` caps what they hold together (the kernel's OOM
killer ends the call past it), ``pids`` how many there are, and the CPU time they used is read
while the call runs, so the caller can stop it at ``cpu_seconds`` of all of them. Without it,
rlimits are per process: one call used 1.2 GiB, 6 CPU-seconds and 149 MiB of disk under limits
of 512 MiB and 5 s.

Where it can be made:

* cgroup v2 (``/sys/fs/cgroup/cgroup.controllers`` exists): under ``$HYBRIDFLOW_SANDBOX_CGROUP``
  (a delegated cgroup, e.g. one systemd made with ``Delegate=yes``), else under this process's
  own cgroup, which must allow ``+memory +pids +cpu`` in its ``cgroup.subtree_control`` (the
  kernel refuses that for a cgroup holding processes, unless it is a root);
* cgroup v1 (Debian 12's hybrid layout on this machine): the ``memory``, ``pids`` and ``cpuacct``
  hierarchies, each writable (root, or a delegated directory).

A pod's ``/sys/fs/cgroup`` is read-only unless it is privileged: there :func:`create` says why it
cannot, and strict mode refuses to run code (``hybridflow.agents.sandbox``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CallCgroup", "CgroupUnavailable", "create"]

ROOT = Path("/sys/fs/cgroup")
BASE_ENV = "HYBRIDFLOW_SANDBOX_CGROUP"
PREFIX = "hybridflow-sandbox"


class CgroupUnavailable(Exception):
    """No cgroup can be made for a call here; the message says why."""


def _own_paths() -> dict[str, str]:
    """This process's cgroup per controller (``/proc/self/cgroup``); "" for cgroup v2's unified one."""
    paths: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            for controller in controllers.split(",") if controllers else [""]:
                paths[controller] = path
    return paths


@dataclass
class CallCgroup:
    """The cgroup directories of one call (one for v2, one per controller for v1)."""

    version: int
    memory: Path
    pids: Path
    cpu: Path

    def add(self, pid: int) -> None:
        """Move ``pid`` (the launcher, before it starts anything) into the call's cgroup."""
        for directory in {self.memory, self.pids, self.cpu}:
            (directory / "cgroup.procs").write_text(str(pid))

    def cpu_seconds(self) -> float:
        """CPU time the call's processes used so far, together."""
        try:
            if self.version == 2:
                usage = next(
                    line.split()[1]
                    for line in (self.cpu / "cpu.stat").read_text().splitlines()
                    if line.startswith("usage_usec")
                )
                return int(usage) / 1e6
            return int((self.cpu / "cpuacct.usage").read_text()) / 1e9
        except (OSError, ValueError, StopIteration):
            return 0.0

    def oom_killed(self) -> bool:
        """Whether the kernel killed a process of the call for the memory cap."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            fields = dict(line.split() for line in (self.memory / name).read_text().splitlines())
        except (OSError, ValueError):
            return False
        return int(fields.get("oom_kill", "0")) > 0

    def processes(self) -> list[int]:
        pids: set[int] = set()
        for directory in {self.memory, self.pids, self.cpu}:
            with contextlib.suppress(OSError, ValueError):
                pids |= {int(p) for p in (directory / "cgroup.procs").read_text().split()}
        return sorted(pids)

    def kill(self) -> None:
        """End every process of the call (``cgroup.kill`` where v2 has it, else one by one until none is left)."""
        if self.version == 2:
            with contextlib.suppress(OSError):
                (self.memory / "cgroup.kill").write_text("1")
        deadline = time.monotonic() + 5
        while (pids := self.processes()) and time.monotonic() < deadline:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.01)

    def remove(self) -> bool:
        """Kill what is left and remove the directories; whether they are gone (none of the call's
        processes can outlive a removed cgroup: the kernel refuses to remove one that has some)."""
        self.kill()
        gone = True
        for directory in {self.memory, self.pids, self.cpu}:
            for _ in range(100):
                try:
                    directory.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as error:
                    if error.errno != errno.EBUSY:
                        gone = False
                        break
                    time.sleep(0.01)
            else:
                gone = False
        return gone


def _v2(memory_bytes: int, processes: int) -> CallCgroup:
    base = os.environ.get(BASE_ENV)
    parent = Path(base) if base else ROOT / _own_paths().get("", "/").lstrip("/")
    try:
        enabled = set((parent / "cgroup.subtree_control").read_text().split())
        missing = {"memory", "pids", "cpu"} - enabled
        if missing:
            (parent / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in sorted(missing)))
        call = parent / f"{PREFIX}-{uuid.uuid4().hex[:12]}"
        call.mkdir()
    except OSError as error:
        raise CgroupUnavailable(
            f"cgroup v2 at {parent} does not delegate memory, pids and cpu to a child ({error.strerror}); "
            f"set {BASE_ENV} to a delegated cgroup"
        ) from None
    try:
        (call / "memory.max").write_text(str(memory_bytes))
        with contextlib.suppress(OSError):  # no swap accounting: nothing to cap
            (call / "memory.swap.max").write_text("0")
        (call / "pids.max").write_text(str(processes))
    except OSError as error:
        call.rmdir()
        raise CgroupUnavailable(f"cgroup v2 {call}: {error.strerror}") from None
    return CallCgroup(2, call, call, call)


def _v1(memory_bytes: int, processes: int) -> CallCgroup:
    own = _own_paths()
    name = f"{PREFIX}-{uuid.uuid4().hex[:12]}"
    made: dict[str, Path] = {}
    try:
        for controller, mount in (("memory", "memory"), ("pids", "pids"), ("cpuacct", "cpuacct")):
            hierarchy = ROOT / mount
            if not hierarchy.is_dir():
                raise CgroupUnavailable(f"cgroup v1 has no {controller} hierarchy at {hierarchy}")
            directory = hierarchy / own.get(controller, "/").lstrip("/") / name
            directory.mkdir()
            made[controller] = directory
        (made["memory"] / "memory.limit_in_bytes").write_text(str(memory_bytes))
        with contextlib.suppress(OSError):  # swap accounting off: nothing to cap
            (made["memory"] / "memory.memsw.limit_in_bytes").write_text(str(memory_bytes))
        (made["pids"] / "pids.max").write_text(str(processes))
    except OSError as error:
        for directory in made.values():
            with contextlib.suppress(OSError):
                directory.rmdir()
        raise CgroupUnavailable(f"cgroup v1: {error.filename}: {error.strerror}") from None
    return CallCgroup(1, made["memory"], made["pids"], made["cpuacct"])


def create(memory_bytes: int, processes: int) -> CallCgroup:
    """A new cgroup for one call, capped at ``memory_bytes`` and ``processes``; raises
    :class:`CgroupUnavailable` naming why none can be made here."""
    if (ROOT / "cgroup.controllers").is_file():
        return _v2(memory_bytes, processes)
    if (ROOT / "memory").is_dir():
        return _v1(memory_bytes, processes)
    raise CgroupUnavailable(f"no cgroup file system at {ROOT}")
