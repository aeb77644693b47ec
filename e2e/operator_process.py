"""The operator as a cluster runs it: ``python -m hybridflow_operator`` in a process of its own.

The process gets what the chart's Deployment gives the pod (``WATCH_NAMESPACES``, the runtime
image, ports, retry backoff) and a kubeconfig for the API-server double instead of the in-cluster
token. It is started, waited for (``/readyz``), killed and restarted by the e2e scenarios; a
restarted operator starts from nothing but what the API server holds, as after a pod restart.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

STARTUP_TIMEOUT_SECONDS = 120.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class OperatorProcess:
    def __init__(self, kubeconfig: Path, log: Path, *, namespace: str, env: dict[str, str]) -> None:
        self.kubeconfig, self.log, self.namespace, self.extra_env = kubeconfig, log, namespace, env
        self.process: subprocess.Popen[bytes] | None = None
        self.health_port = 0
        self.starts = 0

    def start(self) -> None:
        """Start the operator and wait until it answers ready (caches listed, handlers running)."""
        self.health_port = free_port()
        env = {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "WATCH_NAMESPACES": self.namespace,
            "POD_NAMESPACE": self.namespace,
            "HYBRIDFLOW_OPERATOR_METRICS_PORT": str(free_port()),
            "HYBRIDFLOW_OPERATOR_HEALTH_PORT": str(self.health_port),
            "PYTHONUNBUFFERED": "1",
            **self.extra_env,
        }
        env.pop("KUBERNETES_SERVICE_HOST", None)
        self.starts += 1
        with open(self.log, "ab") as output:
            output.write(f"--- operator start {self.starts}\n".encode())
            output.flush()
            self.process = subprocess.Popen(
                [sys.executable, "-m", "hybridflow_operator"],
                stdout=output,
                stderr=subprocess.STDOUT,
                env=env,
            )
        deadline = time.monotonic() + STARTUP_TIMEOUT_SECONDS
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the operator exited with {self.process.returncode}:\n{self.tail()}")
            if self.ready():
                return
            time.sleep(0.2)
        raise RuntimeError(f"the operator was not ready within {STARTUP_TIMEOUT_SECONDS} s:\n{self.tail()}")

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/readyz", timeout=2) as answer:
                return bool(answer.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def kill(self) -> None:
        """SIGKILL, as a lost node or an OOM kill: no cleanup handler runs."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def tail(self, characters: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-characters:] if self.log.exists() else ""
