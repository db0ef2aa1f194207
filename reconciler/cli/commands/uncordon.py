"""``reconciler uncordon HOST``: lift a host's cordon or drain."""

from __future__ import annotations

from reconciler.cli.host_command import host_command

__all__ = ["uncordon_cmd"]

uncordon_cmd = host_command(
    "uncordon",
    short_help="Lift a host's cordon or drain.",
    help_text="""Lift HOST's cordon or drain: new work may land there again.

    A host whose snapshot says unschedulable (the bridge's --hosts-config) still admits
    nothing: the decision says so.

    \b
    Example:
      reconciler uncordon host-03
    """,
)
