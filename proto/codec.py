"""JSON codecs (readable by any NATS client) with typed decoders."""

from __future__ import annotations

from typing import Any

import msgspec

from proto.api import ApiReply, JobControl, SubmitJob
from proto.commands import Command, CommandReply
from proto.events import Event, EventBase
from proto.job import JobRecord
from proto.node import Heartbeat
from proto.progress import Progress

encoder = msgspec.json.Encoder()
event_decoder: msgspec.json.Decoder[Any] = msgspec.json.Decoder(Event)
command_decoder: msgspec.json.Decoder[Any] = msgspec.json.Decoder(Command)
reply_decoder = msgspec.json.Decoder(CommandReply)
heartbeat_decoder = msgspec.json.Decoder(Heartbeat)
job_decoder = msgspec.json.Decoder(JobRecord)
submit_decoder = msgspec.json.Decoder(SubmitJob)
control_decoder = msgspec.json.Decoder(JobControl)
api_reply_decoder = msgspec.json.Decoder(ApiReply)
progress_decoder: msgspec.json.Decoder[Any] = msgspec.json.Decoder(Progress)


def encode(obj: object) -> bytes:
    return encoder.encode(obj)


def decode_event(data: bytes) -> EventBase:
    event: EventBase = event_decoder.decode(data)
    return event
