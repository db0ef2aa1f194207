"""``reconciler demo`` (reconciler.demo: simulated, real_incus): the story on a simulated
fleet, and on a private real Incus daemon, each replayed without a divergence."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from reconciler.cli.main import cli
from tests.support import realincus

pytestmark = pytest.mark.timeout(90)


def test_the_demo_runs_the_story_and_replays_it(tmp_path: Path) -> None:
    """The README's main job: nats-server, simulated fleet, replica, bridge, executor."""
    result = CliRunner().invoke(cli, ["demo", "--db", str(tmp_path / "demo.db"), "--quiet"])
    assert result.exit_code == 0, result.output
    assert "1 x admit-preemptible pending → admitted" in result.output
    assert "2 x claim-warm claimed" in result.output
    assert re.search(r"Summary of \d+ requests", result.output)
    assert re.search(r"executor commands: \{'create': [45], 'delete': 1\}", result.output)
    assert "dead letters: 2" in result.output
    assert "replay of the input stream: no divergences, same digest" in result.output


@pytest.mark.real_incus
def test_the_demo_runs_on_a_real_incus_daemon(tmp_path: Path) -> None:
    """``demo --incus-real``: the same story on containers of a private Incus daemon of
    its own (not the session's), replayed without a divergence."""
    reason = realincus.unavailable()
    if reason is not None:
        if realincus.required():
            pytest.fail(f"{realincus.REQUIRE_ENV} is set but {reason}", pytrace=False)
        pytest.skip(reason)
    db = tmp_path / "demo.db"
    result = CliRunner().invoke(cli, ["demo", "--incus-real", "--db", str(db), "--quiet"])
    assert result.exit_code == 0, result.output
    assert "1 x admit-preemptible pending → admitted" in result.output
    assert "1 x claim-warm claimed" in result.output
    assert "dead letters: 0" in result.output
    assert "replay of the input stream: no divergences, same digest" in result.output
