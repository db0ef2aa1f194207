"""Inputs refused: dead letters (bad input) and config rejections (refused config).

``out.dlq.<reason>``, ``Nats-Msg-Id`` ``dlq:<stream_seq>`` (docs/interface.md, "Dead
letters")::

    {v, subject, stream_seq, error, payload_b64}

the input's subject (whole), its stream sequence, why it is bad (at most
:data:`~reconciler.core.messages.envelope.MAX_ERROR_CHARS` characters) and its payload,
cut at :data:`DLQ_PAYLOAD_CUT` bytes, in base64. The reasons are ``decode``, ``schema``,
``too-large`` and ``domain``.

``out.config.rejected.<kind>.<name>``, ``Nats-Msg-Id`` ``rejected:<input_seq>``::

    {v, kind, name, error, input_seq}

a config input the fold refused (the last good version stays in force).

Both are sorted-key JSON.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from reconciler.core.messages.envelope import Output, clip, encode
from reconciler.core.messages.fields import MessageError, field_int, field_str, json_object
from reconciler.core.messages.ids import dead_letter_id, rejection_id
from reconciler.core.messages.subjects import (
    DEAD_LETTER_REASONS,
    UNPREFIXED,
    DeadLetterReason,
)

__all__ = ["DLQ_PAYLOAD_CUT", "ConfigRejected", "DeadLetter"]

#: how much of a bad input's payload its dead letter carries
DLQ_PAYLOAD_CUT: Final = 65_536


@dataclass(frozen=True, slots=True, kw_only=True)
class DeadLetter:
    """A bad input, as its dead letter tells it."""

    reason: DeadLetterReason
    #: the input's subject, with its prefix
    subject: str
    stream_seq: int
    error: str
    #: the input's payload, cut at :data:`DLQ_PAYLOAD_CUT` bytes
    payload: bytes

    @classmethod
    def of(
        cls, *, reason: DeadLetterReason, subject: str, stream_seq: int, error: str, data: bytes
    ) -> DeadLetter:
        """The dead letter of one input: its error clipped, its payload cut."""
        if reason not in DEAD_LETTER_REASONS:
            raise ValueError(f"unknown dead-letter reason {reason!r}")
        return cls(
            reason=reason,
            subject=subject,
            stream_seq=stream_seq,
            error=clip(error),
            payload=data[:DLQ_PAYLOAD_CUT],
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "v": 1,
            "subject": self.subject,
            "stream_seq": self.stream_seq,
            "error": self.error,
            "payload_b64": base64.b64encode(self.payload).decode("ascii"),
        }

    def encode(self) -> bytes:
        return encode(self.as_dict())

    def output(self) -> Output:
        return Output(
            UNPREFIXED.dead_letter(self.reason), dead_letter_id(self.stream_seq), self.encode()
        )

    @classmethod
    def parse(cls, reason: str, data: bytes) -> DeadLetter:
        """A dead letter's payload, read; ``reason`` is its subject's last token."""
        if reason not in DEAD_LETTER_REASONS:
            raise MessageError(f"unknown dead-letter reason {reason!r}")
        body = json_object(data, "a dead letter")
        try:
            payload = base64.b64decode(field_str(body, "payload_b64"), validate=True)
        except binascii.Error as exc:
            raise MessageError(f"field 'payload_b64' is not base64: {exc}") from None
        return cls(
            reason=reason,  # one of the reasons, checked above
            subject=field_str(body, "subject"),
            stream_seq=field_int(body, "stream_seq"),
            error=field_str(body, "error"),
            payload=payload,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class ConfigRejected:
    """A config input the fold refused: which, why, and where on the stream."""

    kind: str
    name: str
    error: str
    input_seq: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "v": 1,
            "kind": self.kind,
            "name": self.name,
            "error": self.error,
            "input_seq": self.input_seq,
        }

    def encode(self) -> bytes:
        return encode(self.as_dict())

    def output(self) -> Output:
        return Output(
            UNPREFIXED.config_rejected(self.kind, self.name),
            rejection_id(self.input_seq),
            self.encode(),
        )

    @classmethod
    def parse(cls, data: bytes) -> ConfigRejected:
        return cls.from_dict(json_object(data, "a config rejection"))

    @classmethod
    def from_dict(cls, body: Mapping[str, Any]) -> ConfigRejected:
        return cls(
            kind=field_str(body, "kind"),
            name=field_str(body, "name"),
            error=field_str(body, "error"),
            input_seq=field_int(body, "input_seq"),
        )
