"""The input decoder and dead letters (``reconciler.bus.decoder``), black-box over bytes.

Subjects and payloads are written as the contract writes them; the schemas' own examples
supply one valid payload per input kind.
"""

from __future__ import annotations

import base64
import copy
import shutil
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reconciler.bus.decoder import (
    MAX_PAYLOAD_BYTES,
    BadInput,
    Decoded,
    Decoder,
    dead_letter_output,
)
from reconciler.bus.schemas import SCHEMAS_DIR_ENV, SchemaLoadError, load, schemas_dir
from reconciler.core import inputs as ev
from reconciler.core.inputs import KINDS
from reconciler.core.messages import DLQ_PAYLOAD_CUT, MAX_ERROR_CHARS, DeadLetterReason, Subjects

SCHEMAS = load()
_DECODER = Decoder()


def decode(subject: str, raw: bytes, *, prefix: str = "rc") -> Decoded | BadInput:
    """One input decoded against the repository's schemas."""
    return _DECODER.decode(subject, raw, prefix=prefix)


def dead_letter(
    subject: str,
    stream_seq: int,
    raw: bytes,
    reason: DeadLetterReason,
    error: str,
    *,
    prefix: str = "rc",
) -> tuple[str, str | None, bytes]:
    """The (subject, msg id, payload) that dead-letters one input under ``prefix``."""
    out = dead_letter_output(subject, stream_seq, raw, reason, error)
    return Subjects(prefix).absolute(out.subject), out.msg_id, out.payload


EXPECTED_TYPE: dict[str, type] = {
    "host.snapshot": ev.HostSnapshot,
    "host.inventory": ev.HostInventory,
    "host.lifecycle": ev.Lifecycle,
    "host.observation": ev.Observation,
    "host.failure": ev.Failure,
    "config.pool": ev.PoolConfig,
    "config.class": ev.ClassConfig,
    "config.gpu-profile": ev.GpuProfileConfig,
    "config.gpu-policy": ev.GpuPolicyConfig,
    "cmd.admit": ev.Admit,
    "cmd.admit-preemptible": ev.Admit,
    "cmd.claim-warm": ev.ClaimWarm,
    "cmd.authorize-warm-drain": ev.AuthorizeWarmDrain,
    "cmd.mark-created": ev.MarkCreated,
    "cmd.mark-warm-injected": ev.MarkWarmInjected,
    "cmd.mark-deleting": ev.MarkDeleting,
    "cmd.release": ev.Release,
    "cmd.render-runtime": ev.RenderRuntime,
    "cmd.apply-config": ev.ApplyConfig,
    "cmd.cordon": ev.Cordon,
    "cmd.uncordon": ev.Uncordon,
    "cmd.drain": ev.Drain,
    "cmd.queue-timeout": ev.QueueTimeout,
    "config.tenant": ev.TenantConfig,
}
_TOKEN_FIELD = {
    "host": "host",
    "pool": "pool",
    "class": "class",
    "name": "name",
    "tenant": "tenant",
}


def schema_of(kind: str) -> dict[str, Any]:
    return SCHEMAS.documents[f"in/{kind}.json"]


def example(kind: str, i: int = 0) -> dict[str, Any]:
    return copy.deepcopy(schema_of(kind)["examples"][i])


def subject_for(kind: str, payload: dict[str, Any], prefix: str = "rc") -> str:
    """The contract subject of ``payload`` (``x-subject`` with its token filled in)."""
    subject: str = schema_of(kind)["x-subject"].replace("<prefix>", prefix)
    for placeholder, field in _TOKEN_FIELD.items():
        subject = subject.replace(f"<{placeholder}>", str(payload.get(field)))
    return subject


def data(payload: Any) -> bytes:
    return orjson.dumps(payload)


def bad(subject: str, raw: bytes, reason: str, **kw: Any) -> str:
    result = decode(subject, raw, **kw)
    assert isinstance(result, BadInput), result
    assert result.reason == reason, result
    return result.error


SNAPSHOT = example("host.snapshot", 1)  # host gpu-host-01, with two GPUs
SNAPSHOT_SUBJECT = subject_for("host.snapshot", SNAPSHOT)
ADMIT = example("cmd.admit")


