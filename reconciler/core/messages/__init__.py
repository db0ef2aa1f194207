"""The wire contract (docs/interface.md) in one place: subjects, message ids, headers and
the messages the reconciler publishes, built and read.

Every module that names a subject, sets a message id or reads an output does it through
this package; a test keeps it so. Modules:

- :mod:`.subjects`: the subject grammar under a prefix, built and parsed
  (:class:`Subjects`; :data:`UNPREFIXED` for the core's outputs), and the grammar's words;
- :mod:`.ids`: every ``Nats-Msg-Id`` scheme and the header names;
- :mod:`.envelope`: :class:`Output` (a subject without prefix, a message id, exact bytes)
  and the one encoding, sorted-key JSON;
- :mod:`.decisions`: :class:`Decision` and how the fold writes one;
- :mod:`.exec_commands`: the executor's :class:`CreateCommand` and :class:`DeleteCommand`;
- :mod:`.rejections`: :class:`DeadLetter` and :class:`ConfigRejected`;
- :mod:`.replies`: query replies;
- :mod:`.fields`: reading a message's fields, :class:`MessageError` when they are wrong.

Rules: pure (like all of ``reconciler.core``: no I/O, no clock); the bytes a message
encodes to are the bytes the fold has always written (the golden tests pin them), and
parsing them gives the message back.
"""

from reconciler.core.messages.decisions import (
    ITEM_CHANGES,
    PHASES,
    DecidedLease,
    Decision,
    ItemChange,
    ItemResult,
    Phase,
    Victim,
    decision_output,
    lease_payload,
    victim_payload,
)
from reconciler.core.messages.envelope import (
    MAX_ERROR_CHARS,
    MAX_OUTPUT_BYTES,
    MAX_PAYLOAD_BYTES,
    Output,
    clip,
    encode,
)
from reconciler.core.messages.exec_commands import (
    DEFAULT_INSTANCE_TYPE,
    DELETE_REASONS,
    CommandBase,
    CreateCommand,
    DeleteCommand,
    DeleteReason,
    ExecCommand,
    GpuAssignment,
    create_payload,
    delete_payload,
    exec_output,
    parse_exec_command,
)
from reconciler.core.messages.fields import MessageError
from reconciler.core.messages.ids import (
    MSG_ID,
    STREAM_HEADER,
    Origin,
    command_msg_id,
    config_msg_id,
    create_command_id,
    dead_letter_id,
    decision_id,
    delete_command_id,
    failure_msg_id,
    lifecycle_msg_id,
    observation_msg_id,
    rejection_id,
)
from reconciler.core.messages.rejections import DLQ_PAYLOAD_CUT, ConfigRejected, DeadLetter
from reconciler.core.messages.replies import (
    CACHE_NOT_READY,
    INTERNAL,
    INVALID,
    NOT_FOUND,
    STALE_RUNTIME_INPUTS,
    QueryReply,
    error_reply,
    ok_reply,
)
from reconciler.core.messages.subjects import (
    COMMAND_VERBS,
    CONFIG_KINDS,
    DEAD_LETTER_HEAD,
    DEAD_LETTER_REASONS,
    DECISION_HEAD,
    DEFAULT_PREFIX,
    EXEC_HEAD,
    EXEC_VERBS,
    HOST_INPUTS,
    INPUT_KINDS,
    OPERATOR_VERBS,
    PRODUCER_VERBS,
    STATUS_KINDS,
    TOKEN_PATTERN,
    UNPREFIXED,
    ConfigRejectedSubject,
    DeadLetterReason,
    DeadLetterSubject,
    DecisionSubject,
    ExecSubject,
    ExecVerb,
    InputSubject,
    OutputSubject,
    StatusSubject,
    SubjectError,
    Subjects,
    is_token,
)

__all__ = [
    "CACHE_NOT_READY",
    "COMMAND_VERBS",
    "CONFIG_KINDS",
    "DEAD_LETTER_HEAD",
    "DEAD_LETTER_REASONS",
    "DECISION_HEAD",
    "DEFAULT_INSTANCE_TYPE",
    "DEFAULT_PREFIX",
    "DELETE_REASONS",
    "DLQ_PAYLOAD_CUT",
    "EXEC_HEAD",
    "EXEC_VERBS",
    "HOST_INPUTS",
    "INPUT_KINDS",
    "INTERNAL",
    "INVALID",
    "ITEM_CHANGES",
    "MAX_ERROR_CHARS",
    "MAX_OUTPUT_BYTES",
    "MAX_PAYLOAD_BYTES",
    "MSG_ID",
    "NOT_FOUND",
    "OPERATOR_VERBS",
    "PHASES",
    "PRODUCER_VERBS",
    "STALE_RUNTIME_INPUTS",
    "STATUS_KINDS",
    "STREAM_HEADER",
    "TOKEN_PATTERN",
    "UNPREFIXED",
    "CommandBase",
    "ConfigRejected",
    "ConfigRejectedSubject",
    "CreateCommand",
    "DeadLetter",
    "DeadLetterReason",
    "DeadLetterSubject",
    "DecidedLease",
    "Decision",
    "DecisionSubject",
    "DeleteCommand",
    "DeleteReason",
    "ExecCommand",
    "ExecSubject",
    "ExecVerb",
    "GpuAssignment",
    "InputSubject",
    "ItemChange",
    "ItemResult",
    "MessageError",
    "Origin",
    "Output",
    "OutputSubject",
    "Phase",
    "QueryReply",
    "StatusSubject",
    "SubjectError",
    "Subjects",
    "Victim",
    "clip",
    "command_msg_id",
    "config_msg_id",
    "create_command_id",
    "create_payload",
    "dead_letter_id",
    "decision_id",
    "decision_output",
    "delete_command_id",
    "delete_payload",
    "encode",
    "error_reply",
    "exec_output",
    "failure_msg_id",
    "is_token",
    "lease_payload",
    "lifecycle_msg_id",
    "observation_msg_id",
    "ok_reply",
    "parse_exec_command",
    "rejection_id",
    "victim_payload",
]
