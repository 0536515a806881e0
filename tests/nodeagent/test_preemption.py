"""PreemptionCollector against local HTTP servers playing AWS, GCP and Azure metadata, and
SpotNoticeDetector. The service and the collector share a manual clock: a notice's time
left is exact."""

from __future__ import annotations

import json
import socket
import socketserver
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from nodeagent.collectors.base import CollectorUnavailable
from nodeagent.collectors.preemption import (
    AWS_TOKEN_TTL_S,
    MetadataError,
    Notice,
    PreemptionCollector,
    PreemptionSample,
)
from nodeagent.detectors.preemption import PASSED_AFTER_S, SpotNoticeDetector
from nodeagent.sim.metadata import MetadataServer
from proto.conditions import ConditionKind, condition_key
from proto.events import SpotNotice
from ringmaster.clock import EPOCH, ManualClock
from ringmaster.procs import wait_until

NOW = datetime.fromtimestamp(EPOCH, UTC)  # a manual clock's wall time until it is moved


@pytest.fixture
def metadata(request: pytest.FixtureRequest) -> Iterator[MetadataServer]:
    providers = getattr(request, "param", ("aws", "gcp", "azure"))
    server = MetadataServer(providers, clock=ManualClock()).start()
    try:
        yield server
    finally:
        server.stop()


def collector(server: MetadataServer, provider: str = "auto") -> PreemptionCollector:
    url = server.url
    return PreemptionCollector(
        provider=provider, aws_url=url, gcp_url=url, azure_url=url, clock=server.clock
    )


def notice_of(c: PreemptionCollector, now: float = EPOCH) -> Notice | None:
    return c.collect(now).notice


def test_aws_imdsv2_token_then_instance_action(metadata: MetadataServer) -> None:
    aws = collector(metadata, "aws")
    assert aws.collect(0.0) == PreemptionSample(time=0.0, provider="aws", notice=None)
    metadata.preempt(120)
    notice = notice_of(aws)
    assert notice is not None
    assert notice.deadline.tzinfo is not None
    assert notice.deadline == NOW + timedelta(seconds=120)
    assert notice.action == "terminate" and notice.detail == "spot instance-action"
    puts = [r for r in metadata.requests if r.startswith("PUT")]
    assert puts == ["PUT /latest/api/token"], "one token, reused"
    metadata.tokens.clear()  # the token is no longer valid: fetch another, once
    assert notice_of(aws) is not None
    assert [r for r in metadata.requests if r.startswith("PUT")] == ["PUT /latest/api/token"] * 2
    metadata.withdraw()
    assert notice_of(aws) is None


@pytest.mark.parametrize("metadata", [("aws",)], indirect=True)
def test_the_imdsv2_token_is_renewed_before_it_expires(metadata: MetadataServer) -> None:
    clock = metadata.clock
    assert isinstance(clock, ManualClock)
    aws = collector(metadata, "aws")
    aws.collect(EPOCH)
    clock.advance(AWS_TOKEN_TTL_S - 61)
    aws.collect(clock.time())
    assert [r for r in metadata.requests if r.startswith("PUT")] == ["PUT /latest/api/token"]
    clock.advance(1)  # a minute before it expires: another
    aws.collect(clock.time())
    assert [r for r in metadata.requests if r.startswith("PUT")] == ["PUT /latest/api/token"] * 2


@pytest.mark.parametrize("key", ["action", "instance-action"])
def test_aws_both_keys(key: str) -> None:
    class Imds(BaseHTTPRequestHandler):
        def do_PUT(self) -> None:
            self._send(b"token")

        def do_GET(self) -> None:
            self._send(json.dumps({key: "stop", "time": "2026-11-05T10:02:00Z"}).encode())

        def _send(self, body: bytes) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Imds)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        notice = notice_of(PreemptionCollector(provider="aws", aws_url=url))
        assert notice == Notice(
            action="stop",
            deadline=datetime(2026, 11, 5, 10, 2, tzinfo=UTC),
            detail="spot instance-action",
        )
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("metadata", [("gcp",)], indirect=True)
def test_gcp_preempted_flag_with_a_deadline_from_first_sight(metadata: MetadataServer) -> None:
    gcp = collector(metadata)
    assert gcp.collect(0.0) == PreemptionSample(time=0.0, provider="gcp", notice=None)
    metadata.preempt(30)
    first, second = notice_of(gcp), notice_of(gcp, EPOCH + 2)
    assert first is not None and first == second, "the deadline is fixed at first sight"
    assert first.deadline == NOW + timedelta(seconds=30)  # GCP's own: the setting's
    assert first.detail == "instance/preempted is TRUE"
    metadata.withdraw()
    assert notice_of(gcp, EPOCH + 4) is None
    metadata.preempt(30)
    again = notice_of(gcp, EPOCH + 6)
    assert again is not None and again.deadline == NOW + timedelta(seconds=36), "seen anew"


