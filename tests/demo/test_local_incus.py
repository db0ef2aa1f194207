"""The private real Incus daemon itself (tests/support/realincus.py): up, image, ready signal."""

from __future__ import annotations

import time

import pytest

from tests.support.realincus import RealIncus

pytestmark = pytest.mark.real_incus


def test_the_daemon_is_an_incus_lts_with_the_busybox_image(real_incus: RealIncus) -> None:
    server = real_incus.query("/1.0")
    assert isinstance(server, dict)
    assert server["environment"]["server"] == "incus"
    assert real_incus.version.split(".")[0] == "6"
    aliases = real_incus.query("/1.0/images/aliases")
    # the session's daemon is shared: other tests import images of their own (the GARM
    # tests' slow image), in any order; the fixture's own image is always there
    assert isinstance(aliases, list)
    assert "/1.0/images/aliases/busybox" in aliases


def test_a_container_of_the_test_image_signals_ready_at_boot(real_incus: RealIncus) -> None:
    real_incus.launch("fixture-ready")

    status: object = None
    for _ in range(100):
        found = real_incus.query("/1.0/instances/fixture-ready")
        assert isinstance(found, dict)
        status = found["status"]
        if status == "Ready":
            break
        time.sleep(0.05)
    assert status == "Ready"
