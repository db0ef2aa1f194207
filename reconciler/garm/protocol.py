"""GARM's external-provider protocol: the environment, stdin, stdout and exit codes.

Pure functions over the values GARM passes; no I/O. Key spellings are GARM's own
(``callback-url``, ``instance-token``, ``ca-cert-bundle``…), see ``docs/garm.md``.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from reconciler.garm.errors import ExitCode, ProviderError
from reconciler.garm.specs import ExtraSpecs, parse_extra_specs

__all__ = [
    "Bootstrap",
    "ExitCode",
    "Invocation",
    "ProviderError",
    "Tool",
    "garm_status",
    "parse_bootstrap",
    "provider_instance",
]

#: Incus's instance-name rule (also a subject token and a job identity)
_INSTANCE_NAME = re.compile(r"(?!-)(?![0-9]+$)[A-Za-z0-9-]{1,63}(?<!-)")
#: the statuses GARM accepts in a ProviderInstance
STATUSES = ("running", "stopped", "error", "unknown")


def _b64json(value: str, what: str) -> Any:
    try:
        return orjson.loads(base64.b64decode(value, validate=True))
    except (binascii.Error, ValueError) as exc:
        raise ProviderError(f"{what} is not base64 of JSON: {type(exc).__name__}") from None


@dataclass(frozen=True, kw_only=True)
class Invocation:
    """What GARM's environment says about this call."""

    command: str
    controller_id: str
    config_file: str
    interface_version: str = "v0.1.0"
    pool_id: str | None = None
    instance_id: str | None = None
    #: v0.1.1's ``GARM_POOL_EXTRASPECS``: holds GARM's wrapper with the instance token
    extra_specs: Any = field(default=None, repr=False)

    @classmethod
    def from_environ(cls, env: Mapping[str, str]) -> Invocation:
        command = env.get("GARM_COMMAND", "")
        if not command:
            raise ProviderError("GARM_COMMAND is not set: this program is run by GARM")
        specs = env.get("GARM_POOL_EXTRASPECS")
        return cls(
            command=command,
            controller_id=env.get("GARM_CONTROLLER_ID", ""),
            config_file=env.get("GARM_PROVIDER_CONFIG_FILE", ""),
            interface_version=env.get("GARM_INTERFACE_VERSION") or "v0.1.0",
            pool_id=env.get("GARM_POOL_ID"),
            instance_id=env.get("GARM_INSTANCE_ID") or None,
            extra_specs=_b64json(specs, "GARM_POOL_EXTRASPECS") if specs else None,
        )

    def require_instance_id(self) -> str:
        if not self.instance_id:
            raise ProviderError(f"{self.command} needs GARM_INSTANCE_ID")
        return self.instance_id

    def require_controller(self) -> str:
        if not self.controller_id:
            raise ProviderError(f"{self.command} needs GARM_CONTROLLER_ID")
        return self.controller_id


@dataclass(frozen=True, kw_only=True)
class Tool:
    """One runner download of the bootstrap's ``tools`` (GitHub's names: ``linux``,
    ``x64``…). ``temp_download_token`` is a secret (GHES downloads)."""

    os: str
    architecture: str
    download_url: str
    filename: str
    temp_download_token: str = field(default="", repr=False)


@dataclass(frozen=True, kw_only=True)
class Bootstrap:
    """The BootstrapInstance GARM sends on CreateInstance's stdin.

    ``instance_token``, ``ca_bundle``, the tools' download tokens and the extra specs
    (GARM's wrapper embeds the token) are secrets: kept out of ``repr`` so that no log
    line or traceback shows them."""

    name: str
    pool_id: str
    flavor: str
    image: str
    os_type: str
    arch: str
    callback_url: str
    metadata_url: str
    repo_url: str = ""
    instance_token: str = field(default="", repr=False)
    ca_bundle: bytes | None = field(default=None, repr=False)
    specs: ExtraSpecs = field(default_factory=ExtraSpecs, repr=False)
    tools: tuple[Tool, ...] = field(default=(), repr=False)
    github_runner_group: str = ""
    proxy: Mapping[str, str] = field(default_factory=dict, repr=False)
    extra_packages: tuple[str, ...] = ()
    disable_updates_on_boot: bool = False
    enable_boot_debug: bool = False
    jit_config_enabled: bool = False
    labels: tuple[str, ...] = ()

    def secrets(self) -> tuple[str, ...]:
        """The strings no message may show (for scrubbing what a library says)."""
        found = [self.instance_token, *(t.temp_download_token for t in self.tools)]
        return tuple(sorted({s for s in found if s}, key=len, reverse=True))


def _text(body: Mapping[str, Any], key: str, *, required: bool = False) -> str:
    value = body.get(key)
    if value is None:
        if required:
            raise ProviderError(f"bootstrap: {key!r} is missing")
        return ""
    if not isinstance(value, str):
        raise ProviderError(f"bootstrap: {key!r} must be a string")
    return value


