"""Record the streams of a previous release, for tests/system/test_upgrade_replay.py.

Run it with the *previous* release's code first on the path (see README.md here)::

    git archive 43f83fd | tar -x -C /tmp/prev
    PYTHONPATH=/tmp/prev .venv/bin/python tests/data/upgrade/record.py \\
        --commit 43f83fd --nats-server /usr/sbin/nats-server --out tests/data/upgrade

It starts a private nats-server (JetStream in a temporary directory), runs that code's
``reconciler demo`` story against it (a replica, the bridge and the executor over a
simulated Incus fleet), then a replica of that code again for a few commands the story
does not send (config rejections, drains, errors, a duplicate instance, a resent
request), checks with that code's replay that the recording is whole, and writes:

- ``streams.tar.gz``: the server's store, holding only ``RC_IN`` and ``RC_OUT``, with
  ``max_age`` lifted (0) so that a server started on it years later keeps every
  message (JetStream stamps a message when it stores it; only a store keeps the stamps
  the decisions were made with);
- ``streams.jsonl``: the same messages, one JSON object a line (``stream``, ``seq``,
  ``time``, ``subject``, ``headers``, and ``data`` as text or ``data_b64``), to read;
- ``manifest.json``: how and from what it was made.

Only this script's standard library, nats-py and the code on the path are used: it must
run with the old code, whose modules it imports.
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import nats

PREFIX = "rc"
STREAMS = ("RC_IN", "RC_OUT")

#: commands the demo's story does not send, each answered by the old code
EXTRA: tuple[tuple[str, dict[str, Any]], ...] = (
    ("config.pool.bad", {
        "v": 1, "pool": "bad", "flavor": {"cpu": 1, "memory_mib": 1024, "disk_gib": 10},
        "claims": [], "warm": {"min_ready": 3, "max_ready": 1, "protect_min_ready": False},
        "max_instances": 4, "priority": 0, "host_selector": {}, "placement": "pack",
        "image": "images:ubuntu/24.04/cloud", "profiles": ["default"], "project": "ci",
    }),
    ("cmd.admit", {"v": 1, "request_id": "x-unknown-pool", "pool": "nope", "instance": "x-1",
                   "kind": "cold"}),
    ("cmd.admit", {"v": 1, "request_id": "x-duplicate", "pool": "ml", "instance": "ml-1",
                   "kind": "cold"}),
    ("cmd.admit", {"v": 1, "request_id": "ml-1", "pool": "ml", "instance": "ml-1",
                   "kind": "cold"}),  # decided already: its decision again, unchanged
    ("cmd.claim-warm", {"v": 1, "request_id": "x-no-warm", "pool": "ml", "job": "job-9"}),
    ("cmd.authorize-warm-drain", {"v": 1, "request_id": "x-drain-unknown", "instance": "x-2"}),
    ("cmd.mark-created", {"v": 1, "request_id": "x-created-unknown", "instance": "x-3"}),
    ("cmd.mark-deleting", {"v": 1, "request_id": "x-deleting", "instance": "ml-2"}),
    ("cmd.release", {"v": 1, "request_id": "x-release", "instance": "ml-2"}),
)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--commit", required=True, help="the release's commit, for the manifest")
    parser.add_argument("--nats-server", default="/usr/sbin/nats-server")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    import reconciler

    code = Path(reconciler.__file__).resolve().parent
    print(f"recording with the code in {code}", file=sys.stderr)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="rc-record-") as scratch:
        work = Path(scratch)
        server = _start(args.nats_server, work)
        try:
            url = _url(work)
            counts = anyio.run(_record, url, work)
            dump = anyio.run(_dump, url)
        finally:
            server.terminate()  # SIGTERM: the server flushes and closes its store
            server.wait(30)
        _write(args.out, work / "store", dump)
    version = subprocess.run(
        [args.nats_server, "--version"], capture_output=True, text=True, check=True
    ).stdout.strip()
    manifest = {
        "made": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": args.commit,
        "nats_server": version,
        "prefix": PREFIX,
        "messages": counts,
        "streams.jsonl sha256": hashlib.sha256(
            (args.out / "streams.jsonl").read_bytes()
        ).hexdigest(),
    }
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(json.dumps(manifest, indent=2))


def _start(binary: str, work: Path) -> subprocess.Popen[bytes]:
    (work / "ports").mkdir()
    (work / "nats-server.conf").write_text("max_payload: 4194304\n")
    log = (work / "nats-server.log").open("ab")
    return subprocess.Popen(
        [binary, "-c", str(work / "nats-server.conf"), "-a", "127.0.0.1", "-p", "-1", "-js",
         "-sd", str(work / "store"), "--ports_file_dir", str(work / "ports")],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
    )  # fmt: skip


def _url(work: Path) -> str:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for path in (work / "ports").glob("*.ports"):
            try:
                return str(json.loads(path.read_text())["nats"][0])
            except (ValueError, KeyError):
                pass
        time.sleep(0.05)
    raise RuntimeError("nats-server did not start: " + (work / "nats-server.log").read_text())


async def _record(url: str, work: Path) -> dict[str, int]:
    from reconciler.demo.simulated import run_demo

    db = work / "demo.db"
    summary = await run_demo(db, nats_url=url, echo=False)
    assert summary.replay_divergences == 0, summary
    await _extra(url, db)
    return await _finish(url)


async def _extra(url: str, db: Path) -> None:
    """The commands of :data:`EXTRA`, each until its output is on ``RC_OUT``."""
    from reconciler.bus.connection import ConnectOptions
    from reconciler.replica.replica import Replica, RunConfig

    replica = Replica(
        RunConfig(
            nats=ConnectOptions(urls=(url,)),
            db=db,
            prefix=PREFIX,
            replica="demo",
            leader_ttl_s=3.0,
            status_debounce_s=0.1,
        )
    )
    nc = await nats.connect(url)
    stop = anyio.Event()
    try:
        js = nc.jetstream()
        async with anyio.create_task_group() as tg:

            async def run() -> None:
                await replica.run(stop=stop)

            tg.start_soon(run)
            with anyio.fail_after(30):
                while not replica.leader_ready:  # noqa: ASYNC110
                    await anyio.sleep(0.05)
            for subject, body in EXTRA:
                data = json.dumps(body).encode()
                rid = body.get("request_id")
                headers = {"Nats-Msg-Id": f"record:{subject}:{rid}"}
                ack = await js.publish(f"{PREFIX}.in.{subject}", data, headers=headers)
                with anyio.fail_after(30):  # decided, and its outputs on RC_OUT
                    while (await replica.health())["published_seq"] < ack.seq:  # noqa: ASYNC110
                        await anyio.sleep(0.05)
            stop.set()
    finally:
        await nc.close()


async def _finish(url: str) -> dict[str, int]:
    """Replay with the old code (nothing diverges), keep only the two streams, without
    consumers, and lift their ``max_age``."""
    from reconciler.replay.replay import replay_into

    nc = await nats.connect(url)
    try:
        report = await replay_into(nc, prefix=PREFIX)
        assert report.ok, report.divergences[:3]
        js = nc.jetstream()
        for info in await js.streams_info():
            name = info.config.name
            assert name is not None
            if name not in STREAMS:
                await js.delete_stream(name)
        counts = {}
        for stream in STREAMS:
            for consumer in await js.consumers_info(stream):
                await js.delete_consumer(stream, consumer.name)
            info = await js.stream_info(stream)
            await js.update_stream(info.config.evolve(max_age=0))
            counts[stream] = int(info.state.messages)
        print(f"old replay: {report.inputs} inputs, {report.compared} compared", file=sys.stderr)
        return counts
    finally:
        await nc.close()


async def _dump(url: str) -> list[dict[str, Any]]:
    """Every message of both streams as the server stores it (the time to the
    nanosecond, as the server wrote it)."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        rows = []
        for stream in STREAMS:
            last = (await js.stream_info(stream)).state.last_seq
            for seq in range(1, last + 1):
                request = json.dumps({"seq": seq}).encode()
                reply = await nc.request(f"$JS.API.STREAM.MSG.GET.{stream}", request, timeout=5)
                msg = json.loads(reply.data)["message"]
                data = base64.b64decode(msg.get("data", ""))
                row: dict[str, Any] = {
                    "stream": stream,
                    "seq": seq,
                    "time": msg["time"],
                    "subject": msg["subject"],
                    "headers": _headers(base64.b64decode(msg.get("hdrs", ""))),
                }
                try:
                    row["data"] = data.decode()
                except UnicodeDecodeError:
                    row["data_b64"] = base64.b64encode(data).decode()
                rows.append(row)
        return rows
    finally:
        await nc.close()


def _headers(block: bytes) -> dict[str, str]:
    """``NATS/1.0\r\nName: value\r\n\r\n`` → ``{name: value}``."""
    lines = block.decode().split("\r\n")[1:]
    return dict(line.split(": ", 1) for line in lines if line)


def _write(out: Path, store: Path, dump: list[dict[str, Any]]) -> None:
    lines = [json.dumps(row, sort_keys=True, ensure_ascii=False) for row in dump]
    (out / "streams.jsonl").write_text("\n".join(lines) + "\n")
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=9) as tar:
        for path in sorted(store.rglob("*")):
            info = tar.gettarinfo(str(path), arcname=str(path.relative_to(store)))
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            if path.is_file():
                with path.open("rb") as f:
                    tar.addfile(info, f)
            else:
                tar.addfile(info)
    (out / "streams.tar.gz").write_bytes(buffer.getvalue())
    print(f"wrote {out}: {len(dump)} messages, {len(buffer.getvalue())} bytes", file=sys.stderr)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
