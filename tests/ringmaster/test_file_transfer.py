"""Files from rank 0 to the ranks that do not see them, over a real gloo group of two
processes: a rank with a dir of its own receives the whole tree, a rank that shares rank
0's dir receives nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.trainer.zygote import Forked, Zygote

REPO = Path(__file__).resolve().parents[2]
RANK = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import torch.distributed as dist
    from ringmaster.rank.file_transfer import share_from_rank0

    rank, store, root, out = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), sys.argv[4]
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    received = share_from_rank0(root, rank, 2, None)
    Path(out).write_text(json.dumps(received))
    dist.destroy_process_group()
    """
)


def share(tmp_path: Path, roots: tuple[Path, Path], name: str, zygote: Zygote | None) -> list[int]:
    """Both ranks run the script above, forked from the test worker's fork server (its
    torch already imported) where there is one, else started cold."""
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    store = tmp_path / f"store-{name}"
    outs = [tmp_path / f"{name}-{rank}.json" for rank in (0, 1)]
    procs: list[subprocess.Popen[bytes] | Forked] = []
    for rank in (0, 1):
        argv = [str(script), str(rank), str(store), str(roots[rank]), str(outs[rank])]
        log = tmp_path / f"{name}-{rank}.log"
        forked = zygote.spawn(argv, dict(os.environ), REPO, log) if zygote else None
        procs.append(forked or subprocess.Popen([sys.executable, *argv], cwd=REPO))
    assert [p.wait(120) for p in procs] == [0, 0]
    return [json.loads(out.read_text()) for out in outs]


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_rank_0s_tree_reaches_a_rank_that_does_not_see_it(
    tmp_path: Path, zygote: Zygote | None
) -> None:
    mine, theirs = tmp_path / "rank-0", tmp_path / "rank-1"
    (mine / "ds" / "zero" / "w").mkdir(parents=True)
    (mine / "ds" / "zero" / "w" / "fp32.pt").write_bytes(bytes(range(256)) * 40)
    (mine / "ds" / "empty").write_bytes(b"")
    (mine / "latest_universal").write_text("ds")
    (theirs / "ds").mkdir(parents=True)
    (theirs / "ds" / "empty").write_bytes(b"stale, of another size")
    assert share(tmp_path, (mine, theirs), "apart", zygote) == [0, 3]
    assert tree(theirs) == tree(mine)
    # one dir seen by both (a shared filesystem): nothing travels
    assert share(tmp_path, (mine, mine), "shared", zygote) == [0, 0]
