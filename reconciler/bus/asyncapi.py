"""An AsyncAPI 3.0 document of the bus, generated from the JSON Schemas (``reconciler/schemas``).

``python -m reconciler.bus.asyncapi > docs/asyncapi.json`` writes it; a test validates it
against AsyncAPI's own schema and fails when it differs from what the schemas generate.

Rules:

- The schemas are the source: every schema with an ``x-subject`` is a message on a
  channel whose address is that subject for the default prefix ``rc``, each
  ``<token>`` becoming an AsyncAPI parameter ``{token}``; its title, description and
  ``examples`` carry over. Inputs (``in/``) are received by the reconciler, outputs
  (``out/``) sent by it, and each query is a request it receives and answers.
- Each schema file is one entry of ``components.schemas`` named by its path
  (``in/cmd.admit.json`` is ``in.cmd.admit``), kept in its own dialect (JSON Schema
  2020-12, said by every payload's ``schemaFormat``) with ``$id``/``$schema`` removed and
  every reference rewritten to point inside the document, so it stands alone.
- The output is deterministic (files in path order), so regenerating is a no-op unless a
  schema changed.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import orjson

import reconciler
from reconciler.bus.schemas import load
from reconciler.core.messages import DEFAULT_PREFIX

__all__ = ["SCHEMA_FORMAT", "asyncapi_document", "main"]

SCHEMA_FORMAT = "application/schema+json;version=draft-2020-12"
_TOKEN = re.compile(r"<([a-z_]+)>")


def _key(relpath: str) -> str:
    return relpath.removesuffix(".json").replace("/", ".")


def _rewrite(node: Any, relpath: str) -> Any:
    """A copy of a schema node whose ``$ref`` point inside the AsyncAPI document."""
    if isinstance(node, list):
        return [_rewrite(item, relpath) for item in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in ("$id", "$schema"):
            continue
        if key == "$ref" and isinstance(value, str):
            target, _, pointer = value.partition("#")
            base = Path(relpath).parent
            target_path = (base / target).as_posix() if target else relpath
            parts = [p for p in target_path.split("/") if p not in ("", ".")]
            resolved: list[str] = []
            for part in parts:
                if part == "..":
                    resolved.pop()
                else:
                    resolved.append(part)
            out[key] = f"#/components/schemas/{_key('/'.join(resolved))}{pointer}"
        elif key in ("examples", "x-invalid-examples", "const", "enum", "default"):
            out[key] = value  # data, not schema: left as it is
        else:
            out[key] = _rewrite(value, relpath)
    return out


def _address(subject: str) -> tuple[str, list[str]]:
    address = subject.replace("<prefix>", DEFAULT_PREFIX)
    return _TOKEN.sub(r"{\1}", address), _TOKEN.findall(address)


def _payload(ref: str) -> dict[str, Any]:
    return {"schemaFormat": SCHEMA_FORMAT, "schema": {"$ref": ref}}


def asyncapi_document(root: Path | None = None) -> dict[str, Any]:
    """The AsyncAPI 3.0 document of the schemas under ``root`` (default: the package's)."""
    documents = load(root).documents
    app_version = reconciler.__version__
    schemas = {_key(rel): _rewrite(doc, rel) for rel, doc in sorted(documents.items())}
    channels: dict[str, Any] = {}
    operations: dict[str, Any] = {}
    messages: dict[str, Any] = {}
    queries: dict[str, dict[str, str]] = {}
    for rel, doc in sorted(documents.items()):
        subject = doc.get("x-subject")
        if not isinstance(subject, str):
            continue
        key = _key(rel)
        if rel.startswith("query/"):
            name, _, part = Path(rel).stem.rpartition(".")
            queries.setdefault(name, {})[part] = key
            continue
        address, params = _address(subject)
        message: dict[str, Any] = {
            "name": key,
            "title": doc.get("title", key),
            "contentType": "application/json",
            "payload": _payload(f"#/components/schemas/{key}"),
        }
        if "description" in doc:
            message["summary"] = doc["description"].split(". ")[0].rstrip(".")[:200]
        examples = doc.get("examples") or []
        if examples:
            message["examples"] = [{"payload": example} for example in examples]
        messages[key] = message
        channel: dict[str, Any] = {
            "address": address,
            "title": doc.get("title", key),
            "messages": {key: {"$ref": f"#/components/messages/{key}"}},
        }
        if params:
            channel["parameters"] = {
                p: {"description": f"the {p.replace('_', ' ')}, one subject token"} for p in params
            }
        channels[key] = channel
        action = "receive" if rel.startswith("in/") else "send"
        operations[f"{action}.{key}"] = {
            "action": action,
            "channel": {"$ref": f"#/channels/{key}"},
            "title": doc.get("title", key),
            "messages": [{"$ref": f"#/channels/{key}/messages/{key}"}],
        }
    for name, parts in sorted(queries.items()):
        request, result = parts.get("request"), parts.get("result")
        if request is None or result is None:
            continue
        doc = documents[f"query/{name}.request.json"]
        req_key, reply_key = f"query.{name}.request", f"query.{name}.reply"
        messages[req_key] = {
            "name": req_key,
            "title": f"Query {name}: request",
            "contentType": "application/json",
            "payload": _payload(f"#/components/schemas/{request}"),
            "examples": [{"payload": e} for e in doc.get("examples") or []],
        }
        messages[reply_key] = {
            "name": reply_key,
            "title": f"Query {name}: reply",
            "summary": "{ok:true, result} or {ok:false, error:{code, message}}",
            "contentType": "application/json",
            "payload": {
                "schemaFormat": SCHEMA_FORMAT,
                "schema": {
                    "$ref": "#/components/schemas/query.reply",
                    "properties": {"result": {"$ref": f"#/components/schemas/{result}"}},
                },
            },
        }
        channels[f"query.{name}"] = {
            "address": _address(str(doc["x-subject"]))[0],
            "title": f"Query {name}",
            "messages": {req_key: {"$ref": f"#/components/messages/{req_key}"}},
        }
        channels[f"query.{name}.reply"] = {
            "address": None,
            "title": f"Query {name}: the requester's reply subject",
            "messages": {reply_key: {"$ref": f"#/components/messages/{reply_key}"}},
        }
        operations[f"answer.query.{name}"] = {
            "action": "receive",
            "channel": {"$ref": f"#/channels/query.{name}"},
            "title": f"Answer query {name}",
            "messages": [{"$ref": f"#/channels/query.{name}/messages/{req_key}"}],
            "reply": {
                "channel": {"$ref": f"#/channels/query.{name}.reply"},
                "messages": [{"$ref": f"#/channels/query.{name}.reply/messages/{reply_key}"}],
            },
        }
    return {
        "asyncapi": "3.0.0",
        "info": {
            "title": "reconciler",
            "version": app_version,
            "description": (
                "Admission control for self-hosted CI runners on Incus, over NATS JetStream. "
                "Inputs arrive on the stream RC_IN (subjects rc.in.>), outputs leave on RC_OUT "
                "(rc.out.>), queries are core NATS request-reply on rc.query.<name>. Addresses "
                "are shown for the default prefix rc. Generated from reconciler/schemas/ by "
                "`python -m reconciler.bus.asyncapi`; see docs/interface.md."
            ),
        },
        "defaultContentType": "application/json",
        "servers": {
            "local": {
                "host": "127.0.0.1:4222",
                "protocol": "nats",
                "description": "the default --nats-url; JetStream enabled",
            }
        },
        "channels": channels,
        "operations": operations,
        "components": {"schemas": schemas, "messages": messages},
    }


def render(root: Path | None = None) -> bytes:
    """The document as written to ``docs/asyncapi.json`` (indented, newline-terminated)."""
    return orjson.dumps(asyncapi_document(root), option=orjson.OPT_INDENT_2) + b"\n"


def main() -> None:
    sys.stdout.buffer.write(render())


if __name__ == "__main__":
    main()
