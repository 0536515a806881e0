"""Fixtures for node agent tests: text fixture trees and a real nats-server.

Fixture trees are kept as text (``tests/fixtures/*.ttar``), node_exporter's habit, so a diff
shows what a test's hardware looks like. The format, one entry per header line:

    ### <path>              a file; the lines up to the next header are its content
    ### <path>/             an empty directory
    ### <path> -> <target>  a symbolic link (sysfs's /sys/block entries are links)

Other lines starting with ``#`` are comments, wherever they are. A file's content gets a final
newline, as the kernel writes it.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from gpu_stub import GpuNode

from nodeagent.sim import nvml_stub
from nodeagent.sim.nvml_state import hgx
from tests.waits import until

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
REPO = FIXTURES.parent.parent
NATS_SERVER = REPO / ".venv" / "bin" / "nats-server"


def load_ttar(source: Path, dest: Path) -> None:
    """Materialise one text fixture under ``dest``, overwriting files already there."""
    path: str | None = None
    lines: list[str] = []

    def flush() -> None:
        if path is not None:
            target = dest / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text("".join(f"{line}\n" for line in lines))

    for raw in source.read_text().splitlines():
        if not raw.startswith("### "):
            if path is not None and not raw.startswith("#"):
                lines.append(raw)
            continue
        flush()
        path, lines = None, []
        header = raw[4:]
        if " -> " in header:
            name, link_to = header.split(" -> ", 1)
            link = dest / name
            link.parent.mkdir(parents=True, exist_ok=True)
            if link.is_symlink():
                link.unlink()
            link.symlink_to(link_to)
        elif header.endswith("/"):
            (dest / header).mkdir(parents=True, exist_ok=True)
        else:
            path = header
    flush()


@pytest.fixture
def tree(tmp_path: Path) -> Callable[[str], Path]:
    """``tree("sysfs_nvme")`` loads ``tests/fixtures/sysfs_nvme.ttar`` into one root per test
    (later loads overlay earlier ones) and returns that root, the parent of ``sys/``."""
    root = tmp_path / "root"
    root.mkdir(mode=0o755)

    def load(name: str) -> Path:
        load_ttar(FIXTURES / f"{name}.ttar", root)
        return root

    return load


@pytest.fixture
def nats_url(tmp_path: Path) -> Iterator[str]:
    """A private nats-server on a free port (``-p -1``; the port comes from its ports file)."""
    ports_dir = tmp_path / "nats-ports"
    ports_dir.mkdir()
    server = subprocess.Popen(
        [str(NATS_SERVER), "-a", "127.0.0.1", "-p", "-1", "--ports_file_dir", str(ports_dir)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield _client_url(server, ports_dir / f"nats-server_{server.pid}.ports")
    finally:
        server.terminate()
        server.wait(timeout=10)


def _client_url(server: subprocess.Popen[bytes], ports_file: Path) -> str:
    """The client URL from the ports file, once the server has written all of it."""

    def url() -> str | None:
        try:
            return str(json.loads(ports_file.read_text())["nats"][0])
        except (FileNotFoundError, json.JSONDecodeError):
            assert server.poll() is None, "nats-server exited at start"
            return None

    return until(url, 10, "nats-server's ports file", lambda: ports_file.exists())


# -- the stub NVML library ------------------------------------------------------------


@pytest.fixture(scope="session")
def nvml_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the stub library is compiled, once per test session."""
    cache = tmp_path_factory.mktemp("nvml-cache")
    try:
        nvml_stub.build(cache)
    except nvml_stub.StubBuildError as exc:
        pytest.skip(f"cannot build the NVML stub: {exc}")
    return cache


@pytest.fixture
def gpu_node(tmp_path: Path, nvml_cache: Path) -> Iterator[GpuNode]:
    """Eight idle GPUs of an HGX-like board behind the stub library."""
    directory = tmp_path / "nvml"
    nvml_stub.install(directory, nvml_cache)
    node = GpuNode(directory, hgx(8))
    node.write()
    try:
        yield node
    finally:
        node.close()
