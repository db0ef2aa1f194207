"""Message ids and header names (docs/interface.md): what makes a publish exactly once.

Rules:

- Every output the fold writes, and every input a component of this project publishes,
  carries a deterministic ``Nats-Msg-Id`` (:data:`MSG_ID`), so that publishing it again
  inside the stream's duplicate window stores nothing new. Each id is built here, once:

  ========================================  ===========================================
  ``decision:<request_id>:<phase>``          a decision (phase ``pending`` or ``final``)
  ``create:<lease_id>``                      an executor create command (its command id)
  ``delete:<lease_id>:<reason>``             an executor delete command (its command id)
  ``rejected:<input_seq>``                   a refused config input
  ``dlq:<stream_seq>``                       a dead letter
  ``<origin>:<request_id>``                  a command, by who sent it (:class:`Origin`)
  ``observation:<lease>:<revision>:<bool>``  the leader's live check of a suspect lease
  ``lifecycle:<sha256 of the payload>``      an Incus lifecycle event, from the bridge
  ``apply:<kind>:<name>:<sha256>``           a single config item (``publish_config``)
  ``failure:<lease_id>:<action>``            what the executor (or GARM's provider) could
                                             not do to a lease's instance
  ========================================  ===========================================

- Host snapshots and inventories carry none: their revisions order them, and the fold
  ignores one not newer than the last.
"""

from __future__ import annotations

import enum
import hashlib
from typing import Any, Final

import orjson

__all__ = [
    "MSG_ID",
    "STREAM_HEADER",
    "Origin",
    "command_msg_id",
    "config_msg_id",
    "create_command_id",
    "dead_letter_id",
    "decision_id",
    "delete_command_id",
    "failure_msg_id",
    "lifecycle_msg_id",
    "observation_msg_id",
    "rejection_id",
]

#: the header JetStream deduplicates on
MSG_ID: Final = "Nats-Msg-Id"
#: the header of a state snapshot (in the ``<prefix>_snapshots`` object store) naming
#: the input stream it was folded from
STREAM_HEADER: Final = "Reconciler-Stream"


class Origin(enum.StrEnum):
    """Who published a command: the first part of its message id."""

    #: the leader's own commands (warm top-ups, expiries, abandoned reservations)
    LEADER = "in"
    #: ``reconciler cmd``
    CLI = "cmd"
    #: ``reconciler garm-provider``
    GARM = "garm"
    #: ``reconciler demo``
    DEMO = "demo"


def decision_id(request_id: str, phase: str) -> str:
    """``decision:<request_id>:<phase>``."""
    return f"decision:{request_id}:{phase}"


def create_command_id(lease_id: str) -> str:
    """``create:<lease_id>``: the command id (and message id) of a warm VM's create."""
    return f"create:{lease_id}"


def delete_command_id(lease_id: str, reason: str) -> str:
    """``delete:<lease_id>:<reason>``: the command id (and message id) of a delete."""
    return f"delete:{lease_id}:{reason}"


def rejection_id(input_seq: int) -> str:
    """``rejected:<input_seq>``: a refused config input's."""
    return f"rejected:{input_seq}"


def dead_letter_id(stream_seq: int) -> str:
    """``dlq:<stream_seq>``: a dead letter's."""
    return f"dlq:{stream_seq}"


def command_msg_id(origin: Origin, request_id: str) -> str:
    """``<origin>:<request_id>``: a command's, by who publishes it."""
    return f"{origin}:{request_id}"


def observation_msg_id(lease_id: str, revision: int, present: bool) -> str:
    """``observation:<lease_id>:<revision>:<true|false>``: two leaders checking the same
    suspicion at the same inventory revision and seeing the same publish it once."""
    return f"observation:{lease_id}:{revision}:{str(present).lower()}"


def failure_msg_id(lease_id: str, action: str) -> str:
    """``failure:<lease_id>:<action>``: a lease's instance fails an action once for good;
    an executor that reports it again after a restart stores nothing new."""
    return f"failure:{lease_id}:{action}"


def lifecycle_msg_id(payload: bytes) -> str:
    """``lifecycle:<digest>``: an event's, from its payload (the same event, sent again
    after a reconnect, is stored once)."""
    return f"lifecycle:{hashlib.sha256(payload).hexdigest()[:32]}"


def config_msg_id(kind: str, name: str, payload: dict[str, Any]) -> str:
    """``apply:<kind>:<name>:<digest>``: a config item's, from its content (applying the
    same file twice stores nothing new)."""
    digest = hashlib.sha256(orjson.dumps(payload, option=orjson.OPT_SORT_KEYS))
    return f"apply:{kind}:{name}:{digest.hexdigest()[:24]}"
