"""The wire contract (reconciler.core.messages): every subject built and parsed back,
every message id scheme, and every message the fold writes read back into its typed form
and encoded again to the very same bytes."""

from __future__ import annotations

import ast
import base64
import re
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from reconciler.bus.schemas import load
from reconciler.core.messages import (
    COMMAND_VERBS,
    CONFIG_KINDS,
    DEAD_LETTER_REASONS,
    DLQ_PAYLOAD_CUT,
    HOST_INPUTS,
    INPUT_KINDS,
    MAX_ERROR_CHARS,
    UNPREFIXED,
    ConfigRejected,
    ConfigRejectedSubject,
    CreateCommand,
    DeadLetter,
    DeadLetterSubject,
    DecidedLease,
    Decision,
    DecisionSubject,
    DeleteCommand,
    ExecSubject,
    GpuAssignment,
    InputSubject,
    MessageError,
    Origin,
    Output,
    QueryReply,
    StatusSubject,
    SubjectError,
    Subjects,
    Victim,
    command_msg_id,
    config_msg_id,
    create_command_id,
    dead_letter_id,
    decision_id,
    delete_command_id,
    error_reply,
    is_token,
    lease_payload,
    lifecycle_msg_id,
    observation_msg_id,
    ok_reply,
    parse_exec_command,
    rejection_id,
)
from reconciler.core.model import Resources
from reconciler.core.state import Effects
from tests.support import builders as b
from tests.support import workload as wl
from tests.support.repo import ROOT

TOKENS = ("h1", "pool_a", "gpu-profile-2", "r-" + "x" * 126, "A_b-9")
BAD_TOKENS = ("", "a.b", "a b", "x" * 129, "ä", "a*", ">", "a:b")
PREFIXES = ("rc", "p-2", "Team_7")


# ---------------------------------------------------------------------- subjects


@pytest.mark.parametrize("prefix", PREFIXES)
def test_every_input_subject_round_trips(prefix: str) -> None:
    subjects = Subjects(prefix)
    for kind in INPUT_KINDS:
        for token in TOKENS:
            token_or_none = None if kind.startswith("cmd.") else token
            subject = subjects.input(kind, token_or_none)
            assert subject.startswith(f"{prefix}.in.")
            assert subjects.parse_input(subject) == InputSubject(kind, token_or_none)


def test_input_subjects_by_family() -> None:
    rc = Subjects("rc")
    assert [rc.host_input("h1", k) for k in HOST_INPUTS] == [
        "rc.in.host.h1.snapshot",
        "rc.in.host.h1.inventory",
        "rc.in.host.h1.lifecycle",
        "rc.in.host.h1.observation",
        "rc.in.host.h1.failure",
    ]
    assert [rc.config_input(k, "n") for k in CONFIG_KINDS] == [
        "rc.in.config.pool.n",
        "rc.in.config.class.n",
        "rc.in.config.gpu-profile.n",
        "rc.in.config.gpu-policy.n",
        "rc.in.config.tenant.n",
    ]
    assert rc.command("admit-preemptible") == "rc.in.cmd.admit-preemptible"
    assert set(COMMAND_VERBS) >= {"admit", "claim-warm", "release", "mark-created"}
    with pytest.raises(ValueError, match="no input subject"):
        rc.input("cmd.admit", "h1")
    with pytest.raises(ValueError, match="no input subject"):
        rc.input("host.snapshot")


@pytest.mark.parametrize(
    ("subject", "error"),
    [
        ("rc.out.decision.r1", "is not under rc.in."),
        ("p.in.cmd.admit", "is not under rc.in."),
        ("rc.in.cmd", "is not rc.in.host.<host>.<kind>"),
        ("rc.in.host.h1", "is not rc.in.host.<host>.<kind>"),
        ("rc.in.config.pool.a.b", "is not rc.in.host.<host>.<kind>"),
        ("rc.in.cmd.teleport", "unknown input kind 'cmd.teleport'"),
        ("rc.in.host.h1.weather", "unknown input kind 'host.weather'"),
        ("rc.in.config.pool.a:b", "'a:b' is not a subject token"),
    ],
)
def test_a_subject_that_is_no_input_says_why(subject: str, error: str) -> None:
    parsed = Subjects("rc").parse_input(subject)
    assert isinstance(parsed, SubjectError)
    assert error in parsed.error