@pytest.mark.parametrize("metadata", [("azure",)], indirect=True)
def test_azure_scheduled_preempt_event(metadata: MetadataServer) -> None:
    azure = collector(metadata)
    assert azure.collect(0.0) == PreemptionSample(time=0.0, provider="azure", notice=None)
    metadata.preempt(45)
    notice = notice_of(azure)
    assert notice is not None and notice.action == "preempt"
    assert notice.detail == "602d9444-d2cd-49c7-8624-8643e7171297"
    assert notice.deadline == NOW + timedelta(seconds=45)


def test_no_metadata_service_is_unavailable_and_not_retried_at_once() -> None:
    dead = "http://127.0.0.1:9"  # the discard port: connection refused
    lonely = PreemptionCollector(aws_url=dead, gcp_url=dead, azure_url=dead, redetect_s=60)
    for _ in range(2):
        with pytest.raises(CollectorUnavailable, match="no cloud metadata service"):
            lonely.collect(0.0)


@pytest.mark.parametrize("metadata", [()], indirect=True)  # a service, but no cloud's
def test_detection_is_tried_again_after_redetect_s(metadata: MetadataServer) -> None:
    clock = metadata.clock
    assert isinstance(clock, ManualClock)
    url = metadata.url
    lonely = PreemptionCollector(
        aws_url=url, gcp_url=url, azure_url=url, redetect_s=60, clock=clock
    )
    tried = []
    for advance in (0, 59, 1):
        clock.advance(advance)
        with pytest.raises(CollectorUnavailable, match="no cloud metadata service"):
            lonely.collect(clock.time())
        tried.append(len(metadata.requests))
    assert tried == [3, 3, 6], "each provider probed, then not again until redetect_s"


@pytest.mark.parametrize("metadata", [("aws",)], indirect=True)
def test_a_failing_service_fails_the_collection(metadata: MetadataServer) -> None:
    aws = collector(metadata)
    aws.collect(0.0)
    metadata.failing = 503
    with pytest.raises(MetadataError, match="HTTP 503"):
        aws.collect(1.0)
    metadata.failing = None
    assert aws.collect(2.0).notice is None, "and it recovers by itself"
    assert issubclass(MetadataError, OSError)


def test_connections_are_kept_alive_and_renewed(monkeypatch: pytest.MonkeyPatch) -> None:
    """One connection for many polls; when the service closed it while idle, the next
    poll opens another instead of failing."""
    server = MetadataServer(("aws",), idle_timeout=1.0)
    port = int(server.url.rsplit(":", 1)[1])
    opened: list[object] = []
    closed: list[object] = []  # the server's side: accepted, then done with

    def ours(tcp: socketserver.TCPServer) -> bool:
        return tcp.server_address[1] == port

    def get_request(tcp: socketserver.TCPServer) -> tuple[socket.socket, Any]:
        request = accept(tcp)
        if ours(tcp):
            opened.append(request[0])
        return request

    def shutdown_request(tcp: socketserver.TCPServer, request: socket.socket) -> None:
        shutdown(tcp, request)
        if ours(tcp):
            closed.append(request)

    accept, shutdown = socketserver.TCPServer.get_request, socketserver.TCPServer.shutdown_request
    monkeypatch.setattr(socketserver.TCPServer, "get_request", get_request)
    monkeypatch.setattr(socketserver.TCPServer, "shutdown_request", shutdown_request)
    server.start()
    try:
        aws = collector(server, "aws")
        for t in range(5):
            aws.collect(float(t))
        assert len(server.requests) == 6 and len(opened) == 1, "a token and 5 polls, one socket"
        wait_until(lambda: closed, timeout=30)  # the service dropped it, idle
        server.preempt(60)
        assert notice_of(aws) is not None
        assert len(opened) == 2, "renewed: a second connection"
    finally:
        server.stop()


