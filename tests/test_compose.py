"""``compose/`` as Docker Compose and Prometheus read it (its images cannot be pulled
here). The compose file is valid against the Compose specification's JSON Schema and
consistent with what the rest of the repository proves: the components run as the
image's unprivileged user with no capability and no group, reach Incus over HTTPS with
the client certificates ``reconciler credentials`` makes (as
tests/system/test_deployment_systemd.py does under systemd), and use exactly the
credentials files it writes; the NATS nodes mount their configuration where
``server.conf`` includes the generated accounts from; GARM's configuration names only the
client ports compose publishes. The Prometheus alert rules and the Grafana dashboard
parse, and name the replicas' counters with their ``_total`` suffix; that every metric
they name is exported by a running replica, bridge or executor, and promtool's checks,
are in tests/test_compose_alert_rules.py."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Any

import jsonschema_rs
import pytest
import yaml
from click.testing import CliRunner

from reconciler.cli.main import cli
from tests.support.cluster import INCUS_HOSTS, REPLICAS
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
    # a row is a heading: it holds no query (its panels follow it, not collapsed)
    panels = [panel for panel in doc["panels"] if panel["type"] != "row"]
    assert all(panel["targets"] for panel in panels)
    return [t["expr"] for panel in panels for t in panel["targets"]]


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


def test_the_dashboard_shows_the_fleet_first_and_the_machinery_below() -> None:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    rows = [(p["title"], p["gridPos"]["y"]) for p in panels if p["type"] == "row"]
    assert [title for title, _ in rows] == ["Fleet", "Machinery"]
    below = rows[1][1]
    fleet = [p for p in panels if p["type"] != "row" and p["gridPos"]["y"] < below]
    named = {m for p in fleet for t in p["targets"] for m in METRIC.findall(t["expr"])}
    for metric in ("rc_fleet_capacity", "rc_host_booked", "rc_pool_leases",
                   "rc_warm_claims_total", "rc_decision_latency_seconds_bucket",
                   "rc_warm_boot_seconds_bucket", "rc_decision_outcomes_total",
                   "rc_queue_depth", "rc_queue_wait_seconds_bucket",
                   "rc_queue_requests_total"):  # fmt: skip
        assert metric in named, metric
    machinery = {"rc_leader", "rc_applied_seq", "rc_commit_seconds_total", "rc_dead_letters_total"}
    assert not named & machinery


@pytest.mark.parametrize("path", [ALERTS, DASHBOARD])
def test_no_metric_is_named_without_its_counter_suffix(path: Path) -> None:
    # prometheus-client exports a counter "x" as "x_total": "x" alone matches nothing
    counters = ("rc_decisions", "rc_inputs_folded", "rc_dead_letters", "rc_outbox_published")
    text = path.read_text()
    for counter in counters:
        assert not re.search(rf"\b{counter}\b(?!_total)", text), counter


COMPOSE = ROOT / "compose"
SPEC = ROOT / "tests" / "data" / "compose-spec.schema.json"


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    loaded = yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())
    assert isinstance(loaded, dict)
    return loaded


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    """The names of the files ``reconciler credentials`` makes for compose's fleet."""
    out = tmp_path_factory.mktemp("secrets")
    args = ["credentials", "--out", str(out)]
    args += [a for r in REPLICAS for a in ("--replica", r)]
    args += [a for h in INCUS_HOSTS for a in ("--incus-host", h)]
    done = CliRunner().invoke(cli, args)
    assert done.exit_code == 0, done.output
    return {p.name for p in out.iterdir()}


def components(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        name: service
        for name, service in compose["services"].items()
        if service.get("image") == "reconciler:local"
    }


def test_the_compose_file_follows_the_compose_specification(compose: dict[str, Any]) -> None:
    validator = jsonschema_rs.validator_for(json.loads(SPEC.read_text()))
    errors = [
        f"{'/'.join(map(str, e.instance_path))}: {e.message}"
        for e in validator.iter_errors(compose)
    ]
    assert errors == []


