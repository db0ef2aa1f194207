"""compose/'s Prometheus alert rules and Grafana dashboard: they parse, and name the
replicas' counters with their ``_total`` suffix. That every metric they name is exported
by a running replica, bridge or executor, and promtool's checks, are in
tests/test_compose_alert_rules.py."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.repo import ROOT

ALERTS = ROOT / "compose" / "prometheus" / "alerts.yml"
DASHBOARD = ROOT / "compose" / "grafana" / "dashboards" / "reconciler.json"
METRIC = re.compile(r"\b(rc_[a-z0-9_]+)\b")


def alert_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(ALERTS.read_text())
    rules = [rule for group in doc["groups"] for rule in group["rules"]]
    assert rules
    return rules


def dashboard_exprs() -> list[str]:
    doc = json.loads(DASHBOARD.read_text())
    return [t["expr"] for panel in doc["panels"] for t in panel["targets"]]


def balanced(expr: str) -> bool:
    depth = {"(": 0, "[": 0, "{": 0}
    closing = {")": "(", "]": "[", "}": "{"}
    for ch in expr:
        if ch in depth:
            depth[ch] += 1
        elif ch in closing:
            depth[closing[ch]] -= 1
            if depth[closing[ch]] < 0:
                return False
    return all(v == 0 for v in depth.values())


def test_the_alert_rules_parse() -> None:
    names = set()
    for rule in alert_rules():
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule
        assert re.fullmatch(r"[A-Z][A-Za-z]+", rule["alert"])
        assert rule["alert"] not in names
        names.add(rule["alert"])
        assert balanced(rule["expr"]), rule["expr"]
        assert rule["labels"]["severity"] in ("warning", "critical")
        assert rule["annotations"]["summary"]
        if "for" in rule:
            assert re.fullmatch(r"\d+[smh]", rule["for"])


def test_the_dashboard_parses() -> None:
    doc = json.loads(DASHBOARD.read_text())
    assert doc["uid"] and doc["panels"]
    assert len({p["id"] for p in doc["panels"]}) == len(doc["panels"])
    for expr in dashboard_exprs():
        assert balanced(expr), expr


@pytest.mark.parametrize("path", [ALERTS, DASHBOARD])
def test_no_metric_is_named_without_its_counter_suffix(path: Path) -> None:
    # prometheus-client exports a counter "x" as "x_total": "x" alone matches nothing
    counters = ("rc_decisions", "rc_inputs_folded", "rc_dead_letters", "rc_outbox_published")
    text = path.read_text()
    for counter in counters:
        assert not re.search(rf"\b{counter}\b(?!_total)", text), counter
