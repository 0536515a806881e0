"""Package boundaries: the coordinator and the node agent ship and run apart, so neither
imports the other; both share only ``proto`` (the wire contract) and ``ringmaster`` (the
shared runtime), which import neither. None of them imports the trainer (the agent starts
ranks as processes, ``python -m trainer.worker``) or torch and its libraries.

The rank runtime (``ringmaster.rank``) and the framework integrations
(``ringmaster.integrations``) live in the ``ringmaster`` namespace, where a user imports
them, but on the training side: they import torch, and nothing of the control plane (the
rest of ``ringmaster`` included) imports them. The built-in trainer is one user of the
rank runtime: ``ringmaster`` and ``proto`` never import it, so a user's loop that imports
an integration loads neither our model nor DeepSpeed, and the trainer reaches the runtime
only through the modules ``docs/integrations.md`` documents.

Every import counts: ``import x`` and ``from x import y``, at module level or inside a
function, absolute or relative (resolved against the importing module's package), and a
module named by a string (``importlib.import_module("x")``, ``__import__``,
``runpy.run_module``).

Two boundaries run inside the coordinator: its pure decision modules read no clock (the
time is their argument), so only the I/O shell's clock object says what time it is; and
its modules import one another in one direction, with no cycle."""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
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
# Never the built-in trainer, anywhere in these trees (the rank runtime included): the
# trainer is one user of the runtime, not a part of it.
NOT_THE_TRAINER = ("ringmaster", "proto")
# the calls that import a module named by a string
BY_NAME = frozenset(("import_module", "__import__", "run_module"))


def imported_modules(path: Path, root: Path) -> Iterator[tuple[int, str]]:
    """(line, absolute module name) for every import statement in ``path``."""
    # relative imports start from the module's package (for __init__.py, the package itself)
    package = path.relative_to(root).parts[:-1]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            yield node.lineno, _from_module(node, package)
        elif isinstance(node, ast.Call) and (name := _named_module(node)) is not None:
            yield node.lineno, name


def _from_module(node: ast.ImportFrom, package: tuple[str, ...]) -> str:
    """The absolute module a ``from … import`` in ``package`` names."""
    base = package[: len(package) - node.level + 1] if node.level else ()
    return ".".join([*base, *([node.module] if node.module else [])])


def _named_module(call: ast.Call) -> str | None:
    """The module a call like ``importlib.import_module("x")`` imports, if it is one."""
    func = call.func
    callee = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    first = call.args[0] if call.args else None
    if callee in BY_NAME and isinstance(first, ast.Constant) and isinstance(first.value, str):
        return first.value
    return None


def violations(package: str, root: Path = ROOT) -> list[str]:
    """Every forbidden import in ``package`` (a directory under ``root``), leaving out the
    subpackages that have rules of their own."""
    others = [root / p for p in FORBIDDEN if p != package and p.startswith(f"{package}/")]
    return imports_of(package, FORBIDDEN[package], root, others)


def imports_of(
    package: str, banned: tuple[str, ...], root: Path = ROOT, leave_out: list[Path] | None = None
) -> list[str]:
    """Every import of a ``banned`` module in ``package`` (a directory under ``root``),
    but in the directories of ``leave_out``."""
    return [
        f"{path.relative_to(root)}:{line} imports {module}"
        for path in sorted((root / package).rglob("*.py"))
        if not any(path.is_relative_to(other) for other in leave_out or [])
        for line, module in sorted(imported_modules(path, root))
        if any(module == b or module.startswith(f"{b}.") for b in banned)
    ]


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_import_across_the_boundary(package: str) -> None:
    found = violations(package)
    banned = " or ".join(FORBIDDEN[package])
    assert not found, f"{package}/ must not import {banned}:\n" + "\n".join(found)


@pytest.mark.parametrize("package", NOT_THE_TRAINER)
def test_the_runtime_never_imports_the_trainer(package: str) -> None:
    found = imports_of(package, ("trainer",))
    assert not found, f"{package}/ must not import the built-in trainer:\n" + "\n".join(found)


