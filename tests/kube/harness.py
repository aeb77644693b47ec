"""Run the API-server emulator on a thread of its own, point clients at it, and run kopf against it.

Who runs where, and why:

* The emulator (``kube.emulator.ApiServerEmulator`` behind ``kmock.Server``) runs on a
  background thread's event loop, because both the official ``kubernetes`` client and
  ``kopf``'s in-process runners block the calling thread; a test then talks to the emulator
  synchronously, exactly as the operator's own code would.
* A kopf operator runs on another thread with its own loop (:meth:`EmulatedCluster.run_operator`),
  against a fresh ``kopf.OperatorRegistry``: kopf's default registry is process-global, so
  handlers registered for one test would otherwise run in every later one.
* Clients find the emulator through a kubeconfig written to a temporary file. The official
  client reads ``$KUBECONFIG`` once, at import (``kube_config.KUBE_CONFIG_DEFAULT_LOCATION``),
  so the harness patches that constant as well as the variable and the client's default
  ``Configuration``, and restores all three on exit. kopf logs in with
  ``kopf.login_with_kubeconfig``, which reads ``$KUBECONFIG`` when the operator starts.

Example::

    with EmulatedCluster() as cluster:
        cluster.emulator.register_custom_resource(
            group="hybridflow.io", version="v1alpha1", plural="rlhfjobs", kind="RLHFJob",
            subresources={"status"},
        )
        registry = operator_registry()

        @kopf.on.create("hybridflow.io", "v1alpha1", "rlhfjobs", registry=registry)
        def created(patch: kopf.Patch, **_: object) -> None:
            patch.status["phase"] = "Pending"

        with cluster.run_operator(registry):
            cluster.custom.create_namespaced_custom_object(
                "hybridflow.io", "v1alpha1", "default", "rlhfjobs",
                {"apiVersion": "hybridflow.io/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "a"}},
            )
            wait_until(lambda: cluster.custom.get_namespaced_custom_object_status(
                "hybridflow.io", "v1alpha1", "default", "rlhfjobs", "a").get("status"))
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import importlib
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar
from unittest import mock

import kmock
import kopf
import kubernetes.client
import kubernetes.config
import kubernetes.config.kube_config
import yaml

from kube.emulator import ApiServerEmulator

T = TypeVar("T")

STARTUP_TIMEOUT_SECONDS = 10.0
SHUTDOWN_TIMEOUT_SECONDS = 10.0


@functools.cache
def _parsed_yaml(path: str, mtime_ns: int) -> Any:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: 5x faster on KubeRay's 1.4 MB CRD
    with open(path) as stream:
        return yaml.load(stream, Loader=loader)


def load_crd(path: Path) -> dict[str, Any]:
    """A CRD manifest, parsed once per process (a fresh copy each call: callers may change it)."""
    parsed: dict[str, Any] = _parsed_yaml(str(path), path.stat().st_mtime_ns)
    return copy.deepcopy(parsed)


def wait_until(
    predicate: Callable[[], T | None],
    *,
    timeout_seconds: float = 10.0,
    interval_seconds: float = 0.02,
    message: str = "",
) -> T:
    """Poll ``predicate`` until it returns something truthy, and return that; fail after the timeout.

    Operators converge asynchronously, so assertions on their effects poll instead of sleeping a
    fixed time (slow on a busy machine, flaky on a slower one).
    """
    deadline = time.monotonic() + timeout_seconds
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout_seconds} s: {message or predicate}")
        time.sleep(interval_seconds)


def operator_registry() -> kopf.OperatorRegistry:
    """A fresh, empty kopf registry that logs in through the harness's kubeconfig.

    A non-default ``kopf.OperatorRegistry`` has none of the fallback login handlers of kopf's
    default registry, and kopf refuses to start without one.
    """
    registry = kopf.OperatorRegistry()
    kopf.on.login(registry=registry)(kopf.login_with_kubeconfig)
    return registry


def registry_for_module(module_name: str) -> kopf.OperatorRegistry:
    """A fresh registry holding the handlers a module registers with bare ``@kopf.on...`` decorators.

    Such decorators register into kopf's default registry at import time, so the module is
    imported (or re-imported) while the fresh registry is the default, and the previous default
    is restored afterwards. Functions of a re-imported module are new objects: take them from
    ``sys.modules[module_name]`` afterwards, not from an earlier import.
    """
    registry = operator_registry()
    previous = kopf.get_default_registry()
    kopf.set_default_registry(registry)
    try:
        if module_name in sys.modules:
            importlib.reload(sys.modules[module_name])
        else:
            importlib.import_module(module_name)
    finally:
        kopf.set_default_registry(previous)
    return registry


def operator_settings() -> kopf.OperatorSettings:
    """kopf settings for an operator under test: standalone, no cluster scanning.

    Scanning is off because tests declare their resources up front; kopf then discovers the
    handled resources once and does not watch Namespaces and CRDs (fewer streams, faster start).
    Posting of kopf's own k8s Events stays on: the operator's Events are part of its behaviour.
    """
    settings = kopf.OperatorSettings()
    settings.scanning.disabled = True
    settings.peering.standalone = True
    settings.networking.request_timeout = 10.0
    settings.watching.connect_timeout = 5.0
    return settings


class OperatorThread:
    """One kopf operator running ``kopf.operator()`` on its own thread and loop until stopped.

    ``kopf.testing.KopfRunner`` would do the same through kopf's CLI, but it installs the given
    registry as kopf's process-wide default and swaps ``sys.stdout`` from a background thread;
    calling ``kopf.operator`` directly avoids both.
    """

    def __init__(
        self,
        registry: kopf.OperatorRegistry,
        *,
        settings: kopf.OperatorSettings,
        namespaces: Collection[str],
    ) -> None:
        self._registry = registry
        self._settings = settings
        self._namespaces = tuple(namespaces)
        self._stop_flag = threading.Event()
        self._ready_flag = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kopf-operator", daemon=True)
        self.error: BaseException | None = None

    def start(self, timeout_seconds: float = STARTUP_TIMEOUT_SECONDS) -> None:
        """Start the operator and wait until its startup handlers are done and it begins watching."""
        self._thread.start()
        wait_until(
            lambda: self._ready_flag.is_set() or not self._thread.is_alive(), timeout_seconds=timeout_seconds
        )
        if self.error is not None:
            raise RuntimeError("the operator failed to start") from self.error

    def stop(self, timeout_seconds: float = SHUTDOWN_TIMEOUT_SECONDS) -> None:
        """Stop the operator (as on SIGTERM) and re-raise whatever made it fail, if anything did."""
        self._stop_flag.set()
        self._thread.join(timeout_seconds)
        if self._thread.is_alive():
            raise RuntimeError(f"the operator did not stop within {timeout_seconds} s")
        if self.error is not None:
            raise RuntimeError("the operator failed") from self.error

    def _run(self) -> None:
        try:
            asyncio.run(
                kopf.operator(
                    registry=self._registry,
                    settings=self._settings,
                    standalone=True,
                    clusterwide=not self._namespaces,
                    namespaces=self._namespaces,
                    stop_flag=self._stop_flag,
                    ready_flag=self._ready_flag,
                )
            )
        except BaseException as e:  # reported to the test thread by start()/stop()
            self.error = e


class EmulatedCluster(contextlib.AbstractContextManager["EmulatedCluster"]):
    """The emulator served on ``127.0.0.1`` (a free port), with clients configured to use it.

    Attributes, valid inside the ``with`` block: ``emulator`` (also before, to register
    resources), ``url``, ``kubeconfig_path``, ``api_client`` and the ``core``/``custom``/``rbac``
    API objects built on it.
    """

    def __init__(self, emulator: ApiServerEmulator | None = None, *, host: str = "127.0.0.1") -> None:
        """``host``: the address to serve on (a container network's gateway, for pods run as
        containers: e2e/test_containers.py)."""
        self.emulator = emulator if emulator is not None else ApiServerEmulator()
        self.host = host
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._server_error: BaseException | None = None
        self._url: str | None = None
        self._thread = threading.Thread(target=self._serve, name="kube-emulator", daemon=True)
        self._exit_stack = contextlib.ExitStack()

    # --- lifecycle --------------------------------------------------------------------------------

    def __enter__(self) -> EmulatedCluster:
        self._thread.start()
        self._ready.wait(STARTUP_TIMEOUT_SECONDS)
        if self._url is None:
            raise RuntimeError("the API-server emulator did not start") from self._server_error
        try:
            self._configure_clients()
        except BaseException:
            self._stop_server()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        try:
            self._exit_stack.close()
        finally:
            self._stop_server()

    def _serve(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._serve_until_stopped())
        except BaseException as e:
            self._server_error = e
        finally:
            self._ready.set()  # unblock __enter__ if the server failed before it was ready
            loop.close()

    async def _serve_until_stopped(self) -> None:
        self._stop = asyncio.Event()
        async with self.emulator, kmock.Server(self.emulator, host=self.host) as server:
            self._url = f"http://{server.host}:{server.port}"
            self._ready.set()
            await self._stop.wait()
            self.emulator.close_watches()

    def _stop_server(self) -> None:
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop may have just closed
                self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(SHUTDOWN_TIMEOUT_SECONDS)
        if self._thread.is_alive():
            raise RuntimeError(f"the API-server emulator did not stop within {SHUTDOWN_TIMEOUT_SECONDS} s")

    def _configure_clients(self) -> None:
        directory = Path(self._exit_stack.enter_context(tempfile.TemporaryDirectory(prefix="kube-emulator-")))
        self.kubeconfig_path = directory / "kubeconfig"
        self.kubeconfig_path.write_text(yaml.safe_dump(self.kubeconfig()))

        configuration = kubernetes.client.Configuration()
        kubernetes.config.load_kube_config(
            config_file=str(self.kubeconfig_path), client_configuration=configuration
        )
        path = str(self.kubeconfig_path)
        for patcher in (
            mock.patch.dict(os.environ, {"KUBECONFIG": path}),
            mock.patch.object(kubernetes.config.kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", path),
            mock.patch.object(kubernetes.config, "KUBE_CONFIG_DEFAULT_LOCATION", path),
            mock.patch.object(kubernetes.client.Configuration, "_default", configuration),
        ):
            self._exit_stack.enter_context(patcher)

        self.api_client = self._exit_stack.enter_context(kubernetes.client.ApiClient(configuration))
        self.core = kubernetes.client.CoreV1Api(self.api_client)
        self.custom = kubernetes.client.CustomObjectsApi(self.api_client)
        self.rbac = kubernetes.client.RbacAuthorizationV1Api(self.api_client)

    # --- what tests use ---------------------------------------------------------------------------

    @property
    def url(self) -> str:
        if self._url is None:
            raise RuntimeError("the cluster is not started: use it in a `with` block")
        return self._url

    def kubeconfig(self, namespace: str = "default") -> dict[str, Any]:
        """A kubeconfig for the emulator (no TLS, a dummy token: the emulator has no auth)."""
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
            "users": [{"name": "emulator", "user": {"token": "emulator"}}],
            "contexts": [
                {
                    "name": "emulator",
                    "context": {"cluster": "emulator", "user": "emulator", "namespace": namespace},
                }
            ],
            "current-context": "emulator",
        }

    def drop_watches(self) -> None:
        """End every open watch stream once (a broken connection); watchers reconnect."""
        if self._loop is None:
            raise RuntimeError("the cluster is not started: use it in a `with` block")
        self._loop.call_soon_threadsafe(self.emulator.drop_watches)

    def run_on_server(self, function: Callable[[], T], *, timeout_seconds: float = 10.0) -> T:
        """Run ``function`` on the server's loop, under the emulator's lock, and return its result
        (or raise its exception): no request is served while it runs, so it may change the store
        (``emulator.delete_stored_object``), as the emulator's threading protocol requires."""
        loop = self._loop
        if loop is None or self._url is None:
            raise RuntimeError("the cluster is not started: use it in a `with` block")

        async def locked() -> T:
            async with self.emulator._lock:
                return function()

        return asyncio.run_coroutine_threadsafe(locked(), loop).result(timeout_seconds)

    def compact(self) -> int:
        """Compact the history as etcd does (``ApiServerEmulator.compact``); return the revision:
        a watch or an ``Exact`` list from before it gets 410 Gone."""
        return self.run_on_server(self.emulator.compact)

    def watch_gap(self, actions: Callable[[], object] = lambda: None) -> int:
        """End every watch, run ``actions`` on the server's loop, compact, in one step: watchers
        reconnect to 410 Gone, re-list, and never see an event of what ``actions`` did, as after
        a long disconnection. Returns the compacted revision. For example::

            jobs = kmock.resource("hybridflow.io", "v1alpha1", "rlhfjobs")
            cluster.watch_gap(lambda: cluster.emulator.delete_stored_object(jobs, "a", "default"))
        """
        return self.run_on_server(lambda: self.emulator.watch_gap(actions))

    def kubeconfig_with_token(self, token: str, namespace: str = "default") -> dict[str, Any]:
        """A kubeconfig whose requests carry ``token`` (an admin, unless ``identities`` names it):
        fault injection tells one client's writes from another's by it."""
        config = self.kubeconfig(namespace)
        config["users"] = [{"name": "emulator", "user": {"token": token}}]
        return config

    def kubeconfig_as(self, user: str, namespace: str = "default") -> dict[str, Any]:
        """A kubeconfig whose token the emulator authorizes as ``user`` (RBAC): a ServiceAccount,
        ``system:serviceaccount:<namespace>:<name>`` (what a pod of it gets mounted), or any
        other user name (a ``User`` subject)."""
        token = f"token-for-{user}"
        self.emulator.identities[token] = user
        return self.kubeconfig_with_token(token, namespace)

    def api_client_as(self, user: str) -> kubernetes.client.ApiClient:
        """A client whose requests the emulator authorizes as ``user`` (RBAC: the roles bound to it).

        ``user`` is a ServiceAccount's name in the API server's form,
        ``system:serviceaccount:<namespace>:<name>``, or any other user name; the token is made
        up and registered here.
        """
        token = f"token-for-{user}"
        self.emulator.identities[token] = user
        configuration = copy.copy(kubernetes.client.Configuration.get_default_copy())
        configuration.refresh_api_key_hook = None  # it would put the kubeconfig's token back
        configuration.api_key = {"BearerToken": token}
        configuration.api_key_prefix = {"BearerToken": "Bearer"}
        return self._exit_stack.enter_context(kubernetes.client.ApiClient(configuration))

    @contextlib.contextmanager
    def run_operator(
        self,
        registry: kopf.OperatorRegistry,
        *,
        settings: kopf.OperatorSettings | None = None,
        namespaces: Collection[str] = (),
    ) -> Iterator[OperatorThread]:
        """Run a kopf operator with ``registry``'s handlers for the duration of the block.

        ``registry`` needs a login handler: build it with :func:`operator_registry` or
        :func:`registry_for_module`. Without ``namespaces`` the operator is cluster-wide.
        Errors of the operator itself (not of its handlers, which kopf retries) are re-raised
        when the block exits.
        """
        operator = OperatorThread(
            registry,
            settings=settings if settings is not None else operator_settings(),
            namespaces=namespaces,
        )
        operator.start()
        try:
            yield operator
        finally:
            operator.stop()

    def wait_until_idle(self, *, quiet_seconds: float = 0.5, timeout_seconds: float = 10.0) -> int:
        """Wait until no request has arrived for ``quiet_seconds``; return how many have arrived.

        For counting an operator's writes: its work ends with a last request, after which only
        its long-lived watch streams stay open.
        """
        deadline = time.monotonic() + timeout_seconds
        seen, quiet_since = self.emulator.request_count, time.monotonic()
        while time.monotonic() - quiet_since < quiet_seconds:
            if time.monotonic() > deadline:
                raise AssertionError(f"requests kept arriving for {timeout_seconds} s")
            time.sleep(0.02)
            if (count := self.emulator.request_count) != seen:
                seen, quiet_since = count, time.monotonic()
        return seen
