"""``reconciler cordon HOST``: admit nothing new on a host; what runs there stays."""

from __future__ import annotations

from reconciler.cli.host_command import host_command

__all__ = ["cordon_cmd"]

cordon_cmd = host_command(
    "cordon",
    short_help="Admit nothing new on a host.",
    help_text="""Admit nothing new on HOST, whatever its snapshot says; its leases stay.

    The cordon is the host's on the bus, folded like any other input: it outlives a
    restart of the bridge and a reinstall of the host, until `reconciler uncordon`.

    \b
    Example:
      reconciler cordon host-03
    """,
)
