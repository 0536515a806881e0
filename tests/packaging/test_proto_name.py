"""Google's proto-plus is also imported as ``proto``. Ours must either be the one imported
or every entry point must stop with one clear line — never a confusing traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_a_foreign_proto_package_stops_us_with_one_line(tmp_path: Path) -> None:
    foreign = tmp_path / "proto"
    foreign.mkdir()
    (foreign / "__init__.py").write_text("# proto-plus stand-in\n")
    for module in ("coordinator.ctl.main", "coordinator.cli", "nodeagent.cli", "trainer.worker"):
        done = subprocess.run(
            [sys.executable, "-c", f"import {module}"],
            capture_output=True,
            text=True,
            env={"PYTHONPATH": str(tmp_path)},
            timeout=120,
            cwd=tmp_path,
            check=False,
        )
        assert done.returncode == 1, (module, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and "is not Ringmaster's wire contract" in lines[0], done.stderr


def test_ours_is_the_one_imported() -> None:
    import proto

    assert proto.RINGMASTER_PROTO is True
    assert Path(proto.__file__).parent.name == "proto"
