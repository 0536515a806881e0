"""The rank's stacks thread: its dump reads as faulthandler's does to the hang watch, and
it answers a byte on its FIFO."""

from __future__ import annotations

import io
import os
import threading
from pathlib import Path

import pytest

from nodeagent.hangwatch import main_frames, threads
from ringmaster.rank import stacks
from tests.waits import until


def _parked(started: threading.Event, release: threading.Event) -> None:
    started.set()
    release.wait()


def test_the_dump_names_every_other_thread_and_the_main_thread_last() -> None:
    started, release = threading.Event(), threading.Event()
    helper = threading.Thread(target=_parked, args=(started, release), daemon=True)
    helper.start()
    started.wait()
    out = io.StringIO()
    try:
        stacks.dump(out)
    finally:
        release.set()
        helper.join()
    found = threads(out.getvalue())
    main = threading.main_thread().ident
    assert list(found)[-1] == main
    assert helper.ident in found
    assert [f.func for f in found[helper.ident]][:2] == ["wait", "wait"]  # innermost first
    assert "_parked" in [f.func for f in found[helper.ident]]
    funcs = [f.func for f in main_frames(out.getvalue(), main or 0)]
    assert funcs[0] == "dump"  # this thread dumped itself in the call
    assert "test_the_dump_names_every_other_thread_and_the_main_thread_last" in funcs


def test_a_byte_on_the_fifo_is_answered_with_a_dump(tmp_path: Path) -> None:
    fifo = tmp_path / "rank-0.stacks"
    fifo.write_text("a stale file the rank replaces")
    log = tmp_path / "rank-0.log"
    with log.open("w") as out:
        assert stacks.serve(fifo, out)
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.write(fd, b"s")
        os.close(fd)
        until(
            lambda: "(most recent call first)" in log.read_text(),
            10,
            "the dump in the log",
            log.read_text,
            interval=0.01,
        )
    dump = log.read_text()
    assert "test_a_byte_on_the_fifo_is_answered_with_a_dump" in dump
    assert " in _answer\n" not in dump  # the answering thread leaves itself out


def test_a_fifo_that_cannot_be_made_is_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert not stacks.serve(tmp_path / "missing" / "rank-0.stacks")
    assert "no stacks on request" in capsys.readouterr().err
