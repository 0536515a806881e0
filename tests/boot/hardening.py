"""Whether each sandbox directive of a unit holds under a container's real systemd.

For the unit's running main process, read from ``/proc`` beside PID 1's (the container's
own view, the baseline): its capabilities, user, mounts, limits and OOM adjustment. For the
system-call restrictions, ``sandbox_probe.py`` is run by ``systemd-run`` twice, once with
the unit's sandbox and once with only its non-seccomp part: a forbidden operation that
succeeds without the restriction and fails with it shows the restriction enforced.

Each directive comes out ``ok``, ``FAILED: ...`` (it is not in force) or ``cannot be
checked here: ...`` (this container or host does the same on its own, or lacks what the
check needs), so a directive nobody looked at is a failure of the test, not a surprise
at a user's boot."""

from __future__ import annotations

import base64
import json
import shlex
from collections.abc import Callable
from pathlib import Path

from cluster import BootCluster

# How a unit lives, not how it is confined: the boot test shows these at work.
LIFECYCLE = frozenset(
    {
        "Type",
        "NotifyAccess",
        "ExecStart",
        "Environment",
        "EnvironmentFile",
        "Restart",
        "RestartSec",
        "WatchdogSec",
        "TimeoutStartSec",
        "TimeoutStopSec",
        "KillMode",
        "StateDirectory",
    }
)
# system-call restrictions → the probe operations each forbids
SECCOMP = {
    "RestrictNamespaces": ("unshare_user",),
    "RestrictRealtime": ("realtime",),
    "RestrictSUIDSGID": ("setuid_bit",),
    "LockPersonality": ("personality",),
    "MemoryDenyWriteExecute": ("write_execute",),
    "RestrictAddressFamilies": ("af_alg", "af_netlink"),
    "SystemCallFilter": ("ptrace",),
}
CAPS = (  # capability numbers 0-25, in order
    "CHOWN",
    "DAC_OVERRIDE",
    "DAC_READ_SEARCH",
    "FOWNER",
    "FSETID",
    "KILL",
    "SETGID",
    "SETUID",
    "SETPCAP",
    "LINUX_IMMUTABLE",
    "NET_BIND_SERVICE",
    "NET_BROADCAST",
    "NET_ADMIN",
    "NET_RAW",
    "IPC_LOCK",
    "IPC_OWNER",
    "SYS_MODULE",
    "SYS_RAWIO",
    "SYS_CHROOT",
    "SYS_PTRACE",
    "SYS_PACCT",
    "SYS_ADMIN",
    "SYS_BOOT",
    "SYS_NICE",
    "SYS_RESOURCE",
    "SYS_TIME",
)
PROBE = Path(__file__).with_name("sandbox_probe.py")
OK = "ok"


def directives(unit: Path) -> dict[str, list[str]]:
    """The ``[Service]`` section's settings, each with every value it is given."""
    found: dict[str, list[str]] = {}
    section = ""
    for line in unit.read_text().splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line
        elif section == "[Service]" and "=" in line and not line.startswith("#"):
            key, _, value = line.partition("=")
            found.setdefault(key, []).append(value)
    return found


def cap_mask(names: str) -> int:
    return sum(1 << CAPS.index(n.removeprefix("CAP_")) for n in names.split())


class Process:
    """What ``/proc`` says of one process in a container."""

    def __init__(self, c: BootCluster, host: str, pid: str) -> None:
        read = lambda name: c.sh(host, f"cat /proc/{pid}/{name}")  # noqa: E731
        self.status = dict(
            (k, v.strip()) for k, _, v in (ln.partition(":") for ln in read("status").splitlines())
        )
        self.limits = read("limits")
        self.oom = int(read("oom_score_adj"))
        self.uid_map = read("uid_map").split()
        self.uts = c.sh(host, f"readlink /proc/{pid}/ns/uts").strip()
        self.mounts: dict[str, tuple[str, str]] = {}
        for line in read("mountinfo").splitlines():
            fields = line.split()
            self.mounts[fields[4]] = (fields[3], fields[5] + "," + fields[-1])

    def cap(self, name: str) -> int:
        return int(self.status[name], 16)

    def read_only(self, path: str) -> bool:
        return path in self.mounts and "ro" in self.mounts[path][1].split(",")[:1]


