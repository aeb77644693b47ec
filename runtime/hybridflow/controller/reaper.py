"""Kill every process a ``hybridflow run`` started once the run's driver is gone, however it ended.

Why: ``ray.init`` on one machine starts GCS, raylet and agents; the raylet starts the workers
and Ray's dashboard and runtime-env agents. Ray ties GCS and the raylet to the driver (they die
with it), but after a SIGKILL of the driver the agents outlive it, and any worker that was
between tasks may too; a rerun then shares the machine with them.

Protocol: before starting Ray, the driver (:func:`hybridflow.controller.local_cluster.init_local_ray`)
puts ``HYBRIDFLOW_RUN_ID=<random>`` into its environment, which every process it starts
inherits, and starts this file as a script (``python -I reaper.py <id>``) in a session of its
own, with stdin the read end of a pipe whose write end only the driver holds. Once Ray is up,
the driver writes Ray's session directory into the pipe (one line). When the driver exits or is
killed, the kernel closes the write end; the reaper reads EOF and SIGKILLs, until none is left,
every process that has a file open under the session directory (every Ray process keeps its log
files there open) or whose environment carries the marker. Neither the process tree nor the
process group identifies them: Ray puts workers into process groups of their own, orphans are
re-parented to init, and Ray's processes rename themselves (``ray::DashboardAgent``), which
overwrites the environment block ``/proc/<pid>/environ`` shows.

This file is run as a script, so it imports only the standard library. On systems without
``/proc`` (macOS) it finds nothing and exits.
"""

from __future__ import annotations

import os
import signal
import sys
import time

RUN_ID_VARIABLE = "HYBRIDFLOW_RUN_ID"
GIVE_UP_AFTER_SECONDS = 30.0


def _holds_file_under(pid: str, directories: list[str]) -> bool:
    try:
        descriptors = os.listdir(f"/proc/{pid}/fd")
    except OSError:  # gone, or another user's
        return False
    for descriptor in descriptors:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{descriptor}")
        except OSError:
            continue
        if any(target.startswith(directory) for directory in directories):
            return True
    return False


def _carries(pid: str, marker: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as environ:
            return marker in environ.read().split(b"\0")
    except OSError:
        return False


def marked_processes(marker: bytes, session_directories: list[str]) -> list[int]:
    """Pids of this user's processes with ``marker`` (``NAME=value``) or a file open under a directory."""
    me = os.getpid()
    directories = [directory.rstrip("/") + "/" for directory in session_directories if directory]
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    return [
        int(entry)
        for entry in entries
        if entry.isdigit()
        and int(entry) != me
        and (_carries(entry, marker) or _holds_file_under(entry, directories))
    ]


def kill_marked(
    marker: bytes, session_directories: list[str], *, give_up_after_seconds: float = GIVE_UP_AFTER_SECONDS
) -> int:
    """SIGKILL the run's processes until none is left (a dying raylet may still start one); how many."""
    killed: set[int] = set()
    deadline = time.monotonic() + give_up_after_seconds
    while time.monotonic() < deadline:
        pids = marked_processes(marker, session_directories)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    return len(killed)


def main(argv: list[str]) -> int:
    if len(argv) != 2 or not argv[1]:
        print(f"usage: {argv[0]} RUN_ID (stdin: a pipe the driver holds open)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C for the driver is not for the reaper
    # Lines until EOF, which comes when the driver has exited, however it ended.
    session_directories = [line.strip() for line in sys.stdin if line.strip()]
    kill_marked(f"{RUN_ID_VARIABLE}={argv[1]}".encode(), session_directories)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
