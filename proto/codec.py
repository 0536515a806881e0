"""JSON codecs (readable by any NATS client) with typed decoders."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import msgspec

from proto.api import ApiReply, JobControl, NodeControl, SubmitJob
from proto.commands import Command, CommandReply
from proto.events import Event, EventBase
from proto.job import JobRecord
from proto.node import Heartbeat, NodeBeat
from proto.progress import Progress

T = TypeVar("T")


class Decoder(Generic[T]):
    """msgspec's JSON decoder, except that a message nested too deeply for the stack, or
    with bytes that are not UTF-8 in a key or a tag, is a ``msgspec.DecodeError`` like any
    other malformed one (msgspec raises RecursionError and UnicodeDecodeError there)."""

    def __init__(self, decoder: msgspec.json.Decoder[T]) -> None:
        self._decoder = decoder

    def decode(self, data: bytes | str) -> T:
        try:
            return self._decoder.decode(data)
        except RecursionError:
            raise msgspec.DecodeError("JSON is nested too deeply") from None
        except UnicodeDecodeError as exc:
            raise msgspec.DecodeError(f"JSON is malformed: not UTF-8 ({exc.reason})") from None


encoder = msgspec.json.Encoder()
event_decoder: Decoder[Any] = Decoder(msgspec.json.Decoder(Event))
command_decoder: Decoder[Any] = Decoder(msgspec.json.Decoder(Command))
reply_decoder = Decoder(msgspec.json.Decoder(CommandReply))
heartbeat_decoder = Decoder(msgspec.json.Decoder(Heartbeat))
node_beat_decoder = Decoder(msgspec.json.Decoder(NodeBeat))  # the coordinator's reading
job_decoder = Decoder(msgspec.json.Decoder(JobRecord))
submit_decoder = Decoder(msgspec.json.Decoder(SubmitJob))
control_decoder = Decoder(msgspec.json.Decoder(JobControl))
node_control_decoder = Decoder(msgspec.json.Decoder(NodeControl))
api_reply_decoder = Decoder(msgspec.json.Decoder(ApiReply))
progress_decoder: Decoder[Any] = Decoder(msgspec.json.Decoder(Progress))


def encode(obj: object) -> bytes:
    return encoder.encode(obj)


def decode_event(data: bytes) -> EventBase:
    event: EventBase = event_decoder.decode(data)
    return event