def check(c: BootCluster, host: str, unit: Path, host_caps: int) -> dict[str, str]:
    """Each sandbox directive of ``unit``, as it holds for its process in ``host``."""
    settings = directives(unit)
    name = unit.name
    me = Process(c, host, c.show(host, name)["MainPID"])
    init = Process(c, host, "1")
    journal = c.journal(host, name)
    can_raise = host_caps >> CAPS.index("SYS_RESOURCE") & 1
    seccomp = _probe(c, host, settings)

    def mount_differs(path: str, what: str) -> str:
        if path not in me.mounts:
            return f"FAILED: {path} is not {what}"
        if init.mounts.get(path) == me.mounts[path]:
            return f"cannot be checked here: the container's own {path} is already {what}"
        return OK

    def read_only(paths: tuple[str, ...]) -> str:
        for path in paths:
            if not me.read_only(path):
                return f"FAILED: {path} is writable"
            if init.read_only(path):
                return f"cannot be checked here: the container mounts {path} read-only"
        return OK

    def noted_or(option: str) -> Callable[[str], str]:
        def judge(value: str) -> str:
            if option in me.mounts.get("/proc", ("", ""))[1]:
                return OK
            noted = [ln for ln in journal.splitlines() if ln.startswith(f"{name}: ") and
                     value.split("=")[0] in ln]  # fmt: skip
            if noted:
                return f"cannot be checked here: systemd says {noted[0][len(name) + 2 :]!r}"
            if "PrivateUsers" in settings and not _proc_mounts_in_a_user_namespace(c, host):
                return (
                    "cannot be checked here: this container refuses a /proc mounted in a user "
                    "namespace (PrivateUsers=; its own /proc has masked paths), so systemd "
                    "leaves it without effect"
                )
            return f"FAILED: /proc has no {option}"

        return judge

    def raised(limit: str, want: str) -> str:
        line = next(ln for ln in me.limits.splitlines() if ln.startswith(limit))
        if line.split()[-3] == want or (want == "infinity" and "unlimited" in line):
            return OK
        if not can_raise:
            return "cannot be checked here: this host withholds CAP_SYS_RESOURCE, so no " \
                   f"limit is raised past the container's ({line.split()[-2]})"  # fmt: skip
        return f"FAILED: {line}"

    def seccomp_judge(key: str, value: str) -> str:
        results = []
        # a family the unit allows is no test of the restriction
        ops = [op for op in SECCOMP[key] if f"AF_{op[3:].upper()}" not in value.split()]
        for op in ops:
            free, confined = seccomp
            if confined[op]:
                return f"FAILED: {op} allowed under the unit's sandbox"
            results.append(OK if free[op] else f"{op} is refused here even without it")
        if OK in results:
            return OK
        return "cannot be checked here: " + "; ".join(results)

    judges: dict[str, Callable[[str], str]] = {
        "CapabilityBoundingSet": lambda v: (
            OK
            if me.cap("CapBnd") == cap_mask(v) & init.cap("CapBnd")
            else f"FAILED: CapBnd {me.cap('CapBnd'):#x}"
        ),
        "AmbientCapabilities": lambda v: OK if me.cap("CapAmb") == cap_mask(v) else "FAILED",
        "NoNewPrivileges": lambda v: OK if me.status["NoNewPrivs"] == "1" else "FAILED",
        "UMask": lambda v: OK if me.status["Umask"] == v else f"FAILED: {me.status['Umask']}",
        "DynamicUser": lambda v: OK if me.status["Uid"].split()[0] != "0" else "FAILED: root",
        "PrivateUsers": lambda v: OK if me.uid_map != init.uid_map else "FAILED",
        "OOMScoreAdjust": lambda v: (
            OK
            if me.oom == int(v)
            else "cannot be checked here: this host withholds CAP_SYS_RESOURCE (a lower OOM "
            "score needs it; systemd ignores the refusal in a container)"
            if not can_raise
            else f"FAILED: {me.oom}"
        ),
        "LimitNOFILE": lambda v: raised("Max open files", v),
        "LimitMEMLOCK": lambda v: raised("Max locked memory", v),
        "ProtectSystem": lambda v: read_only(("/usr", "/etc") if v == "full" else ("/",)),
        "ProtectHome": lambda v: (
            mount_differs("/home", "mounted over")
            if "/home" in init.mounts or "/home" in me.mounts
            else "cannot be checked here: no /home"
        ),
        "PrivateTmp": lambda v: mount_differs("/tmp", "a private /tmp"),
        "PrivateDevices": lambda v: mount_differs("/dev", "a private /dev"),
        "ProtectControlGroups": lambda v: read_only(("/sys/fs/cgroup",)),
        "ProtectKernelTunables": lambda v: read_only(("/proc/sys",)),
        "ProtectKernelLogs": lambda v: mount_differs("/proc/kmsg", "masked"),
        "ProtectKernelModules": lambda v: (
            "cannot be checked here: the image has no "
            "/lib/modules and the container withholds CAP_SYS_MODULE on its own"
            if not init.cap("CapBnd") >> CAPS.index("SYS_MODULE") & 1
            else OK
        ),
        "ProtectClock": lambda v: (
            OK
            if not me.cap("CapBnd") >> CAPS.index("SYS_TIME") & 1
            and init.cap("CapBnd") >> CAPS.index("SYS_TIME") & 1
            else "cannot be checked here: the container withholds CAP_SYS_TIME on its own"
        ),
        "ProtectHostname": lambda v: OK if me.uts != init.uts else noted_or("-")(v),
        "ProtectProc": noted_or("hidepid=invisible"),
        "ProcSubset": noted_or("subset=pid"),
        "SystemCallArchitectures": lambda v: (
            "cannot be checked here: it needs a non-native "
            "(32-bit) program to try, and the image has none"
        ),
        **{key: (lambda v, key=key: seccomp_judge(key, v)) for key in SECCOMP},
    }
    report = {}
    for key, values in settings.items():
        if key in LIFECYCLE:
            continue
        judge = judges.get(key)
        report[key] = judge(values[-1]) if judge else "FAILED: no check for this directive"
    return report


