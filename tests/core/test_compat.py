"""What a later release may add to an output (reconciler.core.compat): the registry of
additions, each optional in its output's schema, and the judge that takes out what an
older release could not have written."""

from __future__ import annotations

import json
from typing import Any

import orjson

from reconciler.core.compat import ADDITIONS, Addition, judge
from tests.support.repo import ROOT

SCHEMAS = ROOT / "reconciler" / "schemas" / "out"

INSTANCE_TYPE = "out.exec.*.create instance_type"


def test_the_additions_are_registered_oldest_release_first() -> None:
    releases = [tuple(int(p) for p in a.since.split(".")) for a in ADDITIONS]
    assert releases == sorted(releases)
    assert len({a.name for a in ADDITIONS}) == len(ADDITIONS)
    assert all(a.why for a in ADDITIONS)


def test_every_addition_is_optional_in_its_output_s_schema() -> None:
    """Consumers read an added field when it is there and the older meaning when not."""
    for addition in ADDITIONS:
        kind = ".".join(t for t in addition.output.split(".") if t not in ("out", "*"))
        schema = json.loads((SCHEMAS / f"{kind}.json").read_text())
        node = schema
        for step in addition.path[:-1]:
            node = _resolved(schema, node["items"] if step == "[]" else node["properties"][step])
        leaf = addition.path[-1]
        assert leaf in node["properties"], addition
        assert leaf not in node.get("required", []), addition


def _resolved(schema: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    """``node`` with its ``$ref`` followed, within ``schema`` or into ``defs.json``."""
    while "$ref" in node:
        document, _, pointer = node["$ref"].partition("#/")
        target: Any = schema
        if document:
            target = schema = json.loads((SCHEMAS / document).read_text())
        for part in pointer.split("/"):
            target = target[part]
        node = target
    return node


CREATE = b'{"command_id":"create:L1","instance_type":"virtual-machine","v":1}'


LATER = (
    Addition(since="9.1.0", output="out.decision.*", path=("lease", "zone")),
    Addition(since="9.2.0", output="out.decision.*", path=("victims", "[]", "tenant")),
    Addition(since="9.2.0", output="out.decision.*", path=("queued",), when=False),
)


DECISION = {
    "lease": {"host": "h1", "zone": "a"},
    "queued": False,
    "victims": [{"instance": "w1", "tenant": "t1"}, {"instance": "w2"}],
}


def _bytes(body: dict[str, Any]) -> bytes:
    return orjson.dumps(body, option=orjson.OPT_SORT_KEYS)


def test_judge_takes_out_later_additions_newest_release_first() -> None:
    subject = "out.decision.r1"
    produced = _bytes(DECISION)
    assert judge(subject, produced, produced, additions=LATER) == ()
    # as 9.1 wrote it: no tenant, no queued
    v91 = {
        "lease": {"host": "h1", "zone": "a"},
        "victims": [{"instance": "w1"}, {"instance": "w2"}],
    }
    assert judge(subject, produced, _bytes(v91), additions=LATER) == LATER[1:]
    # as 9.0 wrote it: no zone either
    v90 = {**v91, "lease": {"host": "h1"}}
    assert judge(subject, produced, _bytes(v90), additions=LATER) == (*LATER[1:], LATER[0])
    # a 9.2 addition without the 9.1 one was written by no release
    no_zone = {**DECISION, "lease": {"host": "h1"}}
    assert judge(subject, produced, _bytes(no_zone), additions=LATER) is None
    # a value changed, a key order changed, another subject: divergences
    assert (
        judge(
            subject,
            produced,
            _bytes({**v91, "lease": {"host": "h2", "zone": "a"}}),
            additions=LATER,
        )
        is None
    )
    assert judge(subject, produced, json.dumps(v91).encode(), additions=LATER) is None
    assert judge("out.exec.h1.create", produced, _bytes(v91), additions=LATER) is None


def test_judge_takes_out_a_when_field_only_with_its_implicit_value() -> None:
    subject = "out.exec.h1.create"
    creates = tuple(a for a in ADDITIONS if a.applies_to(subject))
    assert [a.name for a in creates] == [INSTANCE_TYPE]
    assert judge(subject, CREATE, b'{"command_id":"create:L1","v":1}') == creates
    container = CREATE.replace(b"virtual-machine", b"container")
    # older releases wrote "container" themselves: its absence is a divergence
    assert judge(subject, container, b'{"command_id":"create:L1","v":1}') is None
    # a queued: false is implicit before 9.2, a queued: true never is; 0 is not false
    produced = _bytes({"queued": True, "v": 1})
    assert judge("out.decision.r", produced, b'{"v":1}', additions=LATER) is None
    produced = _bytes({"queued": 0, "v": 1})
    assert judge("out.decision.r", produced, b'{"v":1}', additions=LATER) is None
