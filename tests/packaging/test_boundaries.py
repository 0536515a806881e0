"""Package boundaries: the coordinator and the node agent ship and run apart, so neither
imports the other; both share only ``proto`` (the wire contract) and ``ringmaster`` (the
shared runtime), which import neither. None of them imports the trainer (the agent starts
ranks as processes, ``python -m trainer.worker``) or torch and its libraries.

The rank API (``ringmaster.rank``) and the framework integrations
(``ringmaster.integrations``) live in the ``ringmaster`` namespace, where a user imports
them, but on the training side: they import torch and the trainer, and nothing of the
control plane (the rest of ``ringmaster`` included) imports them.

Every import counts: ``import x`` and ``from x import y``, at module level or inside a
function, absolute or relative (resolved against the importing module's package).

One boundary runs inside the coordinator: its pure decision modules read no clock (the
time is their argument), so only the I/O shell's clock object says what time it is."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The control plane runs on machines (and in processes) without a training stack: it never
# imports torch or the libraries built on it.
TRAINING_STACK = ("torch", "deepspeed", "torchao")
# the rank API and the integrations: in the ringmaster namespace, on the training side
TRAINING_SIDE = ("ringmaster.rank", "ringmaster.integrations")
FORBIDDEN = {
    "coordinator": ("nodeagent", "trainer", *TRAINING_STACK, *TRAINING_SIDE),
    "nodeagent": ("coordinator", "trainer", *TRAINING_STACK, *TRAINING_SIDE),
    "proto": ("coordinator", "nodeagent", "trainer", *TRAINING_STACK, *TRAINING_SIDE),
    "ringmaster": ("coordinator", "nodeagent", "trainer", *TRAINING_STACK, *TRAINING_SIDE),
    "ringmaster/rank": ("coordinator", "nodeagent"),
    "ringmaster/integrations": ("coordinator", "nodeagent"),
}


def imported_modules(path: Path, root: Path) -> Iterator[tuple[int, str]]:
    """(line, absolute module name) for every import statement in ``path``."""
    # relative imports start from the module's package (for __init__.py, the package itself)
    package = path.relative_to(root).parts[:-1]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else ()
            yield node.lineno, ".".join([*base, *([node.module] if node.module else [])])


def violations(package: str, root: Path = ROOT) -> list[str]:
    """Every forbidden import in ``package`` (a directory under ``root``), leaving out the
    subpackages that have rules of their own."""
    others = [root / p for p in FORBIDDEN if p != package and p.startswith(f"{package}/")]
    return [
        f"{path.relative_to(root)}:{line} imports {module}"
        for path in sorted((root / package).rglob("*.py"))
        if not any(path.is_relative_to(other) for other in others)
        for line, module in sorted(imported_modules(path, root))
        if any(module == b or module.startswith(f"{b}.") for b in FORBIDDEN[package])
    ]


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_import_across_the_boundary(package: str) -> None:
    found = violations(package)
    banned = " or ".join(FORBIDDEN[package])
    assert not found, f"{package}/ must not import {banned}:\n" + "\n".join(found)


def test_the_check_catches_every_form_of_import(tmp_path: Path) -> None:
    """A guard that finds nothing proves nothing unless it would have found something."""
    sub = tmp_path / "coordinator" / "sub"
    sub.mkdir(parents=True)
    (sub / "mod.py").write_text(
        "import nodeagent\n"
        "import os, nodeagent.sim as sim\n"
        "from nodeagent.collectors import clock_peer\n"
        "from proto import faults\n"
        "def late():\n"
        "    from trainer import worker\n"
        "    import trainer.loop\n"
        "from ..nodeagent import x\n"  # coordinator.nodeagent: inside the package, allowed
        "from . import sibling\n"
    )
    assert violations("coordinator", tmp_path) == [
        "coordinator/sub/mod.py:1 imports nodeagent",
        "coordinator/sub/mod.py:2 imports nodeagent.sim",
        "coordinator/sub/mod.py:3 imports nodeagent.collectors",
        "coordinator/sub/mod.py:6 imports trainer",
        "coordinator/sub/mod.py:7 imports trainer.loop",
    ]


def test_the_rank_api_is_on_the_training_side_of_the_runtime(tmp_path: Path) -> None:
    """The shared runtime may not import the rank API; the rank API may import torch."""
    (tmp_path / "ringmaster" / "rank").mkdir(parents=True)
    (tmp_path / "ringmaster" / "log.py").write_text("from ringmaster.rank import step\n")
    (tmp_path / "ringmaster" / "rank" / "api.py").write_text(
        "import torch\nfrom trainer import loop\nimport coordinator.jobs\n"
    )
    assert violations("ringmaster", tmp_path) == ["ringmaster/log.py:1 imports ringmaster.rank"]
    assert violations("ringmaster/rank", tmp_path) == [
        "ringmaster/rank/api.py:3 imports coordinator.jobs"
    ]


def test_relative_imports_resolve_against_the_package(tmp_path: Path) -> None:
    module = tmp_path / "nodeagent" / "sim" / "node.py"
    init = tmp_path / "nodeagent" / "sim" / "__init__.py"
    module.parent.mkdir(parents=True)
    source = "from . import gpus\nfrom ..collectors.base import Roots\nfrom .faults import X\n"
    module.write_text(source)
    init.write_text(source)
    expected = [(1, "nodeagent.sim"), (2, "nodeagent.collectors.base"), (3, "nodeagent.sim.faults")]
    assert list(imported_modules(module, tmp_path)) == expected
    assert list(imported_modules(init, tmp_path)) == expected


# The coordinator's pure decisions take the time as an argument (``now``) from the one
# clock the I/O shell holds (``ringmaster.clock``): none of them reads a clock itself.
PURE = (
    *("alerts", "exclusion", "goodput", "hang_verdict", "job_machine", "loss_verdict"),
    *(
        "network_culprit",
        "node_life",
        "node_view",
        "policy",
        "progress_policy",
        "reconcile",
        "registry",
    ),
)
CLOCKS = ("time", "ringmaster.clock")
CLOCK_CALLS = ("now", "utcnow", "today")  # datetime's and date's readings of the clock


def clock_reads(path: Path, root: Path = ROOT) -> list[str]:
    """Every import of a clock module in ``path``, and every call of ``now()``,
    ``utcnow()`` or ``today()``."""
    found = [
        f"{path.relative_to(root)}:{line} imports {module}"
        for line, module in imported_modules(path, root)
        if any(module == c or module.startswith(f"{c}.") for c in CLOCKS)
    ]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in CLOCK_CALLS:
                found.append(f"{path.relative_to(root)}:{node.lineno} calls {name}()")
    return found


@pytest.mark.parametrize("module", PURE)
def test_the_coordinators_pure_decisions_read_no_clock(module: str) -> None:
    assert clock_reads(ROOT / "coordinator" / f"{module}.py") == []


def test_the_clock_check_catches_every_reading(tmp_path: Path) -> None:
    module = tmp_path / "coordinator" / "policy.py"
    module.parent.mkdir()
    module.write_text(
        "import time\n"
        "from time import monotonic\n"
        "from ringmaster.clock import SYSTEM\n"
        "from datetime import UTC, datetime\n"
        "stamp = datetime.now(UTC)\n"
        "from proto.events import utcnow\n"
        "later = utcnow()\n"
        "at = datetime.fromtimestamp(0.0, UTC)\n"  # a given time, formatted: no clock
    )
    assert clock_reads(module, tmp_path) == [
        "coordinator/policy.py:1 imports time",
        "coordinator/policy.py:2 imports time",
        "coordinator/policy.py:3 imports ringmaster.clock",
        "coordinator/policy.py:5 calls now()",
        "coordinator/policy.py:7 calls utcnow()",
    ]
