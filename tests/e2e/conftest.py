"""End-to-end fixtures: a CLI bound to a fresh local cluster directory."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_harness import Ctl


@pytest.fixture
def ctl(tmp_path: Path) -> Iterator[Ctl]:
    """A CLI bound to a fresh local cluster directory; whatever it brought up goes down."""
    cli = Ctl(tmp_path / "cluster")
    yield cli
    cli.run("down")
