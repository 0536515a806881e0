"""Messages between rank 0 of a job and its node agent (one JSON object per line over a
Unix socket), relayed to the coordinator as they arrive."""

from __future__ import annotations

from typing import Literal

import msgspec


class ProgressBase(msgspec.Struct, tag_field="type", kw_only=True):
    job: str = ""
    step: int = 0
    time: float = 0.0


class StepDone(ProgressBase, tag="step"):
    loss: float = 0.0
    step_time_s: float = 0.0
    tokens_per_s: float = 0.0
    target_steps: int = 0


class Paused(ProgressBase, tag="paused"):
    pass


class Resumed(ProgressBase, tag="resumed"):
    pass


class Checkpointed(ProgressBase, tag="checkpointed"):
    path: str = ""
    stall_s: float = 0.0


class Finished(ProgressBase, tag="finished"):
    outcome: Literal["completed", "stopped"] = "completed"


Progress = StepDone | Paused | Resumed | Checkpointed | Finished


class ControlWord(msgspec.Struct, kw_only=True):
    """Agent → rank 0: what to do at the next step boundary."""

    action: Literal["pause", "resume", "checkpoint", "stop"]
    seq: int = 0
