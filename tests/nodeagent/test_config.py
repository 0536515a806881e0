"""Agent settings: defaults, refusals that name the key, and the simulator's agent.toml."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from nodeagent.cli import parse
from nodeagent.collectors.nvme import NvmeDeviceReading, NvmeLatencySample
from nodeagent.config import ConfigError, load
from nodeagent.detectors.nvme import NvmeLatencyDetector
from nodeagent.registry import build
from nodeagent.sim import agent_config
from nodeagent.sim.node import SimulatedNode
from proto.warm import WARM_TEMPLATE_ENV


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("[gpu]\nwarn_c = 99\n", "gpu.warn_c must not exceed gpu.critical_c - at `$.gpu`"),
        ("[nvme]\nrecover_us = 500\n", "nvme.recover_us must not exceed nvme.spike_us"),
        ("[clock]\nrecover_ms = 9\n", "clock.recover_ms must not exceed clock.max_offset_ms"),
        ("[gpu]\nwarn = 99\n", "Object contains unknown field `warn` - at `$.gpu`"),
        (
            '[preemption]\nprovider = "ibm"\n',
            "Invalid enum value 'ibm' - at `$.preemption.provider`",
        ),
        ('[gpu]\nexpect_nvlink = "most"\n', "at `$.gpu.expect_nvlink`"),
        ("[nvme]\nrecover_us = 0\n", "Expected `float` > 0.0 - at `$.nvme.recover_us`"),
        ("[nvme]\nhold_s = -1\n", "Expected `float` >= 0.0 - at `$.nvme.hold_s`"),
        ("[gpu]\nthermal_confirm = 0\n", "Expected `int` >= 1 - at `$.gpu.thermal_confirm`"),
        ("stop_grace_s = 5\n", "Object contains unknown field `stop_grace_s`"),
        ("warm_ranks = -1\n", "Expected `int` >= 0 - at `$.warm_ranks`"),
        (
            'warm_template_socket = "t.sock"\n',
            "warm_template_socket must be an absolute path: 't.sock'",
        ),
        (
            f'warm_template_socket = "/{"d" * 120}.sock"\n',
            "warm_template_socket is longer than a Unix socket's path may be (107 bytes)",
        ),
    ],
)
def test_bad_settings_name_the_key(tmp_path: Path, toml: str, message: str) -> None:
    path = tmp_path / "agent.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError, match=re.escape(message)):
        load(path, {})


def test_every_collector_is_registered_once() -> None:
    names = [entry.collector.name for entry in build(load(None, {"node": "n1"}))]
    assert names == [
        "preflight",
        "nvme",
        "nvme_smart",
        "nvme_udev",
        "gpu",
        "gpu_topology",
        "clock",
        "nic",
        "tcp",
        "rdma",
        "preemption",
    ]
    quiet = load(None, {"nvme": {"udev": False}, "preemption": {"provider": "none"}})
    assert "nvme_udev" not in [e.collector.name for e in build(quiet)]


def test_detectors_read_their_section_of_the_settings(tmp_path: Path) -> None:
    path = tmp_path / "agent.toml"
    path.write_text("[nvme]\nspike_us = 30.0\nrecover_us = 10.0\n")
    nvme = next(e for e in build(load(path, {"node": "n1"})) if e.collector.name == "nvme")
    detector = next(d for d in nvme.detectors if isinstance(d, NvmeLatencyDetector))
    reading = NvmeDeviceReading(readonly=False, in_flight=0, latency_us=35.0)
    [spike] = detector.observe(NvmeLatencySample(time=0.0, devices={"nvme0n1": reading}))
    assert spike.condition is not None and spike.condition.threshold == 30.0


def test_the_simulators_agent_toml_loads(tmp_path: Path) -> None:
    node = SimulatedNode(tmp_path / "node-3", "node-3", nvme_devices=1)
    config = load(agent_config.write(node, {"heartbeat_s": 0.5, "gpu": {"interval_s": 0.25}}), {})
    assert (config.sysfs, config.simulated, config.heartbeat_s) == (
        str(tmp_path / "node-3" / "sys"),
        True,
        0.5,
    )
    assert config.gpu.interval_s == 0.25 and config.gpu.expect_nvlink == "all"
    assert config.gpu.nvml_library is None, "no GPUs on this node"
    assert config.clock.step_command == ["rm", "-f", str(node.skew_file)]
    assert (config.preemption.provider, config.preemption.sigterm_notice) == ("none", "never")
    with pytest.raises(TypeError):
        agent_config.to_toml({"x": {"nested": {"deeper": 1}}})


def test_spare_interpreters_default_to_one_per_gpu(tmp_path: Path) -> None:
    assert load(None, {}).warm_spares(gpus=8) == 8
    assert load(None, {}).warm_spares(gpus=0) == 1  # GPU-less, or NVML not read yet
    assert load(None, {"simulated": True}).warm_spares(gpus=8) == 2  # the host's cores
    assert load(None, {"warm_ranks": 0}).warm_spares(gpus=8) == 0  # off
    assert load(None, {"warm_ranks": 3, "simulated": True}).warm_spares(gpus=8) == 3


def test_a_shared_template_comes_from_the_config_a_flag_or_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "agent.toml"
    path.write_text('warm_template_socket = "/run/from-config.sock"\n')
    assert load(path, {}).warm_template_socket == "/run/from-config.sock"
    assert load(None, {}).warm_template_socket == ""  # the pool's own template
    flag = parse(["--warm-template-socket", "/run/from-flag.sock"]).warm_template_socket
    assert load(path, {"warm_template_socket": flag}).warm_template_socket == flag
    monkeypatch.setenv(WARM_TEMPLATE_ENV, "/run/from-env.sock")
    assert parse([]).warm_template_socket == "/run/from-env.sock"
