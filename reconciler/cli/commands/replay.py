"""``reconciler replay``: fold the input stream again and compare every output with the
output stream; prints the report (or one JSON object) and exits 1 on any divergence.
While it folds, a terminal's standard error shows how far it is, its rate and the time
left (:mod:`reconciler.cli.progress`); nothing when standard error is not a terminal.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import anyio
import click
import orjson

from reconciler.cli.oneshot import once
from reconciler.cli.options import (
    bus_options,
    common_from,
    connect_timeout_option,
    decision_retention_option,
    oneshot_log_options,
)
from reconciler.cli.progress import Progress
from reconciler.replay.replay import ReplayError, replay
from reconciler.store.errors import StoreError

__all__ = ["replay_command"]


@click.command("replay")
@bus_options
@click.option(
    "--db",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Fold into this new SQLite file and keep it (default: a database in memory).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object.")
@click.option(
    "--show", type=click.IntRange(min=0), default=20, show_default=True, help="Divergences shown."
)
@click.option(
    "--from-snapshot",
    is_flag=True,
    help="Start from a snapshot even when the stream still starts at seq 1 (always done "
    "when its oldest inputs aged out).",
)
@connect_timeout_option
@decision_retention_option
@oneshot_log_options
def replay_command(
    db: Path | None,
    as_json: bool,
    show: int,
    from_snapshot: bool,
    connect_timeout: float,
    **kwargs: Any,
) -> None:
    """Fold the input stream into a fresh database and compare every decision with the
    output stream. Prints a digest of the state; exits 1 on any divergence."""
    common = common_from(kwargs, name="reconciler-replay")
    retention = kwargs["decision_retention"]
    # on a terminal only (standard error): inputs folded, their rate and the time left
    progress = Progress("replay", unit="inputs")
    try:
        report = anyio.run(
            lambda: replay(
                once(common.nats, connect_timeout),
                prefix=common.prefix,
                db=db,
                decision_retention_s=retention,
                from_snapshot=from_snapshot,
                progress=progress,
            )
        )
    except TimeoutError as exc:
        raise click.ClickException(f"{exc} (--connect-timeout {connect_timeout:g})") from exc
    except (ReplayError, StoreError) as exc:
        raise click.ClickException(str(exc)) from exc
    if as_json:
        click.echo(
            orjson.dumps(
                {
                    "ok": report.ok,
                    "first_seq": report.first_seq,
                    "last_seq": report.last_seq,
                    "inputs": report.inputs,
                    "dead_letters": report.dead_letters,
                    "outputs": report.outputs,
                    "compared": report.compared,
                    "divergences": len(report.divergences),
                    "digest": report.digest,
                    "snapshot_seq": report.snapshot_seq,
                    "snapshot_digest": report.snapshot_digest,
                    "older": report.older,
                    "details": [
                        {
                            "kind": d.kind,
                            "msg_id": d.msg_id,
                            "subject": d.subject,
                            "expected": (d.expected or b"").decode(errors="replace"),
                            "found": (d.found or b"").decode(errors="replace"),
                        }
                        for d in report.divergences[:show]
                    ],
                }
            )
        )
    else:
        if report.snapshot_seq:
            click.echo(
                f"started from the snapshot at seq {report.snapshot_seq} "
                f"(digest {report.snapshot_digest}): decisions before it are not compared"
            )
        click.echo(
            f"replayed inputs {report.first_seq}..{report.last_seq}: {report.inputs} folded "
            f"({report.dead_letters} dead-lettered), {report.outputs} outputs, "
            f"{report.compared} compared with the output stream"
        )
        for name, count in sorted(report.older.items()):
            click.echo(f"{count} outputs written by an older release, without {name} (added since)")
        click.echo(f"state digest: {report.digest}")
        for d in report.divergences[:show]:
            click.secho(f"  {d.kind:<10} {d.msg_id}  ({d.subject})", fg="red")
            if d.expected is not None:
                click.echo(f"    replay: {d.expected.decode(errors='replace')}")
            if d.found is not None:
                click.echo(f"    stream: {d.found.decode(errors='replace')}")
        if report.divergences:
            click.secho(f"{len(report.divergences)} divergences", fg="red", bold=True)
        else:
            click.secho("no divergences", fg="green")
    sys.exit(0 if report.ok else 1)
