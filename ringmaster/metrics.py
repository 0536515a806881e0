"""The ``/metrics`` endpoint both daemons serve: prometheus-client's own HTTP server, in a
thread of its own, over a private registry.

Why a thread and not the event loop: a scrape must never wait behind a slow KV write or a
burst of heartbeats, and the loop must never wait behind a slow scraper. The collectors a
registry holds read the daemon's state from that thread, so they read only what the loop
replaces whole (a newer sample, a newer record) and copy containers in one call.

Ports: a positive number is that port; ``0`` turns the endpoint off; ``-1`` lets the kernel
pick a free port (``coordinatorctl up``, where many daemons share a host). The address
actually bound is what :attr:`MetricsServer.url` reports and heartbeats carry.
"""

from __future__ import annotations

import ipaddress
import threading
from wsgiref.simple_server import WSGIServer

import structlog
from prometheus_client import CollectorRegistry, start_http_server

log = structlog.get_logger()
ANY_PORT = -1
OFF = 0
WILDCARDS = ("", "0.0.0.0", "::")


class MetricsServer:
    def __init__(self, server: WSGIServer, thread: threading.Thread, host: str) -> None:
        self._server, self._thread = server, thread
        self.port: int = server.server_port
        self.url = f"http://{_bracketed(host)}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=2.0)


def serve(registry: CollectorRegistry, port: int, addr: str, host: str) -> MetricsServer | None:
    """Serve ``registry`` on ``addr:port``; ``host`` names this machine in the URL when
    ``addr`` is a wildcard. None when the endpoint is off or its port is taken: metrics are
    never a reason for a daemon not to run (the URL in ``status`` stays empty)."""
    if port == OFF:
        return None
    try:
        server, thread = start_http_server(max(port, 0), addr=addr, registry=registry)
    except OSError as exc:
        log.error("metrics endpoint not started", addr=addr, port=port, error=str(exc))
        return None
    metrics = MetricsServer(server, thread, addr if addr not in WILDCARDS else host)
    log.info("metrics endpoint up", url=metrics.url)
    return metrics


def _bracketed(host: str) -> str:
    try:
        return f"[{host}]" if ipaddress.ip_address(host).version == 6 else host
    except ValueError:
        return host  # a host name
