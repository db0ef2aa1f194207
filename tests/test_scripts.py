"""The scripts of ``scripts/``.

- ``scripts/bench --quick`` runs end to end and prints one JSON line of the agreed shape.
  Only the shape is checked, never the numbers: performance is judged by reading the
  benchmark's output, not by timed tests (engineering rule).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.support.natsserver import find_binary
from tests.support.repo import ROOT

NUMBER = (int, float)


def run_quick_bench(tmp_path: Path) -> tuple[int, list[str], str]:
    binary = find_binary()
    if binary is None:
        pytest.skip("scripts/bench starts its own nats-server: none installed")
    proc = subprocess.run(
        [str(ROOT / "scripts" / "bench"), "--quick", "--nats-server", binary],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=150,
        # the interpreter running the tests; scratch files under this test's directory
        env={**os.environ, "RC_VENV": sys.prefix, "TMPDIR": str(tmp_path)},
    )
    return proc.returncode, proc.stdout.splitlines(), proc.stderr


def assert_numbers(found: dict[str, Any], *keys: str) -> None:
    for key in keys:
        assert isinstance(found[key], NUMBER) and not isinstance(found[key], bool), key
        assert found[key] >= 0, key


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_quick_bench_prints_one_json_line_with_every_figure(tmp_path: Path) -> None:
    code, lines, stderr = run_quick_bench(tmp_path)

    assert code == 0, stderr[-3000:]
    assert len(lines) == 1, lines
    result = orjson.loads(lines[0])
    assert result["ok"] is True and result["errors"] == []
    assert_numbers(
        result,
        "fold_events_per_s",
        "baseline_fetch_ack_per_s",
        "ratio",
        "offered_rate_per_s",
        "peak_rss_mib",
        "messages",
        "batch",
        "hosts",
        "leases",
    )
    assert set(result["latency_ms"]) >= {"p50", "p90", "p99", "max"}
    assert_numbers(result["latency_ms"], "p50", "p90", "p99", "max")
    assert result["quick"] is True and result["skipped"] == []
    assert result["throughput"]["decisions"] == result["throughput"]["commands"]
    assert result["throughput"]["dead_letters"] == 0
    assert result["rss"]["leases"] >= result["leases"]
    assert_numbers(result, "io_floor_per_s", "ratio_io_floor")
    assert result["soak"] is None and result["soak_commands"] is None  # only with --soak
    for name in ("ratio", "ratio_io_floor", "latency_p99_ms", "peak_rss_mib"):
        assert isinstance(result["targets"][name]["pass"], bool), name
    # issue 15: latency with a large fleet, and replay from a snapshot against a bare read
    assert_numbers(result["fleet_latency_ms"], "p50", "p90", "p99", "max")
    assert result["fleet"]["hosts"] == result["fleet_hosts"]
    assert_numbers(result, "snapshot_ratio", "replay_from_snapshot_per_s", "bare_read_per_s")
    assert result["snapshot"]["tail_inputs"] > 0 and result["snapshot"]["compared"] > 0
    # three replays, each against the bare reads on either side: the figure is the median
    rounds = result["snapshot"]["rounds"]
    assert len(rounds) == 3 and result["snapshot_ratio"] == sorted(rounds)[1]
    for name in ("fleet_latency_p99_ms", "snapshot_ratio"):
        assert isinstance(result["targets"][name]["pass"], bool), name
    assert isinstance(result["machine"]["cpu_count"], int)
    assert isinstance(result["versions"]["nats_server"], str)
    assert isinstance(result["versions"]["nats_py"], str)
    # nothing left behind in the temporary directory it was given
    assert list(tmp_path.iterdir()) == []