# ------------------------------------------------------------------- good input


ROUND_TRIPS = [(kind, i) for kind in KINDS for i in range(len(schema_of(kind)["examples"]))]


@pytest.mark.parametrize(("kind", "i"), ROUND_TRIPS, ids=lambda v: str(v))
def test_every_valid_example_decodes_to_its_dataclass(kind: str, i: int) -> None:
    payload = example(kind, i)
    result = decode(subject_for(kind, payload), data(payload))
    assert isinstance(result, Decoded), result
    assert result.kind == kind
    assert type(result.input) is EXPECTED_TYPE[kind]
    assert result.input == ev.from_payload(kind, payload)


def test_fields_arrive_typed() -> None:
    result = decode(SNAPSHOT_SUBJECT, data(SNAPSHOT))
    assert isinstance(result, Decoded)
    snap = result.input
    assert isinstance(snap, ev.HostSnapshot)
    assert snap.host == "gpu-host-01"
    assert snap.capacity.cpu == 64
    assert [g.index for g in snap.gpus] == [0, 1]
    assert snap.gpu_profile == "a100-default"

    pre = example("cmd.admit-preemptible")
    result = decode("rc.in.cmd.admit-preemptible", data(pre))
    assert isinstance(result, Decoded) and isinstance(result.input, ev.Admit)
    assert result.input.preemptible and result.input.verb == "admit-preemptible"


def test_unknown_fields_are_ignored() -> None:
    payload = {**ADMIT, "extra": {"deep": [1, 2, {"x": None}]}, "priority_hint": "high"}
    assert isinstance(decode("rc.in.cmd.admit", data(payload)), Decoded)


def test_another_prefix() -> None:
    assert isinstance(decode("p-2.in.cmd.admit", data(ADMIT), prefix="p-2"), Decoded)
    bad("p-2.in.cmd.admit", data(ADMIT), "schema")
    bad("rc.in.cmd.admit", data(ADMIT), "schema", prefix="p-2")


def test_a_payload_of_exactly_one_mib_is_not_too_large() -> None:
    raw = data(ADMIT)
    raw += b" " * (MAX_PAYLOAD_BYTES - len(raw))
    assert len(raw) == MAX_PAYLOAD_BYTES
    assert isinstance(decode("rc.in.cmd.admit", raw), Decoded)


# ----------------------------------------------------------------- too large


def test_a_two_mib_payload_is_too_large() -> None:
    raw = data({**ADMIT, "pad": "x" * (2 * MAX_PAYLOAD_BYTES)})
    error = bad("rc.in.cmd.admit", raw, "too-large")
    assert str(len(raw)) in error and "1048576" in error


def test_one_byte_over_is_too_large_even_when_it_is_not_json() -> None:
    bad("rc.in.cmd.admit", b"\xff" * (MAX_PAYLOAD_BYTES + 1), "too-large")


# ------------------------------------------------------------------- decode


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"{",
        b'{"v":1,}',
        b"{'v': 1}",
        b"not json",
        b'{"v":1} {"v":1}',
        b'{"v": NaN}',
        b'{"v": Infinity}',
        b'{"v": 1',
        b"[" * 2000 + b"]" * 2000,
    ],
)
def test_malformed_json(raw: bytes) -> None:
    bad("rc.in.cmd.admit", raw, "decode")


@pytest.mark.parametrize(
    ("raw", "name"),
    [
        (b"[]", "array"),
        (b'[{"v":1}]', "array"),
        (b'"admit"', "string"),
        (b"1", "number"),
        (b"1.5", "number"),
        (b"null", "null"),
        (b"true", "boolean"),
    ],
)
def test_non_object_json(raw: bytes, name: str) -> None:
    assert bad("rc.in.cmd.admit", raw, "decode") == f"payload is a JSON {name}, not an object"


@pytest.mark.parametrize(
    "raw",
    [
        b'{"v":1,"request_id":"\xff"}',
        b'{"v":1,"request_id":"\xc3"}',
        b'{"v":1,"request_id":"\xed\xa0\x80"}',
        b'\xfe\xff{"v":1}',
        b'{"v":1,"x":"\\ud800"}',
    ],
)
def test_invalid_utf8(raw: bytes) -> None:
    bad("rc.in.cmd.admit", raw, "decode")