def test_the_trainer_check_sees_into_the_rank_runtime_and_names_in_strings(
    tmp_path: Path,
) -> None:
    rank = tmp_path / "ringmaster" / "rank"
    rank.mkdir(parents=True)
    (rank / "driver.py").write_text(
        "import importlib, runpy\n"
        "from trainer.control import StepControl\n"
        "def late():\n"
        "    from trainer import durable\n"
        "    importlib.import_module('trainer.engine')\n"
        "    __import__('trainer')\n"
        "    runpy.run_module('trainer.worker')\n"
        "    importlib.import_module(name)\n"  # not a name we can read: not counted
        "    importlib.import_module('trainerlike')\n"
    )
    assert imports_of("ringmaster", ("trainer",), tmp_path) == [
        "ringmaster/rank/driver.py:2 imports trainer.control",
        "ringmaster/rank/driver.py:4 imports trainer",
        "ringmaster/rank/driver.py:5 imports trainer.engine",
        "ringmaster/rank/driver.py:6 imports trainer",
        "ringmaster/rank/driver.py:7 imports trainer.worker",
    ]


# each integration and the library its user installs it with
INTEGRATIONS = {"hf": "transformers", "lightning": "pytorch_lightning", "accelerate": "accelerate"}


@pytest.mark.parametrize("integration", sorted(INTEGRATIONS))
def test_an_integration_loads_neither_the_trainer_nor_deepspeed(integration: str) -> None:
    """A user's script that imports an integration, in a fresh interpreter: no module of
    the built-in trainer and no DeepSpeed come with it (``sys.modules``)."""
    if importlib.util.find_spec(INTEGRATIONS[integration]) is None:
        pytest.skip(f"{INTEGRATIONS[integration]} is not installed")
    module = f"ringmaster.integrations.{integration}"
    code = (
        f"import sys, {module}\n"
        "print(*sorted(m for m in sys.modules if m.split('.')[0] in ('trainer', 'deepspeed')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [], f"importing {module} loads {done.stdout.strip()}"


def documented_modules(text: str) -> set[str]:
    """Every dotted name ``text`` shows in backquotes, and each module above it."""
    names = re.findall(r"`(ringmaster(?:\.\w+)+)", text)
    return {".".join(n.split(".")[:i]) for n in names for i in range(2, n.count(".") + 2)}


def rank_modules_used(package: str, root: Path = ROOT) -> dict[str, str]:
    """The modules of ``ringmaster.rank`` that ``package`` imports, each with where first."""
    used: dict[str, str] = {}
    for path in sorted((root / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                # ``from ringmaster.rank import termination``: the module is the name
                sub = [f"{node.module}.{alias.name}" for alias in node.names]
                names = [n for n in sub if _is_module(root, n)] or [node.module]
            else:
                continue
            for name in names:
                if name.startswith("ringmaster.rank."):
                    used.setdefault(name, f"{path.relative_to(root)}:{node.lineno}")
    return used


def _is_module(root: Path, name: str) -> bool:
    path = root.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def test_the_trainer_reaches_the_runtime_only_through_its_documented_api() -> None:
    """Every module of the rank runtime the built-in trainer imports is one that
    ``docs/integrations.md`` names: what the trainer needs is public, and said so."""
    documented = documented_modules((ROOT / "docs" / "integrations.md").read_text())
    hidden = {m: at for m, at in rank_modules_used("trainer").items() if m not in documented}
    assert not hidden, "undocumented in docs/integrations.md:\n" + "\n".join(
        f"{at} imports {m}" for m, at in sorted(hidden.items())
    )


def test_the_documented_api_check_reads_every_form(tmp_path: Path) -> None:
    (tmp_path / "ringmaster" / "rank").mkdir(parents=True)
    (tmp_path / "ringmaster" / "rank" / "termination.py").write_text("")
    (tmp_path / "trainer").mkdir()
    (tmp_path / "trainer" / "worker.py").write_text(
        "from ringmaster import rank\n"
        "from ringmaster.rank import termination\n"
        "from ringmaster.rank.session import Session\n"
        "def late():\n"
        "    import ringmaster.rank.driver\n"
    )
    assert rank_modules_used("trainer", tmp_path) == {
        "ringmaster.rank.termination": "trainer/worker.py:2",
        "ringmaster.rank.session": "trainer/worker.py:3",
        "ringmaster.rank.driver": "trainer/worker.py:5",
    }
    assert documented_modules("`ringmaster.rank.session.Session`, `ringmaster/rank/x.py`") == {
        "ringmaster.rank",
        "ringmaster.rank.session",
        "ringmaster.rank.session.Session",
    }


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
        "node_verbs",
        "node_view",
        "numeric_policy",
        "placement_policy",
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


# The coordinator's modules import one another in one direction: a module that a module
# it imports imports back (even only for types) is one part cut in two, each reaching
# into the other, and neither can be read or changed alone.
def module_imports(root: Path, package: str = "coordinator") -> dict[str, set[str]]:
    """Each module of ``package`` and the modules of ``package`` it imports: at module
    level, inside a function or under ``TYPE_CHECKING``; ``from p import m`` of a module
    ``m`` counts as an import of ``p.m``."""
    paths = {
        ".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
        for p in sorted((root / package).rglob("*.py"))
    }
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = path.relative_to(root).parts[:-1]
        edges = graph.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = []
            if isinstance(node, ast.ImportFrom):
                base = _from_module(node, package)
                names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            edges.update(n for n in names if n in paths and n != name)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle's modules, one cycle for each group of modules that reach one another
    (Tarjan's strongly connected components, a group of more than one module or one that
    imports itself), each given as a path from its first module back to it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(name: str) -> None:
        index[name] = low[name] = len(index)
        stack.append(name)
        for other in sorted(graph.get(name, ())):
            if other not in index:
                visit(other)
                low[name] = min(low[name], low[other])
            elif other in stack:
                low[name] = min(low[name], index[other])
        if low[name] == index[name]:
            group = []
            while (top := stack.pop()) != name:
                group.append(top)
            group.append(name)
            if len(group) > 1 or name in graph.get(name, ()):
                groups.append(sorted(group))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return [_path_through(graph, group) for group in groups]


def _path_through(graph: dict[str, set[str]], group: list[str]) -> list[str]:
    """A shortest import path from the group's first module back to it, inside it."""
    start, members = group[0], set(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for name in frontier:
            for other in sorted(graph[name] & members):
                if other == start:
                    return [*paths[name], start]
                if other not in paths:
                    paths[other] = [*paths[name], other]
                    nxt.append(other)
        frontier = nxt
    return group


def test_the_coordinators_modules_import_in_one_direction() -> None:
    cycles = import_cycles(module_imports(ROOT))
    assert not cycles, "import cycles in coordinator/:\n" + "\n".join(
        " → ".join(cycle) for cycle in cycles
    )


def test_the_cycle_check_catches_every_form_of_import(tmp_path: Path) -> None:
    package = tmp_path / "coordinator"
    (package / "ctl").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "ctl" / "__init__.py").write_text("")
    (package / "shell.py").write_text("from coordinator import inputs\n")
    (package / "inputs.py").write_text("def late():\n    from . import checks\n")
    (package / "checks.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from coordinator.shell import Shell\n"
    )
    (package / "ctl" / "main.py").write_text("import coordinator.ctl.status\n")
    (package / "ctl" / "status.py").write_text("from ..ctl.main import run\n")
    graph = module_imports(tmp_path)
    assert graph["coordinator.inputs"] == {"coordinator", "coordinator.checks"}
    assert import_cycles(graph) == [
        ["coordinator.checks", "coordinator.shell", "coordinator.inputs", "coordinator.checks"],
        ["coordinator.ctl.main", "coordinator.ctl.status", "coordinator.ctl.main"],
    ]
