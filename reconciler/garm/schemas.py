"""The provider's JSON Schemas (``GetConfigJSONSchema``, ``GetExtraSpecsJSONSchema``) and
the names of its configuration file's keys, which :mod:`reconciler.garm.config` checks.

Rules: plain data only, no imports beyond typing, so the local commands GARM calls answer
without loading nats-py or pylxd.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ADMISSION_VERBS", "CONFIG_SCHEMA", "EXTRA_SPECS_SCHEMA", "NUMBER_KEYS", "STRING_KEYS"]

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
NUMBER_KEYS = ("decision_timeout", "query_timeout", "incus_timeout")

EXTRA_SPECS_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "reconciler GARM provider: pool extra specs",
    "type": "object",
    "properties": {
        "runner_install_template": {
            "type": "string",
            "description": "base64 of the rendered install script (GARM sets it itself)",
        }
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
        "incus_verify": {"type": ["boolean", "string"]},
        "admission": {"enum": list(ADMISSION_VERBS)},
        "incus": {
            "type": "object",
            "properties": {"hosts": {"type": "object", "additionalProperties": {"type": "string"}}},
            "additionalProperties": False,
        },
        "pools": {"type": "object", "additionalProperties": {"type": "string"}},
    },
    "additionalProperties": False,
}
