"""``reconciler drain HOST``: cordon a host and delete its idle warm VMs."""

from __future__ import annotations

from reconciler.cli.host_command import host_command

__all__ = ["drain_cmd"]

drain_cmd = host_command(
    "drain",
    short_help="Cordon a host and delete its idle warm VMs.",
    help_text="""Cordon HOST and delete its idle warm VMs (booting, or ready and
    unclaimed); claimed VMs and cold leases run to their end. `reconciler status` shows
    the host draining, then drained once it holds no lease.

    \b
    Example:
      reconciler drain host-03 && reconciler status --db ./reconciler.db
    """,
)
