"""The images the booting-node tests run, built once and reused.

Podman as root, with runc and the cgroupfs manager (``containers.conf`` beside this file:
crun refuses this kind of host's hybrid cgroups, and podman's default open-files limit
is above its hard limit). No registry is reachable, so the base image is Debian's own
packages (``mmdebstrap --variant=minbase``, imported by ``podman import``) and the Python
packages come from a wheelhouse built on the host (``build/wheels``, the Dockerfile's
``WHEELS``). Each is kept between runs: the base image by its tag, the wheelhouse by a
stamp of what it was built from, the built images by podman's layer cache.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONF = Path(__file__).with_name("containers.conf")
BASE = "localhost/ringmaster-base:bookworm"
CONTROL_PLANE = "localhost/ringmaster:control-plane"
ROLES = {
    "node": ("ringmaster-nodeagent.service", "localhost/ringmaster:test-node"),
    "coordinator": ("ringmaster-coordinator.service", "localhost/ringmaster:test-coordinator"),
}
WHEELS = REPO / "build" / "wheels"
BASE_PACKAGES = "systemd,systemd-sysv,dbus,python3,python3-venv,iproute2,procps,ca-certificates"
NEEDED = ("podman", "runc", "mmdebstrap", "iptables")


def unavailable() -> str | None:
    """Why the booting-node tests cannot run here, or None."""
    if os.geteuid() != 0:
        return "not root: podman's containers that boot systemd need root here"
    missing = [tool for tool in NEEDED if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} not installed (./scripts/bootstrap.sh installs them as root)"
    return None


def podman(*args: str, check: bool = True, timeout: float = 600) -> str:
    """Runs podman with this suite's containers.conf; its stdout."""
    env = {**os.environ, "CONTAINERS_CONF": str(CONF)}
    done = subprocess.run(
        ["podman", *args], env=env, capture_output=True, text=True, timeout=timeout
    )
    if check and done.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args[:3])}: {done.stderr.strip()[-2000:]}")
    return done.stdout


@contextmanager
def _locked() -> Iterator[None]:
    """One builder at a time across the test workers."""
    lock = Path(tempfile.gettempdir()) / "ringmaster-images.lock"
    with lock.open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _base() -> None:
    """Debian 12 with systemd and Python from Debian's archive (mmdebstrap: the same
    packages debootstrap installs, fetched in parallel, in a fifth of its time)."""
    with tempfile.TemporaryDirectory(prefix="ringmaster-base-", dir="/var/tmp") as tmp:
        tar = Path(tmp) / "base.tar"
        subprocess.run(
            ["mmdebstrap", "--quiet", "--variant=minbase", f"--include={BASE_PACKAGES}",
             "bookworm", str(tar), "http://deb.debian.org/debian"],
            check=True, capture_output=True, timeout=900,
        )  # fmt: skip
        podman("import", "--change", 'CMD ["/sbin/init"]', str(tar), BASE)


def exists(image: str) -> bool:
    env = {**os.environ, "CONTAINERS_CONF": str(CONF)}
    return subprocess.run(["podman", "image", "exists", image], env=env).returncode == 0


def _wheelhouse() -> None:
    """The control plane's wheels and the build backend's, for Python 3.11 on Linux."""
    want = hashlib.sha256(
        (REPO / "pyproject.toml").read_bytes() + (REPO / "constraints.txt").read_bytes()
    ).hexdigest()
    stamp = WHEELS / ".stamp"
    if stamp.is_file() and stamp.read_text() == want:
        return
    shutil.rmtree(WHEELS, ignore_errors=True)
    WHEELS.mkdir(parents=True)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    constraint = ["-c", str(REPO / "constraints.txt")]
    for args in (
        ["wheel", *constraint, "-w", str(WHEELS), str(REPO)],
        ["download", *constraint, "-d", str(WHEELS), "setuptools>=77", "wheel"],
    ):
        done = subprocess.run([*pip, *args], capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(f"pip {args[0]}: {done.stderr.strip()[-2000:]}")
    for ours in WHEELS.glob("ringmaster-*.whl"):
        ours.unlink()  # the image builds the code from its own copy
    stamp.write_text(want)


def build() -> None:
    """The base, the control-plane image and one image per role, each enabling its unit
    as a user's would."""
    with _locked():
        if not exists(BASE):
            _base()
        _wheelhouse()
        podman(
            "build", "--target", "control-plane", "--build-arg", f"BASE={BASE}",
            "--build-arg", f"WHEELS={WHEELS.relative_to(REPO)}", "-t", CONTROL_PLANE,
            str(REPO), timeout=1200,
        )  # fmt: skip
        for unit, tag in ROLES.values():
            with tempfile.TemporaryDirectory() as ctx:
                (Path(ctx) / "Containerfile").write_text(
                    f"FROM {CONTROL_PLANE}\nRUN systemctl enable {unit}\n"
                )
                podman("build", "-t", tag, ctx)


def size_mb(image: str) -> float:
    return int(podman("image", "inspect", "--format", "{{.Size}}", image)) / 1e6
