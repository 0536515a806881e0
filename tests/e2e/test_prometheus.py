"""A real Prometheus scrapes a running local cluster the way an operator's would — a
default-style configuration, ``honor_labels`` left false — and every query of the shipped
dashboard, its template variables substituted, finds the running job's series; promtool
passes every endpoint the cluster serves."""

from __future__ import annotations

import json
import math
import re
import shutil
import socket
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from cli_harness import ROOT, Ctl, eventually

pytestmark = pytest.mark.slow
HOW = (
    "not found: install Debian's prometheus package "
    "(apt-get install prometheus; ./scripts/bootstrap.sh does it when run as root)"
)
DASHBOARD = ROOT / "deploy" / "grafana" / "ringmaster.json"
SCRAPE_JOBS = {"nodes": "ringmaster-nodes", "coordinators": "ringmaster-coordinators"}
LABEL_VALUES = re.compile(r"label_values\((\w+),\s*(\w+)\)")

# What each panel query must return once the job has trained a while: the labels every
# series of the result carries (checked against the cluster where they name a node or the
# job), or None for a query that may rightly be empty (no GPU is throttled, no condition
# is open on a healthy cluster). A panel missing here fails the test: say what it needs.
EXPECTED: dict[tuple[str, str], set[str] | None] = {
    ("Leader", "A"): {"coordinator"},
    ("Nodes by state", "A"): {"state"},
    ("Open conditions", "A"): set(),
    ("Collectors failing", "A"): set(),
    ("Leader epoch", "A"): set(),
    ("GPU utilisation (healthy 75-95 %)", "A"): {"node", "gpu"},
    ("PCIe throughput", "A"): {"node", "gpu", "direction"},
    ("NVMe latency (baseline 20-25 µs)", "A"): {"node", "device"},
    ("PCIe replays", "A"): {"node", "gpu"},
    ("NVMe read-only", "A"): {"node", "device"},
    ("GPU temperature", "A"): {"node", "gpu"},
    ("GPU clock-event reasons", "A"): None,
    ("GPU memory used", "A"): {"node", "gpu"},
    ("Job state", "A"): {"job_name", "state"},
    ("Job step", "A"): {"job_name"},
    ("Job step", "B"): {"job_name"},
    ("Tokens per second", "A"): {"job_name"},
    ("Loss", "A"): {"job_name"},
    ("Restarts and pauses (1 h)", "A"): {"job_name"},
    ("Restarts and pauses (1 h)", "B"): {"job_name"},
    ("Event → decision latency", "A"): set(),
    ("Event → decision latency", "B"): set(),
    ("Goodput ledger (GPU-hours by bucket)", "A"): {"bucket"},
    ("Goodput (productive share)", "A"): {"job_name"},
    ("Active conditions", "A"): None,
    ("Clock offset", "A"): {"node"},
    ("Collector duration", "A"): {"node", "collector"},
}


def binary(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        pytest.skip(f"{name} {HOW}")
    return found


def get(url: str) -> Any:
    """``url``'s JSON; Prometheus' own words when it refuses (a query it cannot parse)."""
    assert url.startswith("http://127.0.0.1:"), url
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:  # loopback only
            return json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"{url}: {exc.code} {exc.read().decode()}") from None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Prometheus:
    """A Prometheus of the test's own — its configuration, storage and log under ``home``,
    a free loopback port — never the package's service."""

    def __init__(self, home: Path, targets: dict[str, list[str]]) -> None:
        home.mkdir()
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
            "scrape_configs": [
                {"job_name": SCRAPE_JOBS[kind], "static_configs": [{"targets": hosts}]}
                for kind, hosts in targets.items()
            ],
        }
        (home / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = home / "prometheus.log"
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                [
                    binary("prometheus"),
                    f"--config.file={home / 'prometheus.yml'}",
                    f"--storage.tsdb.path={home / 'data'}",
                    f"--web.listen-address={self.url.removeprefix('http://')}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def api(self, path: str, **params: str) -> Any:
        reply = get(f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}")
        assert reply["status"] == "success", reply
        return reply["data"]

    def ready(self) -> bool:
        assert self.proc.poll() is None, f"prometheus exited: {self.log.read_text()[-2000:]}"
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=5) as reply:
                return bool(reply.status == 200)
        except OSError:
            return False

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Callable[[dict[str, list[str]]], Prometheus]]:
    """Starts the test's Prometheus on the targets given; kills it at the end."""
    started: list[Prometheus] = []

    def start(targets: dict[str, list[str]]) -> Prometheus:
        started.append(Prometheus(tmp_path / "prometheus", targets))
        return started[-1]

    yield start
    for p in started:
        p.close()


