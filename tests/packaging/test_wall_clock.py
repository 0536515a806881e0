"""Unit tests never read the wall clock or sleep: a test that waits for time to pass is
slow, and one that compares two readings of the machine's clock passes or fails with the
machine's load. The code under test takes a clock (``ringmaster.clock``) that the test
moves itself; what a test waits for that is real (a process, a thread, a socket) is polled
for, bounded, with ``ringmaster.procs.wait_until``.

Every call that reads a clock or sleeps is found, however it was imported (``import time
as t``, ``from time import sleep``, ``from time import monotonic as m``). A sleep of the
literal 0 is a yield and lets no time pass. The suites that run real services on real
time (``tests/e2e``, ``tests/boot``, Slurm's) are left out.

The allowlist is for tests that drive a real process whose own timing is what they test;
each entry names the test file, the function (``"*"``: the whole file) and why. An entry
that covers nothing any more fails too, so the list never outlives its reasons."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[2]
SKIPPED = ("tests/e2e", "tests/boot")  # and any directory whose name says Slurm

READS = {
    "time.time",
    "time.time_ns",
    "time.monotonic",
    "time.monotonic_ns",
    "time.perf_counter",
    "time.perf_counter_ns",
    "datetime.datetime.now",
    "datetime.datetime.utcnow",
    "proto.events.utcnow",
}
SLEEPS = {"time.sleep"}
SLEEPS_BUT_ZERO = {"asyncio.sleep", "anyio.sleep"}  # sleep(0): a yield, no time passes


class Allowed(NamedTuple):
    path: str
    function: str  # the enclosing function ("Class.method", "test.inner"), or "*"
    reason: str


ALLOWED: tuple[Allowed, ...] = (
    Allowed(
        "tests/nodeagent/test_sim_process.py",
        "test_inject_over_nats_changes_what_the_collector_reads",
        "the simulator process advances its disks by the real time between its ticks: "
        "the IOPS checked are per real second",
    ),
)


class Found(NamedTuple):
    line: int
    call: str  # the function called, by its module's name: "time.sleep"
    function: str  # the enclosing function, "Class.method"; "" at module level


def _imported_names(tree: ast.AST) -> dict[str, str]:
    """Local name → the module or object it stands for, from every import in the file."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    names[alias.asname] = alias.name
                else:  # ``import a.b`` binds ``a``
                    top = alias.name.split(".")[0]
                    names[top] = top
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _dotted(node: ast.expr, names: dict[str, str]) -> str | None:
    """``a.b.c`` with ``a`` resolved through the file's imports; None for anything else."""
    attrs: list[str] = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id not in names:
        return None
    return ".".join([names[node.id], *reversed(attrs)])


def _lets_time_pass(call: ast.Call) -> bool:
    """A sleep of anything but the literal 0."""
    args = [*call.args, *(k.value for k in call.keywords)]
    zero = (
        len(args) == 1
        and isinstance(args[0], ast.Constant)
        and type(args[0].value) in (int, float)
        and args[0].value == 0
    )
    return not zero


