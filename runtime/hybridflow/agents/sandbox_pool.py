"""Sandbox workers: the processes that run tool code, apart from the controller and the GPUs.

``spec.agent.sandbox.workers`` Ray actors (:class:`SandboxWorker`), each running one call at a
time through :func:`~hybridflow.agents.sandbox.run_python` (a confined child process per call).
In the cluster they are placed on the pods of the RayJob's ``sandbox`` worker group (CPU only,
Pod Security restricted, egress denied by the job's NetworkPolicy) by the custom resource
:data:`SANDBOX_RESOURCE` that only those pods advertise; on a laptop (the embedded Ray) they
take no resource and run beside the job.

:meth:`SandboxPool.run` sends a call to the worker with the fewest calls in flight and waits for
it, bounded by the call's wall-clock limit plus a margin; a worker that died is replaced (Ray
restarts it) and the call answered with an error, never an exception: the agent loop gives the
model the error and the trajectory goes on.
"""

from __future__ import annotations

import threading
from typing import Any

from hybridflow.agents.sandbox import (
    Isolation,
    IsolationMode,
    SandboxLimits,
    SandboxResult,
    probe,
    run_python,
)
from hybridflow.spec.agent import SANDBOX_GROUP, SANDBOX_RESOURCE

__all__ = ["SANDBOX_GROUP", "SANDBOX_RESOURCE", "SandboxPool", "SandboxWorker"]

MARGIN_SECONDS = 30.0
"""Beyond a call's own wall-clock limit: what a worker's answer may take (scheduling, a restart)."""


class SandboxWorker:
    """One worker: runs calls one at a time (wrapped with ``ray.remote`` by the pool)."""

    def run(self, code: str, limits: SandboxLimits) -> SandboxResult:
        return run_python(code, limits)

    def probe(self, mode: IsolationMode) -> tuple[Isolation | None, str]:
        return probe(mode)


class SandboxPool:
    """``workers`` sandbox workers (see the module docstring); thread-safe."""

    def __init__(self, workers: int, *, in_cluster: bool) -> None:
        import ray

        if workers < 1:
            raise ValueError(f"a sandbox pool needs at least one worker, not {workers}")
        options: dict[str, Any] = {"num_cpus": 0, "max_restarts": -1, "max_task_retries": 0}
        if in_cluster:
            options["resources"] = {SANDBOX_RESOURCE: 1}
        remote: Any = ray.remote(SandboxWorker)
        self._workers: list[Any] = [remote.options(**options).remote() for _ in range(workers)]
        self._in_flight = [0] * workers
        self._lock = threading.Lock()

    def run(self, code: str, limits: SandboxLimits) -> SandboxResult:
        """Run ``code`` on the least-busy worker; an error result if the worker fails or does not answer."""
        import ray

        with self._lock:
            index = min(range(len(self._workers)), key=self._in_flight.__getitem__)
            self._in_flight[index] += 1
        try:
            ref = self._workers[index].run.remote(code, limits)
            result: SandboxResult = ray.get(ref, timeout=limits.wall_seconds + MARGIN_SECONDS)
            return result
        except Exception as error:  # the worker died or stalled: the model hears of it, the step goes on
            return SandboxResult(
                "sandbox_error",
                None,
                "",
                f"sandbox worker {index}: {type(error).__name__}: {error}"[:500],
                0.0,
                None,
            )
        finally:
            with self._lock:
                self._in_flight[index] -= 1

    def probe(self, mode: IsolationMode) -> list[tuple[Isolation | None, str]]:
        """What confinement each worker's machine gives a call in ``mode``, or why it cannot."""
        import ray

        return list(ray.get([worker.probe.remote(mode) for worker in self._workers], timeout=120))

    def isolation(self, mode: IsolationMode = "strict") -> list[Isolation | None]:
        """What confinement each worker's machine gives a call (for the job's log)."""
        return [applied for applied, _ in self.probe(mode)]

    def shutdown(self) -> None:
        import contextlib

        import ray

        for worker in self._workers:
            with contextlib.suppress(Exception):  # already gone
                ray.kill(worker, no_restart=True)
