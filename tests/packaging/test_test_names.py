"""Test modules are imported by their file's name (the test directories are no packages),
so two of one name in different directories stop the suite at collection: every name is
unique."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_module_has_a_name_of_its_own() -> None:
    where: defaultdict[str, list[str]] = defaultdict(list)
    for path in TESTS.rglob("test_*.py"):
        where[path.name].append(str(path.relative_to(TESTS)))
    assert not {name: paths for name, paths in where.items() if len(paths) > 1}
