"""``coordinatorctl join``'s checks and the agent settings it writes, without a cluster:
a local cluster counts as running while its NATS server's PID is alive, here this
process's own."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import pytest

from coordinator.ctl import join
from coordinator.ctl.errors import CtlError
from coordinator.ctl.home import LocalCluster, agent_process, pid_file, pids_dir
from coordinator.ctl.main import main as ctl_main
from coordinator.ctl.netns import CTL_NET, DATA_NET, plan, record_file
from nodeagent.config import load


@pytest.fixture
def home(tmp_path: Path) -> Path:
    local = LocalCluster(
        nats="nats://127.0.0.1:1", cluster="c1", nodes=["node-0"], gpus_per_node=2,
        coordinators=["coordinator-0"], auth=False,
    )  # fmt: skip
    (tmp_path / "cluster.json").write_bytes(msgspec.json.encode(local))
    pids_dir(tmp_path).mkdir()
    pid_file(tmp_path, "nats-server").write_text(str(os.getpid()))
    return tmp_path


def test_the_command_line_hosts_as_many_ranks_as_a_simulated_node(home: Path) -> None:
    _, argv = join.command(home, "real-0", None)
    flags = dict(zip(argv[3::2], argv[4::2], strict=True))
    assert argv[1:3] == ["-m", "nodeagent.cli"] and "--creds" not in flags
    assert flags["--node"] == "real-0" and flags["--gpus"] == "2"
    assert flags["--nats"] == "nats://127.0.0.1:1" and flags["--cluster"] == "c1"
    assert join.command(home, "real-0", 1)[1][-1] == "1"
    config = load(Path(flags["--config"]), {"run_dir": flags["--run-dir"]})
    assert config.sysfs == "/sys" and config.procfs == "/proc" and not config.simulated
    assert config.network.data_interface == "lo" and config.preemption.provider == "none"
    assert not config.preflight.fix and config.metrics_addr == "127.0.0.1"
    assert config.metrics_port == -1 and config.gpus is None  # the count is a flag


def test_an_edited_settings_file_is_kept(home: Path) -> None:
    path = Path(join.command(home, "real-0", None)[1][4])
    path.write_text(path.read_text().replace('"lo"', '"eth9"'))
    join.command(home, "real-0", None)
    assert '"eth9"' in path.read_text()


def test_what_cannot_join(home: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    with pytest.raises(CtlError, match="no local cluster") as none:
        join.command(tmp_path_factory.mktemp("empty"), "real-0", None)
    assert none.value.code == 1
    for node, why in (("node-0", "simulated node"), ("bad.id", "letters, digits")):
        with pytest.raises(CtlError, match=why) as refused:
            join.command(home, node, None)
        assert refused.value.code == 2
    pid_file(home, agent_process("real-0")).write_text(str(os.getpid()))
    with pytest.raises(CtlError, match="already running"):
        join.command(home, "real-0", None)
    # a namespaced cluster whose bridges are gone: the host cannot be put on its data one
    record_file(home).write_bytes(msgspec.json.encode(plan(home, ["node-0"], CTL_NET, DATA_NET)))
    with pytest.raises(CtlError, match=r"ip addr replace 198\.18\.1\.1/24 dev rm"):
        join.command(home, "real-1", None)


def test_a_slot_count_under_one_is_bad_usage(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert ctl_main(["join", "real-0", "--gpus", "0", "--dir", str(home)]) == 2
    assert capsys.readouterr().err.strip() == "coordinatorctl: --gpus must be at least 1"


def test_print_prints_the_command_line_alone(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert ctl_main(["join", "real-0", "--print", "--dir", str(home)]) == 0
    [line] = capsys.readouterr().out.splitlines()
    assert "-m nodeagent.cli" in line and "--node real-0" in line
    assert not pid_file(home, agent_process("real-0")).exists()  # nothing started
