"""The agent's /metrics from known state: names, types, labels and values in base units,
parsed with prometheus-client's own parser."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest
from metric_states import FakeAgent, agent, agent_registry, families, value

from nodeagent.collectors.gpu import CLOCK_REASONS
from nodeagent.config import ConfigError, load
from ringmaster import metrics


def test_gpu_series_in_base_units() -> None:
    f = families(agent_registry())
    assert f["ringmaster_gpu_temperature_celsius"].type == "gauge"
    assert value(f["ringmaster_gpu_temperature_celsius"], node="node-7", gpu="0") == 91.0
    assert value(f["ringmaster_gpu_temperature_celsius"], node="node-7", gpu="1") == 40.0
    assert value(f["ringmaster_gpu_utilization_ratio"], node="node-7", gpu="0") == 0.87
    used = f["ringmaster_gpu_memory_used_bytes"]
    assert value(used, node="node-7", gpu="0") == 1024 * 2**20
    # what GPU 1's driver cannot read is absent, not 0
    assert [s.labels["gpu"] for s in used.samples] == ["0"]
    pcie = f["ringmaster_gpu_pcie_throughput_bytes_per_second"]
    assert value(pcie, node="node-7", gpu="0", direction="tx") == 12.5e9
    assert value(pcie, node="node-7", gpu="0", direction="rx") == 3.25e9
    replays = f["ringmaster_gpu_pcie_replays"]
    assert replays.type == "counter"
    assert [(s.name, s.value) for s in replays.samples] == [
        ("ringmaster_gpu_pcie_replays_total", 17)
    ]
    assert value(f["ringmaster_gpu_lost"], node="node-7", gpu="2") == 1
    info = f["ringmaster_gpu_info"]
    assert value(info, node="node-7", gpu="0", name="NVIDIA H100", uuid="GPU-0") == 1


def test_one_series_per_clock_event_reason() -> None:
    reasons = families(agent_registry())["ringmaster_gpu_clock_event_reason"]
    gpu0 = {s.labels["reason"]: s.value for s in reasons.samples if s.labels["gpu"] == "0"}
    assert set(gpu0) == set(CLOCK_REASONS.values())
    assert {r for r, v in gpu0.items() if v == 1} == {"sw_thermal_slowdown", "hw_thermal_slowdown"}
    # GPU 1's driver cannot say why its clocks moved: no series rather than all zeros
    assert all(s.labels["gpu"] == "0" for s in reasons.samples)


def test_nvme_and_clock_in_seconds() -> None:
    f = families(agent_registry())
    latency = f["ringmaster_nvme_latency_seconds"]
    assert value(latency, node="node-7", device="nvme0n1") == pytest.approx(405e-6)
    assert [s.labels["device"] for s in latency.samples] == ["nvme0n1"]  # idle: no mean
    readonly = f["ringmaster_nvme_readonly"]
    assert value(readonly, node="node-7", device="nvme0n1") == 0
    assert value(readonly, node="node-7", device="nvme1n1") == 1
    assert value(f["ringmaster_nvme_in_flight_ios"], node="node-7", device="nvme0n1") == 3
    assert value(f["ringmaster_clock_offset_seconds"], node="node-7") == pytest.approx(0.0025)
    assert value(f["ringmaster_clock_synchronized"], node="node-7") == 1


def test_collectors_conditions_and_heartbeats() -> None:
    f = families(agent_registry())
    up = f["ringmaster_collector_up"]
    assert value(up, node="node-7", collector="gpu") == 1
    assert value(up, node="node-7", collector="preemption") == 0
    duration = f["ringmaster_collector_duration_seconds"]
    assert value(duration, node="node-7", collector="clock") == 0.25
    success = f["ringmaster_collector_last_success_timestamp_seconds"]
    assert value(success, node="node-7", collector="nvme") == 1000.5
    assert "preemption" not in {s.labels["collector"] for s in success.samples}
    condition = f["ringmaster_node_condition"]
    assert [(s.labels, s.value) for s in condition.samples] == [
        (
            {"node": "node-7", "kind": "nvme.latency", "subject": "nvme0n1", "severity": "warning"},
            1,
        )
    ]
    beats = f["ringmaster_heartbeats_sent"]
    assert beats.type == "counter" and value(beats, node="node-7") == 42


def test_a_fresh_agent_exposes_only_what_it_knows() -> None:
    """Before the first sample: no hardware series, yet a valid exposition."""
    f = families(agent_registry(FakeAgent()))
    assert "ringmaster_gpu_temperature_celsius" not in f
    assert value(f["ringmaster_heartbeats_sent"], node="node-7") == 0
    assert f["ringmaster_node_condition"].samples == []


def test_served_over_http_on_a_free_port_and_off_with_zero() -> None:
    assert metrics.serve(agent_registry(), metrics.OFF, "127.0.0.1", "x") is None
    server = metrics.serve(agent_registry(agent()), metrics.ANY_PORT, "127.0.0.1", "x")
    assert server is not None
    try:
        assert server.port > 0 and server.url == f"http://127.0.0.1:{server.port}/metrics"
        with urllib.request.urlopen(server.url, timeout=5) as reply:
            body = reply.read().decode()
        assert 'ringmaster_gpu_temperature_celsius{gpu="0",node="node-7"} 91.0' in body
        # a taken port leaves the daemon running without metrics
        assert metrics.serve(agent_registry(), server.port, "127.0.0.1", "x") is None
    finally:
        server.close()


def test_a_wildcard_bind_is_named_by_the_host_in_the_url() -> None:
    server = metrics.serve(agent_registry(), metrics.ANY_PORT, "0.0.0.0", "10.1.2.3")
    assert server is not None
    try:
        assert server.url == f"http://10.1.2.3:{server.port}/metrics"
    finally:
        server.close()


@pytest.mark.parametrize(("port", "ok"), [(-1, True), (0, True), (9402, True), (-2, False)])
def test_metrics_port_setting(tmp_path: Path, port: int, ok: bool) -> None:
    toml = tmp_path / "agent.toml"
    toml.write_text(f"metrics_port = {port}\n")
    if ok:
        assert load(toml, {}).metrics_port == port
    else:
        with pytest.raises(ConfigError, match="metrics_port"):
            load(toml, {})
