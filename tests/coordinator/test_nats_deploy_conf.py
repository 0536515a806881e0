"""deploy/nats/nats-cluster.conf, the documented production server config (TLS for clients
and routes, the generated authorization included), is one nats-server accepts: checked
with ``nats-server -t`` against throwaway certificates and a generated nats-auth.conf."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from coordinator import auth
from coordinator.embedded_nats import nats_server_binary

CONF = Path(__file__).resolve().parents[2] / "deploy" / "nats" / "nats-cluster.conf"


def test_the_production_config_parses(tmp_path: Path) -> None:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is needed to make throwaway certificates")
    tls = tmp_path / "tls"
    tls.mkdir()
    key, cert = str(tls / "server-key.pem"), str(tls / "server.pem")
    self_signed = ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
    subprocess.run(
        [openssl, *self_signed, "-subj", "/CN=nats-1", "-keyout", key, "-out", cert],
        check=True,
        capture_output=True,
    )
    shutil.copy(tls / "server.pem", tls / "ca.pem")
    auth.init(tmp_path, "prod", ["gpu-01", "gpu-02"], ["coordinator-a", "coordinator-b"])
    text = CONF.read_text().replace("/etc/nats/", f"{tmp_path}/")
    conf = tmp_path / "nats-cluster.conf"
    conf.write_text(text.replace("/var/lib/nats", str(tmp_path)))
    checked = subprocess.run(
        [str(nats_server_binary()), "-t", "-c", str(conf)], capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stderr + checked.stdout
    assert "valid" in checked.stderr + checked.stdout
