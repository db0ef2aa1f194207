"""Permission violations recognised in nats-py's errors (reconciler.bus.violations)."""

from __future__ import annotations

from reconciler.bus.violations import PermissionViolation, ViolationWatch, parse_violation


def test_violations_are_recognised_in_nats_py_errors() -> None:
    found = parse_violation('nats: permissions violation for publish to "rc.in.cmd.admit"')
    assert found is not None
    assert (found.operation, found.subject) == ("publish", "rc.in.cmd.admit")
    assert "rc.in.cmd.admit" in str(found) and "publish permission" in str(found)
    sub = parse_violation("nats: Permissions Violation for Subscription to _INBOX.x.>")
    assert sub is not None and (sub.operation, sub.subject) == ("subscribe", "_INBOX.x.>")
    assert parse_violation("nats: stale connection") is None
    watch = ViolationWatch()
    assert watch.record("nats: slow consumer") is None and watch.count == 0
    recorded = watch.record('nats: permissions violation for publish to "rc.out.x"')
    assert isinstance(recorded, PermissionViolation) and watch.count == 1
