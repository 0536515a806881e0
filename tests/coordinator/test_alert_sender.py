"""Alerts against a local HTTP server that records what arrives: dedupe and summaries end
to end, retries with backoff that never hold up the caller, and the rate limit."""

from __future__ import annotations

import asyncio
import itertools
import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from test_alerts import thermal

from coordinator.alert_sender import Alerter, Retry, post_json
from coordinator.alerts import AlertSettings
from proto.conditions import Severity
from proto.events import JobCompleted

pytestmark = pytest.mark.anyio
FAST = AlertSettings(summary_window_s=0.1, rate_per_s=100.0, burst=100)


class Recorder:
    """What arrived (monotonic time, JSON body); answers ``codes`` in turn, then 200."""

    def __init__(self) -> None:
        self.got: list[tuple[float, dict[str, Any]]] = []
        self.codes: list[int] = []
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                recorder.got.append((time.monotonic(), json.loads(body)))
                self.send_response(recorder.codes.pop(0) if recorder.codes else 200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook?token=x"

    def texts(self) -> list[str]:
        return [body["text"] for _, body in self.got]


@pytest.fixture
def server() -> Iterator[Recorder]:
    recorder = Recorder()
    thread = threading.Thread(target=recorder.server.serve_forever, daemon=True)
    thread.start()
    yield recorder
    recorder.server.shutdown()
    recorder.server.server_close()


async def settle(alerter: Alerter, seconds: float) -> None:
    await asyncio.sleep(seconds)
    await alerter.close()


async def test_a_thermal_fault_makes_one_alert_and_one_resolution(server: Recorder) -> None:
    alerter = Alerter(lambda e: frozenset({server.url}), FAST)
    for level, temp in ((2, 95.0), (2, 97.0), (1, 90.0), (2, 95.0), (0, 40.0)):
        alerter.notify(thermal("node-1", level, temp))
        await asyncio.sleep(0.05)
    await settle(alerter, 0.5)
    texts = server.texts()
    assert len(texts) == 2, texts
    assert texts[0].startswith("[CRITICAL] gpu.thermal:node-1:0 on node-1")
    assert texts[1].startswith("[RESOLVED] gpu.thermal:node-1:0")
    assert all(body["blocks"] for _, body in server.got)


async def test_fifty_nodes_failing_at_once_make_one_summary(server: Recorder) -> None:
    alerter = Alerter(lambda e: frozenset({server.url}), FAST)
    for i in range(50):
        alerter.notify(thermal(f"node-{i}", 2, 95.0))
    await settle(alerter, 0.6)
    assert len(server.got) == 1 and server.texts()[0].startswith("50 nodes: ")


async def test_a_dead_endpoint_is_retried_with_backoff_without_blocking(server: Recorder) -> None:
    with socket.socket() as s:  # a port nobody listens on: connection refused
        s.bind(("127.0.0.1", 0))
        refused = f"http://127.0.0.1:{s.getsockname()[1]}/hook"
    retry = Retry(attempts=4, first_delay_s=0.05, timeout_s=1.0)
    alerter = Alerter(lambda e: frozenset({refused, server.url}), FAST, retry)
    server.codes = [500, 502, 503, 500]
    started = time.perf_counter()
    for i in range(100):
        alerter.notify(JobCompleted(job=f"j-{i}", message="done"))
    assert time.perf_counter() - started < 0.1  # the caller never waits on the network
    await asyncio.sleep(0.6)  # 4 tries 0.05, 0.1 and 0.2 s apart
    dead, flaky = alerter.hooks[refused], alerter.hooks[server.url]
    assert dead.sent == 0 and dead.failed >= 1
    await settle(alerter, 0.6)
    first = [t for t, _ in server.got[:4]]  # the first message's four tries
    gaps = [round(b - a, 2) for a, b in itertools.pairwise(first)]
    assert all(gap >= want for gap, want in zip(gaps, (0.05, 0.1, 0.2), strict=True)), gaps
    assert flaky.failed == 1 and flaky.sent >= 1  # 4 tries on the first message, then on


async def test_the_rate_limit_is_honoured(server: Recorder) -> None:
    settings = AlertSettings(rate_per_s=10.0, burst=2)
    alerter = Alerter(lambda e: frozenset({server.url}), settings)
    for i in range(6):
        alerter.notify(JobCompleted(job=f"j-{i}", severity=Severity.INFO, message="done"))
    await settle(alerter, 0.8)
    arrivals = [t for t, _ in server.got]
    assert len(arrivals) == 6
    # two at once (the burst), then one every 0.1 s
    assert arrivals[5] - arrivals[0] >= 0.35


async def test_post_json_speaks_plain_http(server: Recorder) -> None:
    assert await post_json(server.url, b'{"text": "hi"}', 2.0) == 200
    assert server.texts() == ["hi"]