def test_spot_notice_once_per_notice() -> None:
    detector = SpotNoticeDetector("node-2")
    deadline = NOW + timedelta(seconds=90)
    notice = Notice(action="terminate", deadline=deadline, detail="x")

    def seen(t: float, present: bool) -> list[SpotNotice]:
        sample = PreemptionSample(time=t, provider="aws", notice=notice if present else None)
        events = detector.observe(sample)
        return [e for e in events if isinstance(e, SpotNotice)]

    now = deadline.timestamp() - 90
    first = seen(now, True)
    assert len(first) == 1 and seen(now + 2, True) == []
    event = first[0]
    assert (event.node, event.provider, event.action, event.deadline) == (
        "node-2",
        "aws",
        "terminate",
        deadline,
    )
    assert event.severity == "critical" and "in 90 s" in event.message
    assert seen(now + 4, False) == [] and len(seen(now + 6, True)) == 1


def test_a_notice_is_a_condition_that_closes_with_no_event() -> None:
    """The contract has no kind for a withdrawn notice: the closed condition is handed to
    the agent's active set directly, and the heartbeat carries the change."""
    detector = SpotNoticeDetector("node-2")
    notice = Notice(action="terminate", deadline=NOW, detail="x")
    opened = detector.observe(PreemptionSample(time=1.0, provider="gcp", notice=notice))
    assert detector.unannounced() == []
    condition = opened[0].condition
    assert condition is not None and condition.active and condition.severity == "critical"
    assert condition.key == condition_key(ConditionKind.PREEMPTION, "node-2", "gcp")
    assert condition.reason == opened[0].message
    assert detector.observe(PreemptionSample(time=2.0, provider="gcp")) == []
    [closed] = detector.unannounced()
    assert (closed.key, closed.active, closed.since) == (condition.key, False, 2.0)
    assert detector.unannounced() == [], "handed over once"


def test_a_notice_whose_deadline_passes_with_the_node_up_closes_once() -> None:
    """The metadata service still serves the notice (AWS's instance-action stays), but the
    machine was not taken: once the agent has sampled PASSED_AFTER_S past the deadline,
    the condition closes saying so, and the same notice never opens it again; one with
    another deadline does."""
    detector = SpotNoticeDetector("node-2")
    deadline = NOW + timedelta(seconds=20)
    notice = Notice(action="terminate", deadline=deadline, detail="x")
    at = deadline.timestamp()

    def seen(t: float, n: Notice | None = notice) -> list[SpotNotice]:
        events = detector.observe(PreemptionSample(time=at + t, provider="aws", notice=n))
        return [e for e in events if isinstance(e, SpotNotice)]

    assert len(seen(-20.0)) == 1
    assert seen(0.0) == [] and seen(PASSED_AFTER_S) == [] and detector.unannounced() == []
    assert seen(PASSED_AFTER_S + 1.0) == []
    [closed] = detector.unannounced()
    assert not closed.active and closed.since == at + PASSED_AFTER_S + 1.0
    assert closed.reason == (
        f"aws preemption notice passed: terminate was due at {deadline:%H:%M:%S} UTC, "
        f"{PASSED_AFTER_S + 1:.0f} s ago, and this node is still up"
    )
    assert seen(600.0) == [] and detector.unannounced() == [], "the same notice: passed"
    later = Notice(action="terminate", deadline=deadline + timedelta(seconds=700), detail="y")
    assert len(seen(650.0, later)) == 1, "another deadline: a new notice"


def test_a_notice_first_seen_long_past_its_deadline_opens_nothing() -> None:
    """An agent restarted after a notice passed finds it still served: not a notice."""
    detector = SpotNoticeDetector("node-2")
    notice = Notice(action="terminate", deadline=NOW, detail="x")
    late = NOW.timestamp() + PASSED_AFTER_S + 5.0
    assert detector.observe(PreemptionSample(time=late, provider="aws", notice=notice)) == []
    assert detector.unannounced() == []
    assert detector.observe(PreemptionSample(time=late + 2.0, provider="aws")) == []
    assert detector.unannounced() == []
