"""``reconciler garm-provider``: GARM's external provider (see ``docs/garm.md``).

GARM runs it with no arguments: the command is ``GARM_COMMAND``, the configuration the
TOML file named by ``GARM_PROVIDER_CONFIG_FILE``. The console script
``reconciler-garm-provider`` is the same program without the command group, for GARM's
``provider_executable``.
"""

from __future__ import annotations

import click

from reconciler.garm.program import main

__all__ = ["garm_provider"]


@click.command(
    "garm-provider",
    context_settings={"ignore_unknown_options": True},
    epilog="Environment: GARM_COMMAND, GARM_CONTROLLER_ID, GARM_PROVIDER_CONFIG_FILE, "
    "GARM_POOL_ID, GARM_INSTANCE_ID, GARM_POOL_EXTRASPECS (set by GARM). "
    "Exit codes: 0 ok, 30 not found, 31 duplicate, 1 failure.",
)
def garm_provider() -> None:
    """Answer one GARM external-provider call (stdin: GARM's bootstrap JSON)."""
    main()
