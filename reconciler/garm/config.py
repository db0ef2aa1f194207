"""The provider's configuration file (``GARM_PROVIDER_CONFIG_FILE``), TOML.

Top-level keys are the long options of the other commands with ``-`` written ``_``;
``[incus.hosts]`` names each host's endpoint, ``[garm_pools]`` maps GARM pool ids and
``[pools]`` GARM flavors to reconciler pools. Every key is checked: an unknown key or a
wrong type is an error that names it (and never shows a secret's value).

Rules:

- **The reconciler pool of a runner** (and so its tenant: a tenant names its pools) is,
  first to last: ``[garm_pools]`` by the runner's GARM pool id (the operator's file
  wins), the pool's extra specs ``reconciler_pool``, ``[pools]`` by flavor, the flavor.
- **A create waits in the queue** ``bootstrap_timeout - boot_time`` seconds (default
  1200 - 300 = 900): GARM gives a runner ``runner_bootstrap_timeout`` (20 minutes by
  default) from its create to come online, and the boot (VM start, cloud-init, the
  runner's download and registration) needs ``boot_time`` of it; 0 or less: no wait.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

from reconciler.bus.connection import DEFAULT_NATS_URL, ConnectOptions, parse_urls
from reconciler.garm.protocol import ProviderError
from reconciler.garm.schemas import ADMISSION_VERBS, NUMBER_KEYS, STRING_KEYS, WAIT_KEYS
from reconciler.incus.endpoints import IncusEndpoint

__all__ = ["ProviderConfig", "load_config"]

_TOKEN = re.compile(r"[A-Za-z0-9_-]{1,128}")
_KNOWN = {*STRING_KEYS, *NUMBER_KEYS, *WAIT_KEYS, "incus_verify", "incus", "pools", "garm_pools"}
#: GARM's default ``runner_bootstrap_timeout`` (20 minutes), in seconds
DEFAULT_BOOTSTRAP_TIMEOUT_S = 1200.0
#: what a runner's boot needs of it by default: VM start, cloud-init, the runner
DEFAULT_BOOT_TIME_S = 300.0


@dataclass(frozen=True, kw_only=True)
class ProviderConfig:
    """The parsed file. ``password`` and key paths are never put into messages."""

    nats: ConnectOptions = field(default_factory=ConnectOptions)
    prefix: str = "rc"
    hosts: Mapping[str, IncusEndpoint] = field(default_factory=dict)
    pools: Mapping[str, str] = field(default_factory=dict)
    garm_pools: Mapping[str, str] = field(default_factory=dict)
    admission: str = "admit-preemptible"
    decision_timeout_s: float = 600.0
    query_timeout_s: float = 10.0
    incus_timeout_s: float = 30.0
    address_timeout_s: float = 30.0
    bootstrap_timeout_s: float = DEFAULT_BOOTSTRAP_TIMEOUT_S
    boot_time_s: float = DEFAULT_BOOT_TIME_S

    @property
    def queue_wait_s(self) -> int:
        """Seconds a create may wait in the queue (``wait_s`` of its admission)."""
        return max(0, int(self.bootstrap_timeout_s - self.boot_time_s))

    def pool_of(self, flavor: str, *, garm_pool: str = "", named: str | None = None) -> str:
        """The reconciler pool of a runner of GARM pool ``garm_pool`` and ``flavor``
        whose extra specs name ``named`` (see the module's rules)."""
        return self.pool_source(flavor, garm_pool=garm_pool, named=named)[0]

    def pool_source(
        self, flavor: str, *, garm_pool: str = "", named: str | None = None
    ) -> tuple[str, str]:
        """:meth:`pool_of`, and which rule gave it (``garm_pools``, ``extra_specs``,
        ``pools`` or ``flavor``)."""
        if garm_pool and garm_pool in self.garm_pools:
            pool, source = self.garm_pools[garm_pool], "garm_pools"
        elif named is not None:
            pool, source = named, "extra_specs"
        elif flavor in self.pools:
            pool, source = self.pools[flavor], "pools"
        else:
            pool, source = flavor, "flavor"
        if not _TOKEN.fullmatch(pool):
            raise ProviderError(
                f"flavor {flavor!r} names no valid pool; map it under [pools] in the config"
            )
        return pool, source

    def endpoint(self, host: str) -> IncusEndpoint:
        found = self.hosts.get(host)
        if found is None:
            raise ProviderError(
                f"host {host!r} is not in [incus.hosts] of the provider's config file"
            )
        return found


def endpoint_url(value: str) -> str:
    """A pylxd URL: ``https://…``/``http://…`` as given; a socket path becomes http+unix."""
    if value.startswith(("https://", "http://", "http+unix://")):
        return value
    path = value.removeprefix("unix:")
    if not path.startswith("/"):
        raise ProviderError(f"Incus endpoint {value!r} is neither a URL nor a socket path")
    return "http+unix://" + quote(path, safe="")


def _check_types(raw: Mapping[str, Any]) -> None:
    unknown = sorted(set(raw) - _KNOWN)
    if unknown:
        raise ProviderError(f"config: unknown key(s) {', '.join(unknown)}")
    for key in STRING_KEYS:
        if key in raw and not isinstance(raw[key], str):
            raise ProviderError(f"config: {key} must be a string")
    for key in NUMBER_KEYS:
        value = raw.get(key)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int | float) or value <= 0
        ):
            raise ProviderError(f"config: {key} must be a number of seconds > 0")
    for key in WAIT_KEYS:
        value = raw.get(key)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int | float) or value < 0
        ):
            raise ProviderError(f"config: {key} must be a number of seconds >= 0")
    verify = raw.get("incus_verify")
    if verify is not None and not isinstance(verify, bool | str):
        raise ProviderError("config: incus_verify must be true, false or a CA file path")


