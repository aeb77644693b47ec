"""Dropping from the caches what a relist no longer returns.

kopf keeps its watches alive across disconnects by resuming from the last resourceVersion it
saw. When the API server has compacted that version away it answers the watch with an ERROR
event of code 410 (Gone); kopf then lists the resource again and resumes watching from the
list (``kopf._cogs.clients.watching.continuous_watch``, kopf 1.45). The objects deleted while
the watch was down are simply missing from that list: no DELETED event is ever delivered for
them. A cache fed by events alone would keep such a job for ever (status patches answered 404,
backoff without end) and such a RayJob too (a pass would think the attempt still runs).

kopf delivers the listed objects as events of type None, the only sign a handler gets of a
(re)list; a relist that finds nothing delivers nothing at all (every RayJob deleted in the gap).
So :class:`Relister` is told of both: of each listed object (:meth:`noted`, from the handlers),
and of each 410 itself, which kopf logs as it restarts that watch (:class:`WatchRestarts`, a
filter on kopf's watching logger: kopf 1.45's "Restarting the watch-stream for <resource>",
logged only on 410; a test fails if kopf words it otherwise). Once a kind has been quiet for
:data:`SETTLE_SECONDS`, the Relister lists it itself, with the selector the watch uses, and drops
every cached object the list did not return, except those an event put into the cache after the
list began (they are newer than the list). The first listing at startup goes the same way, which
also covers a child deleted between the startup listing that fills the caches
(``main.register``'s startup handler) and the watch's own.

Each dropped job is forgotten (``on_job_gone``); each dropped child is handled like its DELETED
event (``on_child_gone``): the job's next pass sees it missing. One list per kind per relist:
relists are rare (a compaction after minutes without events, an API server restart).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from hybridflow_operator.cluster import ApiError

__all__ = ["Lister", "Relister"]

log = logging.getLogger("hybridflow_operator.relist")

SETTLE_SECONDS = 2.0
"""Quiet time after a listing's last event before the operator lists the kind itself."""
JOB_KIND = "RLHFJob"


KOPF_WATCH_LOGGER = "kopf._cogs.clients.watching"
KOPF_RESTART_MESSAGE = "Restarting the watch-stream for "


class WatchRestarts(logging.Filter):
    """Sees kopf's (DEBUG) "Restarting the watch-stream for <plural>.<version>[.<group>] ..." record
    of a 410 and calls ``on_restart(plural)``; hides DEBUG records unless someone wants them."""

    def __init__(self, on_restart: Callable[[str], None]) -> None:
        super().__init__("hybridflow-watch-restarts")
        self.on_restart = on_restart
        self.show_debug = logging.getLogger().isEnabledFor(logging.DEBUG)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.DEBUG:
            message = record.getMessage()
            if message.startswith(KOPF_RESTART_MESSAGE):
                self.on_restart(message.removeprefix(KOPF_RESTART_MESSAGE).split(".", 1)[0])
            return self.show_debug
        return True

    def install(self) -> None:
        watching = logging.getLogger(KOPF_WATCH_LOGGER)
        if watching.getEffectiveLevel() > logging.DEBUG:
            watching.setLevel(logging.DEBUG)  # the record must be made to be seen; the filter hides it
        watching.addFilter(self)

    def uninstall(self) -> None:
        logging.getLogger(KOPF_WATCH_LOGGER).removeFilter(self)


class Lister(Protocol):
    def list_jobs(self, namespaces: Sequence[str]) -> list[dict[str, Any]]: ...
    def list_children(
        self, namespaces: Sequence[str], label_selector: str, kinds: Sequence[str] | None = None
    ) -> list[dict[str, Any]]: ...


class Relister:
    """See the module docstring. ``cache`` is a ``main.JobCache``; callbacks run on a timer thread."""

    def __init__(
        self,
        api: Lister,
        cache: Any,
        *,
        namespaces: Sequence[str],
        label_selector: str,
        on_job_gone: Callable[[tuple[str, str]], None],
        on_child_gone: Callable[[dict[str, Any]], None],
        settle_seconds: float = SETTLE_SECONDS,
    ) -> None:
        self.api, self.cache = api, cache
        self.namespaces, self.label_selector = list(namespaces), label_selector
        self.on_job_gone, self.on_child_gone = on_job_gone, on_child_gone
        self.settle_seconds = settle_seconds
        self._timers: dict[str, threading.Timer] = {}
        self._lock = threading.Lock()
        self.relists = 0
        """Lists made so far (for tests and the log)."""

    def noted(self, kind: str) -> None:
        """An event of type None (a listed object) of ``kind`` arrived: relist it once they settle."""
        with self._lock:
            timer = self._timers.pop(kind, None)
            if timer is not None:
                timer.cancel()
            timer = threading.Timer(self.settle_seconds, self.relist, args=(kind,))
            timer.daemon = True
            timer.name = f"hybridflow-relist-{kind}"
            self._timers[kind] = timer
            timer.start()

    def stop(self) -> None:
        with self._lock:
            for timer in self._timers.values():
                timer.cancel()
            self._timers.clear()

    def relist(self, kind: str) -> None:
        """List ``kind`` now and drop what the cache holds beyond it."""
        since = self.cache.clock
        try:
            if kind == JOB_KIND:
                listed = self.api.list_jobs(self.namespaces)
            else:
                listed = self.api.list_children(self.namespaces, self.label_selector, kinds=[kind])
        except ApiError as err:
            log.warning("relist of %s failed (%s); retried after the next listing", kind, err)
            return
        self.relists += 1
        keys = {
            (
                str((item.get("metadata") or {}).get("namespace")),
                str((item.get("metadata") or {}).get("name")),
            )
            for item in listed
        }
        if kind == JOB_KIND:
            for key in self.cache.stale_jobs(keys, since):
                log.info("RLHFJob %s/%s is gone (missing from a relist): forgotten", *key)
                self.on_job_gone(key)
            return
        for child in self.cache.stale_children(kind, keys, since):
            meta = child.get("metadata") or {}
            log.info(
                "%s %s/%s is gone (missing from a relist)", kind, meta.get("namespace"), meta.get("name")
            )
            self.on_child_gone(child)