def _proc_mounts_in_a_user_namespace(c: BootCluster, host: str) -> bool:
    """Whether a new /proc with ``hidepid=`` may be mounted in a user namespace here."""
    tried = "mkdir -p /run/proc-probe && unshare -U -r -m mount -t proc -o hidepid=invisible "
    return c.sh(host, tried + "proc /run/proc-probe && echo mounted", check=False).strip() == (
        "mounted"
    )


def _probe(
    c: BootCluster, host: str, settings: dict[str, list[str]]
) -> tuple[dict[str, bool], dict[str, bool]]:
    """The probe's answers without the unit's system-call restrictions, and with them."""
    source = base64.b64encode(PROBE.read_bytes()).decode()
    code = f"import base64; exec(base64.b64decode('{source}'))"
    answers = []
    for confined in (False, True):
        props = [
            f"-p {shlex.quote(f'{key}={value}')}"
            for key, values in settings.items()
            if key not in LIFECYCLE and (confined or key not in SECCOMP)
            for value in values
        ]
        argv = " ".join(props)
        out = c.sh(
            host,
            f"systemd-run --wait --pipe --quiet {argv} /opt/ringmaster/bin/python -c "
            f"{shlex.quote(code)}",
        )
        answers.append(json.loads(out.strip().splitlines()[-1]))
    return answers[0], answers[1]
