"""``reconciler audit <identifier>``: a lease's timeline, from the store and the IN stream.

For every lease the identifier names (a job, an instance, a lease id, a request id), the
timeline lists, in stream order: each input that touched it (subject and a one-line
payload, fetched from the IN stream by sequence when NATS is reachable), the lease
transitions it caused (from the append-only journal, a preemption naming the request that
caused it), the decisions that name the lease (every phase from the OUT stream, e.g. a
preemptible admission's ``pending`` then its ``admitted``; the latest one from the store
without NATS), and the executor commands published for the lease.

Reading the bus connects once, bounded by ``--connect-timeout``; a stream that does not
exist is an error, not an empty timeline. The store is opened read-only and must be a
replica's store.
When ``--journal-retention`` pruned the journal, a first line says since when history is
incomplete. Reading a busy host's executor commands walks the OUT stream: a terminal's
standard error shows how far (stream sequences), the rate and the time left
(:mod:`reconciler.cli.progress`); nothing when standard error is not a terminal.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import click
import orjson
import structlog
from nats.js.errors import NotFoundError

from reconciler.bus.connection import ConnectOptions
from reconciler.bus.streams import StreamNames
from reconciler.cli.oneshot import connect_once, missing_stream, once
from reconciler.cli.options import (
    DEFAULT_CONNECT_TIMEOUT_S,
    bus_options,
    common_from,
    connect_timeout_option,
    db_option,
    oneshot_log_options,
)
from reconciler.cli.progress import Progress
from reconciler.store.errors import StoreError
from reconciler.store.sqlite import Store

__all__ = ["audit", "audit_lines"]

logger = structlog.get_logger(__name__)

_PAYLOAD_CHARS = 240


async def audit_lines(
    identifier: str,
    *,
    db: Path,
    nats: ConnectOptions | None,
    prefix: str,
    as_json: bool = False,
) -> list[str]:
    """The lines to print; :class:`LookupError` when nothing is known by ``identifier``."""
    if not await anyio.Path(db).exists():
        raise LookupError(f"no store at {db} (use --db or RC_DB)")
    async with await Store.open_readonly(db) as store:
        leases = await store.find_leases(identifier)
        if not leases:
            raise LookupError(f"nothing in {db} is known as {identifier!r}")
        timelines: list[tuple[Any, dict[int, list[dict[str, Any]]]]] = []
        request_ids: dict[str, list[str]] = {}
        for lease in leases:
            events: dict[int, list[dict[str, Any]]] = defaultdict(list)
            for row in await store.lease_history(lease.lease_id):
                if row["to_state"] == "victim" and lease.victim_of is not None:
                    row = {**row, "by_request": str(lease.victim_of)}
                events[row["input_seq"]].append({"type": "transition", **row})
            request_ids[lease.lease_id] = []
            for record in await store.decisions_for(lease_id=lease.lease_id):
                body = orjson.loads(record.payload)
                request_ids[lease.lease_id].append(str(body["request_id"]))
                events[int(body["input_seq"])].append({"type": "decision", **body})
            timelines.append((lease, events))
        pruned_before, pruned_rows = await store.journal_pruned()
    inputs: dict[int, dict[str, Any]] = {}
    if nats is not None:
        inputs = await _from_bus(timelines, request_ids, nats=nats, prefix=prefix)
    lines: list[str] = []
    if pruned_before:
        when = dt.datetime.fromtimestamp(pruned_before, dt.UTC).isoformat()
        lines.append(
            orjson.dumps({"type": "history-pruned", "before": when, "rows": pruned_rows}).decode()
            if as_json
            else f"history pruned: journal rows before {when} were deleted "
            f"(--journal-retention; {pruned_rows} rows in all)"
        )
    for lease, events in timelines:
        if as_json:
            lines.extend(_json_lines(lease, events, inputs))
        else:
            lines.extend(_text_lines(lease, events, inputs))
    return lines


async def _from_bus(
    timelines: list[tuple[Any, dict[int, list[dict[str, Any]]]]],
    request_ids: dict[str, list[str]],
    *,
    nats: ConnectOptions,
    prefix: str,
) -> dict[int, dict[str, Any]]:
    """Complete the timelines from the streams (every decision phase, the executor
    commands) and return the inputs they name, by sequence."""
    names = StreamNames.for_prefix(prefix)
    nc = await connect_once(nats, nats.initial_timeout_s or DEFAULT_CONNECT_TIMEOUT_S)
    try:
        js = nc.jetstream()
        last_out = 0
        for stream in (names.in_stream, names.out_stream):
            try:
                info = await js.stream_info(stream)
            except NotFoundError:
                raise missing_stream(stream, prefix) from None
            last_out = int(info.state.last_seq or 0)
        # the OUT stream is walked once per lease for its host's commands: its sequences
        progress = Progress("audit", unit="OUT stream messages", total=last_out * len(timelines))
        for at, (lease, events) in enumerate(timelines):
            decided = [
                await _all(js, names.out_stream, names.subjects.decision(rid))
                for rid in request_ids[lease.lease_id]
            ]
            if any(decided):
                for seq in list(events):
                    events[seq] = [e for e in events[seq] if e["type"] != "decision"]
                for phases in decided:
                    for _, body in phases:
                        events[int(body["input_seq"])].append({"type": "decision", **body})
            commands = await _all(
                js,
                names.out_stream,
                names.subjects.exec_commands(lease.host),
                on_seq=functools.partial(_advance, progress, at * last_out),
            )
            for out_seq, body in commands:
                if body.get("lease_id") == lease.lease_id:
                    verb = "delete" if "reason" in body else "create"
                    command = {"type": "command", "verb": verb, "output_seq": out_seq, **body}
                    events[_input_seq_of(events, command)].append(command)
        progress.update(last_out * len(timelines))
        progress.done()
        seqs = sorted({seq for _, events in timelines for seq in events})
        found: dict[int, dict[str, Any]] = {}
        for seq in seqs:
            try:
                msg = await js.get_msg(names.in_stream, seq)
            except NotFoundError:
                found[seq] = {"subject": None, "payload": "(aged out of the stream)"}
                continue
            data = msg.data or b""
            text = data.decode(errors="replace")
            found[seq] = {
                "subject": msg.subject,
                "time": msg.time.isoformat() if msg.time else None,
                "payload": text if len(text) <= _PAYLOAD_CHARS else text[:_PAYLOAD_CHARS] + "…",
            }
    finally:
        await nc.close()
    return found


def _advance(progress: Progress, base: int, seq: int) -> None:
    progress.update(base + seq)


async def _all(
    js: Any, stream: str, subject: str, *, on_seq: Callable[[int], None] | None = None
) -> list[tuple[int, dict[str, Any]]]:
    """Every message of ``stream`` on ``subject`` (wildcards allowed), in order, decoded;
    ``on_seq`` is told the stream sequence reached after each."""
    found: list[tuple[int, dict[str, Any]]] = []
    seq = 1
    while True:
        try:
            msg = await js.get_msg(stream, seq=seq, subject=subject, next=True)
        except NotFoundError:
            return found
        with contextlib.suppress(orjson.JSONDecodeError):
            found.append((int(msg.seq), orjson.loads(msg.data or b"{}")))
        seq = int(msg.seq) + 1
        if on_seq is not None:
            on_seq(int(msg.seq))


def _input_seq_of(events: dict[int, list[dict[str, Any]]], command: dict[str, Any]) -> int:
    """Where an executor command goes in the timeline. It names no input, so it follows the
    transition that called for it: a create the admission, a delete for a preemption the
    move to ``victim``, one for a drain the move to ``draining``, any other the latest."""
    moves = sorted(
        (seq, e["to_state"])
        for seq, evs in events.items()
        for e in evs
        if e["type"] == "transition"
    )
    if not moves:
        return 0
    if "reason" not in command:
        return moves[0][0]
    wanted = {"preempted": "victim", "drained": "draining"}.get(str(command["reason"]))
    for seq, state in moves:
        if state == wanted:
            return seq
    return moves[-1][0]


def _header(lease: Any) -> str:
    job = f" job={lease.job}" if lease.job else ""
    gpus = f" gpus={list(lease.gpus)}" if lease.gpus else ""
    fault = f"\n  fault: {lease.fault}" if lease.fault else ""
    return (
        f"lease {lease.lease_id}: {lease.instance} on {lease.host} ({lease.pool}, "
        f"{lease.kind.value}) is {lease.state.value}{job}{gpus}{fault}"
    )


def _text_lines(
    lease: Any, events: dict[int, list[dict[str, Any]]], inputs: dict[int, dict[str, Any]]
) -> list[str]:
    lines = [_header(lease)]
    for seq in sorted(events):
        given = inputs.get(seq)
        if given is not None:
            lines.append(f"  [{seq:>8}] {given.get('subject')}  {given.get('payload')}")
        else:
            lines.append(f"  [{seq:>8}]")
        for e in events[seq]:
            if e["type"] == "transition":
                by = f", by request {e['by_request']}" if "by_request" in e else ""
                lines.append(
                    f"             {e['from_state'] or '∅'} → {e['to_state']}  ({e['event']}{by})"
                )
            elif e["type"] == "command":
                why = f" ({e['reason']})" if "reason" in e else ""
                lines.append(
                    f"             executor {e['verb']}{why} {e['instance']} on {e['host']}  "
                    f"command {e['command_id']} [output {e['output_seq']}]"
                )
            else:
                why = f" ({e['reason']})" if "reason" in e else ""
                place = f" #{e['position']} in line" if "position" in e else ""
                detail = f": {e['detail']}" if "detail" in e else ""
                lines.append(
                    f"             decision {e['verb']} {e['request_id']} {e['phase']} "
                    f"{e['outcome']}{why}{place}{detail}"
                )
    return lines


def _json_lines(
    lease: Any, events: dict[int, list[dict[str, Any]]], inputs: dict[int, dict[str, Any]]
) -> list[str]:
    out = [orjson.dumps({"type": "lease", **lease.as_dict()}).decode()]
    for seq in sorted(events):
        if seq in inputs:
            out.append(orjson.dumps({"type": "input", "input_seq": seq, **inputs[seq]}).decode())
        out.extend(orjson.dumps(e).decode() for e in events[seq])
    return out


@click.command("audit")
@click.argument("identifier")
@bus_options
@db_option
@click.option("--json", "as_json", is_flag=True, help="Print the timeline as JSON lines.")
@click.option(
    "--no-inputs",
    is_flag=True,
    help="Do not fetch the input messages from the stream (works without NATS).",
)
@connect_timeout_option
@oneshot_log_options
def audit(
    identifier: str, as_json: bool, no_inputs: bool, connect_timeout: float, **kwargs: Any
) -> None:
    """A lease's timeline: its inputs, transitions and decisions, with stream sequences.

    IDENTIFIER is a job identity, an instance name, a lease id or a request id.
    """
    common = common_from(kwargs, name="reconciler-audit")
    try:
        lines = anyio.run(
            lambda: audit_lines(
                identifier,
                db=kwargs["db"],
                nats=None if no_inputs else once(common.nats, connect_timeout),
                prefix=common.prefix,
                as_json=as_json,
            )
        )
    except LookupError as exc:
        raise click.ClickException(str(exc)) from exc
    except StoreError as exc:
        raise click.ClickException(str(exc)) from exc
    for line in lines:
        click.echo(line)