def test_the_components_run_unprivileged_and_reach_incus_over_https(
    compose: dict[str, Any],
) -> None:
    dockerfile = (COMPOSE / "Dockerfile").read_text()
    uid = re.search(r"useradd --system --uid (\d+)", dockerfile)
    assert uid is not None
    found = components(compose)
    assert set(found) == {"provision", *REPLICAS, "bridge", "executor"}
    for name, service in found.items():
        assert service["user"] == f"{uid.group(1)}:{uid.group(1)}", name
        assert service["cap_drop"] == ["ALL"] and service["read_only"] is True, name
        assert "no-new-privileges:true" in service["security_opt"], name
        assert "group_add" not in service and "privileged" not in service, name
        mounts = service.get("volumes", [])
        assert not [m for m in mounts if "unix.socket" in m or "/var/lib/incus" in m], name
        env = service["environment"]
        if name != "provision":
            # the fleet file and the hosts' pinned certificates; a client certificate each
            assert env["RC_INCUS_FLEET"] == "/etc/reconciler/fleet.json", name
            assert "./secrets/fleet.json:/etc/reconciler/fleet.json:ro" in mounts, name
            assert "./incus:/etc/reconciler/incus:ro" in mounts, name
            user = Path(env["RC_NATS_NKEY"]).stem
            assert env["RC_INCUS_CERT"] == f"/run/secrets/{user}-incus.pem", name
            assert env["RC_INCUS_KEY"] == f"/run/secrets/{user}-incus-key.pem", name
    # the fleet's hosts are pinned where fleet.json says: /etc/reconciler/incus/<host>.crt
    assert compose["services"]["provision"]["environment"]["RC_INCUS_FLEET"] == (
        "/etc/reconciler/fleet.json"
    )


def test_every_component_uses_its_own_generated_credentials(
    compose: dict[str, Any], made: set[str]
) -> None:
    declared = compose["secrets"]
    for secret, spec in declared.items():
        assert spec["file"] == f"./secrets/{secret}", secret
        assert secret in made, f"{secret} is not made by reconciler credentials"
    for name, service in components(compose).items():
        env = service["environment"]
        user = Path(env["RC_NATS_NKEY"]).stem
        assert env["RC_INBOX_PREFIX"] == f"_INBOX.{user}", name
        if name in REPLICAS:
            assert user == name == env["RC_REPLICA"]
        for key in ("RC_NATS_NKEY", "RC_TLS_CERT", "RC_TLS_KEY", "RC_TLS_CA",
                    "RC_INCUS_CERT", "RC_INCUS_KEY"):  # fmt: skip
            if key in env:
                secret = env[key].removeprefix("/run/secrets/")
                assert secret in service["secrets"], f"{name}: {key} names {secret}"
        assert env["RC_NATS_URL"] == "tls://nats-1:4222,tls://nats-2:4222,tls://nats-3:4222"


def test_the_nats_nodes_find_the_generated_accounts(compose: dict[str, Any]) -> None:
    conf = (COMPOSE / "nats" / "server.conf").read_text()
    assert 'include "../secrets/accounts.conf"' in conf
    for node in ("nats-1", "nats-2", "nats-3"):
        service = compose["services"][node]
        assert service["command"] == ["-c", "/etc/nats/conf/server.conf"]
        volumes = service["volumes"]
        assert "./nats:/etc/nats/conf:ro" in volumes and "./secrets:/etc/nats/secrets:ro" in volumes
        assert service["environment"]["NATS_CERT_FILE"] == f"/etc/nats/secrets/{node}.pem"


def test_garm_reaches_only_published_nats_ports(compose: dict[str, Any]) -> None:
    published: dict[str, int] = {}
    for name, service in compose["services"].items():
        for port in service.get("ports", []):
            host, host_port, container_port = port.split(":")
            assert host == "127.0.0.1", f"{name} publishes {port} beyond the loopback"
            if name.startswith("nats-") and container_port == "4222":
                published[name] = int(host_port)
    assert sorted(published) == ["nats-1", "nats-2", "nats-3"]
    config = tomllib.loads((COMPOSE / "garm-provider.toml").read_text())
    urls = config["nats_url"].split(",")
    assert urls == [f"tls://localhost:{published[n]}" for n in sorted(published)]
    # the provider reaches Incus like the bridge: a client certificate, a pinned server
    assert config["incus_cert"].endswith("/producer-incus.pem")
    assert config["incus_key"].endswith("/producer-incus-key.pem")
    assert config["incus_verify"].endswith(f"/{INCUS_HOSTS[0]}.crt")
    assert all(url.startswith("https://") for url in config["incus"]["hosts"].values())