def _tools(body: Mapping[str, Any]) -> tuple[Tool, ...]:
    raw = body.get("tools")
    raw = [] if raw is None else raw
    if not isinstance(raw, list) or not all(isinstance(t, dict) for t in raw):
        raise ProviderError("bootstrap: 'tools' must be a list of objects")
    return tuple(
        Tool(
            os=_text(t, "os"),
            architecture=_text(t, "architecture"),
            download_url=_text(t, "download_url"),
            filename=_text(t, "filename"),
            temp_download_token=_text(t, "temp_download_token"),
        )
        for t in raw
    )


def _os_type(body: Mapping[str, Any]) -> str:
    os_type = _text(body, "os_type") or "linux"
    if os_type == "windows":
        raise ProviderError(
            "os_type 'windows' is not supported: this provider sets runners up with "
            "cloud-init and Linux shell scripts; use a Linux pool"
        )
    if os_type != "linux":
        raise ProviderError(f"os_type {os_type[:20]!r} is not supported: only 'linux' is")
    return os_type


def parse_bootstrap(data: bytes) -> Bootstrap:
    """CreateInstance's stdin; a clear :class:`ProviderError` for anything malformed."""
    try:
        body = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise ProviderError(f"stdin is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ProviderError("stdin must be a JSON object (GARM's BootstrapInstance)")
    name = _text(body, "name", required=True)
    if not _INSTANCE_NAME.fullmatch(name):
        raise ProviderError(
            f"runner name {name!r} is not a valid Incus instance name "
            "(1-63 letters, digits and '-', no leading or trailing '-')"
        )
    bundle = body.get("ca-cert-bundle")
    ca_bundle = None
    if bundle is not None:
        if not isinstance(bundle, str):
            raise ProviderError("bootstrap: 'ca-cert-bundle' must be a base64 string")
        try:
            ca_bundle = base64.b64decode(bundle, validate=True) or None
        except (binascii.Error, ValueError):
            raise ProviderError("bootstrap: 'ca-cert-bundle' is not base64") from None
    specs = body.get("extra_specs")
    if specs is not None and not isinstance(specs, dict):
        raise ProviderError("bootstrap: 'extra_specs' must be a JSON object")
    options = body.get("user_data_options") or {}
    proxy = body.get("proxy_config") or {}
    if not isinstance(options, dict) or not isinstance(proxy, dict):
        raise ProviderError("bootstrap: 'user_data_options' and 'proxy_config' are objects")
    packages = options.get("extra_packages") or []
    labels = body.get("labels") or []
    if not isinstance(packages, list) or not isinstance(labels, list):
        raise ProviderError("bootstrap: 'extra_packages' and 'labels' are lists")
    return Bootstrap(
        name=name,
        pool_id=_text(body, "pool_id"),
        flavor=_text(body, "flavor", required=True),
        image=_text(body, "image"),
        os_type=_os_type(body),
        arch=_text(body, "arch") or "amd64",
        callback_url=_text(body, "callback-url"),
        metadata_url=_text(body, "metadata-url"),
        repo_url=_text(body, "repo_url"),
        instance_token=_text(body, "instance-token"),
        ca_bundle=ca_bundle,
        specs=parse_extra_specs(specs),
        tools=_tools(body),
        github_runner_group=_text(body, "github-runner-group"),
        proxy={k: str(v) for k, v in proxy.items() if v},
        extra_packages=tuple(str(p) for p in packages),
        disable_updates_on_boot=bool(options.get("disable_updates_on_boot", False)),
        enable_boot_debug=bool(options.get("enable_boot_debug", False)),
        jit_config_enabled=bool(body.get("jit_config_enabled", False)),
        labels=tuple(str(label) for label in labels),
    )


def garm_status(incus_status: str) -> str:
    """Incus's status → GARM's: Running/Ready → running, Stopped → stopped, Error → error."""
    return {
        "Running": "running",
        "Ready": "running",
        "Stopped": "stopped",
        "Error": "error",
    }.get(incus_status, "unknown")


def provider_instance(
    *,
    name: str,
    provider_id: str,
    status: str,
    os_type: str = "linux",
    os_arch: str = "amd64",
    os_name: str = "",
    os_version: str = "",
    addresses: Sequence[str] = (),
    fault: str | None = None,
) -> dict[str, Any]:
    """A ProviderInstance; ``addresses`` are reported as ``public`` (reachable, as the
    official Incus provider says of global ones); ``fault`` is base64-encoded as GARM
    decodes it."""
    if status not in STATUSES:
        raise ValueError(f"status {status!r} is not one of {STATUSES}")
    out: dict[str, Any] = {
        "provider_id": provider_id,
        "name": name,
        "os_type": os_type,
        "os_name": os_name,
        "os_version": os_version,
        "os_arch": os_arch,
        "addresses": [{"address": a, "type": "public"} for a in addresses],
        "status": status,
    }
    if fault:
        out["provider_fault"] = base64.b64encode(fault.encode()).decode()
    return out