def promtool_problems(promtool: str, url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as reply:  # a loopback URL from status
        body = reply.read().decode()
    done = subprocess.run(
        [promtool, "check", "metrics"], input=body, capture_output=True, text=True, timeout=60
    )
    said = (done.stdout + done.stderr).strip()
    return said if said or done.returncode == 0 else f"exit {done.returncode}"


def panel_queries(dashboard: dict[str, Any]) -> dict[tuple[str, str], str]:
    return {(p["title"], t["refId"]): t["expr"] for p in dashboard["panels"] for t in p["targets"]}


def substituted(expr: str, variables: dict[str, list[str]]) -> str:
    """``expr`` as Grafana sends it: a multi-value variable in a regex matcher becomes
    ``(a|b)``."""
    for name, values in sorted(variables.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace(f"${name}", "(" + "|".join(values) + ")")
    assert "$" not in expr, f"a variable the test does not know: {expr}"
    return expr


def what_is_missing(
    prom: Prometheus, queries: dict[tuple[str, str], str], job: str, nodes: list[str]
) -> list[str]:
    """Every panel query's shortcomings against EXPECTED ([] once all hold)."""
    variables = {"node": nodes, "job_name": [job]}
    missing = []
    for key, expr in queries.items():
        wanted = EXPECTED[key]
        result = prom.api("query", query=substituted(expr, variables))["result"]
        if wanted is None:
            continue
        if not result:
            missing.append(f"{key}: no series for {expr}")
        for series in result:
            labels, value = series["metric"], float(series["value"][1])
            if not wanted <= set(labels):
                missing.append(f"{key}: {labels} lacks {sorted(wanted - set(labels))}")
            if labels.get("job_name", job) != job or labels.get("node", nodes[0]) not in nodes:
                missing.append(f"{key}: a series of another job or node: {labels}")
            if "job_name" in wanted and math.isnan(value):
                missing.append(f"{key}: NaN for {labels}")
    return missing


@pytest.mark.timeout(600)
def test_every_dashboard_query_finds_the_running_job(
    ctl: Ctl, tmp_path: Path, prometheus: Callable[[dict[str, list[str]]], Prometheus]
) -> None:
    promtool = binary("promtool")
    binary("prometheus")
    dashboard = json.loads(DASHBOARD.read_text())
    queries = panel_queries(dashboard)
    assert set(queries) == set(EXPECTED), "say what each new panel query must return"

    ctl("up", "--nodes", "2", "--standby")
    status: dict[str, Any] = {}

    def urls_known() -> bool:
        status.update(ctl.status())
        return len(status["coordinators"]) == 2 and all(
            d["metrics_url"] for d in status["nodes"] + status["coordinators"]
        )

    eventually(urls_known, 60, lambda: f"metrics_url missing: {status}", 0.5)
    nodes = sorted(n["id"] for n in status["nodes"])
    urls = {kind: [d["metrics_url"] for d in status[kind]] for kind in SCRAPE_JOBS}
    for url in urls["nodes"] + urls["coordinators"]:
        assert promtool_problems(promtool, url) == "", url

    targets = {
        kind: [u.removeprefix("http://").removesuffix("/metrics") for u in found]
        for kind, found in urls.items()
    }
    prom = prometheus(targets)
    eventually(prom.ready, 60, lambda: f"prometheus not ready: {prom.log.read_text()}", 0.5)
    job = ctl.start(  # long enough to be running whenever it is queried
        "tiny.toml",
        "train.steps=100000",
        "checkpoint.every_steps=100000",
        f"checkpoint.dir={tmp_path / 'ckpt'}",
    )
    ctl.wait(job, lambda s: s["state"] == "running" and s["step"] >= 2)

    def all_up() -> bool:
        active = prom.api("targets", state="active")["activeTargets"]
        return len(active) == 4 and all(t["health"] == "up" for t in active)

    eventually(all_up, 60, lambda: f"targets: {prom.api('targets')}", 0.5)
    missing: list[str] = []

    def every_panel_has_data() -> bool:
        missing[:] = what_is_missing(prom, queries, job, nodes)
        return not missing

    eventually(every_panel_has_data, 180, lambda: "\n".join(missing), 1.0)

    # The template variables list the cluster's nodes and the running job.
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            [(metric, label)] = LABEL_VALUES.findall(variable["query"]["query"])
            found = prom.api(f"label/{label}/values", **{"match[]": metric})
            assert found == ([job] if label == "job_name" else nodes), variable["name"]
    # honor_labels: false keeps every exported label: the scrape job is the scrape job's.
    [series] = prom.api("query", query=f'ringmaster_job_step{{job_name="{job}"}}')["result"]
    assert series["metric"]["job"] == SCRAPE_JOBS["coordinators"], series
    assert prom.api("query", query='{exported_job=~".+"}')["result"] == []
