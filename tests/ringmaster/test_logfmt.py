"""The rank log's one writer and one reader agree on every value, spaces, quotes,
backslashes and newlines included, so a reader never cuts a field."""

from __future__ import annotations

import io
from contextlib import redirect_stderr

from hypothesis import assume, given
from hypothesis import strategies as st

from ringmaster.logfmt import lines, parse_line, render
from ringmaster.rank.log import Log, read

KEYS = st.from_regex(r"[a-z_][a-z0-9_]{0,11}", fullmatch=True)
VALUES = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)


def _bare_and_ambiguous(value: str) -> bool:
    """The renderer leaves a backslash alone outside quotes and writes a newline ``\\n``
    there too: such a value cannot be told apart from its escaped twin."""
    quoted = any(c in value for c in ' ="')
    return not quoted and ("\\" in value or "\n" in value)


@given(st.dictionaries(KEYS, VALUES, max_size=8))
def test_what_the_renderer_writes_parses_back_whole(fields: dict[str, str]) -> None:
    assume(not any(_bare_and_ambiguous(v) for v in fields.values()))
    line = render(fields)
    assert "\n" not in line
    assert parse_line(line) == fields


def test_quoted_escapes_and_flags_read_as_written() -> None:
    line = render({"flag": True, "msg": 'said "hi" at C:\\new\nline', "empty": ""})
    assert line == 'flag msg="said \\"hi\\" at C:\\\\new\\nline" empty='
    assert parse_line(line) == {"flag": "true", "msg": 'said "hi" at C:\\new\nline', "empty": ""}


def test_a_torn_line_yields_what_it_holds() -> None:
    assert parse_line('trainer wall=1.5 reason="cut off mid') == {
        "trainer": "true",
        "wall": "1.5",
        "reason": "cut off mid",
    }


def test_the_trainer_log_reads_back_values_with_spaces() -> None:
    out = io.StringIO()
    with redirect_stderr(out):
        log = Log(rank=3, attempt=2)
        log("paused", reason="nvme.latency:node-1:nvme0n1 latency 900 µs", step=12)
        log("step", step=13, step_s=0.25)
    text = "noise from a library\n" + out.getvalue() + "trainer.warm: not ours\n"
    paused, step = read(text)
    assert paused["reason"] == "nvme.latency:node-1:nvme0n1 latency 900 µs"
    assert (paused["rank"], paused["attempt"], paused["event"], paused["step"]) == (
        "3",
        "2",
        "paused",
        "12",
    )
    assert float(step["wall"]) >= float(paused["wall"]) and step["step_s"] == "0.25"
    assert out.getvalue().startswith("trainer t=")  # the prefix every reader keys on
    assert len(list(lines(text))) == 4
