"""The job manager's harness as fixtures: ``cluster`` (three beating nodes, the in-memory
store, fake agents, a manual clock: :class:`test_jobs.Cluster`) and ``manager``, a leader
over it. Time passes only where a test advances ``cluster.clock``."""

from __future__ import annotations

import pytest
from test_jobs import Cluster

from coordinator.jobs import JobManager


@pytest.fixture
def cluster() -> Cluster:
    return Cluster()


@pytest.fixture
def manager(cluster: Cluster) -> JobManager:
    return cluster.leader()
