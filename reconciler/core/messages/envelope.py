"""What every output is: a subject without its prefix, a message id and exact bytes.

Rules:

- :class:`Output` is one message to publish after the commit that produced it. Its
  ``subject`` has no prefix (``out.decision.r1``): the fold writes it so, the outbox keeps
  it so, and the publisher puts ``<prefix>.`` in front.
- :func:`encode` writes a payload as sorted-key JSON, the one encoding of every output
  (docs/interface.md): folding the same stream twice gives the same bytes.
- :func:`clip` bounds a sentence carried in a message (a dead letter's error, which may
  quote the payload) to :data:`MAX_ERROR_CHARS` characters.
- No output is larger than :data:`MAX_OUTPUT_BYTES`: the fold refuses an input whose
  decision or command would be (it is dead-lettered ``too-large``), so that nothing it
  commits is one the server refuses to carry.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final

import orjson

from reconciler.core.frozen import fast_init

__all__ = [
    "MAX_ERROR_CHARS",
    "MAX_OUTPUT_BYTES",
    "MAX_PAYLOAD_BYTES",
    "Output",
    "clip",
    "encode",
]

#: error texts carried in messages are clipped to this many characters
MAX_ERROR_CHARS: Final = 1_024
#: the largest payload of an input (docs/interface.md; a larger one is dead-lettered
#: ``too-large``), and the least ``max_payload`` a NATS server of the reconciler has
MAX_PAYLOAD_BYTES: Final = 1_048_576
#: the largest payload the fold writes: what a server with the least ``max_payload``
#: takes, headers (a message id of at most a few hundred bytes) included
MAX_OUTPUT_BYTES: Final = MAX_PAYLOAD_BYTES - 4_096

_SORTED = orjson.OPT_SORT_KEYS


@fast_init
@dataclass(frozen=True, slots=True)
class Output:
    """One message to publish after commit. ``subject`` has no prefix (``out.…``)."""

    subject: str
    msg_id: str | None
    payload: bytes
    #: a decision's outcome, for the logs (which need not parse the payload for it)
    outcome: str | None = field(default=None, compare=False)


def encode(payload: dict[str, Any]) -> bytes:
    """Sorted-key JSON, in a bytes object of its own size.

    orjson (3.12 and later) hands back its working buffer, at least 4 KiB, whatever the
    length; a decision payload is kept for the life of its request, so it is copied to
    its exact size (a quarter of a lease's memory otherwise).
    """
    return bytes(memoryview(orjson.dumps(payload, option=_SORTED)))


def clip(text: str) -> str:
    """``text``, cut to :data:`MAX_ERROR_CHARS` characters (the last one an ellipsis)."""
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 1] + "…"