def test_an_enormous_subject_is_clipped_in_the_error() -> None:
    parsed = Subjects("rc").parse_input("rc.in.host." + "h" * 5000 + ".snapshot.x")
    assert isinstance(parsed, SubjectError)
    assert len(parsed.error) < MAX_ERROR_CHARS + 200


@pytest.mark.parametrize("prefix", [*PREFIXES, None])
def test_every_output_subject_round_trips(prefix: str | None) -> None:
    subjects = Subjects(prefix)
    head = "" if prefix is None else f"{prefix}."
    for token in TOKENS:
        cases = [
            (subjects.decision(token), DecisionSubject(token)),
            (subjects.exec_command(token, "create"), ExecSubject(token, "create")),
            (subjects.exec_command(token, "delete"), ExecSubject(token, "delete")),
            (subjects.status("host", token), StatusSubject("host", token)),
            (subjects.status("pool", token), StatusSubject("pool", token)),
            *(
                (subjects.config_rejected(kind, token), ConfigRejectedSubject(kind, token))
                for kind in CONFIG_KINDS
            ),
        ]
        for subject, parsed in cases:
            assert subject.startswith(f"{head}out.")
            assert subjects.parse_output(subject) == parsed
            assert subjects.relative(subject) == UNPREFIXED.absolute(subject.removeprefix(head))
        assert subjects.parse_query(subjects.query(token)) == token
    for reason in DEAD_LETTER_REASONS:
        subject = subjects.dead_letter(reason)
        assert subjects.parse_output(subject) == DeadLetterSubject(reason)


@pytest.mark.parametrize("token", BAD_TOKENS)
def test_parsers_refuse_bad_tokens(token: str) -> None:
    rc = Subjects("rc")
    assert not is_token(token)
    for subject in (
        rc.decision(token),
        rc.exec_command(token, "create"),
        rc.status("pool", token),
        rc.config_rejected("pool", token),
    ):
        assert rc.parse_output(subject) is None
    assert rc.parse_query(rc.query(token)) is None
    assert isinstance(rc.parse_input(rc.host_input(token, "snapshot")), SubjectError)


@pytest.mark.parametrize(
    "subject",
    [
        "rc.out.exec.h1.reboot",
        "rc.out.status.tenant.t",
        "rc.out.config.rejected.weather.x",
        "rc.out.dlq.bored",
        "rc.out.decision",
        "rc.out.decision.r1.final",
        "rc.in.cmd.admit",
        "p.out.decision.r1",
        "rcx.out.decision.r1",
    ],
)
def test_parse_output_refuses_what_is_no_output(subject: str) -> None:
    assert Subjects("rc").parse_output(subject) is None


@pytest.mark.parametrize("prefix", BAD_TOKENS)
def test_a_prefix_is_one_token(prefix: str) -> None:
    with pytest.raises(ValueError, match="prefix must be one subject token"):
        Subjects(prefix)


def test_wildcards_and_prefixing() -> None:
    p = Subjects("p")
    assert (p.inputs, p.outputs, p.decisions) == ("p.in.>", "p.out.>", "p.out.decision.>")
    assert (p.host_inputs, p.commands, p.any_query) == ("p.in.host.>", "p.in.cmd.>", "p.query.>")
    assert p.exec_commands("h1") == "p.out.exec.h1.>"
    assert (p.config_rejections, p.dead_letters) == ("p.out.config.rejected.>", "p.out.dlq.>")
    assert (p.queries, p.query_group) == ("p.query.*", "p-query")
    assert p.absolute("out.decision.r1") == "p.out.decision.r1"
    assert p.relative("p.out.decision.r1") == "out.decision.r1"
    assert p.relative("q.out.decision.r1") is None
    assert UNPREFIXED.decision("r1") == "out.decision.r1"
    assert UNPREFIXED.relative("out.decision.r1") == "out.decision.r1"


