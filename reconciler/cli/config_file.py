"""Config files as ``apply`` and ``diff`` read them, and config as ``get`` prints it.

A file (YAML or JSON; ``-`` is stdin) holds a list of items, or one item. An item is the
payload of ``<prefix>.in.config.<kind>.<name>``; its kind is its ``kind`` field
(``pool``, ``class``, ``gpu-profile``, ``gpu-policy``; taken out of the payload) or,
without one, the field that names it: ``pool`` or ``class``, else ``defaults`` for a GPU
profile and ``overrides`` for a GPU policy. ``v`` defaults to 1.

Rules:

- Every item is checked before anything is sent, and every problem is reported, each
  naming its item: a field its schema does not name (with the name it is closest to),
  its schema, the checks the fold makes after the schema, an item given twice. One
  problem and nothing is sent.
- The whole file travels as one ``apply-config`` command (:class:`ConfigChange`), so
  its size is checked too, against what one message may carry (the NATS server's
  ``max_payload``, and never more than the contract's 1 MiB): an item over it is named,
  and a file over it as a whole is refused with the advice to split it.
- What ``get`` prints is a list of such items, ``kind`` first: ``apply`` accepts it back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson
import yaml

from reconciler.bus.sending import encoded_size
from reconciler.cli.oneshot import input_problems
from reconciler.core.configs import CONFIG_KINDS
from reconciler.core.messages import MAX_PAYLOAD_BYTES, MSG_ID, Origin, command_msg_id

__all__ = [
    "ConfigChange",
    "ConfigItem",
    "items_as_yaml",
    "problems_message",
    "read_items",
]

KINDS = tuple(CONFIG_KINDS)


def problems_message(source: str, problems: list[str], *, nothing: str) -> str:
    """The error for a file with ``problems`` (each naming its place in the file): one
    line for one problem, else a count and one line each; ``nothing``: what was not done
    (``published``, ``compared``)."""
    if len(problems) == 1:
        (problem,) = problems
        named = problem if problem.startswith(f"{source}:") else f"{source}: {problem}"
        return f"{named}; nothing {nothing}"
    return f"{source}: {len(problems)} problems, nothing {nothing}:\n  " + "\n  ".join(problems)


@dataclass(frozen=True, slots=True)
class ConfigItem:
    """One valid item of a file: its kind, name, payload and place in the file."""

    kind: str
    name: str
    payload: dict[str, Any]
    index: int

    @property
    def label(self) -> str:
        return f"item {self.index} ({self.kind} {self.name!r})"

    def as_change_item(self) -> dict[str, Any]:
        """The item as an ``apply-config`` command carries it."""
        return {"kind": self.kind, "payload": self.payload}


def _kind_of(item: dict[str, Any]) -> str | None:
    kind = item.get("kind")
    if kind is not None:
        return kind if kind in KINDS else None
    for field, guessed in (("tenant", "tenant"), ("pool", "pool"), ("class", "class")):
        if field in item:
            return guessed
    if "defaults" in item:
        return "gpu-profile"
    if "overrides" in item:
        return "gpu-policy"
    return None


def read_items(text: str | bytes, *, source: str) -> tuple[list[ConfigItem], list[str]]:
    """The items of a file's content, and every problem found (items are only valid when
    there is no problem at all)."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            return [], [f"{source}: not UTF-8 text (byte {exc.start} is {text[exc.start]:#04x})"]
    try:
        document = yaml.safe_load(text)  # JSON is YAML too
    except yaml.YAMLError as exc:
        return [], [f"{source}: neither YAML nor JSON: {exc}"]
    if isinstance(document, dict):
        document = [document]
    if not isinstance(document, list) or not document:
        return [], [f"{source}: expected a list of pools, classes, GPU profiles and policies"]
    items: list[ConfigItem] = []
    problems: list[str] = []
    seen: dict[tuple[str, str], int] = {}
    for index, raw in enumerate(document, start=1):
        where = f"item {index}"
        if not isinstance(raw, dict):
            problems.append(f"{where}: not a mapping")
            continue
        kind = _kind_of(raw)
        if kind is None:
            problems.append(
                f"{where}: unknown kind; give kind: {' | '.join(KINDS)} "
                "(or a pool/class field, GPU profile defaults, GPU policy overrides)"
            )
            continue
        payload = {k: v for k, v in raw.items() if k != "kind"}
        payload.setdefault("v", 1)
        name = payload.get(CONFIG_KINDS[kind].name_field)
        where = f"item {index} ({kind} {name!r})"
        size = len(orjson.dumps({"kind": kind, "payload": payload}))
        if size > MAX_PAYLOAD_BYTES:  # no message can carry it, whatever else it says
            problems.append(f"{where}: {size} bytes, over {_carried(MAX_PAYLOAD_BYTES)}")
            continue
        found = input_problems(
            f"config.{kind}", payload, subject_token=name if isinstance(name, str) else None
        )
        problems.extend(f"{where}: {p}" for p in found)
        if found or not isinstance(name, str):
            continue
        if (kind, name) in seen:
            problems.append(f"{where}: the same {kind} as item {seen[(kind, name)]}")
            continue
        seen[(kind, name)] = index
        items.append(ConfigItem(kind, name, payload, index))
    return items, problems


@dataclass(frozen=True, slots=True)
class ConfigChange:
    """Config items to put and to delete, as one ``apply-config`` command's body."""

    items: tuple[ConfigItem, ...] = ()
    #: ``(kind, name)`` to delete
    deletions: tuple[tuple[str, str], ...] = ()

    def body(self) -> dict[str, Any]:
        """The command's fields besides ``v`` and ``request_id`` (and the
        ``config-check`` query's request)."""
        out: dict[str, Any] = {}
        if self.items:
            out["items"] = [item.as_change_item() for item in self.items]
        if self.deletions:
            out["delete"] = [{"kind": kind, "name": name} for kind, name in self.deletions]
        return out

    def describe(self) -> str:
        """``2 item(s)``, ``1 deletion(s)``: what the change holds."""
        parts = [f"{len(self.items)} item(s)"] if self.items else []
        if self.deletions:
            parts.append(f"{len(self.deletions)} deletion(s)")
        return ", ".join(parts) or "nothing"

    def command(self, request_id: str) -> dict[str, Any]:
        return {"v": 1, "request_id": request_id, **self.body()}

    def size_problems(self, *, max_payload: int, request_id: str) -> list[str]:
        """Why the change cannot travel as one message (empty when it can): an item too
        large on its own, or the whole."""
        limit = min(max_payload or MAX_PAYLOAD_BYTES, MAX_PAYLOAD_BYTES)
        what = _carried(limit)
        problems = [
            f"{item.label}: {size} bytes, over {what}"
            for item in self.items
            if (size := len(orjson.dumps(item.as_change_item()))) > limit
        ]
        if problems:
            return problems
        headers = {MSG_ID: command_msg_id(Origin.CLI, request_id)}
        size = encoded_size(orjson.dumps(self.command(request_id)), headers)
        if size > limit:
            return [
                f"the {len(self.items)} items make one input of {size} bytes, over {what}: "
                "split the file and apply the parts one after the other"
            ]
        return []


def _carried(limit: int) -> str:
    return (
        f"the {limit} bytes one message may carry (the NATS server's max_payload, "
        f"at most {MAX_PAYLOAD_BYTES})"
    )


def items_as_yaml(items: list[dict[str, Any]]) -> str:
    """``[{kind, payload}]`` (the ``config`` query's) as the YAML ``apply`` reads: each
    item its payload with ``kind`` first and without ``v``."""
    shown = [
        {"kind": item["kind"], **{k: v for k, v in item["payload"].items() if k != "v"}}
        for item in items
    ]
    text: str = yaml.safe_dump(shown, sort_keys=False, default_flow_style=None, width=100)
    return text
