"""The ``reconciler`` command group (docs/cli.md): every command, each in its own module of
:mod:`reconciler.cli.commands`, loaded only when it runs or when ``--help`` lists it, so
that ``reconciler run`` never loads pylxd, the Incus simulator or aiohttp's server."""

from __future__ import annotations

import importlib

import click

__all__ = ["COMMANDS", "cli", "main"]

#: command name → (module, attribute) of its :class:`click.Command`
COMMANDS: dict[str, tuple[str, str]] = {
    "apply": ("reconciler.cli.commands.apply", "apply_cmd"),
    "audit": ("reconciler.cli.commands.audit", "audit"),
    "bridge": ("reconciler.cli.commands.bridge", "bridge"),
    "cmd": ("reconciler.cli.commands.cmd", "send_cmd"),
    "cordon": ("reconciler.cli.commands.cordon", "cordon_cmd"),
    "credentials": ("reconciler.cli.commands.credentials", "credentials"),
    "delete": ("reconciler.cli.commands.delete", "delete_cmd"),
    "demo": ("reconciler.cli.commands.demo", "demo"),
    "diff": ("reconciler.cli.commands.diff", "diff_cmd"),
    "drain": ("reconciler.cli.commands.drain", "drain_cmd"),
    "executor": ("reconciler.cli.commands.executor", "executor"),
    "garm-provider": ("reconciler.cli.commands.garm_provider", "garm_provider"),
    "get": ("reconciler.cli.commands.get", "get_cmd"),
    "provision": ("reconciler.cli.commands.provision", "provision"),
    "query": ("reconciler.cli.commands.query", "query_cmd"),
    "replay": ("reconciler.cli.commands.replay", "replay_command"),
    "run": ("reconciler.cli.commands.run", "run"),
    "sim-incus": ("reconciler.cli.commands.sim_incus", "sim_incus"),
    "status": ("reconciler.cli.commands.status", "status"),
    "uncordon": ("reconciler.cli.commands.uncordon", "uncordon_cmd"),
    "web": ("reconciler.cli.commands.web", "web"),
}


class _Commands(click.Group):
    """The command group: each command imported from its module when it is needed."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        found = COMMANDS.get(cmd_name)
        if found is None:
            return None
        module, attr = found
        command = getattr(importlib.import_module(module), attr)
        assert isinstance(command, click.Command)
        return command


@click.group(
    cls=_Commands,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@click.version_option(package_name="reconciler")
def cli() -> None:
    """Admission control for self-hosted CI runners on Incus.

    The interface (subjects, payloads, decisions, queries) is described in
    docs/interface.md of the project, and every command in docs/cli.md.
    """


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
