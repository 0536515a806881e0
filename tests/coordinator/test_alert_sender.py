"""Alerts against a local HTTP server that records what arrives: dedupe and summaries end
to end, retries that never hold up the caller, the rate limit, and what the HTTP client
does with proxies, credentials in the URL, redirects and TLS. The alerter's clock is a
manual one: summary windows end and the rate limit's tokens come only as a test says."""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import shutil
import socket
import ssl
import subprocess
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from test_alerts import thermal

from coordinator.alert_sender import Alerter, Retry, Webhook
from coordinator.alerts import AlertSettings
from proto.conditions import Severity
from proto.events import EventBase, JobCompleted
from ringmaster.clock import ManualClock
from ringmaster.procs import wait_until_async

pytestmark = pytest.mark.anyio
FAST = AlertSettings(summary_window_s=0.1, rate_per_s=100.0, burst=100)
ONCE = Retry(attempts=1, timeout_s=5.0)
PROXY_VARS = [f"{v}_proxy" for v in ("http", "https", "all", "no")]


@pytest.fixture(autouse=True)
def no_proxy_from_the_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """The client reads proxies from the environment: start every test without any."""
    for name in PROXY_VARS:
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)


class Recorder:
    """What arrived (``clock``'s monotonic time, JSON body, headers); answers ``codes`` in
    turn, then 200 (a 3xx with a Location header)."""

    def __init__(self, clock: ManualClock) -> None:
        self.got: list[tuple[float, dict[str, Any]]] = []
        self.headers: list[dict[str, str]] = []
        self.codes: list[int] = []
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                recorder.got.append((clock.monotonic(), json.loads(body)))
                recorder.headers.append(dict(self.headers.items()))
                code = recorder.codes.pop(0) if recorder.codes else 200
                self.send_response(code)
                if 300 <= code < 400:
                    self.send_header("Location", "/moved")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/hook?token=x"

    def texts(self) -> list[str]:
        return [body["text"] for _, body in self.got]


@contextlib.contextmanager
def running(server: ThreadingHTTPServer) -> Iterator[None]:
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()


class Proxy:
    """A forwarding HTTP proxy: a POST in absolute form goes to 127.0.0.1 on the URL's
    port, whatever host the URL names (so a URL only it can reach proves the request went
    through it); a CONNECT (https) is recorded and refused."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                proxy.seen.append(("POST", self.path))
                body = self.rfile.read(int(self.headers["Content-Length"]))
                url = urlsplit(self.path)
                upstream = http.client.HTTPConnection("127.0.0.1", url.port, timeout=10)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
                upstream.request("POST", f"{url.path}?{url.query}", body, headers)
                status = upstream.getresponse().status
                upstream.close()
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_CONNECT(self) -> None:
                proxy.seen.append(("CONNECT", self.path))
                self.send_response(403)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def server(clock: ManualClock) -> Iterator[Recorder]:
    recorder = Recorder(clock)
    with running(recorder.server):
        yield recorder


@pytest.fixture
def proxy() -> Iterator[Proxy]:
    forwarder = Proxy()
    with running(forwarder.server):
        yield forwarder


async def until(predicate: Any, timeout: float = 30.0) -> None:
    async def check() -> bool:
        return bool(predicate())

    await wait_until_async(check, timeout)


async def deliver(url: str, retry: Retry = ONCE) -> Webhook:
    """One message to ``url``, through a fresh Alerter (it reads the environment now)."""
    alerter = Alerter(lambda e: frozenset({url}), FAST, retry, ManualClock())
    alerter.notify(JobCompleted(job="j-1", message="done"))
    hook = alerter.hooks[url]
    await until(lambda: hook.sent + hook.failed == 1)
    await alerter.close()
    return hook


def at(event: EventBase, clock: ManualClock) -> EventBase:
    """``event`` stamped with the clock's wall time (two events stamped alike are one)."""
    event.time = datetime.fromtimestamp(clock.time(), UTC)
    return event