def _hosts(raw: Mapping[str, Any]) -> dict[str, IncusEndpoint]:
    incus = raw.get("incus", {})
    if not isinstance(incus, dict) or set(incus) - {"hosts"}:
        raise ProviderError("config: [incus] holds only the table [incus.hosts]")
    table = incus.get("hosts", {})
    if not isinstance(table, dict):
        raise ProviderError("config: [incus.hosts] maps host names to endpoints")
    cert = None
    if "incus_cert" in raw or "incus_key" in raw:
        if "incus_cert" not in raw or "incus_key" not in raw:
            raise ProviderError("config: incus_cert and incus_key go together")
        cert = (str(raw["incus_cert"]), str(raw["incus_key"]))
    verify: bool | str = raw.get("incus_verify", True)
    hosts = {}
    for host, value in table.items():
        if not isinstance(value, str) or not _TOKEN.fullmatch(host):
            raise ProviderError(f"config: [incus.hosts] {host!r} must name an endpoint string")
        url = endpoint_url(value)
        secure = url.startswith("https://")
        hosts[host] = IncusEndpoint(
            host=host,
            url=url,
            cert=cert if secure else None,
            verify=verify if secure else True,
        )
    return hosts


def parse_config(raw: Mapping[str, Any]) -> ProviderConfig:
    _check_types(raw)
    pools = raw.get("pools", {})
    if not isinstance(pools, dict) or not all(isinstance(v, str) for v in pools.values()):
        raise ProviderError("config: [pools] maps GARM flavors to pool names (strings)")
    garm_pools = raw.get("garm_pools", {})
    if not isinstance(garm_pools, dict) or not all(
        isinstance(v, str) and _TOKEN.fullmatch(v) for v in garm_pools.values()
    ):
        raise ProviderError("config: [garm_pools] maps GARM pool ids to pool names")
    admission = raw.get("admission", "admit-preemptible")
    if admission not in ADMISSION_VERBS:
        raise ProviderError(f"config: admission must be one of {', '.join(ADMISSION_VERBS)}")
    prefix = raw.get("prefix", "rc")
    if not _TOKEN.fullmatch(prefix):
        raise ProviderError("config: prefix must be one subject token")
    try:
        urls = parse_urls(raw.get("nats_url", DEFAULT_NATS_URL))
        for url in urls:
            if url.lower().startswith(("ws://", "wss://")):
                raise ValueError(
                    f"nats_url {url!r}: the provider reaches NATS over nats:// or tls:// "
                    f"(its client port), not over WebSocket"
                )
        nats = ConnectOptions(
            urls=urls,
            user=raw.get("nats_user"),
            password=raw.get("nats_password"),
            creds_file=raw.get("nats_creds"),
            nkey_seed_file=raw.get("nats_nkey"),
            tls_ca_file=raw.get("tls_ca"),
            tls_cert_file=raw.get("tls_cert"),
            tls_key_file=raw.get("tls_key"),
            inbox_prefix=raw.get("inbox_prefix", "_INBOX"),
            name="garm-provider",
            reconnect_wait_s=0.5,
            initial_timeout_s=float(raw.get("query_timeout", 10.0)),
        )
    except ValueError as exc:
        raise ProviderError(f"config: {exc}") from None
    return ProviderConfig(
        nats=nats,
        prefix=prefix,
        hosts=_hosts(raw),
        pools=dict(pools),
        garm_pools=dict(garm_pools),
        admission=admission,
        decision_timeout_s=float(raw.get("decision_timeout", 600.0)),
        query_timeout_s=float(raw.get("query_timeout", 10.0)),
        incus_timeout_s=float(raw.get("incus_timeout", 30.0)),
        address_timeout_s=float(raw.get("address_timeout", 30.0)),
        bootstrap_timeout_s=float(raw.get("bootstrap_timeout", DEFAULT_BOOTSTRAP_TIMEOUT_S)),
        boot_time_s=float(raw.get("boot_time", DEFAULT_BOOT_TIME_S)),
    )


def load_config(path: str) -> ProviderConfig:
    """Read and check the file GARM names in ``GARM_PROVIDER_CONFIG_FILE``."""
    if not path:
        raise ProviderError("GARM_PROVIDER_CONFIG_FILE is empty: set config_file in GARM")
    try:
        raw = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ProviderError(f"cannot read config file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ProviderError(f"config file {path} is not valid TOML: {exc}") from None
    return parse_config(raw)
