"""The documentation stands on its own: links resolve inside the repository, the AsyncAPI
document is valid and generated from ``reconciler/schemas/``, every command and option is in
docs/cli.md, and nothing points at files outside the repository."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import click
import jsonschema_rs
import orjson
import pytest
from click.testing import CliRunner

from reconciler.bus.asyncapi import asyncapi_document, render
from reconciler.cli.main import cli
from tests.support.repo import ROOT

ASYNCAPI_SCHEMA = ROOT / "tests" / "data" / "asyncapi-3.0.0.schema.json"
REGENERATE = "python -m reconciler.bus.asyncapi > docs/asyncapi.json"

# [text](target) and [text]: target, outside code spans and fenced blocks
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|^\[[^\]]+\]:\s+(\S+)", re.M)
_FENCE = re.compile(r"^```.*?^```", re.M | re.S)
_CODE = re.compile(r"`[^`\n]*`")


def documents() -> list[Path]:
    found = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    found += sorted((ROOT / "reconciler" / "schemas").rglob("*.md"))
    changelog = ROOT / "CHANGELOG.md"
    return [*found, changelog] if changelog.exists() else found


def links(path: Path) -> list[str]:
    text = _CODE.sub("", _FENCE.sub("", path.read_text(encoding="utf-8")))
    return [a or b for a, b in _LINK.findall(text)]


def _anchors(path: Path) -> set[str]:
    anchors = set()
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            title = re.sub(r"[^\w\- ]", "", title).replace(" ", "-")
            anchors.add(title)
    return anchors


@pytest.mark.parametrize("doc", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves_inside_the_repository(doc: Path) -> None:
    problems = []
    for target in links(doc):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:…
            continue
        file_part, _, anchor = target.partition("#")
        if ".." in Path(file_part).parts:
            # what lies above a folder is reached from the repository's root ("/docs/…",
            # as GitHub reads it), so no link can look like it leaves the repository
            problems.append(f"{target}: climbs with '..'; link from the root with '/'")
            continue
        base = ROOT if file_part.startswith("/") else doc.parent
        resolved = (base / unquote(file_part.lstrip("/"))).resolve() if file_part else doc
        if not resolved.is_relative_to(ROOT):
            problems.append(f"{target}: outside the repository")
        elif not resolved.exists():
            problems.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            problems.append(f"{target}: no heading #{anchor}")
    assert not problems, f"{doc.relative_to(ROOT)}: " + "; ".join(problems)


def test_the_link_checker_sees_links() -> None:
    assert "docs/README.md" in links(ROOT / "README.md")


def test_nothing_points_outside_the_repository() -> None:
    for doc in documents():
        assert "../shared" not in doc.read_text(encoding="utf-8"), doc
    top = CliRunner().invoke(cli, ["--help"]).output
    assert "CONTRACT.md" not in top and "docs/interface.md" in top


# ---------------------------------------------------------------------------- AsyncAPI


def _asyncapi_validator() -> jsonschema_rs.Validator:
    return jsonschema_rs.validator_for(orjson.loads(ASYNCAPI_SCHEMA.read_bytes()))


def test_the_asyncapi_document_is_valid_asyncapi_3() -> None:
    validator = _asyncapi_validator()
    document = orjson.loads((ROOT / "docs" / "asyncapi.json").read_bytes())
    errors = [
        f"{list(e.instance_path)}: {e.message[:200]}" for e in validator.iter_errors(document)
    ]
    assert not errors, errors[:5]
    broken = {**document, "channels": {"x": {"address": 5}}}
    assert not validator.is_valid(broken)
    assert not validator.is_valid({k: v for k, v in document.items() if k != "info"})


def test_the_asyncapi_document_is_generated_from_the_schemas() -> None:
    on_disk = (ROOT / "docs" / "asyncapi.json").read_bytes()
    assert on_disk == render(), f"docs/asyncapi.json is stale: regenerate it ({REGENERATE})"


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        own = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return own + [r for v in node.values() for r in _refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []


def _pointer(document: Any, ref: str) -> Any:
    node = document
    for part in ref.removeprefix("#/").split("/"):
        node = node[part.replace("~1", "/").replace("~0", "~")]
    return node


def test_the_asyncapi_document_covers_every_message_and_its_references_resolve() -> None:
    document = asyncapi_document()
    for ref in _refs(document):
        assert ref.startswith("#/"), ref
        _pointer(document, ref)  # raises KeyError when it does not resolve
    addresses = {c["address"] for c in document["channels"].values()}
    for address in (
        "rc.in.cmd.admit",
        "rc.in.config.pool.{pool}",
        "rc.in.host.{host}.snapshot",
        "rc.out.decision.{request_id}",
        "rc.out.exec.{host}.delete",
        "rc.out.dlq.{reason}",
        "rc.query.lease",
    ):
        assert address in addresses
    # every example of every message is valid against its payload, read through the
    # document itself (the rewritten references stand alone)
    checked = 0
    for key, message in document["components"]["messages"].items():
        ref = message["payload"]["schema"]
        validator = jsonschema_rs.validator_for({**document, **ref})
        for example in message.get("examples", []):
            assert validator.is_valid(example["payload"]), (key, example)
            checked += 1
        if key == "in.cmd.admit":
            assert not validator.is_valid({"v": 1, "request_id": "r", "pool": "p"})
    assert checked > 50


# -------------------------------------------------------------------------- the CLI doc


def _commands() -> dict[str, click.Command]:
    ctx = click.Context(cli)
    found = {}
    for name in cli.list_commands(ctx):
        command = cli.get_command(ctx, name)
        assert command is not None
        found[name] = command
    return found


def _section(text: str, name: str) -> str:
    heading = rf"^## `reconciler {re.escape(name)}\b.*?$(.*?)(?=^## |\Z)"
    match = re.search(heading, text, re.M | re.S)
    assert match, f"docs/cli.md has no section '## `reconciler {name}…`'"
    return match.group(1)


def test_every_command_and_option_is_in_the_cli_doc() -> None:
    text = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    commands = _commands()
    uses = Counter(
        opt for command in commands.values() for p in command.params
        if isinstance(p, click.Option) for opt in p.opts if opt.startswith("--")
    )  # fmt: skip
    missing = []
    for name, command in commands.items():
        section = _section(text, name)
        for param in command.params:
            if not isinstance(param, click.Option):
                continue
            for opt in (o for o in param.opts if o.startswith("--")):
                # an option of several commands is documented once, in a shared table
                where = text if uses[opt] > 1 else section
                if not re.search(rf"`{re.escape(opt)}\b", where):
                    missing.append(f"{name} {opt}")
    assert not missing, f"docs/cli.md does not document: {missing}"


def test_the_schemas_are_package_data_read_through_importlib_resources(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from importlib.resources import files

    from reconciler.bus import schemas

    monkeypatch.delenv(schemas.SCHEMAS_DIR_ENV, raising=False)
    assert schemas.schemas_dir() == files("reconciler") / "schemas"
    assert schemas.schemas_dir() == ROOT / "reconciler" / "schemas"
    # RC_SCHEMAS_DIR names another directory, and nothing else is ever looked at
    monkeypatch.setenv(schemas.SCHEMAS_DIR_ENV, str(tmp_path))
    assert schemas.schemas_dir() == tmp_path