def test_malformed_json_on_an_unknown_subject_is_a_decode_error() -> None:
    bad("rc.in.cmd.nope", b"{", "decode")


# ------------------------------------------------------------------- schema


@pytest.mark.parametrize(
    ("kind", "path", "value", "error"),
    [
        (
            "host.snapshot",
            ["capacity", "cpu"],
            -1,
            "capacity.cpu: -1 is less than the minimum of 0",
        ),
        (
            "host.snapshot",
            ["reserve", "disk_gib"],
            -20,
            "reserve.disk_gib: -20 is less than the minimum of 0",
        ),
        (
            "host.snapshot",
            ["gpus", 1, "memory_mib"],
            "40G",
            'gpus[1].memory_mib: "40G" is not of type "integer"',
        ),
        ("host.snapshot", ["schedulable"], "yes", 'schedulable: "yes" is not of type "boolean"'),
        ("host.snapshot", ["revision"], 1.5, 'revision: 1.5 is not of type "integer"'),
        ("host.snapshot", ["v"], 2, "v: 1 was expected"),
        ("host.snapshot", ["v"], "1", "v: 1 was expected"),
        (
            "host.inventory",
            ["instances", 0, "config", "user.rc.lease-id"],
            7,
            'instances[0].config["user.rc.lease-id"]: 7 is not of type "string"',
        ),
        (
            "config.pool",
            ["flavor", "memory_mib"],
            -4096,
            "flavor.memory_mib: -4096 is less than the minimum of 0",
        ),
        ("config.pool", ["max_instances"], "10", 'max_instances: "10" is not of type "integer"'),
        ("config.pool", ["v"], None, "v: 1 was expected"),
        (
            "config.class",
            ["parameters", "gpu", "count"],
            -1,
            "parameters.gpu.count: -1 is less than the minimum of 0",
        ),
        ("config.gpu-profile", ["defaults", "mig_mode"], "on", None),
        ("config.gpu-policy", ["overrides"], [], None),
        ("cmd.admit", ["kind"], "hot", None),
        ("cmd.admit", ["job"], "", None),
        ("cmd.admit-preemptible", ["kind"], "warm", 'kind: "cold" was expected'),
        ("cmd.claim-warm", ["job"], 42, 'job: 42 is not of type "string"'),
        ("cmd.release", ["request_id"], ["r"], None),
        ("host.observation", ["checked_revision"], -1, None),
    ],
)
def test_wrong_types_negative_quantities_and_unknown_v(
    kind: str, path: list[Any], value: Any, error: str | None
) -> None:
    payload = example(kind, 1 if kind == "host.snapshot" else 0)
    node: Any = payload
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    got = bad(subject_for(kind, payload), data(payload), "schema")
    if error is not None:
        assert got == error
    else:
        assert got.startswith(".".join(path) + ":")


def test_a_missing_required_field_is_named() -> None:
    payload = example("host.snapshot")
    del payload["uid"]
    assert bad(subject_for("host.snapshot", payload), data(payload), "schema") == (
        '"uid" is a required property'
    )
    payload = example("host.snapshot")
    del payload["capacity"]["cpu"]
    assert bad(subject_for("host.snapshot", payload), data(payload), "schema") == (
        'capacity: "cpu" is a required property'
    )
    bad("rc.in.cmd.admit", b"{}", "schema")
    bad("rc.in.cmd.admit", data({k: v for k, v in ADMIT.items() if k != "v"}), "schema")


INVALID_INPUTS = [
    (kind, i, item["payload"])
    for kind in KINDS
    for i, item in enumerate(schema_of(kind)["x-invalid-examples"])
    if not item["why"].startswith("an unknown field")
]
#: config whose only fault is a field its schema does not name: refused by name instead
UNKNOWN_FIELDS = [
    (kind, i, item["payload"])
    for kind in KINDS
    for i, item in enumerate(schema_of(kind)["x-invalid-examples"])
    if item["why"].startswith("an unknown field")
]