@given(st.text(alphabet="abc.-_*>: ", max_size=40))
def test_parsers_never_raise(subject: str) -> None:
    rc = Subjects("rc")
    rc.parse_input(subject)
    rc.parse_output(subject)
    rc.parse_query(subject)


# ----------------------------------------------------------------------------- ids


def test_message_ids() -> None:
    assert decision_id("r1", "pending") == "decision:r1:pending"
    assert create_command_id("L7") == "create:L7"
    assert delete_command_id("L7", "preempted") == "delete:L7:preempted"
    assert rejection_id(12) == "rejected:12"
    assert dead_letter_id(3) == "dlq:3"
    assert [command_msg_id(o, "r1") for o in Origin] == [
        "in:r1",
        "cmd:r1",
        "garm:r1",
        "demo:r1",
    ]
    assert observation_msg_id("L1", 4, False) == "observation:L1:4:false"
    assert observation_msg_id("L1", 4, True) == "observation:L1:4:true"
    assert lifecycle_msg_id(b"{}").startswith("lifecycle:")
    assert len(lifecycle_msg_id(b"{}")) == len("lifecycle:") + 32
    assert lifecycle_msg_id(b"{}") != lifecycle_msg_id(b"[]")
    first = config_msg_id("pool", "p", {"a": 1, "b": 2})
    assert first == config_msg_id("pool", "p", {"b": 2, "a": 1})  # content, not key order
    assert first.startswith("apply:pool:p:") and len(first.rsplit(":", 1)[1]) == 24
    assert first != config_msg_id("pool", "p", {"a": 1, "b": 3})


# ------------------------------------------------------------------- the fold's own


