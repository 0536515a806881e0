"""Chat alerts from a job file's webhook on a real local cluster, and ``report`` after an
NVMe spike the job paused through."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from cli_harness import Ctl, eventually, host_address

from proto.job import GOODPUT_BUCKETS

pytestmark = pytest.mark.slow


class Webhook:
    """A local chat endpoint, started on the address the cluster under test can reach
    (:func:`cli_harness.host_address`): its URL and the texts it received."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.server: ThreadingHTTPServer | None = None

    def start(self, home: Path) -> str:
        texts = self.texts

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                texts.append(body["text"])
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        host = host_address(home)
        self.server = ThreadingHTTPServer((host, 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return f"http://{host}:{self.server.server_address[1]}/hook"


@pytest.fixture
def webhook() -> Iterator[Webhook]:
    hook = Webhook()
    yield hook
    if hook.server is not None:
        hook.server.shutdown()
        hook.server.server_close()


@pytest.mark.timeout(400)
def test_a_thermal_fault_alerts_once_and_resolves_once(
    ctl: Ctl, tmp_path: Path, webhook: Webhook
) -> None:
    ctl("up", "--nodes", "3")
    url, texts = webhook.start(ctl.home), webhook.texts
    job = ctl.start("tiny.toml", f"alerts.webhook_url={url}", f"checkpoint.dir={tmp_path / 'ckpt'}")
    ctl.wait(job, lambda s: s["state"] == "running" and s["step"] >= 5)
    ctl("inject", "node-1", "gpu-temp=95")
    ctl.wait(job, lambda s: s["restarts"] >= 1 and s["state"] == "running", timeout=120)
    ctl("inject", "node-1", "clear")
    ctl.wait(job, lambda s: s["state"] == "completed", timeout=240)
    key = "gpu.thermal:node-1:0"
    eventually(
        lambda: (
            any(t.startswith("[COMPLETED]") for t in texts)
            and any(t.startswith(f"[RESOLVED] {key}") for t in texts)
        ),
        60,
        lambda: f"alerts so far: {texts}",
        0.5,
    )
    assert len([t for t in texts if t.startswith(f"[CRITICAL] {key}")]) == 1, texts
    assert len([t for t in texts if t.startswith(f"[RESOLVED] {key}")]) == 1, texts
    assert len([t for t in texts if t.startswith(f"[COMPLETED] job {job}")]) == 1, texts


@pytest.mark.timeout(400)
def test_report_after_an_nvme_spike(ctl: Ctl, tmp_path: Path) -> None:
    ctl("up", "--nodes", "2")
    job = ctl.start("tiny.toml", f"checkpoint.dir={tmp_path / 'ckpt'}")
    ctl.wait(job, lambda s: s["step"] >= 40)
    ctl("inject", "node-1", "nvme-latency=500")
    ctl.wait(job, lambda s: s["state"] == "paused", timeout=30)
    ctl("inject", "node-1", "clear")
    ctl.wait(job, lambda s: s["state"] == "completed", timeout=240)
    page = tmp_path / "out.html"
    out = ctl("report", job, "--price-per-gpu-hour", "2.5", "--html", str(page))
    rows = {
        line.split()[0]: (float(line.split()[1]), float(line.split()[2]))
        for line in out.splitlines()
        if line.split() and line.split()[0] in (*GOODPUT_BUCKETS, "total")
    }
    assert set(rows) == {*GOODPUT_BUCKETS, "total"}, out
    hours, cost = rows.pop("total")
    assert hours > 0 and sum(h for h, _ in rows.values()) == pytest.approx(hours, abs=5e-4)
    # printed to 4 decimals: each figure is within half a unit of the last place
    assert sum(c for _, c in rows.values()) == pytest.approx(cost, abs=5e-4)
    assert cost == pytest.approx(hours * 2.5, abs=2.5e-4)
    assert all(c == pytest.approx(h * 2.5, abs=2.5e-4) for h, c in rows.values())
    assert "nvme.latency:node-1" in out and "estimate" in out.lower()
    svg = page.read_text()
    for kind in ("nvme.latency_spike", "job.paused", "job.resumed"):
        assert f'data-kind="{kind}"' in svg, kind
    assert ctl.run("report", "no-such-job").returncode == 2
    data = json.loads(ctl("report", job, "--json"))
    assert data["faults"] and data["steps"]