class _Calls(ast.NodeVisitor):
    def __init__(self, names: dict[str, str]) -> None:
        self.names = names
        self.scope: list[str] = []
        self.found: list[Found] = []

    def _scoped(self, node: ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_ClassDef = visit_FunctionDef = visit_AsyncFunctionDef = _scoped

    def visit_Call(self, node: ast.Call) -> None:
        called = _dotted(node.func, self.names)
        if (
            called in READS
            or called in SLEEPS
            or (called in SLEEPS_BUT_ZERO and _lets_time_pass(node))
        ):
            self.found.append(Found(node.lineno, called, ".".join(self.scope)))
        self.generic_visit(node)


def clock_calls(source: str, filename: str = "<test>") -> list[Found]:
    """Every call in ``source`` that reads a clock or sleeps, in line order."""
    tree = ast.parse(source, filename=filename)
    visitor = _Calls(_imported_names(tree))
    visitor.visit(tree)
    return sorted(visitor.found, key=lambda found: found.line)  # stable: source order


def checked_files(root: Path = ROOT, skipped: tuple[str, ...] = SKIPPED) -> Iterator[Path]:
    """Every test module and helper under ``root/tests`` but the real-time suites."""
    for path in sorted((root / "tests").rglob("*.py")):
        relative = path.relative_to(root)
        if any(relative.is_relative_to(s) for s in skipped):
            continue
        if any("slurm" in part.lower() for part in relative.parts[:-1]):
            continue
        yield path


def _covers(entry: Allowed, path: str, found: Found) -> bool:
    if entry.path != path:
        return False
    return entry.function in ("*", found.function) or found.function.startswith(
        f"{entry.function}."
    )


def offences(
    root: Path = ROOT,
    skipped: tuple[str, ...] = SKIPPED,
    allowed: tuple[Allowed, ...] = ALLOWED,
) -> tuple[list[str], list[Allowed]]:
    """The calls no entry covers (``path:line: call``), and the entries covering none."""
    offending: list[str] = []
    used: set[Allowed] = set()
    for path in checked_files(root, skipped):
        relative = path.relative_to(root).as_posix()
        for found in clock_calls(path.read_text(), relative):
            covering = [e for e in allowed if _covers(e, relative, found)]
            used.update(covering)
            if not covering:
                offending.append(f"{relative}:{found.line}: {found.call}()")
    return offending, [e for e in allowed if e not in used]


def test_no_unit_test_reads_the_clock_or_sleeps() -> None:
    offending, stale = offences()
    said = []
    if offending:
        said.append(
            "unit tests read the clock or sleep: give the code under test a "
            "ringmaster.clock clock, or poll with ringmaster.procs.wait_until:"
        )
        said += offending
    if stale:
        said += ["allowlist entries that cover nothing:", *map(str, stale)]
    assert not said, "\n".join(said)


def test_every_entry_gives_a_reason() -> None:
    for entry in ALLOWED:
        assert entry.reason.strip() and "\n" not in entry.reason, entry


def test_the_check_finds_every_form_of_clock_read(tmp_path: Path) -> None:
    """A guard that finds nothing proves nothing unless it would have found something."""
    source = (
        "import asyncio, anyio\n"
        "import time as t\n"
        "from datetime import datetime\n"
        "from time import monotonic as m, sleep\n"
        "from proto import events\n"
        "class Harness:\n"
        "    async def wait(self):\n"
        "        await asyncio.sleep(0)\n"  # a yield
        "        await anyio.sleep(0.1)\n"
        "def test_x():\n"
        "    assert t.time() > 0\n"
        "    sleep(1)\n"
        "    def inner():\n"
        "        return m() + datetime.now().timestamp()\n"
        "    events.utcnow()\n"
    )
    assert clock_calls(source) == [
        Found(9, "anyio.sleep", "Harness.wait"),
        Found(11, "time.time", "test_x"),
        Found(12, "time.sleep", "test_x"),
        Found(14, "time.monotonic", "test_x.inner"),
        Found(14, "datetime.datetime.now", "test_x.inner"),
        Found(15, "proto.events.utcnow", "test_x"),
    ]
    more = (
        "import datetime as dt, time\n"
        "from proto.events import utcnow\n"
        "stamp = dt.datetime.utcnow(), utcnow(), time.perf_counter_ns()\n"
        "time.sleep(0)\n"  # blocks the thread: reported, zero or not
    )
    assert [(f.line, f.call, f.function) for f in clock_calls(more)] == [
        (3, "datetime.datetime.utcnow", ""),
        (3, "proto.events.utcnow", ""),
        (3, "time.perf_counter_ns", ""),
        (4, "time.sleep", ""),
    ]
    for suite in ("unit", "e2e", "boot", "slurm_cluster"):
        (tmp_path / "tests" / suite).mkdir(parents=True)
        (tmp_path / "tests" / suite / "test_a.py").write_text(source)
    stale = Allowed("tests/unit/test_a.py", "test_gone", "a test since removed")
    offending, unused = offences(
        tmp_path, allowed=(Allowed("tests/unit/test_a.py", "test_x", "drives a process"), stale)
    )
    assert offending == ["tests/unit/test_a.py:9: anyio.sleep()"]
    assert unused == [stale]


def test_a_test_reading_the_wall_clock_is_reported() -> None:
    source = (
        "import asyncio\nimport time\n\n"
        "async def test_quick():\n"
        "    started = time.time()\n"
        "    await asyncio.sleep(0)\n"
    )
    assert clock_calls(source) == [Found(5, "time.time", "test_quick")]