@pytest.mark.parametrize(("kind", "i", "payload"), INVALID_INPUTS, ids=lambda v: str(v)[:40])
def test_every_invalid_example_is_dead_lettered(kind: str, i: int, payload: Any) -> None:
    valid = example(kind)
    subject = subject_for(kind, valid)
    result = decode(subject, data(payload))
    assert isinstance(result, BadInput), result
    assert result.reason == ("decode" if not isinstance(payload, dict) else "schema")


@pytest.mark.parametrize(("kind", "i", "payload"), UNKNOWN_FIELDS, ids=lambda v: str(v)[:40])
def test_config_with_an_unknown_field_is_refused_by_name(kind: str, i: int, payload: Any) -> None:
    """Not a dead letter: the fold rejects it on ``config.rejected`` with its name, and
    says which field it did not know."""
    assert kind.startswith("config.")
    result = decode(subject_for(kind, payload), data(payload))
    assert isinstance(result, Decoded), result
    refused = result.input
    assert isinstance(refused, ev.RefusedConfig)
    assert refused.kind == kind.removeprefix("config.")
    named = payload.get("tenant", payload.get("pool", payload.get("class", payload.get("name"))))
    assert refused.name == named
    assert "unknown field" in refused.error and "the schema names no such field" in refused.error


def test_an_unknown_field_next_to_another_error_is_dead_lettered() -> None:
    pool = {**example("config.pool"), "wram": {}, "max_instances": -1}
    assert "max_instances" in bad(subject_for("config.pool", pool), data(pool), "schema")


def test_an_unknown_field_in_a_config_whose_subject_disagrees_is_dead_lettered() -> None:
    pool = {**example("config.pool"), "wram": {}}
    error = bad("rc.in.config.pool.other", data(pool), "domain")
    assert "'other'" in error


def test_an_apply_config_item_that_fails_its_schema_is_carried_with_its_error() -> None:
    good, broken = example("config.pool"), {**example("config.pool"), "pool": "b", "wram": {}}
    negative = {**example("config.class"), "parameters": {"gpu": {"count": -1}}}
    change = {
        "v": 1,
        "request_id": "a1",
        "items": [
            {"kind": "pool", "payload": good},
            {"kind": "pool", "payload": broken},
            {"kind": "class", "payload": negative},
        ],
    }
    result = decode("rc.in.cmd.apply-config", data(change))
    assert isinstance(result, Decoded) and isinstance(result.input, ev.ApplyConfig)
    first, second, third = result.input.items
    assert first.error is None and isinstance(first.config, ev.PoolConfig)
    assert second.name == "b" and second.config is None
    assert second.error == "unknown field 'wram': the schema names no such field"
    assert third.config is None and third.error is not None
    assert "parameters.gpu.count" in third.error


HOSTILE = ["../x", "a b", "x" * 64, "12345", "-h1", "h1-", "a.b", "", "a\x00b", "h\u00e9"]


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_names_in_the_payload(name: str) -> None:
    admit = {**ADMIT, "instance": name}
    bad("rc.in.cmd.admit", data(admit), "schema")
    release = {"v": 1, "request_id": "r1", "instance": name}
    bad("rc.in.cmd.release", data(release), "schema")
    snap = {**SNAPSHOT, "host": name}
    bad(SNAPSHOT_SUBJECT, data(snap), "schema")
    obs = {**example("host.observation"), "instance": name}
    bad(subject_for("host.observation", obs), data(obs), "schema")


@pytest.mark.parametrize(
    "token", ["../x", "a b", "x" * 129, "", "*", ">", "a/b", "h\u00e9", "a\tb"]
)
def test_hostile_subject_tokens(token: str) -> None:
    error = bad(f"rc.in.host.{token}.snapshot", data({**SNAPSHOT, "host": token}), "schema")
    assert "subject" in error
    bad(f"rc.in.config.pool.{token}", data({**example("config.pool"), "pool": token}), "schema")
    bad(f"rc.in.cmd.{token}", data(ADMIT), "schema")