async def settle(alerter: Alerter, server: Recorder, clock: ManualClock) -> None:
    """Close once nothing more arrives: past the summary window, anything the alerter
    still held would reach the server within the bound."""
    clock.advance(alerter.settings.summary_window_s)
    arrived = len(server.got)
    with contextlib.suppress(TimeoutError):
        await until(lambda: len(server.got) > arrived, timeout=0.3)
    await alerter.close()


async def test_a_thermal_fault_makes_one_alert_and_one_resolution(
    server: Recorder, clock: ManualClock
) -> None:
    alerter = Alerter(lambda e: frozenset({server.url}), FAST, clock=clock)
    for level, temp in ((2, 95.0), (2, 97.0), (1, 90.0), (2, 95.0), (0, 40.0)):
        alerter.notify(at(thermal("node-1", level, temp), clock))
        clock.advance(0.05)
    await until(lambda: len(server.got) >= 2)
    await settle(alerter, server, clock)
    texts = server.texts()
    assert len(texts) == 2, texts
    assert texts[0].startswith("[CRITICAL] gpu.thermal:node-1:0 on node-1")
    assert texts[1].startswith("[RESOLVED] gpu.thermal:node-1:0")
    assert all(body["blocks"] for _, body in server.got)


async def test_fifty_nodes_failing_at_once_make_one_summary(
    server: Recorder, clock: ManualClock
) -> None:
    alerter = Alerter(lambda e: frozenset({server.url}), FAST, clock=clock)
    for i in range(50):
        alerter.notify(thermal(f"node-{i}", 2, 95.0))
    assert not alerter.hooks  # held for the summary window
    clock.advance(FAST.summary_window_s)
    await until(lambda: server.got)
    await settle(alerter, server, clock)
    assert len(server.got) == 1 and server.texts()[0].startswith("50 nodes: ")


async def test_a_dead_endpoint_is_retried_without_blocking(
    server: Recorder, clock: ManualClock
) -> None:
    with socket.socket() as s:  # a port nobody listens on: connection refused
        s.bind(("127.0.0.1", 0))
        refused = f"http://127.0.0.1:{s.getsockname()[1]}/hook"
    retry = Retry(attempts=4, first_delay_s=0.05, max_delay_s=0.2, timeout_s=5.0)
    alerter = Alerter(lambda e: frozenset({refused, server.url}), FAST, retry, clock)
    server.codes = [500, 502, 503, 500]
    for i in range(100):
        alerter.notify(JobCompleted(job=f"j-{i}", message="done"))
    dead, flaky = alerter.hooks[refused], alerter.hooks[server.url]
    # notify only enqueued: nothing can have been sent before the loop gets a turn
    assert len(dead.queue) == len(flaky.queue) == 100 and not server.got
    await until(lambda: dead.failed >= 1 and flaky.sent >= 1)
    await alerter.close()
    assert dead.sent == 0
    texts = server.texts()
    assert texts[:4] == [texts[0]] * 4 and texts[4] != texts[0], texts[:5]  # 4 tries, then on
    assert flaky.failed == 1


async def test_a_client_error_is_not_retried(server: Recorder) -> None:
    server.codes = [404]
    hook = await deliver(server.url, Retry(attempts=4, first_delay_s=0.05))
    assert hook.failed == 1 and len(server.got) == 1


async def test_a_url_no_client_can_use_fails_its_messages_and_only_them() -> None:
    url = "http://127.0.0.1:99999/hook"  # parses, but no socket takes that port
    retry = Retry(attempts=3, first_delay_s=0.05)
    alerter = Alerter(lambda e: frozenset({url}), FAST, retry, ManualClock())
    for job in ("j-1", "j-2"):
        alerter.notify(JobCompleted(job=job, message="done"))
    hook = alerter.hooks[url]
    await until(lambda: hook.failed == 2)  # the first did not end the queue's task
    await alerter.close()


