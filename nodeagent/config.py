"""Agent settings: a TOML file (unknown keys are errors) overridden by command-line flags.

The defaults below are the only ones: detectors take their section whole (a threshold has
one name, here) and have no defaults of their own. A job's ``[policy]`` does not repeat
them: the coordinator acts on the conditions they open and on the severity given.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from nodeagent.collectors.base import Roots
from nodeagent.collectors.nic import default_route_interface
from nodeagent.collectors.nvme_smart import DEFAULT_COMMAND as DEFAULT_SMART

NodeId = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]{1,63}$")]
Positive = Annotated[float, msgspec.Meta(gt=0)]
NonNegative = Annotated[float, msgspec.Meta(ge=0)]
Count = Annotated[int, msgspec.Meta(ge=1)]
SOCKET_PATH_MAX = 108  # sun_path, with its terminating NUL (Linux)


class NvmeSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    interval_s: Annotated[float, msgspec.Meta(gt=0)] = 0.5
    # µs: a window's mean latency above spike_us opens nvme.latency (a job on the node
    # pauses); under recover_us for hold_s seconds closes it (the job resumes)
    spike_us: Annotated[float, msgspec.Meta(gt=0)] = 100.0
    recover_us: Annotated[float, msgspec.Meta(gt=0)] = 50.0
    hold_s: Annotated[float, msgspec.Meta(ge=0)] = 3.0
    devices: list[str] | None = None
    udev: bool = True  # live DISK_RO change uevents
    udev_source: Literal["auto", "udev", "kernel"] = "auto"
    udev_devices: str = r"nvme\d+n\d+"  # which block devices' uevents count (a regex)
    smart_interval_s: Positive = 60.0
    smart_command: list[str] = msgspec.field(default_factory=lambda: list(DEFAULT_SMART))
    smart_timeout_s: Positive = 10.0

    def __post_init__(self) -> None:
        if self.recover_us > self.spike_us:
            raise ValueError("nvme.recover_us must not exceed nvme.spike_us")


class GpuSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    interval_s: Positive = 1.0
    topology_interval_s: Positive = 30.0
    nvml_library: str | None = None  # a libnvidia-ml.so.1 by path; unset: the loader's search
    # °C: gpu.thermal opens as a warning at warn_c and turns critical at critical_c (a
    # job on the node checkpoints and leaves it)
    warn_c: Positive = 85.0
    critical_c: Positive = 92.0
    hysteresis_c: NonNegative = 5.0
    thermal_hold_s: NonNegative = 10.0
    thermal_confirm: Count = 1
    pcie_min_gbps: NonNegative = 0.0  # 0: no throughput floor
    pcie_busy_pct: NonNegative = 80.0
    pcie_replay_limit: Annotated[int, msgspec.Meta(ge=0)] = 8  # 0: replays not watched
    pcie_confirm: Count = 2
    pcie_hold_s: NonNegative = 10.0
    expect_nvlink: Literal["all", "baseline", "none"] = "baseline"
    topology_confirm: Count = 2

    def __post_init__(self) -> None:
        if self.warn_c > self.critical_c:
            raise ValueError("gpu.warn_c must not exceed gpu.critical_c")


class ClockSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    interval_s: Positive = 5.0  # clocks drift over minutes; peer and chrony are slower still
    # ms: an offset beyond max_offset_ms opens clock.drift (the coordinator resyncs the
    # node); back within recover_ms for hold_s seconds closes it
    max_offset_ms: Positive = 5.0
    recover_ms: Positive = 2.0
    confirm: Count = 2
    hold_s: NonNegative = 5.0
    adjtimex: bool = True  # the kernel's sync state counts (not on simulated nodes)
    chronyc: list[str] = msgspec.field(default_factory=lambda: ["chronyc", "-c", "tracking"])
    chrony_interval_s: Positive = 16.0
    peer_interval_s: Positive = 10.0  # offset to the coordinator over NATS
    peer_timeout_s: Positive = 1.0
    step_command: list[str] = msgspec.field(default_factory=lambda: ["chronyc", "makestep"])
    step_timeout_s: Positive = 10.0
    skew_file: str | None = None  # simulated nodes: their clock's extra offset in ms

    def __post_init__(self) -> None:
        if self.recover_ms > self.max_offset_ms:
            raise ValueError("clock.recover_ms must not exceed clock.max_offset_ms")


class PreemptionSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    provider: Literal["auto", "aws", "gcp", "azure", "none"] = "auto"
    interval_s: Positive = 2.0
    timeout_s: Positive = 0.5
    aws_url: str = "http://169.254.169.254"
    gcp_url: str = "http://metadata.google.internal"
    azure_url: str = "http://169.254.169.254"
    redetect_s: Positive = 300.0  # off any cloud, how often detection is tried again
    gcp_deadline_s: Positive = 30.0
    # Whether a SIGTERM to the agent announces the node going away: only while the host
    # is shutting down (default), always, or never.
    sigterm_notice: Literal["shutdown", "always", "never"] = "shutdown"
    sigterm_deadline_s: Positive = 30.0


class PreflightSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    interval_s: Positive = 300.0
    # a tunable under its recommendation is a warning, never a refusal (the node is
    # admitted); space and shared memory under the need below refuse the node
    somaxconn_min: Annotated[int, msgspec.Meta(ge=0)] = 65535
    # at start, raise a tunable under its recommendation to it; only as root under
    # systemd (nodeagent.collectors.sysctl), elsewhere it changes nothing
    fix: bool = True
    data_dir: str = "/var/lib/ringmaster"
    data_need_gb: NonNegative = 10.0
    checkpoint_dir: str = "/var/lib/ringmaster/checkpoints"
    checkpoint_need_gb: NonNegative = 10.0
    shm_min_gb: NonNegative = 8.0


class NetworkSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    interval_s: Positive = 1.0  # both link collectors (nic, rdma)
    # the interface the ranks' traffic crosses: its link down (carrier 0 or operstate
    # down) opens net.link, critical (a job on the node leaves it); "": the interface of
    # the IPv4 default route in <procfs>/net/route, looked up when the agent starts
    data_interface: str = ""
    # where the NIC collector reads class/net; unset: the agent's sysfs. A simulated node
    # in its own network namespace (coordinatorctl up --netns) has real links in /sys and
    # simulated everything else
    nic_sysfs: str | None = None
    # net.flap (warning): a watched link's carrier_changes rose by flap_changes or more
    # within window_s seconds; net.errors (warning): its rx_errors + tx_errors rose by
    # error_rise or more within window_s. Each closes once a whole window stays under.
    flap_changes: Count = 3
    error_rise: Count = 100
    window_s: Positive = 60.0
    watch_virtual: bool = False  # flaps and errors on veth, bridges, ifb too
    # net.retrans (warning): TCP sent again retrans_ratio or more of the segments it sent
    # within retrans_window_s, having sent at least retrans_min_segs there (a few lost
    # segments of an idle node are no evidence); closes once a whole window stays under.
    # Healthy data-centre paths retransmit well under 0.1 %.
    retrans_ratio: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.01
    retrans_min_segs: Count = 1000
    retrans_window_s: Positive = 10.0
    # where the TCP collector reads net/snmp; unset: the agent's procfs. /proc/net is the
    # reading process's network namespace: a simulated node in a namespace of its own
    # (coordinatorctl up --netns) has its real TCP counters in /proc
    tcp_procfs: str | None = None
    # rdma.port (warning) for a port out of ACTIVE/LinkUp: only ports seen up since the
    # agent started ("seen_active": an uncabled port is no fault), or every port ("all")
    rdma_watch: Literal["seen_active", "all"] = "seen_active"
    # net.peer: the agent listens on its advertised (data) address at probe_port (0: a
    # port the kernel chooses, sent in the heartbeat) and, while it runs a job's ranks,
    # connects to each of the job's other nodes every probe_every_s; probe_confirm failed
    # connects in a row (each given probe_timeout_s) open it, the first success closes it
    probe_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0
    probe_every_s: Positive = 2.0
    probe_timeout_s: Positive = 1.0
    probe_confirm: Count = 2
    # s: a peer whose listener refuses (its machine answers, its agent does not listen) is
    # taken for an agent restarting (systemd's RestartSec and a start) for this long from
    # its first refusal, and nothing is said; refusals beyond it count as failures
    probe_restart_grace_s: NonNegative = 15.0


def resolve_data_interface(network: NetworkSettings, roots: Roots) -> str:
    """The data interface's name: the setting, else the default route's; "" when there is
    neither (the link-down condition then has nothing to watch)."""
    return network.data_interface or default_route_interface(roots.procfs)


# What torch.distributed's backends read to choose the interface their sockets bind to.
COLLECTIVE_IFNAMES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def collective_env(interface: str) -> dict[str, str]:
    """The ranks' defaults binding their collectives to the data interface (a job's
    ``env`` overrides them), when this host's kernel knows that interface: a simulated
    node's ``data0`` outside a namespace lives only in its simulated tree, and gloo
    fails at init on an interface that does not exist."""
    try:
        socket.if_nametoindex(interface)
    except (OSError, ValueError):
        return {}
    return dict.fromkeys(COLLECTIVE_IFNAMES, interface)


class AgentConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    node: NodeId = msgspec.field(default_factory=lambda: socket.gethostname().split(".")[0])
    cluster: str = "local"
    nats: str = "nats://127.0.0.1:4222"
    creds_file: str | None = None  # NATS creds (ringmaster.auth); unset: $RINGMASTER_CREDS
    advertise_addr: str | None = None  # IP the rendezvous master listens on; detected if unset
    run_dir: str = "/var/lib/ringmaster/agent"
    sysfs: str = "/sys"
    procfs: str = "/proc"
    dev: str = "/dev"
    simulated: bool = False
    gpus: int | None = None  # ranks this node can host; NVML's count if unset
    # spare interpreters with the training stack imported, so a rank (re)starts without
    # a cold Python start (nodeagent.warm_pool: forks of one template that imports once);
    # unset: one per GPU, two on a simulated node, one on a GPU-less one; 0: none
    warm_ranks: Annotated[int, msgspec.Meta(ge=0)] | None = None
    # how long after a launch a new interpreter that imports starts (a template that left
    # no successor, or a spare where the template may not fork): its imports would compete
    # for CPU with the ranks starting at that moment. A fork's refill is not delayed.
    warm_refill_delay_s: NonNegative = 5.0
    # the socket of a template interpreter this machine's agents share, which the pool
    # forks its spares from instead of starting its own (nodeagent.shared_template: a
    # local cluster's simulated nodes, which `coordinatorctl up` points here); nothing
    # answering there, the pool starts its own. "": the pool's own
    warm_template_socket: str = ""
    heartbeat_s: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    hang_check_s: Positive = 0.5  # how often ranks' beats are read (nodeagent.hangwatch)
    # Prometheus /metrics: 0 turns it off, -1 takes any free port (ringmaster.metrics)
    metrics_port: Annotated[int, msgspec.Meta(ge=-1, le=65535)] = 9402
    metrics_addr: str = "0.0.0.0"
    nvme: NvmeSettings = msgspec.field(default_factory=NvmeSettings)
    gpu: GpuSettings = msgspec.field(default_factory=GpuSettings)
    clock: ClockSettings = msgspec.field(default_factory=ClockSettings)
    preemption: PreemptionSettings = msgspec.field(default_factory=PreemptionSettings)
    preflight: PreflightSettings = msgspec.field(default_factory=PreflightSettings)
    network: NetworkSettings = msgspec.field(default_factory=NetworkSettings)

    def __post_init__(self) -> None:
        socket_path = self.warm_template_socket
        if socket_path and not socket_path.startswith("/"):
            raise ValueError(f"warm_template_socket must be an absolute path: {socket_path!r}")
        if len(socket_path.encode()) >= SOCKET_PATH_MAX:
            raise ValueError(
                f"warm_template_socket is longer than a Unix socket's path may be "
                f"({SOCKET_PATH_MAX - 1} bytes): {socket_path!r}"
            )

    def roots(self) -> Roots:
        return Roots(sysfs=Path(self.sysfs), procfs=Path(self.procfs), dev=Path(self.dev))

    def warm_spares(self, gpus: int) -> int:
        """Spare rank interpreters to keep: ``warm_ranks`` if set, else one per GPU
        (``gpus``: this node's count), one on a GPU-less node. A simulated node keeps two
        whatever its "GPUs": they share the host's few cores with every other simulated
        node's ranks, so a replacement takes many seconds to import, and the second spare
        serves a fault that comes before it is ready."""
        if self.warm_ranks is not None:
            return self.warm_ranks
        return 2 if self.simulated else max(1, gpus)


class ConfigError(ValueError):
    pass


def load(path: Path | None, overrides: dict[str, object]) -> AgentConfig:
    """Read the file (if any), apply flag overrides, validate once."""
    raw: dict[str, object] = {}
    if path is not None:
        try:
            raw = msgspec.toml.decode(path.read_bytes())
        except FileNotFoundError:
            raise ConfigError(f"agent config {path}: no such file") from None
        except msgspec.DecodeError as exc:
            raise ConfigError(f"agent config {path}: {exc}") from None
    raw.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return msgspec.convert(raw, AgentConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"agent config: {exc}") from None


def detect_addr(nats_url: str) -> str:
    """The local IP that routes towards the NATS server: the address peers can reach us on.
    A UDP connect sends nothing; it only asks the kernel for the route."""
    host = nats_url.split(",")[0].split("://")[-1].rsplit(":", 1)[0].split("@")[-1] or "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((socket.gethostbyname(host), 4222))
            addr: str = probe.getsockname()[0]
            return addr
    except OSError:
        return "127.0.0.1"
