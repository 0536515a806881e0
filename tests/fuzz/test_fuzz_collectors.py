"""What the collectors read from the node: sysfs ``stat`` and ``ro`` files, SMART JSON,
procfs values, chrony's tracking line and the cloud metadata services' answers. The
contract (nodeagent/collectors/base.py and each collector's docstring): a collector
returns a sample, recording a bad device in ``errors``, or raises its documented
exception (``CollectorUnavailable``; ``MetadataError`` for metadata), never another."""

from __future__ import annotations

import json
import math
import sys
import tempfile
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest
from fuzz_support import counted, json_values, long_text
from hypothesis import given
from hypothesis import strategies as st

from nodeagent.collectors.base import CollectorUnavailable, Roots
from nodeagent.collectors.clock import parse_tracking
from nodeagent.collectors.nvme import NvmeLatencyCollector, StatError, parse_ro, parse_stat
from nodeagent.collectors.nvme_smart import NvmeSmartCollector, SmartError, parse_smart
from nodeagent.collectors.preemption import MetadataError, PreemptionCollector
from nodeagent.collectors.preflight import PreflightCollector
from nodeagent.collectors.sysctl import SOMAXCONN, Tunable

GOOD_STAT = "  100 0 800 50 200 0 1600 70 0 90 120 0 0 0 0\n"
counters = st.one_of(
    st.integers(0, 2**64 - 1).map(str),
    st.sampled_from(["-1", "1_0", "+5", "0x10", "1e3", "٣", "", "nan", "9" * 4000]),
)
stat_texts = st.one_of(
    st.binary(max_size=200).map(lambda b: b.decode("ascii", errors="replace")),
    st.lists(counters, min_size=0, max_size=20).map(" ".join),
    st.just(GOOD_STAT),
)


@given(stat_texts)
@counted
def test_parse_stat(text: str) -> None:
    try:
        ios, ticks, in_flight = parse_stat(text)
    except StatError as exc:
        assert str(exc)
        return
    for value in (ios, ticks, in_flight):
        assert 0 <= value < 2**65, "more than two u64 counters summed"


@given(st.text(max_size=30))
@counted
def test_parse_ro(text: str) -> None:
    try:
        assert parse_ro(text) is (text.strip() == "1")
    except StatError:
        assert text.strip() not in ("0", "1")


def _tree(base: Path, devices: dict[str, tuple[bytes, bytes]]) -> Roots:
    for dev, (stat, ro) in devices.items():
        (base / "block" / dev).mkdir(parents=True, exist_ok=True)
        (base / "block" / dev / "stat").write_bytes(stat)
        (base / "block" / dev / "ro").write_bytes(ro)
    return Roots(sysfs=base)


stat_bytes = st.one_of(st.binary(max_size=100), stat_texts.map(str.encode))
ro_bytes = st.sampled_from([b"0\n", b"1\n", b"", b"2", b"\xff", b"0 1"])


@given(st.lists(st.tuples(stat_bytes, ro_bytes), min_size=2, max_size=2), st.floats(0, 1e6))
@counted
def test_nvme_collector(readings: list[tuple[bytes, bytes]], later: float) -> None:
    """Two windows over a fuzzed device beside a healthy one: the healthy one is always
    read, the fuzzed one is a reading or an entry in ``errors``."""
    with tempfile.TemporaryDirectory(prefix="fuzz-sysfs-") as name:
        base = Path(name)
        collector = NvmeLatencyCollector(_tree(base, {"nvme0n1": (GOOD_STAT.encode(), b"0\n")}))
        for i, (stat, ro) in enumerate(readings):
            _tree(base, {"nvme1n1": (stat, ro)})
            sample = collector.collect(now=1000.0 + i * later)
            assert "nvme0n1" in sample.devices, sample.errors
            assert ("nvme1n1" in sample.devices) != ("nvme1n1" in sample.errors)
            for reading in sample.devices.values():
                assert reading.latency_us is None or reading.latency_us >= 0
                assert math.isfinite(reading.iops) and reading.iops >= 0


def test_nvme_collector_without_devices() -> None:
    with tempfile.TemporaryDirectory() as name, pytest.raises(CollectorUnavailable):
        NvmeLatencyCollector(Roots(sysfs=Path(name))).collect(now=1.0)


SMART = {"critical_warning": 8, "temperature": 310, "avail_spare": 100, "percent_used": 3}
smart_texts = st.one_of(
    st.text(max_size=100),
    st.just("[" * 5000 + "]" * 5000),
    st.builds(
        lambda doc: json.dumps(doc, allow_nan=True),
        st.fixed_dictionaries({}, optional={k: json_values(3) for k in SMART}).map(
            lambda d: {**SMART, **d}
        ),
    ),
    st.builds(
        lambda v: json.dumps({"critical_warning": {"value": v}}, allow_nan=True), json_values(3)
    ),
    st.builds(
        lambda n: '{"critical_warning": 1, "temperature": ' + "9" * n + "}", st.integers(1, 4000)
    ),
)


@given(smart_texts)
@counted
def test_parse_smart(text: str) -> None:
    try:
        log = parse_smart(text)
    except SmartError as exc:
        assert str(exc)
        return
    assert log.media_readonly is bool(log.critical_warning & 0x8)
    for value in (log.temperature_c, log.avail_spare_pct, log.percent_used):
        assert value is None or isinstance(value, int | float)


