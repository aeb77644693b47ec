"""Liveness and readiness endpoints for the operator's pod (``/healthz``, ``/readyz``).

``/healthz`` answers 200 while the scheduler thread (which runs every timed pass) is alive:
a dead scheduler means deadlines and retries would never fire, so the kubelet restarts the pod.
``/readyz`` answers 200 once the operator's startup finished (caches listed, handlers running).
Anything else answers 503 with a one-line reason.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

__all__ = ["HealthServer"]


class HealthServer:
    def __init__(self, port: int, *, alive: Callable[[], bool], ready: Callable[[], bool]) -> None:
        checks = {"/healthz": ("alive", alive), "/readyz": ("ready", ready)}

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                name, check = checks.get(self.path, ("", None)) if self.path in checks else ("", None)
                if check is None:
                    self.send_error(404, "try /healthz or /readyz")
                    return
                ok = check()
                body = f"{name}\n".encode() if ok else f"not {name}\n".encode()
                self.send_response(200 if ok else 503)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                return  # probes every few seconds: not worth a log line each

        self.server = ThreadingHTTPServer(("0.0.0.0", port), Handler)
        self.port = self.server.server_address[1]

    def start(self) -> None:
        threading.Thread(target=self.server.serve_forever, name="hybridflow-health", daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