async def test_the_rate_limit_is_honoured(server: Recorder, clock: ManualClock) -> None:
    settings = AlertSettings(rate_per_s=10.0, burst=2)
    alerter = Alerter(lambda e: frozenset({server.url}), settings, clock=clock)
    for i in range(6):
        alerter.notify(JobCompleted(job=f"j-{i}", severity=Severity.INFO, message="done"))
    hook = alerter.hooks[server.url]

    async def all_arrived() -> bool:
        """Time passes in small steps, each once what was sent has arrived (so an
        arrival's time is the time it was sent at)."""
        if len(server.got) == 6 - len(hook.queue):
            clock.advance(0.05)
        return len(server.got) == 6

    await wait_until_async(all_arrived, 30.0)
    await alerter.close()
    arrivals = [t for t, _ in server.got]
    # two at once (the burst), then one every 0.1 s
    assert arrivals[5] - arrivals[0] >= 0.35


async def test_credentials_in_the_url_are_sent_as_basic_auth(server: Recorder) -> None:
    url = f"http://bot:s%40cret@127.0.0.1:{server.port}/hook"
    hook = await deliver(url)
    assert hook.sent == 1
    expected = "Basic " + base64.b64encode(b"bot:s@cret").decode()
    assert server.headers[0]["Authorization"] == expected
    assert server.headers[0]["Content-Type"] == "application/json"


async def test_a_redirect_is_not_followed(server: Recorder) -> None:
    server.codes = [307]
    hook = await deliver(server.url, Retry(attempts=3, first_delay_s=0.05))
    assert hook.failed == 1 and hook.sent == 0
    assert len(server.got) == 1  # neither retried nor re-POSTed to /moved


async def test_http_goes_through_the_proxy_the_environment_names(
    server: Recorder, proxy: Proxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HTTP_PROXY", proxy.url)
    monkeypatch.setenv("http_proxy", proxy.url)
    # a host only the proxy can reach: delivered at all means delivered through it
    url = f"http://hooks.invalid:{server.port}/hook?token=x"
    hook = await deliver(url)
    assert hook.sent == 1 and len(server.got) == 1 and "j-1" in server.texts()[0]
    assert proxy.seen == [("POST", url)]


async def test_https_goes_through_the_https_proxy_and_a_refusal_is_retried(
    proxy: Proxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HTTPS_PROXY", proxy.url)
    monkeypatch.setenv("https_proxy", proxy.url)
    hook = await deliver("https://hooks.invalid/hook", Retry(attempts=2, first_delay_s=0.05))
    assert hook.failed == 1
    assert proxy.seen == [("CONNECT", "hooks.invalid:443")] * 2


async def test_no_proxy_bypasses_it_and_nothing_else_does(
    server: Recorder, proxy: Proxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HTTP_PROXY", proxy.url)
    monkeypatch.setenv("http_proxy", proxy.url)
    assert (await deliver(server.url)).sent == 1
    assert proxy.seen == [("POST", server.url)]  # loopback is no exception by itself
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    hook = await deliver(server.url)
    assert hook.sent == 1 and len(server.got) == 2 and len(proxy.seen) == 1


@pytest.fixture
def tls_server(tmp_path: Path, clock: ManualClock) -> Iterator[tuple[Recorder, Path]]:
    """The recorder over HTTPS with a self-signed certificate for 127.0.0.1."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command (apt-get install openssl)")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"),
            *("-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1"),
            *("-addext", "subjectAltName=IP:127.0.0.1"),
        ],
        check=True,
        capture_output=True,
    )
    recorder = Recorder(clock)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    recorder.server.socket = context.wrap_socket(recorder.server.socket, server_side=True)
    recorder.url = recorder.url.replace("http://", "https://")
    with running(recorder.server):
        yield recorder, cert


async def test_tls_is_verified_against_the_trust_store(
    tls_server: tuple[Recorder, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, cert = tls_server
    untrusted = await deliver(server.url)
    assert untrusted.failed == 1 and not server.got  # self-signed: refused
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # now it is a trusted certificate
    trusted = await deliver(server.url)
    assert trusted.sent == 1 and len(server.got) == 1