def test_a_host_token_that_is_no_incus_name_cannot_match_its_payload() -> None:
    payload = {**SNAPSHOT, "host": "under_score"}
    error = bad("rc.in.host.under_score.snapshot", data(payload), "schema")
    assert error.startswith("host:")


@pytest.mark.parametrize(
    "subject",
    [
        "rc",
        "rc.in",
        "rc.in.",
        "rc.in.cmd",
        "rc.in.cmd.",
        "rc.in.cmd.admit.extra",
        "rc.in.cmd.nope",
        "rc.in.cmd.ADMIT",
        "rc.in.host",
        "rc.in.host.h1",
        "rc.in.host.h1.reboot",
        "rc.in.host.h1.snapshot.extra",
        "rc.in.host..snapshot",
        "rc.in.config.pool",
        "rc.in.config.host.h1",
        "rc.in.config.pool.small.extra",
        "rc.out.decision.r1",
        "RC.in.cmd.admit",
        "xrc.in.cmd.admit",
        "rc.inx.cmd.admit",
        "rc.in.other.admit",
        "rc.in.>",
        "rc.in.cmd.*",
        ".rc.in.cmd.admit",
    ],
)
def test_unroutable_subjects(subject: str) -> None:
    bad(subject, data(ADMIT), "schema")


def test_an_enormous_string_is_clipped_in_the_error() -> None:
    error = bad("rc.in.cmd.admit", data({**ADMIT, "instance": "x" * 500_000}), "schema")
    assert error.startswith("instance:")
    assert len(error) <= MAX_ERROR_CHARS


# ------------------------------------------------------------------- domain


@pytest.mark.parametrize(
    ("kind", "subject"),
    [
        ("host.snapshot", "rc.in.host.h2.snapshot"),
        ("host.inventory", "rc.in.host.h2.inventory"),
        ("host.lifecycle", "rc.in.host.h2.lifecycle"),
        ("host.observation", "rc.in.host.h2.observation"),
        ("config.pool", "rc.in.config.pool.other"),
        ("config.class", "rc.in.config.class.other"),
        ("config.gpu-profile", "rc.in.config.gpu-profile.other"),
        ("config.gpu-policy", "rc.in.config.gpu-policy.other"),
    ],
)
def test_subject_and_payload_disagree(kind: str, subject: str) -> None:
    error = bad(subject, data(example(kind)), "domain")
    assert "subject names" in error


def test_duplicate_gpu_index() -> None:
    payload = copy.deepcopy(SNAPSHOT)
    payload["gpus"][1]["index"] = 0
    assert "repeats GPU index [0]" in bad(SNAPSHOT_SUBJECT, data(payload), "domain")


def test_duplicate_pci_address() -> None:
    payload = copy.deepcopy(SNAPSHOT)
    payload["gpus"][1]["pci_address"] = payload["gpus"][0]["pci_address"]
    assert "repeats PCI address" in bad(SNAPSHOT_SUBJECT, data(payload), "domain")


def test_duplicate_instance_in_an_inventory() -> None:
    payload = example("host.inventory")
    payload["instances"][1] = {
        **payload["instances"][1],
        "name": payload["instances"][0]["name"],
        "project": payload["instances"][0]["project"],
    }
    bad(subject_for("host.inventory", payload), data(payload), "domain")


def test_duplicate_claim_names_in_a_request() -> None:
    payload = example("cmd.admit", 1)
    payload["claims"] = payload["claims"] * 2
    assert "repeats claim name" in bad("rc.in.cmd.admit", data(payload), "domain")


# -------------------------------------------------------------- never raises


@settings(max_examples=300, deadline=None)
@given(
    raw=st.binary(max_size=256),
    subject=st.sampled_from(
        ["rc.in.cmd.admit", "rc.in.host.h1.snapshot", "rc.in.config.pool.p", "nope"]
    ),
)
def test_arbitrary_bytes_never_raise(raw: bytes, subject: str) -> None:
    assert isinstance(decode(subject, raw), BadInput | Decoded)


_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=10,
)


