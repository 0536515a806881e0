"""Chat alerts from a job file's webhook on a real local cluster (``report`` after the
README's NVMe spike is checked on the scenario itself: ``test_walking_skeleton``)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from cli_harness import Ctl, eventually, host_address

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
