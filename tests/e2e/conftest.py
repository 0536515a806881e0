"""End-to-end fixtures: a CLI bound to a local cluster directory; a failed scenario's
report ends with its cluster's event history, the evidence for what happened.

A scenario gets a fresh cluster of its own, unless it is marked
``shared_cluster(nodes=N)``: then it runs on an N-node cluster this test worker keeps up
for every such scenario, each with its own job, so the cluster's start and stop
(coordinator, agents, simulator, bus) are paid once. ``up`` on it is a no-op (a second
``up`` says the cluster runs and exits 0). A scenario may do to its job and its nodes
whatever a job's own faults do, as long as it clears what it injected; after each one
its jobs are stopped, and the cluster is kept for the next only once every node is
`ready` again with no rank left, else it is brought down and the next scenario gets a
fresh one. A scenario that changes the cluster's environment or its shape, brings it
down, or looks at events of no job of its own keeps a cluster of its own.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from pathlib import Path

import pytest
from cli_harness import ENDED, Ctl, eventually

HISTORY_LINES = 60  # the newest events: a failure's cause is rarely older
SETTLE_S = 90.0  # for a scenario's jobs to end and its nodes to be ready again


@pytest.fixture(scope="session")
def _shared_clusters(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[int, Ctl]]:
    clusters: dict[int, Ctl] = {}
    yield clusters
    for cli in clusters.values():
        cli.run("down")


@pytest.fixture
def ctl(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Ctl]:
    """A CLI bound to a fresh local cluster directory, or to this worker's shared cluster
    of the scenario's ``shared_cluster`` shape; whatever a fresh one brought up goes down."""
    marker = request.node.get_closest_marker("shared_cluster")
    if marker is None:
        cli = Ctl(tmp_path / "cluster")
        yield cli
        cli.run("down")
        return
    nodes = int(marker.kwargs["nodes"])
    clusters: dict[int, Ctl] = request.getfixturevalue("_shared_clusters")
    if nodes not in clusters:
        home = request.getfixturevalue("tmp_path_factory").mktemp(f"shared-{nodes}")
        clusters[nodes] = Ctl(home / "cluster")
    cli = clusters[nodes]
    cli("up", "--nodes", str(nodes))
    yield cli
    if not _settled(cli, nodes):
        cli.run("down")
        del clusters[nodes]


def _settled(cli: Ctl, nodes: int) -> bool:
    """Stop what the scenario left running; whether the cluster is fit for the next."""
    try:
        for job in cli.view(None)["jobs"]:
            if job["state"] not in ENDED:
                cli.run("stop", job["id"])

        def fit() -> bool:
            status = cli.view(None)
            ended = all(j["state"] in ENDED for j in status["jobs"])
            ready = [n for n in status["nodes"] if n["state"] == "ready"]
            return (
                ended
                and len(ready) == nodes
                and not any(cli.ranks(j["id"]) for j in status["jobs"])
            )

        eventually(fit, SETTLE_S, lambda: "the shared cluster did not settle", 0.5)
    except AssertionError:
        return False
    return True


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    cli = getattr(item, "funcargs", {}).get("ctl")
    if call.when == "call" and report.failed and isinstance(cli, Ctl):
        done = cli.run("tail", "--no-follow")  # the cluster is still up: teardown is next
        lines = (done.stdout or done.stderr).splitlines()[-HISTORY_LINES:]
        report.sections.append(("cluster events", "\n".join(lines)))
    return report
