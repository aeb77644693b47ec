"""The cluster's DNS for the e2e harness: a real resolver whose records follow the Services.

In a cluster, a Service's name resolves exactly while the Service exists (CoreDNS serves what the
API server holds). KubeRay's head Service ``<cluster>-head-svc`` is owned by the RayCluster
(``common/service.go`` ``BuildServiceForHeadPod``, ``raycluster_controller.go``
``reconcileServices``), so the garbage collector deletes it together with the head and worker
pods when KubeRay deletes the cluster, while those pods are still in their preStop hooks; every
worker knows its head by that name (``--address=<name>:6379``, ``common/pod.go``, written
unchanged into ``ray_current_cluster`` by Ray 2.60's ``ray start``).

:class:`ClusterDNS` runs dnsmasq (Debian's ``dnsmasq-base``, installed by ``make setup``) on a
loopback address, authoritative for ``cluster.local`` (a name it does not hold is NXDOMAIN at
once, never forwarded), with no cache, reading its records from a hosts file it is told to
re-read (SIGHUP) on every change. :meth:`ClusterDNS.command` wraps a pod's command so that it runs
in a mount namespace of its own whose ``/etc/resolv.conf`` names that resolver: the process
resolves names as a pod does, through glibc and the resolver, and shares everything else (the
loopback, the files) with the harness. Both need root (binding port 53, ``unshare --mount``), as
CI and the development machines run.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

RESOLVER_ADDRESS = "127.0.0.153"
CLUSTER_DOMAIN = "cluster.local"


def head_service_name(cluster: str, namespace: str) -> str:
    """KubeRay's head Service FQDN (``utils.GenerateFQDNServiceName``, 1.5.1-1.7)."""
    return f"{cluster}-head-svc.{namespace}.svc.{CLUSTER_DOMAIN}"


class ClusterDNS:
    """A resolver the test controls (see the module docstring); a context manager."""

    def __init__(self, root: Path, address: str = RESOLVER_ADDRESS) -> None:
        self.root = root
        self.address = address
        self.hosts = root / "hosts"
        self.resolv_conf = root / "resolv.conf"
        self._records: dict[str, str] = {}
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> ClusterDNS:
        problem = self.unavailable()
        if problem:
            raise RuntimeError(problem)
        self.root.mkdir(parents=True, exist_ok=True)
        self.hosts.write_text("")
        self.resolv_conf.write_text(f"nameserver {self.address}\noptions timeout:1 attempts:2\n")
        self._process = subprocess.Popen(
            [
                "dnsmasq",
                "--keep-in-foreground",
                "--no-resolv",
                "--no-hosts",
                f"--addn-hosts={self.hosts}",
                f"--listen-address={self.address}",
                "--bind-interfaces",
                "--port=53",
                f"--local=/{CLUSTER_DOMAIN}/",
                "--cache-size=0",
                "--no-negcache",
                "--user=root",
                "--pid-file=",
            ],
            stdout=subprocess.DEVNULL,
            stderr=open(self.root / "dnsmasq.log", "ab"),
        )
        self._wait_listening()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            self._process.wait(timeout=10)

    @staticmethod
    def unavailable() -> str | None:
        """Why the resolver cannot run here, or None."""
        if shutil.which("dnsmasq") is None:
            return "dnsmasq is not installed: `make setup` installs Debian's dnsmasq-base (as root)"
        if os.geteuid() != 0:
            return (
                "the cluster's DNS needs root (port 53, a mount namespace per pod): run the e2e tests as root"
            )
        return None

    def _wait_listening(self) -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                try:
                    probe.bind((self.address, 53))
                except OSError:
                    return  # dnsmasq holds the port
            time.sleep(0.05)
        raise RuntimeError(f"dnsmasq did not start on {self.address}:53 (see {self.root / 'dnsmasq.log'})")

    def add(self, name: str, ip: str) -> None:
        """A Service named ``name`` now exists (its ClusterIP, or the pod IP of a headless one)."""
        with self._lock:
            self._records[name] = ip
            self._publish()

    def remove(self, name: str) -> None:
        """The Service named ``name`` is gone: from now on the name does not resolve."""
        with self._lock:
            self._records.pop(name, None)
            self._publish()

    def _publish(self) -> None:
        staging = self.hosts.with_suffix(".tmp")
        staging.write_text("".join(f"{ip} {name}\n" for name, ip in sorted(self._records.items())))
        staging.replace(self.hosts)
        assert self._process is not None
        self._process.send_signal(signal.SIGHUP)  # re-read the hosts file now
        time.sleep(0.05)

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run as a pod runs it: its names resolved by this resolver (module docstring)."""
        script = 'mount --bind "$0" /etc/resolv.conf && exec "$@"'
        return [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            script,
            str(self.resolv_conf),
            *argv,
        ]

    def resolves(self, name: str) -> bool:
        """Whether a pod would resolve ``name`` now."""
        probe = "import socket, sys\ntry:\n    socket.gethostbyname(sys.argv[1])\nexcept OSError:\n    sys.exit(1)"
        import sys

        return subprocess.run(self.command([sys.executable, "-c", probe, name]), check=False).returncode == 0
