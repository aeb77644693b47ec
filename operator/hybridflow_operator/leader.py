"""Leader election over a ``coordination.k8s.io/v1`` Lease, so that two replicas are safe.

Every replica watches and caches; only the Lease's holder reconciles. The protocol is
client-go's leaderelection, reduced to what the operator needs:

* every ``retry_seconds`` each replica reads the Lease ``hybridflow-operator`` in its namespace;
* the holder renews it (``renewTime``) with a replace that names the ``resourceVersion`` it read,
  so a concurrent writer makes the replace fail with 409 and nobody holds it twice;
* another replica takes it over only after ``renewTime + leaseDurationSeconds`` has passed
  (the holder died or is partitioned), again with a resourceVersion-preconditioned replace;
* a holder stops reconciling ``renew_deadline_seconds`` after the start of its last successful
  renewal, before its lease runs out (client-go's ``RenewDeadline`` < ``LeaseDuration``: 10 s
  against 15 s, as here), so an old leader whose renewals fail has stopped writing while its lease
  still keeps everyone else out: clocks that differ by less than the margin cannot make two
  leaders;
* on shutdown (SIGTERM: a rollout, a drained node) the holder releases the Lease (client-go's
  ``ReleaseOnCancel``: no holder, a one-second duration), so a standby takes over within a retry
  period instead of waiting out the lease.

A new leader runs ``on_elected`` (reconcile every cached job once), since the previous holder's
scheduled rechecks are gone with it; a leader that stops leading runs ``on_deposed`` (the
operator drops its per-job gauges: only the leader exports job state, so two replicas never
report the same jobs twice, and a standby never reports stale ones).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

__all__ = ["LeaderElection", "LeaseApi"]

log = logging.getLogger("hybridflow_operator.leader")

LEASE_NAME = "hybridflow-operator"


class LeaseApi(Protocol):
    def get_lease(self, namespace: str, name: str) -> dict[str, Any] | None: ...
    def create_lease(self, namespace: str, body: dict[str, Any]) -> bool: ...
    def replace_lease(self, namespace: str, name: str, body: dict[str, Any]) -> bool: ...


def _micro_time(when: datetime) -> str:
    return when.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse_time(value: object) -> datetime | None:
    if not isinstance(value, str) or not value:
        return None
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


class LeaderElection:
    def __init__(
        self,
        api: LeaseApi,
        *,
        namespace: str,
        identity: str,
        lease_seconds: int = 15,
        renew_deadline_seconds: float = 10.0,
        retry_seconds: float = 2.0,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        if not 0 < retry_seconds < renew_deadline_seconds < lease_seconds:
            raise ValueError(
                "leader election needs retry < renew deadline < lease duration, got "
                f"{retry_seconds} s, {renew_deadline_seconds} s, {lease_seconds} s"
            )
        self.api, self.namespace, self.identity = api, namespace, identity
        self.lease_seconds, self.retry_seconds, self.clock = lease_seconds, retry_seconds, clock
        self.renew_deadline_seconds = renew_deadline_seconds
        self._leader_until: datetime | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._on_elected: Callable[[], None] = lambda: None
        self._on_deposed: Callable[[], None] = lambda: None
        self._was_leader = False

    @classmethod
    def from_config(cls, config: Any, api: Any) -> LeaderElection:
        return cls(api, namespace=config.namespace, identity=config.identity)

    @property
    def is_leader(self) -> bool:
        return self._leader_until is not None and self.clock() < self._leader_until

    def start(self, on_elected: Callable[[], None], on_deposed: Callable[[], None] = lambda: None) -> None:
        self._on_elected, self._on_deposed = on_elected, on_deposed
        self._thread = threading.Thread(target=self._loop, name="hybridflow-leader", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop campaigning and, if this replica holds the Lease, release it (the operator is stopping)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.retry_seconds + 5)
        try:
            self.release()
        except Exception:
            log.exception("leader election: could not release the Lease")

    def release(self) -> bool:
        """Give the Lease up now if this replica holds it; True when it did."""
        held = self.is_leader
        self._leader_until = None
        self._check_deposed()
        if not held:
            return False
        lease = self.api.get_lease(self.namespace, LEASE_NAME)
        spec = (lease or {}).get("spec") or {}
        if lease is None or spec.get("holderIdentity") != self.identity:
            return False
        now = _micro_time(self.clock())
        body = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {
                "name": LEASE_NAME,
                "namespace": self.namespace,
                "resourceVersion": (lease.get("metadata") or {}).get("resourceVersion"),
            },
            "spec": {
                "holderIdentity": None,
                "leaseDurationSeconds": 1,
                "renewTime": now,
                "acquireTime": now,
                "leaseTransitions": int(spec.get("leaseTransitions") or 0),
            },
        }
        released = self.api.replace_lease(self.namespace, LEASE_NAME, body)
        if released:
            log.info("leader election: %s released the Lease", self.identity)
        return released

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.try_acquire_or_renew()
            except Exception:  # the API is down: keep what we have until the renew deadline
                log.exception("leader election: could not reach the Lease")
            self._check_deposed()
            self._stop.wait(self.retry_seconds)

    def _check_deposed(self) -> None:
        """Run ``on_deposed`` once when this replica stopped leading (lost, expired or released)."""
        leading = self.is_leader
        if self._was_leader and not leading:
            log.info("leader election: %s no longer holds the Lease", self.identity)
            self._on_deposed()
        self._was_leader = leading

    def try_acquire_or_renew(self) -> bool:
        """One round of the protocol; True when this replica holds the Lease afterwards."""
        was_leader = self.is_leader
        now = self.clock()
        lease = self.api.get_lease(self.namespace, LEASE_NAME)
        spec = {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": self.lease_seconds,
            "renewTime": _micro_time(now),
        }
        if lease is None:
            body = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": LEASE_NAME, "namespace": self.namespace},
                "spec": {**spec, "acquireTime": _micro_time(now), "leaseTransitions": 0},
            }
            won = self.api.create_lease(self.namespace, body)
        else:
            held = lease.get("spec") or {}
            holder = held.get("holderIdentity")
            renewed = _parse_time(held.get("renewTime")) or _parse_time(held.get("acquireTime"))
            duration = int(held.get("leaseDurationSeconds") or self.lease_seconds)
            expired = not holder or renewed is None or now >= renewed + timedelta(seconds=duration)
            if holder != self.identity and not expired:
                self._leader_until = None
                return False
            transitions = int(held.get("leaseTransitions") or 0) + (0 if holder == self.identity else 1)
            acquired = held.get("acquireTime") if holder == self.identity else _micro_time(now)
            body = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {
                    "name": LEASE_NAME,
                    "namespace": self.namespace,
                    "resourceVersion": (lease.get("metadata") or {}).get("resourceVersion"),
                },
                "spec": {**spec, "acquireTime": acquired, "leaseTransitions": transitions},
            }
            won = self.api.replace_lease(self.namespace, LEASE_NAME, body)
        if won:
            # Count from before the request, so a slow request never stretches it, and only up to the
            # renew deadline, so that this replica stops before anyone else may start.
            self._leader_until = now + timedelta(seconds=self.renew_deadline_seconds)
            if not was_leader:
                log.info("leader election: %s now holds the Lease", self.identity)
                self._on_elected()
        elif self.clock() >= (self._leader_until or now):
            self._leader_until = None
        return won