@settings(max_examples=300, deadline=None)
@given(kind=st.sampled_from(KINDS), key=st.text(max_size=12), value=_json, drop=st.booleans())
def test_mutated_examples_never_raise(kind: str, key: str, value: Any, drop: bool) -> None:
    payload = example(kind)
    target = key if key in payload or not payload else sorted(payload)[len(key) % len(payload)]
    if drop:
        payload.pop(target, None)
    else:
        payload[target] = value
    result = decode(subject_for(kind, example(kind)), data(payload))
    assert isinstance(result, BadInput | Decoded)


# -------------------------------------------------------------- schema location


def _package_schemas() -> Path:
    """The package's schemas, a plain directory in a checkout."""
    found = schemas_dir()
    assert isinstance(found, Path), found
    return found


def test_schemas_dir_override(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    copied = tmp_path / "schemas"
    shutil.copytree(_package_schemas(), copied)
    monkeypatch.setenv(SCHEMAS_DIR_ENV, str(copied))
    assert schemas_dir() == copied
    decoder = Decoder()
    assert isinstance(decoder.decode("rc.in.cmd.admit", data(ADMIT)), Decoded)


def test_a_missing_schema_is_a_deployment_error_not_bad_input(tmp_path: Path) -> None:
    copied = tmp_path / "schemas"
    shutil.copytree(_package_schemas(), copied)
    (copied / "in" / "cmd.release.json").unlink()
    with pytest.raises(SchemaLoadError, match=r"in/cmd\.release\.json"):
        Decoder(schemas_dir=copied)


# ------------------------------------------------------------------ dead letters


def test_dead_letter_subject_id_and_payload() -> None:
    raw = b'{"v":1,"host":"h1"'
    result = decode("rc.in.host.h1.snapshot", raw)
    assert isinstance(result, BadInput)
    subject, msg_id, payload = dead_letter(
        "rc.in.host.h1.snapshot", 17, raw, result.reason, result.error
    )
    assert subject == "rc.out.dlq.decode"
    assert msg_id == "dlq:17"
    body = orjson.loads(payload)
    assert body == {
        "v": 1,
        "subject": "rc.in.host.h1.snapshot",
        "stream_seq": 17,
        "error": result.error,
        "payload_b64": base64.b64encode(raw).decode(),
    }
    assert SCHEMAS.validator("out/dlq.json").is_valid(body)


@pytest.mark.parametrize("reason", ["decode", "schema", "too-large", "domain"])
def test_dead_letter_subject_per_reason_and_prefix(reason: Any) -> None:
    subject, msg_id, _ = dead_letter("p.in.cmd.admit", 3, b"{}", reason, "x", prefix="p")
    assert (subject, msg_id) == (f"p.out.dlq.{reason}", "dlq:3")


def test_dead_letter_payload_is_cut_at_64_kib() -> None:
    raw = bytes(range(256)) * 1024  # 256 KiB
    _, _, payload = dead_letter("rc.in.cmd.admit", 9, raw, "too-large", "too large")
    body = orjson.loads(payload)
    kept = base64.b64decode(body["payload_b64"])
    assert kept == raw[:DLQ_PAYLOAD_CUT]
    assert len(kept) == 65_536
    assert SCHEMAS.validator("out/dlq.json").is_valid(body)


def test_dead_letter_keeps_a_payload_of_exactly_64_kib() -> None:
    raw = b"a" * DLQ_PAYLOAD_CUT
    body = orjson.loads(dead_letter("rc.in.cmd.admit", 1, raw, "schema", "e")[2])
    assert base64.b64decode(body["payload_b64"]) == raw


def test_dead_letters_are_deterministic() -> None:
    raw = data({**ADMIT, "instance": "../x"})
    first = decode("rc.in.cmd.admit", raw)
    again = Decoder().decode("rc.in.cmd.admit", raw)
    assert first == again
    assert isinstance(first, BadInput)
    assert dead_letter("s", 1, raw, first.reason, first.error) == dead_letter(
        "s", 1, raw, first.reason, first.error
    )


def test_dead_letter_refuses_an_unknown_reason() -> None:
    with pytest.raises(ValueError, match="reason"):
        dead_letter("rc.in.cmd.admit", 1, b"", "bogus", "x")  # type: ignore[arg-type]
