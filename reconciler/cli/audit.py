"""``reconciler audit <identifier>``: a lease's timeline, from the store and the IN stream.

For every lease the identifier names (a job, an instance, a lease id, a request id), the
timeline lists, in stream order: each input that touched it (subject and a one-line
payload, fetched from the IN stream by sequence when NATS is reachable), the lease
transitions it caused (from the append-only journal), and the decisions that name the
lease (their latest phase, as the store keeps it). When ``--journal-retention`` pruned
the journal, a first line says since when history is incomplete.
"""

from __future__ import annotations

import datetime as dt
from collections import defaultdict
from pathlib import Path
from typing import Any

import anyio
import orjson
import structlog
from nats.js.errors import NotFoundError

from reconciler.bus.connection import ConnectOptions, connect
from reconciler.bus.streams import StreamNames
from reconciler.store.sqlite import Store

__all__ = ["audit_lines"]

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
    async with await Store.open(db) as store:
        leases = await store.find_leases(identifier)
        if not leases:
            raise LookupError(f"nothing in {db} is known as {identifier!r}")
        timelines: list[tuple[Any, dict[int, list[dict[str, Any]]]]] = []
        seqs: set[int] = set()
        for lease in leases:
            events: dict[int, list[dict[str, Any]]] = defaultdict(list)
            for row in await store.lease_history(lease.lease_id):
                events[row["input_seq"]].append({"type": "transition", **row})
            for record in await store.decisions_for(lease_id=lease.lease_id):
                body = orjson.loads(record.payload)
                events[int(body["input_seq"])].append({"type": "decision", **body})
            seqs.update(events)
            timelines.append((lease, events))
        pruned_before, pruned_rows = await store.journal_pruned()
    inputs = await _fetch_inputs(sorted(seqs), nats=nats, prefix=prefix) if nats else {}
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


async def _fetch_inputs(
    seqs: list[int], *, nats: ConnectOptions, prefix: str
) -> dict[int, dict[str, Any]]:
    found: dict[int, dict[str, Any]] = {}
    stream = StreamNames.for_prefix(prefix).in_stream
    try:
        with anyio.fail_after(10.0):
            nc = await connect(nats)
    except (TimeoutError, OSError) as exc:
        logger.warning("audit.no_nats", error=repr(exc))
        return found
    try:
        js = nc.jetstream()
        for seq in seqs:
            try:
                msg = await js.get_msg(stream, seq)
            except NotFoundError:
                found[seq] = {"subject": None, "payload": "(no longer in the stream)"}
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


def _header(lease: Any) -> str:
    job = f" job={lease.job}" if lease.job else ""
    gpus = f" gpus={list(lease.gpus)}" if lease.gpus else ""
    return (
        f"lease {lease.lease_id}: {lease.instance} on {lease.host} ({lease.pool}, "
        f"{lease.kind.value}) is {lease.state.value}{job}{gpus}"
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
                lines.append(
                    f"             {e['from_state'] or '∅'} → {e['to_state']}  ({e['event']})"
                )
            else:
                why = f" ({e['reason']})" if "reason" in e else ""
                detail = f": {e['detail']}" if "detail" in e else ""
                lines.append(
                    f"             decision {e['verb']} {e['request_id']} {e['phase']} "
                    f"{e['outcome']}{why}{detail}"
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
