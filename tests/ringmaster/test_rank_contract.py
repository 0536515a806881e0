"""The agent ↔ rank contract has one spelling: control actions come from
``proto.progress.ControlAction`` (the commands' tags, the words, the trainer's codes), and
the environment names from ``ringmaster.rank_env`` (the attempt, set by the agent, is read
and stamped on every log line)."""

from __future__ import annotations

import io
import sys
from contextlib import redirect_stderr
from pathlib import Path

import msgspec
import pytest

from proto.commands import CheckpointNow, Pause, Resume, Stop
from proto.progress import ControlAction, ControlWord
from ringmaster import rank_env
from ringmaster.rank.control import Action, fold
from ringmaster.rank.driver import AGREE_EVERY_S, agreement_every
from ringmaster.rank.launch import SpecError, read_launch
from ringmaster.rank.log import Log, read


def test_the_trainer_codes_every_action_but_checkpoint_from_the_contract() -> None:
    coded = {a.name for a in Action} - {"NONE"}
    assert coded == {a.name for a in ControlAction} - {"CHECKPOINT"}
    assert [int(Action[a.name]) for a in ControlAction if a.name in coded] == sorted(
        int(a) for a in Action if a.name in coded
    )
    assert len(set(Action)) == len(Action), "distinct codes"


def test_commands_are_tagged_with_the_actions_and_words_decode_to_them() -> None:
    tags = [c.__struct_config__.tag for c in (Pause, Resume, CheckpointNow, Stop)]
    assert tags == [a.value for a in ControlAction]
    word = msgspec.json.decode(b'{"action": "stop", "seq": 4}', type=ControlWord)
    assert word.action is ControlAction.STOP and fold([word]).action is Action.STOP
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"action": "halt"}', type=ControlWord)


def test_the_attempt_the_agent_sets_is_stamped_on_every_line(tmp_path: Path) -> None:
    config = tmp_path / "job.toml"
    config.write_text('[job]\nname = "contract"\n')
    launch = read_launch({rank_env.ATTEMPT: "3"}, ["--config", str(config)])
    assert launch.attempt == 3
    assert read_launch({}, ["--config", str(config)]).attempt == 0  # no agent: none
    with pytest.raises(SpecError, match="RINGMASTER_ATTEMPT='x' is not an integer"):
        read_launch({rank_env.ATTEMPT: "x"}, ["--config", str(config)])
    out = io.StringIO()
    with redirect_stderr(out):
        Log(0, launch.attempt)("start", step=0)
    [line] = read(out.getvalue())
    assert line["attempt"] == "3"


def test_a_line_after_a_progress_bar_s_carriage_return_is_read_whole() -> None:
    out = io.StringIO()
    with redirect_stderr(out):
        sys.stderr.write("\r 40%|████      | 100/250 [00:20<00:30,  4.97it/s]")
        Log(0, 2)("step", step=100, step_s=0.2)
    [line] = read(out.getvalue())
    assert (line["event"], line["step"], line["attempt"]) == ("step", "100", "2")


def test_a_loop_agrees_every_step_unless_its_steps_are_shorter_than_the_agreement_bound() -> None:
    assert agreement_every(0.0) == 1  # no step time yet: every step
    assert agreement_every(2 * AGREE_EVERY_S) == 1
    assert agreement_every(AGREE_EVERY_S) == 1
    assert agreement_every(0.02) == int(AGREE_EVERY_S / 0.02)  # 20 ms steps: every 12th
    assert agreement_every(AGREE_EVERY_S / 3.5) == 3  # never later than the bound
