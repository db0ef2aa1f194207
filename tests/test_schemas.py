"""The JSON Schemas (``reconciler/schemas/``): valid 2020-12, self-consistent, true to the code.

Every schema carries ``examples`` (valid) and ``x-invalid-examples`` (``{payload, why}``);
both are run here. Input schemas are also checked against ``reconciler.core.inputs``: a
payload the schema accepts must build (so every field the builder requires is required by
the schema), and the payloads of ``tests/support/builders.py`` and the outputs the fold publishes
in a small scenario must validate against their schemas.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema_rs
import orjson
import pytest

from reconciler.bus.schemas import BASE_URI, SchemaLoadError, input_schema_path, load, schemas_dir
from reconciler.core.configs import CONFIG_KINDS
from reconciler.core.inputs import CONFIG_NAME_FIELDS, KINDS, DomainError, PoolConfig, from_payload
from reconciler.core.messages import CONFIG_KINDS as SUBJECT_KINDS
from reconciler.core.state import Effects
from tests.support import builders as b
from tests.support.repo import ROOT as REPO

ROOT = schemas_dir()
SCHEMAS = load()
ALL = sorted(SCHEMAS.documents)
MESSAGES = [p for p in ALL if p != "defs.json"]
INPUTS = [p for p in ALL if p.startswith("in/")]
DRAFT_2020_12 = "https://json-schema.org/draft/2020-12/schema"


def doc(relpath: str) -> dict[str, Any]:
    return SCHEMAS.documents[relpath]


def validator(relpath: str) -> jsonschema_rs.Validator:
    return _VALIDATORS[relpath]


_VALIDATORS = {relpath: SCHEMAS.validator(relpath) for relpath in ALL}


def _cases(kind: str) -> list[tuple[str, int, Any]]:
    out: list[tuple[str, int, Any]] = []
    for relpath in MESSAGES:
        document = doc(relpath)
        items = (
            document.get("examples", [])
            if kind == "valid"
            else [e["payload"] for e in document.get("x-invalid-examples", [])]
        )
        out.extend((relpath, i, item) for i, item in enumerate(items))
    return out


def _id(case: tuple[str, int, Any]) -> str:
    return f"{case[0]}#{case[1]}"


# ------------------------------------------------------------------- the files


def test_the_schema_directory_is_the_packages() -> None:
    assert REPO / "reconciler" / "schemas" == ROOT


def test_every_message_of_the_contract_has_a_schema() -> None:
    outputs = [
        "decision",
        "exec.delete",
        "exec.create",
        "status.host",
        "status.pool",
        "config.rejected",
        "dlq",
    ]
    queries = [
        "resolve",
        "lease",
        "assignments",
        "effective-runtime",
        "unsuitable-hosts",
        "health",
        "pool",
        "config",
        "config-check",
        "queue",
        "fleet",
        "decisions",
    ]
    expected = {
        "defs.json",
        "query/reply.json",
        *(input_schema_path(kind) for kind in KINDS),
        *(f"out/{name}.json" for name in outputs),
        *(f"query/{name}.{part}.json" for name in queries for part in ("request", "result")),
    }
    assert set(ALL) == expected


@pytest.mark.parametrize("relpath", ALL)
def test_each_schema_is_valid_draft_2020_12(relpath: str) -> None:
    document = doc(relpath)
    assert document["$schema"] == DRAFT_2020_12
    assert document["$id"] == BASE_URI + relpath
    jsonschema_rs.meta.validate(document)
    assert document.get("title") and document.get("description")


#: config is refused by name for a field its schema does not name (docs/interface.md)
STRICT = {input_schema_path(kind) for kind in KINDS if kind.startswith("config.")}


@pytest.mark.parametrize("relpath", MESSAGES)
def test_each_message_schema_allows_unknown_fields_and_has_examples(relpath: str) -> None:
    """Every message may carry fields its schema does not name (extensions), except
    config, where such a field is refused: a typo is never silently ignored."""
    document = doc(relpath)
    if document["type"] == "object":
        assert document["additionalProperties"] is (relpath not in STRICT)
    invalid = document["x-invalid-examples"]
    assert all(set(item) == {"payload", "why"} and item["why"] for item in invalid)
    assert len(document["examples"]) >= 2
    assert len(invalid) >= (3 if relpath.startswith("in/") else 2)


def test_every_input_kind_has_exactly_one_schema() -> None:
    assert sorted(input_schema_path(kind) for kind in KINDS) == INPUTS
    for kind in KINDS:
        document = doc(input_schema_path(kind))
        assert document["x-kind"] == kind
        assert document["required"][0] == "v"
        assert document["properties"]["v"] == {"$ref": "../defs.json#/$defs/v"}


def _walk(node: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(node, dict):
        for key, value in node.items():
            yield key, value
            if key not in ("examples", "x-invalid-examples"):
                yield from _walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from _walk(value)


@pytest.mark.parametrize("relpath", ALL)
def test_patterns_are_portable(relpath: str) -> None:
    """No look-around or other non-RE2 syntax, so Go and Rust validators take them too."""
    for key, value in _walk(doc(relpath)):
        if key == "pattern":
            assert not re.search(r"\(\?[=!<]|\\[0-9]|\(\?P?<", value), value
            re.compile(value)


@pytest.mark.parametrize("relpath", ALL)
def test_every_reference_resolves(relpath: str) -> None:
    refs = [value for key, value in _walk(doc(relpath)) if key == "$ref"]
    for target in refs:
        base, _, pointer = target.partition("#")
        holder = doc(relpath) if not base else doc("defs.json")
        assert base in ("", "../defs.json"), target
        node: Any = holder
        for part in pointer.strip("/").split("/"):
            node = node[part]
        assert isinstance(node, dict)


def test_a_missing_schema_directory_is_a_load_error(tmp_path: Path) -> None:
    with pytest.raises(SchemaLoadError, match="does not exist"):
        load(tmp_path / "nothing-here")


def test_a_schema_with_a_wrong_id_is_a_load_error(tmp_path: Path) -> None:
    (tmp_path / "defs.json").write_text('{"$id": "https://example.com/defs.json"}')
    with pytest.raises(SchemaLoadError, match=r"\$id"):
        load(tmp_path)


# ---------------------------------------------------------------- the examples


@pytest.mark.parametrize("case", _cases("valid"), ids=_id)
def test_valid_examples_pass(case: tuple[str, int, Any]) -> None:
    relpath, _, payload = case
    errors = [e.message for e in validator(relpath).iter_errors(payload)]
    assert errors == []


@pytest.mark.parametrize("case", _cases("invalid"), ids=_id)
def test_invalid_examples_fail(case: tuple[str, int, Any]) -> None:
    relpath, _, payload = case
    assert not validator(relpath).is_valid(payload)


def test_invalid_examples_cover_the_contracts_kinds_of_bad_input() -> None:
    hostile = {"../x", "a b", "a" * 64, "12345", "-h1"}
    seen: set[str] = set()
    for relpath in INPUTS:
        for item in doc(relpath)["x-invalid-examples"]:
            seen.update(_strings(item["payload"]) & hostile)
    assert seen == hostile
    whys = " ".join(
        item["why"] for relpath in INPUTS for item in doc(relpath)["x-invalid-examples"]
    )
    for phrase in ("unknown v", "is required", "negative", "is a string", "is an integer"):
        assert phrase in whys


def _strings(node: Any) -> set[str]:
    if isinstance(node, str):
        return {node}
    if isinstance(node, dict):
        return set().union(*(_strings(v) for v in node.values())) if node else set()
    if isinstance(node, list):
        return set().union(*(_strings(v) for v in node)) if node else set()
    return set()


# --------------------------------------------------------------- shared rules


def _def(name: str) -> jsonschema_rs.Validator:
    return jsonschema_rs.validator_for(
        {"$schema": DRAFT_2020_12, "$ref": f"{BASE_URI}defs.json#/$defs/{name}"},
        registry=SCHEMAS.registry,
        offline=True,
    )


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("a", True),
        ("h1", True),
        ("rc-small-1", True),
        ("1a", True),
        ("a1", True),
        ("A-9", True),
        ("x" * 63, True),
        ("0-0", True),
        ("", False),
        ("x" * 64, False),
        ("123", False),
        ("0", False),
        ("-a", False),
        ("a-", False),
        ("-", False),
        ("a b", False),
        ("../x", False),
        ("a.b", False),
        ("a_b", False),
        ("a\n", False),
        ("é", False),
        ("a/b", False),
    ],
)
def test_incus_names(name: str, ok: bool) -> None:
    assert _def("instance-name").is_valid(name) is ok
    assert _def("host-name").is_valid(name) is ok


@pytest.mark.parametrize(
    ("token", "ok"),
    [
        ("a", True),
        ("a_b-C9", True),
        ("1", True),
        ("x" * 128, True),
        ("", False),
        ("x" * 129, False),
        ("a.b", False),
        ("a b", False),
        ("*", False),
        (">", False),
        ("../x", False),
        ("a\n", False),
    ],
)
def test_subject_tokens(token: str, ok: bool) -> None:
    assert _def("token").is_valid(token) is ok
    assert _def("request-id").is_valid(token) is ok


@pytest.mark.parametrize(
    ("job", "ok"),
    [
        ("j", True),
        ("octo/repo run 42 / job build", True),
        ("~" * 128, True),
        (" ", True),
        ("", False),
        ("x" * 129, False),
        ("a\tb", False),
        ("a\nb", False),
        ("\x7f", False),
        ("café", False),
        (7, False),
    ],
)
def test_job_identities(job: Any, ok: bool) -> None:
    assert _def("job").is_valid(job) is ok


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        (0, True),
        (1, True),
        (2**53 - 1, True),
        (-1, False),
        (2**53, False),
        (1.5, False),
        ("1", False),
        (True, False),
        (None, False),
    ],
)
def test_quantities(value: Any, ok: bool) -> None:
    assert _def("quantity").is_valid(value) is ok


# ------------------------------------------------- schemas agree with the code


def _drops(node: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every path to a key of a dict inside ``node``."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield (*path, key)
            yield from _drops(value, (*path, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _drops(value, (*path, i))


def _without(payload: dict[str, Any], path: tuple[Any, ...]) -> dict[str, Any]:
    out = copy.deepcopy(payload)
    node: Any = out
    for part in path[:-1]:
        node = node[part]
    del node[path[-1]]
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_what_a_schema_accepts_builds(kind: str) -> None:
    """Drop any one field of a valid example: if the schema still accepts it, it builds.

    So every field ``from_payload`` reads as required is required by the schema.
    """
    check = validator(input_schema_path(kind))
    for example in doc(input_schema_path(kind))["examples"]:
        from_payload(kind, example)
        for path in _drops(example):
            smaller = _without(example, path)
            if check.is_valid(smaller):
                try:
                    from_payload(kind, smaller)
                except DomainError as exc:  # pragma: no cover - the failure message
                    pytest.fail(f"{kind} without {path} passes its schema but: {exc}")


def test_optional_pool_fields_get_the_builders_defaults() -> None:
    pool = doc("in/config.pool.json")
    assert pool["required"] == ["v", "pool", "flavor", "max_instances"]
    built = from_payload(
        "config.pool",
        {
            "v": 1,
            "pool": "p",
            "max_instances": 1,
            "flavor": {"cpu": 1, "memory_mib": 1, "disk_gib": 1},
        },
    )
    props = pool["properties"]
    assert isinstance(built, PoolConfig)
    assert built.placement == props["placement"]["default"]
    assert built.project == props["project"]["default"]
    assert built.image == props["image"]["default"]
    assert built.priority == props["priority"]["default"]


class _Checked(b.Fleet):
    """A fleet whose every input and output is validated against its schema."""

    def __init__(self) -> None:
        super().__init__()
        self.published: list[str] = []

    def send(self, *items: tuple[str, dict[str, Any]]) -> Effects:
        for kind, payload in items:
            errors = [e.message for e in validator(input_schema_path(kind)).iter_errors(payload)]
            assert errors == [], (kind, payload)
        fx = super().send(*items)
        for out in fx.outputs:
            relpath = _output_schema(out.subject)
            payload = orjson.loads(out.payload)
            errors = [e.message for e in validator(relpath).iter_errors(payload)]
            assert errors == [], (out.subject, payload)
            self.published.append(relpath)
        return fx


def _output_schema(subject: str) -> str:
    parts = subject.split(".")
    if parts[1] == "decision":
        return "out/decision.json"
    if parts[1] == "exec":
        return f"out/exec.{parts[3]}.json"
    if parts[1:3] == ["config", "rejected"]:
        return "out/config.rejected.json"
    raise AssertionError(subject)


def test_builders_inputs_and_fold_outputs_match_the_schemas() -> None:
    fleet = _Checked()
    tag = {"user.rc.lease-id": "L900", "user.rc.pool": "warm", "user.rc.kind": "warm"}
    fleet.send(
        b.gpu_profile("a100", power_limit_w=300),
        b.gpu_policy("p", overrides={"mig_mode": "enabled"}, models=["A100"], indexes=[0]),
        b.gpu_policy("bad", overrides={"mig_mode": "sometimes"}),
        b.gpu_class("a100", model="A100"),
        b.gpu_class("zero", count=0),
        b.pool("cold", cpu=4, memory_mib=8192, disk_gib=40),
        b.pool("warm", cpu=4, memory_mib=8192, disk_gib=40, min_ready=1, max_ready=2, priority=-1),
        b.pool("broken", min_ready=3, max_ready=1),
        b.pool("gpu", claims=[{"name": "g", "class": "a100", "parameters": {"gpu": {"count": 1}}}]),
        b.snapshot(
            "h1",
            cpu=16,
            memory_mib=32768,
            disk_gib=160,
            gpus=[b.gpu(0), b.gpu(1)],
            labels={"zone": "a"},
            gpu_profile="a100",
        ),
        b.inventory(
            "h1",
            [
                b.instance("foreign-1", cpu=0, memory_mib=0, disk_gib=0),
                b.instance("adopted-1", cpu=0, memory_mib=0, disk_gib=0, config=tag),
            ],
        ),
        b.admit("w1", "warm", "w-1", kind="warm"),
        b.lifecycle("h1", "instance-created", "w-1"),
        b.lifecycle("h1", "instance-ready", "w-1"),
        b.cmd("claim-warm", "cw1", pool="warm", job="job-1"),
        b.cmd("mark-warm-injected", "mwi1", job="job-1", instance="adopted-1"),
        b.admit("w2", "warm", "w-2", kind="warm"),
        b.lifecycle("h1", "instance-agent-started", "w-2"),
        b.admit("c1", "cold", "c-1", job="job-2"),
        b.cmd("mark-created", "mc1", instance="c-1"),
        b.cmd("mark-created", "mc2", instance="nobody"),
        b.admit("g1", "gpu", "g-1"),
        b.cmd("render-runtime", "rr1", instance="g-1"),
        b.admit("nope", "missing", "n-1"),
        b.admit("big", "cold", "big-1", preemptible=True),
        b.lifecycle("h1", "instance-deleted", "w-2"),
        b.snapshot(
            "h1",
            revision=2,
            cpu=16,
            memory_mib=32768,
            disk_gib=160,
            gpus=[b.gpu(0), b.gpu(1)],
            labels={"zone": "a"},
            gpu_profile="a100",
        ),
        b.cmd("authorize-warm-drain", "d1", instance="w-1"),
        b.cmd("mark-deleting", "md1", instance="c-1"),
        b.cmd("release", "r1", instance="c-1"),
        b.observation("h1", "adopted-1", present=False),
        b.inventory("h1", [], revision=2),
    )
    assert set(fleet.published) == {
        "out/decision.json",
        "out/config.rejected.json",
        "out/exec.create.json",
        "out/exec.delete.json",
    }


def test_unknown_fields_are_found_at_every_depth_with_the_closest_name() -> None:
    """How the command line refuses a typo (``SchemaSet.unknown_fields``), even in a
    command whose schema lets extension fields through on the bus."""
    pool = copy.deepcopy(doc("in/config.pool.json")["examples"][0])
    pool["wram"] = pool.pop("warm")
    pool["flavor"]["cpus"] = 2
    pool["claims"] = [
        {"name": "g", "class": "a", "parameters": {"gpu": {"count": 1, "modle": "x"}}}
    ]
    pool["host_selector"] = {"any-label": "is content, not a field"}
    found = [str(u) for u in SCHEMAS.unknown_fields("in/config.pool.json", pool)]
    assert sorted(found) == [
        "claims/0/parameters/gpu: unknown field 'modle' (did you mean 'model'?)",
        "flavor: unknown field 'cpus' (did you mean 'cpu'?)",
        "unknown field 'wram' (did you mean 'warm'?)",
    ]
    admit = {**doc("in/cmd.admit.json")["examples"][0], "cpu": "4"}
    assert [str(u) for u in SCHEMAS.unknown_fields("in/cmd.admit.json", admit)] == [
        "unknown field 'cpu'"
    ]
    assert validator("in/cmd.admit.json").is_valid(admit)  # the bus would let it through
    _, snapshot = b.snapshot("h1", labels={"zone": "a"}, gpus=[b.gpu(0)])
    assert SCHEMAS.unknown_fields("in/host.snapshot.json", snapshot) == []


def test_every_config_kind_is_the_same_in_every_table() -> None:
    """A new kind of config (tenants) is added in one table each: the config kinds of
    the core (reconciler.core.configs), the subjects' kinds, the typed inputs' name
    fields, and the schemas' enums."""
    kinds = list(CONFIG_KINDS)
    assert list(SUBJECT_KINDS) == kinds == list(CONFIG_NAME_FIELDS)
    assert SCHEMAS.documents["defs.json"]["$defs"]["config-kind"]["enum"] == kinds
    assert doc("out/config.rejected.json")["properties"]["kind"]["enum"] == kinds
    for kind, spec in CONFIG_KINDS.items():
        document = doc(f"in/config.{kind}.json")
        assert spec.name_field in document["required"]
