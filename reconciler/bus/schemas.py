"""The contract's JSON Schemas (``reconciler/schemas/``, package data), loaded and compiled.

Rules:

- The schemas are the package's own data, read through :mod:`importlib.resources`
  (``reconciler/schemas/``: in a checkout, an editable install, a wheel installed into
  any prefix or with ``--user``); ``$RC_SCHEMAS_DIR`` names another directory instead
  (a schema under development, a test).
- Every ``*.json`` file below it is one schema (draft 2020-12) with an ``$id`` under
  :data:`BASE_URI`; schemas refer to each other (``../defs.json#/$defs/…``) through one
  offline registry, so nothing is ever fetched over the network.
- The schema of input kind ``k`` (``"host.snapshot"``, ``"cmd.admit"``…, see
  ``reconciler.core.inputs.KINDS``) is ``in/<k>.json``.
- A missing or broken schema is a deployment error: :class:`SchemaLoadError`, raised when the
  schemas are loaded — never mistaken for bad input.
- :meth:`SchemaSet.unknown_fields` finds the fields of a payload its schema does not name,
  at every depth where the schema names an object's fields, each with the closest name
  the schema knows: how the command line refuses a typo before publishing, where the
  bus would ignore it (commands may carry extension fields).
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

import jsonschema_rs
import orjson

__all__ = [
    "BASE_URI",
    "SCHEMAS_DIR_ENV",
    "SchemaLoadError",
    "SchemaSet",
    "UnknownField",
    "input_schema_path",
    "load",
    "schemas_dir",
]

SCHEMAS_DIR_ENV = "RC_SCHEMAS_DIR"
BASE_URI = "https://reconciler.invalid/schemas/"


class SchemaLoadError(RuntimeError):
    """The schema directory is missing, or a schema in it cannot be read or compiled."""


def schemas_dir() -> Traversable:
    """Where the schemas are: ``$RC_SCHEMAS_DIR`` when set, else the package's own
    ``schemas/`` (a :class:`~pathlib.Path` wherever the package is a plain directory)."""
    override = os.environ.get(SCHEMAS_DIR_ENV)
    if override:
        return Path(override)
    return files("reconciler") / "schemas"


def input_schema_path(kind: str) -> str:
    """The schema file (relative to the schema directory) of an input kind."""
    return f"in/{kind}.json"


@dataclass(frozen=True, slots=True)
class UnknownField:
    """A field a payload has and its schema does not name."""

    #: where: the object's path (``flavor``, ``claims/0/parameters``), ``""`` at the top
    path: str
    name: str
    #: the closest name the schema knows there, if any is close
    suggestion: str | None

    def __str__(self) -> str:
        where = f"{self.path}: " if self.path else ""
        hint = f" (did you mean {self.suggestion!r}?)" if self.suggestion else ""
        return f"{where}unknown field {self.name!r}{hint}"


@dataclass(frozen=True, slots=True)
class SchemaSet:
    """Every schema of one directory, by relative path, with their shared registry."""

    root: Traversable
    documents: dict[str, dict[str, Any]]
    registry: jsonschema_rs.Registry

    def validator(self, relpath: str) -> jsonschema_rs.Validator:
        """A compiled validator for the schema at ``relpath`` (e.g. ``"in/cmd.admit.json"``)."""
        document = self.documents.get(relpath)
        if document is None:
            raise SchemaLoadError(f"no schema {relpath} in {self.root}")
        try:
            return jsonschema_rs.validator_for(document, registry=self.registry, offline=True)
        except (ValueError, jsonschema_rs.ReferencingError) as exc:
            raise SchemaLoadError(
                f"schema {relpath} in {self.root} does not compile: {exc}"
            ) from exc

    def unknown_fields(self, relpath: str, payload: Any) -> list[UnknownField]:
        """Every field of ``payload`` that the schema at ``relpath`` does not name, where
        it names an object's fields (a map such as labels names none)."""
        found: list[UnknownField] = []
        self._unknown(relpath, self.documents[relpath], payload, "", found)
        return found

    def _resolve(self, relpath: str, node: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """``node``'s ``$ref`` target (and the document it is in), or ``node`` itself."""
        ref = node.get("$ref")
        if not isinstance(ref, str):
            return relpath, node
        document, _, pointer = ref.partition("#")
        if document:
            base = relpath.rsplit("/", 1)[0] + "/" if "/" in relpath else ""
            relpath = os.path.normpath(base + document).replace(os.sep, "/")
        target: Any = self.documents[relpath]
        for part in pointer.strip("/").split("/") if pointer.strip("/") else ():
            target = target[part]
        return relpath, target

    def _named(self, relpath: str, node: dict[str, Any]) -> dict[str, tuple[str, Any]]:
        """The properties ``node`` names, with its ``$ref``'s and ``allOf``'s: name ->
        (the document it is in, its schema)."""
        named: dict[str, tuple[str, Any]] = {}
        ref_path, target = self._resolve(relpath, node)
        if target is not node:
            named.update(self._named(ref_path, target))
        for part in node.get("allOf", ()):
            named.update(self._named(relpath, part))
        for name, schema in (node.get("properties") or {}).items():
            named[name] = (relpath, schema)
        return named

    def _unknown(
        self, relpath: str, node: Any, value: Any, path: str, found: list[UnknownField]
    ) -> None:
        if not isinstance(node, dict):
            return
        if isinstance(value, dict):
            named = self._named(relpath, node)
            if not named:
                return  # a map (labels, user config): any key is its content
            for key, item in value.items():
                if key in named:
                    where, schema = named[key]
                    here = f"{path}/{key}" if path else str(key)
                    self._unknown(where, schema, item, here, found)
                    continue
                close = difflib.get_close_matches(str(key), list(named), n=1, cutoff=0.6)
                found.append(UnknownField(path, str(key), close[0] if close else None))
        elif isinstance(value, list):
            where, target = self._resolve(relpath, node)
            items = target.get("items")
            for index, item in enumerate(value):
                self._unknown(where, items, item, f"{path}/{index}", found)


def _walk(directory: Traversable, prefix: str = "") -> Iterator[tuple[str, Traversable]]:
    """Every ``*.json`` file below ``directory``, by relative path, in name order."""
    for entry in sorted(directory.iterdir(), key=lambda e: e.name):
        relpath = prefix + entry.name
        if entry.is_dir():
            yield from _walk(entry, relpath + "/")
        elif entry.name.endswith(".json"):
            yield relpath, entry


def _read(root: Traversable) -> dict[str, dict[str, Any]]:
    if not root.is_dir():
        raise SchemaLoadError(
            f"schema directory {root} does not exist (set {SCHEMAS_DIR_ENV} to override)"
        )
    documents: dict[str, dict[str, Any]] = {}
    for relpath, entry in sorted(_walk(root)):
        try:
            document = orjson.loads(entry.read_bytes())
        except (OSError, orjson.JSONDecodeError) as exc:
            raise SchemaLoadError(f"cannot read schema {relpath} in {root}: {exc}") from exc
        if not isinstance(document, dict):
            raise SchemaLoadError(f"schema {relpath} in {root} is not a JSON object")
        expected = BASE_URI + relpath
        if document.get("$id") != expected:
            raise SchemaLoadError(
                f"schema {relpath} in {root} has $id {document.get('$id')!r}, not {expected!r}"
            )
        documents[relpath] = document
    return documents


def _compile(root: Traversable) -> SchemaSet:
    documents = _read(root)
    try:
        registry = jsonschema_rs.Registry(
            [(BASE_URI + relpath, document) for relpath, document in documents.items()]
        )
    except (ValueError, jsonschema_rs.ReferencingError) as exc:
        raise SchemaLoadError(f"schemas in {root} do not form a registry: {exc}") from exc
    return SchemaSet(root=root, documents=documents, registry=registry)


#: every schema set loaded, by its directory
_LOADED: dict[str, SchemaSet] = {}


def load(root: Traversable | None = None) -> SchemaSet:
    """Load (once per directory) every schema under ``root`` (default :func:`schemas_dir`)."""
    found = root if root is not None else schemas_dir()
    if isinstance(found, Path):
        found = found.resolve()
    key = str(found)
    loaded = _LOADED.get(key)
    if loaded is None:
        loaded = _LOADED[key] = _compile(found)
    return loaded