@given(st.binary(max_size=300))
@counted
def test_smart_collector_output(output: bytes) -> None:
    """The command's output, whatever its bytes: a log or an entry in ``errors``."""
    with tempfile.TemporaryDirectory(prefix="fuzz-smart-") as name:
        base = Path(name)
        (base / "block" / "nvme0n1").mkdir(parents=True)
        (base / "out").write_bytes(output)
        command = ["cat", str(base / "out")]
        sample = NvmeSmartCollector(Roots(sysfs=base), command=command).collect(now=1.0)
        assert ("nvme0n1" in sample.devices) != ("nvme0n1" in sample.errors)


@given(st.one_of(st.binary(max_size=60), st.integers().map(lambda i: str(i).encode())))
@counted
def test_preflight_somaxconn(content: bytes) -> None:
    with tempfile.TemporaryDirectory(prefix="fuzz-proc-") as name:
        base = Path(name)
        (base / "proc/sys/net/core").mkdir(parents=True)
        (base / "proc/sys/net/core/somaxconn").write_bytes(content)
        (base / "dev/shm").mkdir(parents=True)
        roots = Roots(procfs=base / "proc", dev=base / "dev")
        somaxconn = Tunable("somaxconn", SOMAXCONN, 4096)
        collector = PreflightCollector(
            roots, needs=[], interval_s=60, tunables=[somaxconn], shm_min_gb=0.0
        )
        sample = collector.collect(now=1.0)
        check = sample.checks[0]
        assert check.name == "somaxconn" and "\n" not in check.value
        try:
            value = int(content.decode().strip())
        except (UnicodeDecodeError, ValueError):
            assert not check.ok and check.value.startswith("unreadable")
        else:
            assert check.ok is (value >= 4096)


GOOD_TRACKING = (
    "A29FC87B,162.159.200.123,3,1700000000.0,-0.000012,0.000010,0.000020,"
    "-1.2,0.001,0.02,0.010,0.002,64.0,Normal\n"
)
tracking = st.one_of(
    st.text(max_size=120),
    st.lists(st.one_of(st.text(max_size=6), st.floats().map(str), long_text()), max_size=16).map(
        ",".join
    ),
    st.just(GOOD_TRACKING),
)


@given(tracking)
@counted
def test_parse_tracking(line: str) -> None:
    """One chronyc line: a reading with finite numbers, or a ValueError the collector
    records as ``chrony_error``."""
    try:
        reading = parse_tracking(line)
    except ValueError as exc:
        assert str(exc)
        return
    assert math.isfinite(reading.offset_ms) and math.isfinite(reading.bound_ms)


# -- metadata services, served from loopback -----------------------------------------------


class Metadata(BaseHTTPRequestHandler):
    """Answers every request with the status and body the property chose."""

    answer: ClassVar[tuple[int, bytes, dict[str, str]]] = (404, b"", {})

    def _reply(self) -> None:
        status, body, headers = self.answer
        if "/latest/api/token" in self.path:
            status, body = 200, b"token"
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_PUT = _reply

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def metadata() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Metadata)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


AWS = {"action": "terminate", "time": "2030-01-01T00:00:00Z"}
AZURE = {"Events": [{"EventType": "Preempt", "NotBefore": "Mon, 19 Sep 2030 18:29:47 GMT"}]}


def _bodies(good: dict[str, Any]) -> st.SearchStrategy[bytes]:
    from fuzz_support import structured

    return st.one_of(st.binary(max_size=200), structured(good), st.just(json.dumps(good).encode()))


def _azure_well_formed(body: bytes) -> bool:
    try:
        events = json.loads(body)["Events"]
        return any(isinstance(e, dict) and e.get("EventType") == "Preempt" for e in events)
    except (ValueError, KeyError, TypeError, RecursionError):
        return False


def _aws_well_formed(body: bytes) -> bool:
    try:
        doc = json.loads(body)
        return (
            isinstance(doc, dict)
            and isinstance(doc["time"], str)
            and bool(doc.get("action") or doc["instance-action"])
        )
    except (ValueError, KeyError, TypeError, RecursionError):
        return False


@pytest.mark.parametrize("provider", ["aws", "gcp", "azure"])
@given(
    status=st.sampled_from([200, 200, 200, 204, 301, 401, 404, 418, 500, 503]),
    aws=_bodies(AWS),
    azure=_bodies(AZURE),
    gcp=st.one_of(st.binary(max_size=20), st.sampled_from([b"TRUE", b"FALSE", b" TRUE\n"])),
)
@counted
def test_preemption_answers(
    metadata: str, provider: str, status: int, aws: bytes, azure: bytes, gcp: bytes
) -> None:
    body = {"aws": aws, "gcp": gcp, "azure": azure}[provider]
    Metadata.answer = (status, body, {"Metadata-Flavor": "Google"})
    collector = PreemptionCollector(
        provider=provider, aws_url=metadata, gcp_url=metadata, azure_url=metadata, timeout_s=5
    )
    try:
        sample = collector.collect(now=1.0)
    except MetadataError as exc:
        assert str(exc)
        return
    finally:
        for netloc in list(collector._connections):
            collector._drop(netloc)
    if sample.notice is None:
        return
    assert status == 200, "a notice from an answer that was not 200"
    well_formed = {
        "aws": _aws_well_formed,
        "azure": _azure_well_formed,
        "gcp": lambda b: b.strip() == b"TRUE",
    }[provider]
    assert well_formed(body), f"a notice from {body[:80]!r}"
    assert sample.notice.deadline.tzinfo is not None


if sys.platform != "linux":  # pragma: no cover
    pytestmark = pytest.mark.skip("sysfs and procfs are Linux's")
