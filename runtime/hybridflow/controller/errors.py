"""Errors the single controller raises. Each names the role, pool, rank and method involved."""

from __future__ import annotations

__all__ = [
    "CallTimeoutError",
    "ControllerError",
    "RoleMappingError",
    "WorkerDiedError",
    "WorkerError",
    "WorkerStalledError",
]


class ControllerError(RuntimeError):
    """Base of the controller's runtime errors."""


class RoleMappingError(ControllerError, ValueError):
    """A role names a pool that does not exist, a layout that does not fit, or a bad worker class."""


class WorkerError(ControllerError):
    """A worker method raised. ``remote_traceback`` holds the worker-side traceback text."""

    def __init__(self, message: str, *, remote_traceback: str = "") -> None:
        super().__init__(message)
        self.remote_traceback = remote_traceback


class WorkerDiedError(ControllerError):
    """A worker process exited or became unreachable during a call."""


class CallTimeoutError(ControllerError):
    """A call did not finish within the caller's timeout; names the ranks still running."""


class WorkerStalledError(CallTimeoutError):
    """A group call got no answer within the deployment's stall timeout while its ranks stayed alive.

    A hung rollout or collective (a rank blocked on a peer that never joins, a deadlocked
    engine) looks like this; the message names the role, method, silent ranks and where they run.
    """
