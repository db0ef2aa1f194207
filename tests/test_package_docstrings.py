"""Every package's docstring names each of its modules and subpackages, so that the
docstring a reader opens first is a true map of the package (and says where a new module
must be described)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "reconciler"
#: entry points (``python -m``), not modules of their own concept
_NOT_LISTED = {"__init__", "__main__"}


def _packages() -> list[Path]:
    return sorted(p.parent for p in PACKAGE.rglob("__init__.py"))


def _members(package: Path) -> list[str]:
    modules = [p.stem for p in package.glob("*.py") if p.stem not in _NOT_LISTED]
    subpackages = [p.parent.name for p in package.glob("*/__init__.py")]
    return sorted(modules + subpackages)


def _named(docstring: str, package: str, member: str) -> bool:
    """Whether the docstring names ``member``: ``:mod:`.member``` (or its full dotted
    name), ````member````, or ``member.py``/``member/``."""
    forms = (
        rf":mod:`~?(\.|{re.escape(package)}\.){re.escape(member)}`",
        rf"``{re.escape(member)}``",
        rf"\b{re.escape(member)}(\.py|/)",
    )
    return any(re.search(form, docstring) for form in forms)


def test_every_package_docstring_names_each_of_its_modules() -> None:
    missing: list[str] = []
    for package in _packages():
        dotted = ".".join(package.relative_to(PACKAGE.parent).parts)
        docstring = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
        if not docstring:
            missing.append(f"{dotted}: no docstring")
            continue
        missing += [
            f"{dotted}: {member}"
            for member in _members(package)
            if not _named(docstring, dotted, member)
        ]
    assert missing == [], "package docstrings that do not name a module of theirs"


def test_the_check_sees_the_forms_it_accepts() -> None:
    doc = "- :mod:`.fold`: x\n- :mod:`reconciler.core.model`\n- ``state``\n- queries.py\n"
    for member in ("fold", "model", "state", "queries"):
        assert _named(doc, "reconciler.core", member), member
    assert not _named(doc, "reconciler.core", "placement")
    assert not _named("the state of a host", "reconciler.core", "state")
