"""Which replica serves a request: the least loaded, by in-flight tokens; a session stays on one.

Pure bookkeeping in the controller (the replicas know nothing of each other). The router
counts, per replica, the tokens its open requests may still occupy: a request's prompt plus
``n * max_new_tokens`` from the moment it is routed to the moment its result comes back.
That is an upper bound (a response may stop early), but the same bound for every replica, and
it needs no report from the replica on the request path.

Sessions (multi-turn trajectories) keep their replica, so that the replica's prefix cache holds
their earlier turns; a session whose replica left the routing moves to the least-loaded one.
A replica that leaves (:meth:`RequestRouter.remove`) hands back its open requests, for the
caller to route again.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

__all__ = ["RequestRouter"]


@dataclass
class _Replica:
    in_flight_tokens: int = 0
    requests: dict[Hashable, int] = field(default_factory=dict)  # request id -> its tokens


class RequestRouter:
    """Routes requests to replicas (identified by any hashable: the rollout worker's rank)."""

    def __init__(self, replicas: Iterable[Hashable]) -> None:
        self._replicas: dict[Hashable, _Replica] = {replica: _Replica() for replica in replicas}
        self._sessions: dict[str, Hashable] = {}
        self._where: dict[Hashable, Hashable] = {}  # request id -> replica

    @property
    def replicas(self) -> list[Hashable]:
        return list(self._replicas)

    def in_flight_tokens(self, replica: Hashable) -> int:
        return self._replicas[replica].in_flight_tokens

    def open_requests(self, replica: Hashable) -> list[Hashable]:
        return list(self._replicas[replica].requests)

    def route(self, request_id: Hashable, tokens: int, session_id: str | None = None) -> Hashable:
        """The replica that serves ``request_id`` (``tokens``: what it may occupy); recorded as open there."""
        if not self._replicas:
            raise RuntimeError("no rollout replica is in the routing")
        if request_id in self._where:
            raise ValueError(f"request {request_id!r} is routed already (to {self._where[request_id]!r})")
        replica = self._sessions.get(session_id) if session_id is not None else None
        if replica is None or replica not in self._replicas:
            # Least in-flight tokens; ties go to the replica listed first (deterministic).
            replica = min(self._replicas, key=lambda name: self._replicas[name].in_flight_tokens)
            if session_id is not None:
                self._sessions[session_id] = replica
        state = self._replicas[replica]
        state.requests[request_id] = tokens
        state.in_flight_tokens += tokens
        self._where[request_id] = replica
        return replica

    def finished(self, request_id: Hashable) -> None:
        """The request's result came back: its tokens no longer load its replica."""
        replica = self._where.pop(request_id)
        state = self._replicas[replica]
        state.in_flight_tokens -= state.requests.pop(request_id)

    def end_session(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    def remove(self, replica: Hashable) -> list[Hashable]:
        """Take ``replica`` out of the routing; returns its open requests (to route again)."""
        state = self._replicas.pop(replica)
        for request_id in state.requests:
            del self._where[request_id]
        for session, owner in list(self._sessions.items()):
            if owner == replica:
                del self._sessions[session]
        return list(state.requests)

    def add(self, replica: Hashable) -> None:
        """A (new or replaced) replica joins the routing with no load."""
        if replica in self._replicas:
            raise ValueError(f"replica {replica!r} is in the routing already")
        self._replicas[replica] = _Replica()
