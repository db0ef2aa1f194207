"""A GARM pool's extra specs, as the provider reads them.

The keys are those of GARM's provider library (``runner_install_template``,
``pre_install_scripts``, ``extra_context``) and of the official Incus provider
(``disable_updates``, ``extra_packages``, ``enable_boot_debug``), and this provider's
``reconciler_pool`` (the reconciler pool, and so the tenant, of the GARM pool's
runners). Other keys are left alone: GARM passes a pool's extra specs through, and
other tools may add their own.

Rules:

- Byte values are base64 (standard alphabet; line breaks ignored), as Go's JSON encodes
  ``[]byte``: the install template and each pre-install script.
- A key of the wrong type is refused with its name, never with its value: values carry
  secrets (GARM's rendered wrapper embeds the instance token; ``extra_context`` may hold
  anything).
- Pre-install script names become file names under ``/garm-pre-install/``: letters,
  digits, ``.``, ``_`` and ``-`` only (no path), run in name order (byte order, as Go
  sorts them).
- Pure: no I/O.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from reconciler.garm.errors import ProviderError

__all__ = ["ExtraSpecs", "parse_extra_specs"]

_SCRIPT_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
_POOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,128}")


@dataclass(frozen=True, kw_only=True)
class ExtraSpecs:
    """What the provider acts on in a pool's extra specs; ``None``: not said."""

    install_template: bytes | None = field(default=None, repr=False)
    pre_install_scripts: tuple[tuple[str, bytes], ...] = field(default=(), repr=False)
    extra_context: Mapping[str, str] = field(default_factory=dict, repr=False)
    disable_updates: bool | None = None
    extra_packages: tuple[str, ...] = ()
    enable_boot_debug: bool | None = None
    reconciler_pool: str | None = None


def _bytes(value: Any, what: str) -> bytes:
    if not isinstance(value, str):
        raise ProviderError(f"{what} must be a base64 string")
    try:
        return base64.b64decode(value.replace("\r", "").replace("\n", ""), validate=True)
    except (binascii.Error, ValueError):
        raise ProviderError(f"{what} is not base64") from None


def _flag(raw: Mapping[str, Any], key: str) -> bool | None:
    value = raw.get(key)
    if value is not None and not isinstance(value, bool):
        raise ProviderError(f"extra_specs.{key} must be true or false")
    return value


def _scripts(value: Any) -> tuple[tuple[str, bytes], ...]:
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise ProviderError("extra_specs.pre_install_scripts must map script names to base64")
    scripts = []
    for name in sorted(value, key=lambda n: str(n).encode("utf-8", "surrogateescape")):
        if not _SCRIPT_NAME.fullmatch(name):
            shown = name if len(name) <= 40 else name[:40] + "…"
            raise ProviderError(
                f"extra_specs.pre_install_scripts: {shown!r} is not a file name "
                "(letters, digits, '.', '_' and '-', not starting with '.' or '-')"
            )
        scripts.append((name, _bytes(value[name], f"extra_specs.pre_install_scripts.{name}")))
    return tuple(scripts)


def _context(value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise ProviderError("extra_specs.extra_context must map names to strings")
    return dict(value)


def _packages(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(p, str) and p for p in value):
        raise ProviderError("extra_specs.extra_packages must be a list of package names")
    return tuple(value)


def _pool(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not _POOL_NAME.fullmatch(value):
        raise ProviderError(
            "extra_specs.reconciler_pool must be a pool name (letters, digits, '_' and '-')"
        )
    return value


def parse_extra_specs(raw: Any) -> ExtraSpecs:
    """Read ``raw`` (the JSON object of a pool's extra specs, or ``None``)."""
    if raw is None:
        return ExtraSpecs()
    if not isinstance(raw, Mapping):
        raise ProviderError("extra specs must be a JSON object")
    template = raw.get("runner_install_template")
    return ExtraSpecs(
        install_template=(
            None if template is None else _bytes(template, "extra_specs.runner_install_template")
        ),
        pre_install_scripts=_scripts(raw.get("pre_install_scripts")),
        extra_context=_context(raw.get("extra_context")),
        disable_updates=_flag(raw, "disable_updates"),
        extra_packages=_packages(raw.get("extra_packages")),
        enable_boot_debug=_flag(raw, "enable_boot_debug"),
        reconciler_pool=_pool(raw.get("reconciler_pool")),
    )
