"""The outbox's row format: one row per committed batch, its outputs packed in order.

A packed batch is the concatenation, per output, of a header ``<HHI`` (subject length,
message id length or ``0xFFFF`` for none, payload length) and the three byte strings.
Packing and unpacking are exact inverses and keep the order of the outputs.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable

__all__ = ["pack_outputs", "unpack_outputs"]

_HEADER = struct.Struct("<HHI")
_NO_ID = 0xFFFF

Packed = tuple[str, str | None, bytes]


def pack_outputs(outputs: Iterable[Packed]) -> bytes:
    """``[(subject, msg_id, payload), …]`` → one blob."""
    parts: list[bytes] = []
    for subject, msg_id, payload in outputs:
        s = subject.encode()
        m = msg_id.encode() if msg_id is not None else b""
        parts.append(_HEADER.pack(len(s), len(m) if msg_id is not None else _NO_ID, len(payload)))
        parts += (s, m, payload)
    return b"".join(parts)


def unpack_outputs(blob: bytes) -> list[Packed]:
    """The inverse of :func:`pack_outputs`."""
    out: list[Packed] = []
    view = memoryview(blob)
    at, end, size = 0, len(blob), _HEADER.size
    while at < end:
        s_len, m_len, p_len = _HEADER.unpack_from(view, at)
        at += size
        subject = bytes(view[at : at + s_len]).decode()
        at += s_len
        msg_id = None
        if m_len != _NO_ID:
            msg_id = bytes(view[at : at + m_len]).decode()
            at += m_len
        out.append((subject, msg_id, bytes(view[at : at + p_len])))
        at += p_len
    return out
