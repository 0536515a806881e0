"""The HTML report as a browser draws it: headless Chromium lays the timeline out and a
script measures every text of the picture against the SVG's viewport, so a label cut at
an edge (``job.c`` for ``job.completed``) fails here."""

from __future__ import annotations

import html as markup
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from test_report_model import at, nvme_on, record

from coordinator.ctl.report_html import html
from coordinator.ctl.report_model import build
from proto.events import (
    JobCheckpointed,
    JobCompleted,
    JobPaused,
    JobResumed,
    JobStarted,
)

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
NEEDS = "needs Chromium: apt-get update && apt-get install -y chromium (scripts/bootstrap.sh "
NEEDS += "installs it when run as root)"
MEASURE = """<pre id="fit"></pre><script>
const svg = document.querySelector("svg"), box = svg.getBoundingClientRect();
const texts = [...svg.querySelectorAll("text")].map(t => {
  const b = t.getBoundingClientRect();
  return {text: t.textContent, left: b.left - box.left, right: b.right - box.left,
          top: b.top - box.top, bottom: b.bottom - box.top, width: b.width};
});
document.getElementById("fit").textContent =
  JSON.stringify({width: box.width, height: box.height, texts});
</script></body>"""


def demo_page() -> str:
    """A report like the demo's: a spike on one device pauses the job, a second device
    spikes during the pause, and checkpoints and the end crowd the right edge."""
    nvme = "nvme.latency:node-1:nvme0n1"
    events = [
        JobStarted(time=at(0), job="j-1", nodes=["node-0", "node-1"]),
        nvme_on("nvme0n1", 20, True),
        JobPaused(time=at(21), job="j-1", step=40, reason=nvme),
        nvme_on("nvme1n1", 22, True),
        nvme_on("nvme0n1", 23, False),
        nvme_on("nvme1n1", 23.5, False),
        JobResumed(time=at(24), job="j-1", step=40),
        JobCheckpointed(time=at(50), job="j-1", step=50),
        JobCheckpointed(time=at(99.5), job="j-1", step=100),
        JobCompleted(time=at(100), job="j-1", step=100),
    ]
    steps = [(at(5 + i).timestamp(), i) for i in range(1, 96)]
    return html(build(record(productive=200.0, startup=10.0, paused=6.0), events, steps), 2.5)


def chromium(*args: str, profile: Path) -> str:
    assert CHROMIUM is not None
    command = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu"]
    command += ["--disable-background-networking", "--disable-component-update"]
    command += ["--disable-sync", "--no-first-run", f"--user-data-dir={profile}", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, check=True)
    return done.stdout


@pytest.mark.skipif(CHROMIUM is None, reason=NEEDS)
def test_every_label_of_the_timeline_lies_inside_the_picture(tmp_path: Path) -> None:
    page = tmp_path / "report.html"
    page.write_text(demo_page().replace("</body>", MEASURE))
    dom = chromium(
        "--virtual-time-budget=10000", "--dump-dom", page.as_uri(), profile=tmp_path / "p"
    )
    found = re.search(r'<pre id="fit">(.*?)</pre>', dom, re.S)
    assert found and found.group(1), dom[-2000:]
    fit: dict[str, Any] = json.loads(markup.unescape(found.group(1)))
    texts = fit["texts"]
    labels = {t["text"] for t in texts}
    assert {"job.completed", "job.checkpointed", "nvme.latency_spike"} <= labels
    assert any("time (UTC" in t for t in labels) and any(t.startswith("step") for t in labels)
    outside = [
        t
        for t in texts
        if t["width"] <= 0
        or t["left"] < 0
        or t["top"] < 0
        or t["right"] > fit["width"]
        or t["bottom"] > fit["height"]
    ]
    assert not outside, outside
    shot = tmp_path / "report.png"
    chromium(
        f"--screenshot={shot}", "--window-size=1040,1300", page.as_uri(), profile=tmp_path / "p"
    )
    assert shot.stat().st_size > 10_000
