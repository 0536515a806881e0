"""Prometheus' view of a running local cluster: every agent's and coordinator's /metrics,
found through ``status --json``, scraped while a job trains, parsed with prometheus-client's
own parser."""

from __future__ import annotations

import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from cli_harness import Ctl, daemon_addresses, eventually
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from proto.job import GOODPUT_BUCKETS

pytestmark = pytest.mark.slow


def scrape(url: str) -> dict[str, Metric]:
    assert urllib.parse.urlsplit(url).path == "/metrics", url
    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def samples(families: dict[str, Metric], name: str, **labels: str) -> list[float]:
    """Values of the samples called ``name`` (``_total``, ``_count`` included) with
    ``labels`` among theirs."""
    return [
        s.value
        for family in families.values()
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]


def check_agent(node: str, url: str) -> None:
    """Per-GPU temperature and NVMe latency (in seconds) once the collectors have read."""

    def hardware_read() -> dict[str, Metric] | None:
        f = scrape(url)
        ok = samples(f, "ringmaster_nvme_latency_seconds") and samples(
            f, "ringmaster_gpu_temperature_celsius"
        )
        return f if ok else None

    f = eventually(hardware_read, 30, lambda: f"no hardware series from {node} at {url}", 0.5)
    temps = samples(f, "ringmaster_gpu_temperature_celsius", node=node, gpu="0")
    assert len(temps) == 1 and 0 < temps[0] < 120, temps
    latencies = samples(f, "ringmaster_nvme_latency_seconds", node=node)
    assert latencies and all(0 < v < 0.01 for v in latencies), latencies  # seconds, not µs
    assert samples(f, "ringmaster_collector_up", node=node, collector="gpu") == [1]
    assert samples(f, "ringmaster_heartbeats_sent_total", node=node)[0] >= 1


@pytest.mark.timeout(400)
def test_every_daemon_serves_its_metrics(ctl: Ctl, tmp_path: Path) -> None:
    ctl("up", "--nodes", "2", "--standby")
    job = ctl.start(  # long enough to be running whenever it is scraped
        "tiny.toml",
        "train.steps=100000",
        "checkpoint.every_steps=100000",
        f"checkpoint.dir={tmp_path / 'ckpt'}",
    )
    ctl.wait(job, lambda s: s["state"] == "running" and s["step"] >= 2)
    status: dict[str, Any] = {}

    def urls_known() -> bool:
        status.update(ctl.status())
        return len(status["coordinators"]) == 2 and all(
            d["metrics_url"] for d in status["nodes"] + status["coordinators"]
        )

    eventually(urls_known, 30, lambda: f"metrics_url missing: {status}", 0.5)
    urls = [d["metrics_url"] for d in status["nodes"] + status["coordinators"]]
    assert len(set(urls)) == 4, urls  # every daemon on a port of its own
    addresses = daemon_addresses(ctl.home)  # loopback, or the namespaces' control addresses
    assert {urllib.parse.urlsplit(url).hostname for url in urls} <= addresses, urls

    for node in status["nodes"]:
        check_agent(node["id"], node["metrics_url"])

    leaders = []
    for c in status["coordinators"]:
        f = scrape(c["metrics_url"])
        [leading] = samples(f, "ringmaster_coordinator_leader", coordinator=c["id"])
        assert leading == int(c["leader"]), (c, leading)
        if leading:
            leaders.append(f)
        else:
            assert "ringmaster_job_step" not in f  # cluster series from the leader alone
    [leader] = leaders
    assert samples(leader, "ringmaster_job_state", job_name=job, state="running") == [1]
    assert samples(leader, "ringmaster_job_step", job_name=job)[0] >= 2
    assert samples(leader, "ringmaster_job_target_steps", job_name=job) == [100000]
    assert samples(leader, "ringmaster_nodes", state="ready") == [2]
    goodput = samples(leader, "ringmaster_job_goodput_gpu_seconds_total", job_name=job)
    assert len(goodput) == len(GOODPUT_BUCKETS) and sum(goodput) > 0, goodput
    [count] = samples(leader, "ringmaster_event_decision_seconds_count")
    assert count >= 1  # node.registered at least went through the policy
