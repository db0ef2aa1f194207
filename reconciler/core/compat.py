"""Outputs across versions: the registry of additive changes, and how an output an older
release published is judged against what this version's fold writes.

Rules (docs/operations.md, "Upgrade", states the compatibility rule):

- Within a major version the fold's outputs change only by *additions*: a new field in an
  output, written by every output of its kind from the release that added it on. Each
  addition is registered in :data:`ADDITIONS`, oldest release first, with the release
  that made it, the outputs it is in (:attr:`Addition.output`, a subject without prefix
  whose ``*`` tokens match any one token), where (:attr:`Addition.path`, ``"[]"`` for
  every element of a list), and, when older releases already wrote it with some values,
  the only value they left implicit (:attr:`Addition.when`).
- An output on the bus is first compared byte for byte with the replay's. When the bytes
  differ, it is compared, for each release a registered addition came with (newest
  first), with the bytes *that* release would have written: the replay's payload without
  the additions of later releases (a field is taken out only where present, and only
  with its :attr:`Addition.when` value when one is given), keys sorted at every level as
  every release writes them. The first release that reproduces the output's bytes
  exactly is the one that wrote it (:func:`judge` returns the additions it lacked);
  when none does, the output diverges.
- So nothing else passes: a field of the output whose value differs, a field it lacks
  that no later release added, a field it has that the replay does not, another order
  of keys, another subject or message id, and an output one side has and the other does
  not, are all divergences. Additions are taken out together, newest first: an output
  that lacks an older addition but carries a newer one was written by no release.
- Pure: no I/O; the registry is data.

**Registering an addition** (docs/development.md): append an :class:`Addition` to
:data:`ADDITIONS` in the same change that makes the fold write the field, with ``since``
the release it will ship in, and say so in CHANGELOG.md. ``tests/system/test_upgrade_replay.py``
replays a stream the previous release recorded: an unregistered addition to any output
it holds fails there as a mismatch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import orjson

from reconciler.core.messages import UNPREFIXED

__all__ = ["ADDITIONS", "ANY_VALUE", "Addition", "judge", "release_key"]

#: :attr:`Addition.when` for an addition older releases never wrote at all
ANY_VALUE: Final = object()


@dataclass(frozen=True, slots=True, kw_only=True)
class Addition:
    """A field one release added to an output of the fold."""

    #: the release that first wrote it ("0.2.0")
    since: str
    #: the outputs that carry it: a subject without prefix, ``*`` for any one token
    output: str
    #: where it is in the payload; ``"[]"`` steps into every element of a list
    path: tuple[str, ...]
    #: the one value older releases left implicit (they wrote the others), if any
    when: object = ANY_VALUE
    #: one line: what it says
    why: str = ""

    @property
    def name(self) -> str:
        """``out.exec.*.create instance_type``: how reports name it."""
        return f"{self.output} {'.'.join(self.path)}"

    def applies_to(self, subject: str) -> bool:
        tokens, pattern = subject.split("."), self.output.split(".")
        return len(tokens) == len(pattern) and all(
            p in ("*", t) for p, t in zip(pattern, tokens, strict=True)
        )


#: every addition since the first release, oldest release first (see the module's rules)
ADDITIONS: tuple[Addition, ...] = (
    Addition(
        since="0.1.0",
        output=UNPREFIXED.exec_command("*", "create"),
        path=("instance_type",),
        when="virtual-machine",
        why="the pool's instance type; before, written only for a pool that named one",
    ),
    Addition(
        since="0.2.0",
        output=UNPREFIXED.decision("*"),
        path=("lease", "fault"),
        why="what could not be done to the lease's VM (a create refused, a delete failed)",
    ),
    Addition(
        since="0.2.0",
        output=UNPREFIXED.decision("*"),
        path=("items",),
        why="what became of each item of an apply-config change, or why it was refused",
    ),
    Addition(
        since="0.2.0",
        output=UNPREFIXED.decision("*"),
        path=("position",),
        why="a queued request's 1-based place in its pool's queue (outcome queued)",
    ),
)


def release_key(release: str) -> tuple[int, ...]:
    """``"0.10.1"`` → ``(0, 10, 1)``, to order releases."""
    return tuple(int(part) for part in release.split("."))


def judge(
    subject: str,
    produced: bytes,
    recorded: bytes,
    *,
    additions: Sequence[Addition] = ADDITIONS,
) -> tuple[Addition, ...] | None:
    """Whether ``recorded`` (an output on the bus, on ``subject`` without prefix) is what
    an older release wrote where this version writes ``produced``: the additions it lacks
    (empty when the bytes are equal), or ``None`` for a divergence."""
    if recorded == produced:
        return ()
    relevant = [a for a in additions if a.applies_to(subject)]
    if not relevant:
        return None
    try:
        payload = orjson.loads(produced)
    except orjson.JSONDecodeError:
        return None
    releases = sorted({a.since for a in relevant}, key=release_key, reverse=True)
    lacked: list[Addition] = []
    for release in releases:  # newest first: each older release lacks one more set
        newer = [a for a in relevant if a.since == release]
        payload, removed = _without(payload, newer)
        lacked.extend(removed)
        if removed and orjson.dumps(payload, option=orjson.OPT_SORT_KEYS) == recorded:
            return tuple(lacked)
    return None


def _without(payload: Any, additions: Sequence[Addition]) -> tuple[Any, list[Addition]]:
    """``payload`` with ``additions`` taken out (a copy), and those that were in it."""
    removed: list[Addition] = []
    for addition in additions:
        payload, found = _strip(payload, addition.path, addition.when)
        if found:
            removed.append(addition)
    return payload, removed


def _strip(node: Any, path: Sequence[str], when: object) -> tuple[Any, bool]:
    if not path:
        return node, False
    head, rest = path[0], path[1:]
    if head == "[]":
        if not isinstance(node, list):
            return node, False
        stripped = [_strip(item, rest, when) for item in node]
        return [item for item, _ in stripped], any(found for _, found in stripped)
    if not isinstance(node, Mapping) or head not in node:
        return node, False
    if rest:
        inner, found = _strip(node[head], rest, when)
        return ({**node, head: inner} if found else node), found
    value = node[head]
    if when is not ANY_VALUE and (type(value) is not type(when) or value != when):
        return node, False  # older releases wrote this value themselves
    return {key: value for key, value in node.items() if key != head}, True
