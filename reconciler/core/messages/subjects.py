"""The subject grammar (docs/interface.md): every subject of the bus, built and parsed.

Rules:

- Every subject starts with the prefix (default ``rc``), one subject token. The core
  builds its outputs' subjects without it (:data:`UNPREFIXED`: ``out.decision.r1``); the
  :class:`Subjects` of a prefix builds whole ones (``rc.out.decision.r1``).
- ``<host>``, ``<pool>``, ``<class>``, ``<name>`` and ``<request_id>`` are tokens of
  ``[A-Za-z0-9_-]{1,128}``. Builders do not check them: they come from inputs whose
  subjects and payloads were checked, and the fold builds a subject per decision.
  Parsers do, and answer ``None`` for anything that is not a subject of the contract;
  :meth:`Subjects.parse_input` answers a :class:`SubjectError` instead, whose sentence
  is the dead letter's.
- The words of the grammar (input kinds, executor verbs, status kinds, dead-letter
  reasons) are defined here, once.

Inputs: ``in.host.<host>.snapshot|inventory|lifecycle|observation``,
``in.config.<kind>.<name>``, ``in.cmd.<verb>``. Outputs: ``out.decision.<request_id>``,
``out.exec.<host>.create|delete``, ``out.status.host|pool.<name>``,
``out.config.rejected.<kind>.<name>``, ``out.dlq.<reason>``. Queries: ``query.<name>``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final, Literal, get_args

from reconciler.core.inputs import KINDS
from reconciler.core.messages.envelope import clip

__all__ = [
    "COMMAND_VERBS",
    "CONFIG_KINDS",
    "DEAD_LETTER_HEAD",
    "DEAD_LETTER_REASONS",
    "DECISION_HEAD",
    "DEFAULT_PREFIX",
    "EXEC_HEAD",
    "EXEC_VERBS",
    "HOST_INPUTS",
    "INPUT_KINDS",
    "OPERATOR_VERBS",
    "PRODUCER_VERBS",
    "STATUS_KINDS",
    "TOKEN_PATTERN",
    "UNPREFIXED",
    "ConfigRejectedSubject",
    "DeadLetterReason",
    "DeadLetterSubject",
    "DecisionSubject",
    "ExecSubject",
    "ExecVerb",
    "InputSubject",
    "OutputSubject",
    "StatusSubject",
    "SubjectError",
    "Subjects",
    "is_token",
]

#: the prefix of every subject unless configured otherwise (``--prefix``)
DEFAULT_PREFIX: Final = "rc"
TOKEN_PATTERN: Final = "[A-Za-z0-9_-]{1,128}"
_TOKEN = re.compile(TOKEN_PATTERN)

#: every input kind, as named after ``in.`` with the host or name token left out
#: (``host.snapshot``, ``config.pool``, ``cmd.admit``): the typed inputs' own list
INPUT_KINDS: Final[tuple[str, ...]] = KINDS
HOST_INPUTS: Final = tuple(k.removeprefix("host.") for k in KINDS if k.startswith("host."))
CONFIG_KINDS: Final = tuple(k.removeprefix("config.") for k in KINDS if k.startswith("config."))
COMMAND_VERBS: Final = tuple(k.removeprefix("cmd.") for k in KINDS if k.startswith("cmd."))
#: the commands of operators (config and hosts), which producers such as GARM's provider
#: are not given permission to publish; every other command is a producer's
OPERATOR_VERBS: Final = ("apply-config", "cordon", "uncordon", "drain")
PRODUCER_VERBS: Final = tuple(v for v in COMMAND_VERBS if v not in OPERATOR_VERBS)

ExecVerb = Literal["create", "delete"]
EXEC_VERBS: Final[tuple[ExecVerb, ...]] = get_args(ExecVerb)
StatusKind = Literal["host", "pool"]
STATUS_KINDS: Final[tuple[StatusKind, ...]] = get_args(StatusKind)
DeadLetterReason = Literal["decode", "schema", "too-large", "domain"]
DEAD_LETTER_REASONS: Final[tuple[DeadLetterReason, ...]] = get_args(DeadLetterReason)

#: how the unprefixed subjects of decisions, executor commands and dead letters start
#: (what the pipeline counts and logs by)
DECISION_HEAD: Final = "out.decision."
EXEC_HEAD: Final = "out.exec."
DEAD_LETTER_HEAD: Final = "out.dlq."


def is_token(text: str) -> bool:
    """Whether ``text`` is one subject token: 1-128 of ``[A-Za-z0-9_-]``."""
    return _TOKEN.fullmatch(text) is not None


# ------------------------------------------------------------------ parsed subjects


@dataclass(frozen=True, slots=True)
class InputSubject:
    """An input's subject: its kind (``host.snapshot``, ``config.pool``, ``cmd.admit``)
    and its host or name token (``None`` for a command)."""

    kind: str
    token: str | None


@dataclass(frozen=True, slots=True)
class SubjectError:
    """Why a subject is not an input's: one sentence, the dead letter's error."""

    error: str


@dataclass(frozen=True, slots=True)
class DecisionSubject:
    request_id: str


@dataclass(frozen=True, slots=True)
class ExecSubject:
    host: str
    verb: ExecVerb


@dataclass(frozen=True, slots=True)
class StatusSubject:
    kind: StatusKind
    name: str


@dataclass(frozen=True, slots=True)
class ConfigRejectedSubject:
    kind: str
    name: str


@dataclass(frozen=True, slots=True)
class DeadLetterSubject:
    reason: DeadLetterReason


OutputSubject = (
    DecisionSubject | ExecSubject | StatusSubject | ConfigRejectedSubject | DeadLetterSubject
)


# ------------------------------------------------------------------------ subjects


class Subjects:
    """The contract's subjects under one prefix (``None``: without one, as the core's
    outputs are); see the module's rules."""

    __slots__ = ("_head", "prefix")

    def __init__(self, prefix: str | None) -> None:
        if prefix is not None and not is_token(prefix):
            raise ValueError(f"prefix must be one subject token {TOKEN_PATTERN}: {prefix!r}")
        self.prefix = prefix
        self._head = "" if prefix is None else f"{prefix}."

    def __repr__(self) -> str:
        return f"Subjects({self.prefix!r})"

    # ---------------------------------------------------------------- inputs

    def host_input(self, host: str, kind: str) -> str:
        """``in.host.<host>.<kind>`` (kind: snapshot, inventory, lifecycle, observation)."""
        return f"{self._head}in.host.{host}.{kind}"

    def config_input(self, kind: str, name: str) -> str:
        """``in.config.<kind>.<name>`` (kind: pool, class, gpu-profile, gpu-policy, tenant)."""
        return f"{self._head}in.config.{kind}.{name}"

    def command(self, verb: str) -> str:
        """``in.cmd.<verb>``."""
        return f"{self._head}in.cmd.{verb}"

    def input(self, kind: str, token: str | None = None) -> str:
        """The subject of an input of ``kind`` (an :data:`INPUT_KINDS` name) whose host or
        name is ``token`` (none for a command): :meth:`parse_input` the other way."""
        family, _, what = kind.partition(".")
        if family == "cmd" and token is None:
            return self.command(what)
        if family == "host" and token is not None:
            return self.host_input(token, what)
        if family == "config" and token is not None:
            return self.config_input(what, token)
        raise ValueError(f"no input subject for kind {kind!r} with token {token!r}")

    # --------------------------------------------------------------- outputs

    def decision(self, request_id: str) -> str:
        """``out.decision.<request_id>``: every decision of one request."""
        return f"{self._head}out.decision.{request_id}"

    def exec_command(self, host: str, verb: str) -> str:
        """``out.exec.<host>.create|delete``: one executor command."""
        return f"{self._head}out.exec.{host}.{verb}"

    def status(self, kind: str, name: str) -> str:
        """``out.status.host|pool.<name>``."""
        return f"{self._head}out.status.{kind}.{name}"

    def config_rejected(self, kind: str, name: str) -> str:
        """``out.config.rejected.<kind>.<name>``."""
        return f"{self._head}out.config.rejected.{kind}.{name}"

    def dead_letter(self, reason: str) -> str:
        """``out.dlq.<reason>``."""
        return f"{self._head}out.dlq.{reason}"

    # --------------------------------------------------------------- queries

    def query(self, name: str) -> str:
        """``query.<name>``: a query's request subject."""
        return f"{self._head}query.{name}"

    # ------------------------------------------------------------- wildcards

    @property
    def inputs(self) -> str:
        """``in.>``: the IN stream's subjects."""
        return f"{self._head}in.>"

    @property
    def outputs(self) -> str:
        """``out.>``: the OUT stream's subjects."""
        return f"{self._head}out.>"

    @property
    def host_inputs(self) -> str:
        """``in.host.>``: every host's snapshots, inventories, events and observations."""
        return f"{self._head}in.host.>"

    @property
    def commands(self) -> str:
        """``in.cmd.>``: every command."""
        return f"{self._head}in.cmd.>"

    @property
    def decisions(self) -> str:
        """``out.decision.>``: every decision."""
        return f"{self._head}out.decision.>"

    def exec_commands(self, host: str) -> str:
        """``out.exec.<host>.>``: one host's executor commands (its consumer's filter)."""
        return f"{self._head}out.exec.{host}.>"

    @property
    def config_rejections(self) -> str:
        """``out.config.rejected.>``."""
        return f"{self._head}out.config.rejected.>"

    @property
    def dead_letters(self) -> str:
        """``out.dlq.>``."""
        return f"{self._head}out.dlq.>"

    @property
    def queries(self) -> str:
        """``query.*``: every query (what a replica answers)."""
        return f"{self._head}query.*"

    @property
    def any_query(self) -> str:
        """``query.>``: every query subject, at any depth (a permission's pattern)."""
        return f"{self._head}query.>"

    @property
    def query_group(self) -> str:
        """The queue group of the replicas answering queries: ``<prefix>-query``."""
        return f"{self.prefix}-query"

    # ----------------------------------------------------------- prefixing

    def absolute(self, relative: str) -> str:
        """``relative`` (an unprefixed subject, as the core's outputs have) under this
        prefix."""
        return f"{self._head}{relative}"

    def relative(self, subject: str) -> str | None:
        """``subject`` without this prefix; ``None`` when it does not start with it."""
        head = self._head
        if not subject.startswith(head):
            return None
        return subject[len(head) :]

    # --------------------------------------------------------------- parsing

    def parse_input(self, subject: str) -> InputSubject | SubjectError:
        """An input's subject (kind and token), or why it is not one. The checks, in
        order: the prefix, the shape, a known kind, a valid token."""
        head = f"{self._head}in."
        if not subject.startswith(head):
            return SubjectError(f"subject {_shown(subject)} is not under {head}")
        parts = subject[len(head) :].split(".")
        token: str | None
        if len(parts) == 2 and parts[0] == "cmd":
            kind, token = f"cmd.{parts[1]}", None
        elif len(parts) == 3 and parts[0] == "host":
            kind, token = f"host.{parts[2]}", parts[1]
        elif len(parts) == 3 and parts[0] == "config":
            kind, token = f"config.{parts[1]}", parts[2]
        else:
            return SubjectError(
                f"subject {_shown(subject)} is not {head}host.<host>.<kind>, "
                f"{head}config.<kind>.<name> or {head}cmd.<verb>"
            )
        if kind not in INPUT_KINDS:
            return SubjectError(f"subject {_shown(subject)}: unknown input kind {kind!r}")
        if token is not None and not is_token(token):
            return SubjectError(
                f"subject {_shown(subject)}: {token!r} is not a subject token of {TOKEN_PATTERN}"
            )
        return InputSubject(kind, token)

    def parse_output(self, subject: str) -> OutputSubject | None:
        """An output's subject, or ``None`` when it is not one of the contract's."""
        rest = self.relative(subject)
        if rest is None or not rest.startswith("out."):
            return None
        parts = rest.split(".")[1:]
        if not all(is_token(p) for p in parts):
            return None
        match parts:
            case ["decision", request_id]:
                return DecisionSubject(request_id)
            case ["exec", host, ("create" | "delete") as verb]:
                return ExecSubject(host, verb)
            case ["status", ("host" | "pool") as kind, name]:
                return StatusSubject(kind, name)
            case ["config", "rejected", kind, name] if kind in CONFIG_KINDS:
                return ConfigRejectedSubject(kind, name)
            case ["dlq", ("decode" | "schema" | "too-large" | "domain") as reason]:
                return DeadLetterSubject(reason)
        return None

    def parse_query(self, subject: str) -> str | None:
        """A query's name, or ``None`` when ``subject`` is not ``query.<name>``."""
        rest = self.relative(subject)
        if rest is None:
            return None
        family, _, name = rest.partition(".")
        return name if family == "query" and is_token(name) else None


#: the subjects the core writes: without a prefix
UNPREFIXED: Final = Subjects(None)


def _shown(subject: str) -> str:
    return clip(repr(subject))
