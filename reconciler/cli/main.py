"""The ``reconciler`` command line."""

from __future__ import annotations

from pathlib import Path

import anyio
import click

from reconciler.cli.demo import run_demo


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="reconciler")
def cli() -> None:
    """Admission control for self-hosted CI runners on Incus (see CONTRACT.md)."""


@cli.command()
@click.option(
    "--db",
    type=click.Path(dir_okay=False, path_type=Path),
    default=Path("demo.db"),
    envvar="RC_DB",
    show_default=True,
    help="SQLite file to fold the scripted fleet into (recreated).",
)
@click.option("--quiet", is_flag=True, help="Print only the summary.")
def demo(db: Path, quiet: bool) -> None:
    """Fold a scripted fleet into SQLite and summarise every decision."""
    summary = anyio.run(lambda: run_demo(db, echo=not quiet))
    outcomes: dict[str, int] = {}
    for d in summary.decisions:
        key = f"{d['verb']} {d['phase']} {d['outcome']}"
        outcomes[key] = outcomes.get(key, 0) + 1
    click.echo("\nSummary of decisions")
    for key, n in sorted(outcomes.items()):
        click.echo(f"  {n:>3} x {key}")
    click.echo(f"  executor commands: {dict(summary.commands)}")
    click.echo(f"  dead letters: {len(summary.dead_letters)}")
    click.echo(f"  journal: {db} (state reloaded from it equals the folded state)")


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