def _story() -> list[Output]:
    """Outputs of every kind the fold writes: decisions of every phase (with leases,
    victims, jobs, GPUs, suspect and adopted leases), creates, deletes (preempted,
    drained, orphan), config rejections, and a republished decision."""
    fleet = b.Fleet()
    outputs: list[Output] = []

    def send(*items: tuple[str, dict[str, Any]]) -> Effects:
        fx = fleet.send(*items)
        outputs.extend(fx.outputs)
        return fx

    gpus = [b.gpu(i, numa=i // 2) for i in range(4)]
    send(
        b.snapshot("h1", cpu=4),
        b.snapshot("g1", cpu=32, gpus=gpus, labels={"gpu": "yes"}),
        b.gpu_class("a100", count=1),
        b.pool("warm", cpu=1, max_ready=10),
        b.pool("cold", cpu=2),
        b.pool("ml", cpu=4, claims=[{"name": "g", "class": "a100"}]),
        b.pool("bad", min_ready=3, max_ready=1),
    )
    for i in range(4):
        send(b.admit(f"w{i}", "warm", f"w{i}", kind="warm", host="h1"))
        send(b.lifecycle("h1", "instance-ready", f"w{i}"))
    send(b.cmd("claim-warm", "c1", pool="warm", job="job-1"))
    send(b.cmd("authorize-warm-drain", "d1", instance="w3"))
    send(b.admit("p1", "cold", "vm-p", preemptible=True, job="job-p", host="h1"))
    send(b.admit("m1", "ml", "ml-1", claims=[{"name": "g", "class": "a100"}]))
    send(b.admit("m1", "ml", "ml-1"))  # decided already: republished unchanged
    send(
        b.inventory(
            "g1",
            [
                b.instance(
                    "stray",
                    config={
                        "user.rc.lease-id": "L999",
                        "user.rc.pool": "warm",
                        "user.rc.kind": "warm",
                    },
                )
            ],
        )
    )
    send(b.cmd("mark-created", "mc", instance="ml-1"))
    send(b.cmd("mark-deleting", "ms", instance="stray"))
    send(b.inventory("g1", [], revision=2))  # ml-1 and stray missing: suspect
    send(b.cmd("mark-deleting", "md", instance="ml-1"))
    send(b.cmd("release", "rl", instance="nobody"))
    return outputs


def test_the_story_covers_every_kind_of_output() -> None:
    outputs = _story()
    routes = [UNPREFIXED.parse_output(o.subject) for o in outputs]
    assert {type(r) for r in routes} == {DecisionSubject, ExecSubject, ConfigRejectedSubject}
    payloads = [orjson.loads(o.payload) for o in outputs]
    decisions = [p for p, r in zip(payloads, routes, strict=True) if type(r) is DecisionSubject]
    assert {d["phase"] for d in decisions} == {"pending", "final"}
    assert any(d.get("victims") for d in decisions)
    assert any((d.get("lease") or {}).get("gpus") for d in decisions)
    assert any((d.get("lease") or {}).get("job") for d in decisions)
    assert any((d.get("lease") or {}).get("suspect") for d in decisions)
    assert any((d.get("lease") or {}).get("adopted") for d in decisions)
    assert any("awaiting_victims" in (d.get("lease") or {}) for d in decisions)
    reasons = {p.get("reason") for p, r in zip(payloads, routes, strict=True)}
    assert {"preempted", "drained"} <= reasons
    assert any(type(r) is ExecSubject and r.verb == "create" for r in routes)
    assert any(o.outcome is None and o.subject.startswith("out.decision.") for o in outputs)


def _read_back(out: Output) -> Output:
    """The output that publishes the typed message read from ``out``."""
    route = UNPREFIXED.parse_output(out.subject)
    match route:
        case DecisionSubject():
            decision = Decision.parse(out.payload)
            assert decision.as_dict() == orjson.loads(out.payload)
            again = decision.output()
            # a republished decision carries no outcome for the logs
            if out.outcome is None:
                return Output(again.subject, again.msg_id, again.payload)
            return again
        case ExecSubject(verb=verb):
            return parse_exec_command(verb, out.payload).output()
        case ConfigRejectedSubject():
            return ConfigRejected.parse(out.payload).output()
        case DeadLetterSubject(reason=reason):
            return DeadLetter.parse(reason, out.payload).output()
    raise AssertionError(f"not an output subject: {out.subject}")


def test_every_output_of_the_story_reads_back_to_the_same_bytes() -> None:
    for out in _story():
        again = _read_back(out)
        assert (again.subject, again.msg_id, again.payload) == (
            out.subject,
            out.msg_id,
            out.payload,
        )
        assert again.outcome == out.outcome


def test_every_output_of_a_mixed_workload_reads_back_to_the_same_bytes() -> None:
    work = wl.mixed(400, seed=11)
    fleet = b.Fleet()
    fx = fleet.send(*work.setup, *work.items)
    assert len(fx.outputs) > 400
    for out in fx.outputs:
        again = _read_back(out)
        assert (again.subject, again.msg_id, again.payload) == (
            out.subject,
            out.msg_id,
            out.payload,
        )


def test_a_decided_lease_is_the_lease_payload() -> None:
    fleet = b.Fleet()
    fleet.send(b.snapshot("h1"), b.pool("cold"), b.admit("r1", "cold", "vm1", job="j"))
    lease = fleet.state.leases[next(iter(fleet.state.leases))]
    built = lease_payload(lease)
    read = DecidedLease.from_dict(orjson.loads(orjson.dumps(built)))
    assert orjson.dumps(read.as_dict()) == orjson.dumps(built)
    assert (read.instance, read.job, read.kind, read.state) == ("vm1", "j", "cold", "reserved")


# ---------------------------------------------------------------- typed messages


def test_a_decision_built_typed_is_what_the_fold_writes() -> None:
    decision = Decision(
        request_id="r1",
        verb="admit-preemptible",
        phase="pending",
        outcome="pending",
        input_seq=7,
        decided_at="2026-12-02T10:00:00Z",
        lease=DecidedLease(
            lease_id="L7",
            instance="vm",
            host="h1",
            host_uid="u",
            pool="p",
            kind="cold",
            state="reserved",
            demand=Resources(1, 2, 3),
            awaiting_victims=("L1",),
        ),
        victims=(Victim(lease_id="L1", instance="w1", host="h1"),),
    )
    out = decision.output()
    assert (out.subject, out.msg_id, out.outcome) == (
        "out.decision.r1",
        "decision:r1:pending",
        "pending",
    )
    assert out.payload == (
        b'{"decided_at":"2026-12-02T10:00:00Z","input_seq":7,"lease":{"awaiting_victims":'
        b'["L1"],"demand":{"cpu":1,"disk_gib":3,"memory_mib":2},"gpus":[],"host":"h1",'
        b'"host_uid":"u","instance":"vm","kind":"cold","lease_id":"L7","pool":"p",'
        b'"state":"reserved"},"outcome":"pending","phase":"pending","request_id":"r1",'
        b'"v":1,"verb":"admit-preemptible","victims":[{"host":"h1","instance":"w1",'
        b'"lease_id":"L1"}]}'
    )
    assert Decision.parse(out.payload) == decision
    assert not decision.final


def test_unknown_fields_of_a_decision_are_ignored() -> None:
    body = {
        "v": 1,
        "request_id": "r",
        "verb": "release",
        "phase": "final",
        "outcome": "ok",
        "input_seq": 1,
        "decided_at": "t",
        "position": 3,
    }
    assert Decision.parse(orjson.dumps(body)).final


@pytest.mark.parametrize(
    ("data", "error"),
    [
        (b"{not json", "is not JSON"),
        (b"[]", "is not a JSON object"),
        (b'{"v":1}', "'phase' is missing"),
        (b'{"phase":"later"}', "unknown decision phase"),
        (
            b'{"phase":"final","request_id":"r","verb":"x","outcome":"ok",'
            b'"input_seq":"1","decided_at":"t"}',
            "'input_seq' is not an integer",
        ),
        (
            b'{"phase":"final","request_id":"r","verb":"x","outcome":"ok",'
            b'"input_seq":1,"decided_at":"t","lease":{"lease_id":"L"}}',
            "'demand' is missing",
        ),
    ],
)
def test_a_malformed_decision_is_refused_by_name(data: bytes, error: str) -> None:
    with pytest.raises(MessageError, match=error):
        Decision.parse(data)


def test_executor_commands_round_trip() -> None:
    delete = DeleteCommand(
        command_id=delete_command_id("L1", "orphan"),
        host="h1",
        instance="vm",
        project="ci",
        lease_id="L1",
        reason="orphan",
    )
    out = delete.output()
    assert (out.subject, out.msg_id) == ("out.exec.h1.delete", "delete:L1:orphan")
    assert orjson.loads(out.payload) == {
        "v": 1,
        "command_id": "delete:L1:orphan",
        "host": "h1",
        "instance": "vm",
        "project": "ci",
        "lease_id": "L1",
        "reason": "orphan",
    }
    assert parse_exec_command("delete", out.payload) == delete
    create = CreateCommand(
        command_id=create_command_id("L2"),
        lease_id="L2",
        host="g1",
        instance="w",
        project="default",
        pool="ml",
        image="img",
        profiles=("default",),
        demand=Resources(2, 4096, 20),
        gpus=(GpuAssignment(index=1, pci_address="0000:41:00.0"),),
        instance_type="container",
    )
    out = create.output()
    assert (out.subject, out.msg_id) == ("out.exec.g1.create", "create:L2")
    assert parse_exec_command("create", out.payload) == create
    body = orjson.loads(out.payload)
    del body["instance_type"]
    default = parse_exec_command("create", orjson.dumps(body))
    assert isinstance(default, CreateCommand)
    assert default.instance_type == "virtual-machine"
    with pytest.raises(MessageError, match="no executor command"):
        parse_exec_command("reboot", out.payload)


def test_dead_letters_round_trip_cut_and_clip() -> None:
    raw = bytes(range(256)) * 1024
    letter = DeadLetter.of(
        reason="too-large", subject="rc.in.cmd.admit", stream_seq=9, error="e" * 5000, data=raw
    )
    assert letter.payload == raw[:DLQ_PAYLOAD_CUT]
    assert len(letter.error) == MAX_ERROR_CHARS
    out = letter.output()
    assert (out.subject, out.msg_id) == ("out.dlq.too-large", "dlq:9")
    body = orjson.loads(out.payload)
    assert base64.b64decode(body["payload_b64"]) == raw[:DLQ_PAYLOAD_CUT]
    assert DeadLetter.parse("too-large", out.payload) == letter
    with pytest.raises(ValueError, match="reason"):
        DeadLetter.of(reason="bored", subject="s", stream_seq=1, error="e", data=b"")  # type: ignore[arg-type]
    with pytest.raises(MessageError, match="reason"):
        DeadLetter.parse("bored", out.payload)
    with pytest.raises(MessageError, match="base64"):
        DeadLetter.parse("decode", orjson.dumps({**body, "payload_b64": "***"}))


def test_config_rejections_round_trip() -> None:
    rejected = ConfigRejected(kind="gpu-policy", name="p", error="bad", input_seq=4)
    out = rejected.output()
    assert (out.subject, out.msg_id) == ("out.config.rejected.gpu-policy.p", "rejected:4")
    assert ConfigRejected.parse(out.payload) == rejected


def test_query_replies_round_trip() -> None:
    ok = QueryReply.parse(ok_reply({"instance": "vm"}))
    assert (ok.ok, ok.result, ok.code) == (True, {"instance": "vm"}, None)
    error = QueryReply.parse(error_reply("not-found", "nothing"))
    assert (error.ok, error.code, error.message) == (False, "not-found", "nothing")
    assert QueryReply.parse(b'{"ok": false}').code is None
    with pytest.raises(MessageError):
        QueryReply.parse(b"[1]")


# ------------------------------------------------------- one home for the contract

_EXPECTED_OUTPUT = {
    "out/decision.json": DecisionSubject,
    "out/exec.create.json": ExecSubject,
    "out/exec.delete.json": ExecSubject,
    "out/status.host.json": StatusSubject,
    "out/status.pool.json": StatusSubject,
    "out/config.rejected.json": ConfigRejectedSubject,
    "out/dlq.json": DeadLetterSubject,
}


def test_the_grammar_parses_every_subject_the_schemas_name() -> None:
    samples = {"prefix": "rc", "kind": "pool", "reason": "schema"}
    named = 0
    for relpath, document in sorted(load().documents.items()):
        pattern = document.get("x-subject")
        if not isinstance(pattern, str):
            continue
        named += 1
        subject = re.sub(r"<([a-z_]+)>", lambda m: samples.get(m.group(1), "t-1"), pattern)
        rc = Subjects("rc")
        family, _, stem = relpath.removesuffix(".json").partition("/")
        if family == "in":
            token = None if stem.startswith("cmd.") else "t-1"
            assert rc.parse_input(subject) == InputSubject(stem, token), relpath
            assert rc.input(stem, token) == subject
        elif family == "out":
            assert type(rc.parse_output(subject)) is _EXPECTED_OUTPUT[relpath], relpath
        else:
            assert rc.parse_query(subject) == stem.rsplit(".", 1)[0], relpath
    assert named >= len(INPUT_KINDS) + len(_EXPECTED_OUTPUT)


_ROOT = ROOT
#: where the contract itself lives
_HOME = _ROOT / "reconciler" / "core" / "messages"
#: how the contract's unprefixed subjects start
_HEADS = (
    "in.host.",
    "in.config.",
    "in.cmd.",
    "out.decision.",
    "out.exec.",
    "out.status.",
    "out.config.",
    "out.dlq.",
)
#: an f-string's text right after a formatted prefix: ``f"{prefix}.in.cmd.{verb}"``
_AFTER_PREFIX = re.compile(r"^\.(in|out|query)\.")
#: a whole subject: ``"rc.out.decision.r1"``
_PREFIXED = re.compile(
    r"^[A-Za-z0-9_-]+\.(in\.(host|config|cmd)|out\.(decision|exec|status|config|dlq))\."
)
_ID_HEAD = re.compile(
    r"^(decision|dlq|rejected|create|delete|observation|lifecycle|apply|in|cmd|garm|demo):"
)


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the docstring constants of a module's tree."""
    found: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            value = body[0].value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                found.add(id(value))
    return found


def _spelled_by_hand(path: Path) -> list[str]:
    """Subjects, message ids and header names a module spells out itself."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = _docstrings(tree)
    rel = path.relative_to(_ROOT).as_posix()
    found: list[str] = []
    in_fstrings: set[int] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.JoinedStr):
            continue
        texts = [v for v in node.values if isinstance(v, ast.Constant)]
        in_fstrings.update(id(v) for v in texts)
        for i, value in enumerate(node.values):
            text = value.value if isinstance(value, ast.Constant) else None
            if not isinstance(text, str):
                continue
            after_value = i > 0 and isinstance(node.values[i - 1], ast.FormattedValue)
            if (after_value and _AFTER_PREFIX.match(text)) or (
                i == 0 and (text.startswith(_HEADS) or _PREFIXED.match(text))
            ):
                found.append(f"{rel}:{node.lineno}: f-string subject {text!r}")
            if i == 0 and _ID_HEAD.match(text):
                found.append(f"{rel}:{node.lineno}: f-string message id {text!r}")
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
            continue
        if id(node) in docstrings or id(node) in in_fstrings:
            continue
        text = node.value
        if text == "Nats-Msg-Id" or text.startswith(_HEADS) or _PREFIXED.match(text):
            found.append(f"{rel}:{node.lineno}: {text!r}")
    return sorted(found, key=lambda line: int(line.split(":")[1]))


def test_no_module_spells_a_subject_or_a_message_id_by_hand() -> None:
    """Every subject, message id and header name is built by reconciler.core.messages."""
    sources = [
        p for p in sorted((_ROOT / "reconciler").rglob("*.py")) if _HOME not in p.parents
    ] + sorted((_ROOT / "scripts").glob("*.py"))
    assert len(sources) > 100
    found = [line for path in sources for line in _spelled_by_hand(path)]
    assert found == []


def test_the_check_finds_what_it_looks_for(tmp_path: Path) -> None:
    module = _ROOT / "reconciler" / "_spelled.py"
    source = (
        '"""A docstring naming rc.out.decision.<id> and Nats-Msg-Id is fine."""\n'
        'A = f"{prefix}.out.decision.{rid}"\n'
        'B = {"Nats-Msg-Id": f"garm:{rid}"}\n'
        'C = "out.dlq."\n'
    )
    module.write_text(source, encoding="utf-8")
    try:
        found = _spelled_by_hand(module)
    finally:
        module.unlink()
    assert [line.split(": ", 1)[1] for line in found] == [
        "f-string subject '.out.decision.'",
        "f-string message id 'garm:'",
        "'Nats-Msg-Id'",
        "'out.dlq.'",
    ]
