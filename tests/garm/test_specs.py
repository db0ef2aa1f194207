"""A pool's extra specs (reconciler.garm.specs): GARM's and the Incus provider's keys
read, their schema agreeing with the reader, bad ones refused naming the key."""

from __future__ import annotations

from typing import Any

import jsonschema_rs
import pytest

from reconciler.garm.protocol import ProviderError
from reconciler.garm.schemas import EXTRA_SPECS_SCHEMA
from reconciler.garm.specs import parse_extra_specs
from tests.support.garm import SPECS

pytestmark = pytest.mark.timeout(60)


def test_extra_specs_are_read_with_garms_and_the_incus_providers_keys() -> None:
    specs = parse_extra_specs(
        {
            **SPECS,
            "extra_context": {"marker": "m"},
            "disable_updates": True,
            "enable_boot_debug": False,
            "reconciler_pool": "team-a-small",
            "someone_elses": {"kept": "out of the way"},
        }
    )
    assert specs.reconciler_pool == "team-a-small"
    assert specs.pre_install_scripts == (("01-first", b"echo one\n"), ("02-second", b"echo two\n"))
    assert specs.extra_packages == ("jq", "curl") and specs.extra_context == {"marker": "m"}
    assert specs.disable_updates is True and specs.enable_boot_debug is False
    assert parse_extra_specs(None) == parse_extra_specs({})


def test_the_extra_specs_schema_takes_what_the_provider_takes() -> None:
    validator = jsonschema_rs.validator_for(EXTRA_SPECS_SCHEMA)
    good = {
        **SPECS,
        "extra_context": {"a": "b"},
        "disable_updates": True,
        "reconciler_pool": "ci-small",
        "other": 1,
    }
    assert validator.is_valid(good)
    for bad in (
        {"pre_install_scripts": {"../x": "eA=="}},
        {"extra_context": {"a": 1}},
        {"extra_packages": [""]},
        {"enable_boot_debug": "yes"},
        {"reconciler_pool": "a pool"},
    ):
        assert not validator.is_valid(bad), bad
        with pytest.raises(ProviderError):
            parse_extra_specs(bad)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"pre_install_scripts": ["x"]}, "map script names to base64"),
        ({"pre_install_scripts": {"../etc/passwd": "eA=="}}, "is not a file name"),
        ({"pre_install_scripts": {".hidden": "eA=="}}, "is not a file name"),
        ({"pre_install_scripts": {"01-x": "not base64!"}}, "01-x is not base64"),
        ({"extra_context": {"a": 1}}, "extra_context must map names to strings"),
        ({"disable_updates": "yes"}, "disable_updates must be true or false"),
        ({"extra_packages": "jq"}, "extra_packages must be a list"),
        ({"runner_install_template": 42}, "must be a base64 string"),
        ({"reconciler_pool": ["x"]}, "reconciler_pool must be a pool name"),
        ([1], "extra specs must be a JSON object"),
    ],
)
def test_bad_extra_specs_are_refused_naming_the_key(raw: Any, message: str) -> None:
    with pytest.raises(ProviderError, match=message):
        parse_extra_specs(raw)
