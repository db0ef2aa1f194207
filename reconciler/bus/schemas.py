"""The contract's JSON Schemas (``schemas/`` at the top of the repository), loaded and compiled.

Rules:

- The directory is ``$RC_SCHEMAS_DIR`` when set, else ``schemas/`` beside the ``reconciler``
  package (``Path(__file__).resolve().parents[2] / "schemas"``, a checkout), else
  ``<sys.prefix>/share/reconciler/schemas`` (where a wheel install puts them).
- Every ``*.json`` file below it is one schema (draft 2020-12) with an ``$id`` under
  :data:`BASE_URI`; schemas refer to each other (``../defs.json#/$defs/…``) through one
  offline registry, so nothing is ever fetched over the network.
- The schema of input kind ``k`` (``"host.snapshot"``, ``"cmd.admit"``…, see
  ``reconciler.core.inputs.KINDS``) is ``in/<k>.json``.
- A missing or broken schema is a deployment error: :class:`SchemaLoadError`, raised when the
  schemas are loaded — never mistaken for bad input.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import jsonschema_rs
import orjson

__all__ = [
    "BASE_URI",
    "SCHEMAS_DIR_ENV",
    "SchemaLoadError",
    "SchemaSet",
    "input_schema_path",
    "load",
    "schemas_dir",
]

SCHEMAS_DIR_ENV = "RC_SCHEMAS_DIR"
BASE_URI = "https://reconciler.invalid/schemas/"


class SchemaLoadError(RuntimeError):
    """The schema directory is missing, or a schema in it cannot be read or compiled."""


def schemas_dir() -> Path:
    """Where the schemas are: ``$RC_SCHEMAS_DIR``, else the checkout's ``schemas/``, else
    the installed copy."""
    override = os.environ.get(SCHEMAS_DIR_ENV)
    if override:
        return Path(override)
    checkout = Path(__file__).resolve().parents[2] / "schemas"
    installed = Path(sys.prefix) / "share" / "reconciler" / "schemas"
    return installed if not checkout.is_dir() and installed.is_dir() else checkout


def input_schema_path(kind: str) -> str:
    """The schema file (relative to the schema directory) of an input kind."""
    return f"in/{kind}.json"


@dataclass(frozen=True, slots=True)
class SchemaSet:
    """Every schema of one directory, by relative path, with their shared registry."""

    root: Path
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


def _read(root: Path) -> dict[str, dict[str, Any]]:
    if not root.is_dir():
        raise SchemaLoadError(
            f"schema directory {root} does not exist (set {SCHEMAS_DIR_ENV} to override)"
        )
    documents: dict[str, dict[str, Any]] = {}
    for path in sorted(root.rglob("*.json")):
        relpath = path.relative_to(root).as_posix()
        try:
            document = orjson.loads(path.read_bytes())
        except (OSError, orjson.JSONDecodeError) as exc:
            raise SchemaLoadError(f"cannot read schema {path}: {exc}") from exc
        if not isinstance(document, dict):
            raise SchemaLoadError(f"schema {path} is not a JSON object")
        expected = BASE_URI + relpath
        if document.get("$id") != expected:
            raise SchemaLoadError(
                f"schema {path} has $id {document.get('$id')!r}, not {expected!r}"
            )
        documents[relpath] = document
    return documents


@lru_cache(maxsize=8)
def _load(root: Path) -> SchemaSet:
    documents = _read(root)
    try:
        registry = jsonschema_rs.Registry(
            [(BASE_URI + relpath, document) for relpath, document in documents.items()]
        )
    except (ValueError, jsonschema_rs.ReferencingError) as exc:
        raise SchemaLoadError(f"schemas in {root} do not form a registry: {exc}") from exc
    return SchemaSet(root=root, documents=documents, registry=registry)


def load(root: Path | None = None) -> SchemaSet:
    """Load (once per directory) every schema under ``root`` (default :func:`schemas_dir`)."""
    return _load((root or schemas_dir()).resolve())
