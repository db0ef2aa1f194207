"""The provider's JSON Schemas (``GetConfigJSONSchema``, ``GetExtraSpecsJSONSchema``) and
the names of its configuration file's keys, which :mod:`reconciler.garm.config` checks.

Rules: plain data only, no imports beyond typing, so the local commands GARM calls answer
without loading nats-py or pylxd.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ADMISSION_VERBS",
    "CONFIG_SCHEMA",
    "EXTRA_SPECS_SCHEMA",
    "NUMBER_KEYS",
    "STRING_KEYS",
    "WAIT_KEYS",
]

ADMISSION_VERBS = ("admit-preemptible", "admit")
#: the file's top-level keys by type (``incus_verify``, ``incus`` and ``pools`` apart)
STRING_KEYS = (
    "nats_url",
    "nats_user",
    "nats_password",
    "nats_creds",
    "nats_nkey",
    "tls_ca",
    "tls_cert",
    "tls_key",
    "inbox_prefix",
    "prefix",
    "incus_cert",
    "incus_key",
    "admission",
)
NUMBER_KEYS = ("decision_timeout", "query_timeout", "incus_timeout", "bootstrap_timeout")
#: seconds that may be 0 (do not wait)
WAIT_KEYS = ("address_timeout", "boot_time")

_BASE64 = {"type": "string", "contentEncoding": "base64"}

EXTRA_SPECS_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "reconciler GARM provider: pool extra specs",
    "type": "object",
    "properties": {
        "runner_install_template": {
            **_BASE64,
            "description": "base64 of the runner install script, a Go text/template rendered "
            "with the runner's values (GARM sets its own rendered wrapper when the pool "
            "sets none)",
        },
        "extra_context": {
            "type": "object",
            "additionalProperties": {"type": "string"},
            "description": 'values for the template: {{ index .ExtraContext "name" }}',
        },
        "pre_install_scripts": {
            "type": "object",
            "propertyNames": {"pattern": "^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$"},
            "additionalProperties": _BASE64,
            "description": "scripts (base64) run as root in name order from "
            "/garm-pre-install/ before the install script",
        },
        "disable_updates": {
            "type": "boolean",
            "description": "no package upgrade at boot, and no default packages (curl, tar)",
        },
        "extra_packages": {
            "type": "array",
            "items": {"type": "string", "minLength": 1},
            "description": "packages cloud-init installs",
        },
        "enable_boot_debug": {
            "type": "boolean",
            "description": "EnableBootDebug for the template (set -x)",
        },
        "reconciler_pool": {
            "type": "string",
            "pattern": "^[A-Za-z0-9_-]{1,128}$",
            "description": "the reconciler pool (and so the tenant naming it) this GARM pool's "
            "runners are admitted in; the provider config's [garm_pools] entry for the "
            "pool's id wins over it",
        },
    },
    "additionalProperties": True,
}

CONFIG_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "reconciler GARM provider: configuration file (TOML)",
    "type": "object",
    "properties": {
        **{key: {"type": "string"} for key in STRING_KEYS},
        **{key: {"type": "number", "exclusiveMinimum": 0} for key in NUMBER_KEYS},
        **{key: {"type": "number", "minimum": 0} for key in WAIT_KEYS},
        "incus_verify": {"type": ["boolean", "string"]},
        "admission": {"enum": list(ADMISSION_VERBS)},
        "incus": {
            "type": "object",
            "properties": {"hosts": {"type": "object", "additionalProperties": {"type": "string"}}},
            "additionalProperties": False,
        },
        "pools": {"type": "object", "additionalProperties": {"type": "string"}},
        "garm_pools": {"type": "object", "additionalProperties": {"type": "string"}},
    },
    "additionalProperties": False,
}
