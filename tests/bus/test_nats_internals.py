"""The nats-py internals the project relies on (reconciler/bus/nats_internals.py): fenced in
one module, present in the installed nats-py, and each one's path without it.

The paths without an internal run against a real nats-server: the fence's check is made
to say "not there" (what a nats-py that renamed it would say), and the project must then
work the ordinary way (publishes one by one, nats-py's own callbacks) or, for TLS, refuse
to connect rather than risk plaintext.
"""

from __future__ import annotations

import ast
import inspect
import re
import socket
from pathlib import Path
from typing import Any

import anyio
import pytest
from nats.aio.client import Client

from reconciler.bus import direct, nats_internals, wire
from reconciler.bus.connection import ConnectOptions, connect
from reconciler.bus.input_consumer import InputConsumer
from reconciler.bus.nats_internals import UnsupportedNatsPy
from reconciler.bus.publisher import publish_outputs
from reconciler.bus.sending import publish
from reconciler.bus.streams import StreamNames, ensure_streams
from reconciler.core.messages import Output
from tests.support.bus import BusClient

pytestmark = pytest.mark.timeout(30)

PACKAGE = Path(__file__).resolve().parents[2] / "reconciler"
FENCE = PACKAGE / "bus" / "nats_internals.py"


def _nats_py_private_names() -> set[str]:
    """Every single-underscore attribute nats-py's own code defines or sets on ``self``."""
    import nats

    names: set[str] = set()
    for path in Path(nats.__file__).parent.rglob("*.py"):
        text = path.read_text()
        names |= set(re.findall(r"\bself\.(_[A-Za-z]\w*)", text))
        names |= set(re.findall(r"\bdef (_[A-Za-z]\w*)", text))
    return {n for n in names if not n.startswith("__")}


def test_nothing_outside_the_fence_names_a_nats_py_internal() -> None:
    private = _nats_py_private_names()
    assert {"_nc", "_process_msg", "_send_command", "_process_info", "_id"} <= private
    found: list[str] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        if path == FENCE or not re.search(r"^\s*(from|import) nats\b", text, re.MULTILINE):
            continue  # the fence itself, or a module that cannot hold a nats-py object
        tree = ast.parse(text, str(path))
        for node in ast.walk(tree):
            where = f"{path.relative_to(PACKAGE.parent)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Attribute) and node.attr in private:
                # our own classes may name their own attributes like nats-py names its
                # (self._nc); nothing else may reach into another object's
                if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                    found.append(f"{where} {ast.unparse(node)}")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                args = node.args
                if (
                    node.func.id in ("getattr", "setattr", "hasattr", "delattr")
                    and len(args) > 1
                    and isinstance(args[1], ast.Constant)
                    and args[1].value in private
                ):
                    found.append(f"{where} {ast.unparse(node)}")
            elif isinstance(node, ast.ClassDef):
                # a subclass of a nats-py class overrides its internals by name
                bases = [ast.unparse(b) for b in node.bases]
                if any(b in ("Client", "Subscription", "Msg", "JetStreamContext") for b in bases):
                    found.append(f"{where} class {node.name}({', '.join(bases)})")
    assert found == []


async def test_the_installed_nats_py_has_every_internal(nc: Client) -> None:
    js = nc.jetstream()
    assert nats_internals.client_of(js) is nc
    assert nats_internals.writes_batches(nc)
    assert nats_internals.routes_messages(nc)
    assert nats_internals.guards_tls()
    sub = await nc.subscribe("x.y")
    assert isinstance(nats_internals.subscription_id(sub), int)
    await sub.unsubscribe()


def test_the_checks_see_an_internal_that_changed_shape() -> None:
    """What a nats-py that renamed or reshaped an internal looks like to the checks."""

    class ReshapedClient(Client):
        # sync where nats-py's is a coroutine; other parameters; no initial_connection
        def _send_command(self, cmd: bytes, priority: bool = False) -> None:  # type: ignore[override]
            raise AssertionError("never called")

        async def _process_msg(self, sid: int, subject: bytes, reply: bytes, data: bytes) -> None:  # type: ignore[override]
            raise AssertionError("never called")

        async def _process_info(self, info: dict[str, Any]) -> None:  # type: ignore[override]
            raise AssertionError("never called")

        def _connect_to_server(self, s: Any) -> None:  # type: ignore[override]
            raise AssertionError("never called")

    reshaped = ReshapedClient()
    assert not nats_internals.writes_batches(reshaped)
    assert not nats_internals.routes_messages(reshaped)
    assert not nats_internals.guards_tls(ReshapedClient)
    assert not nats_internals.tidies_attempts(ReshapedClient)
    assert nats_internals.writes_batches(Client()) and nats_internals.guards_tls(Client)
    assert nats_internals.tidies_attempts(Client)
    assert nats_internals.subscription_id(object()) is None  # type: ignore[arg-type]
    assert inspect.iscoroutinefunction(Client._process_info)


async def test_without_the_contexts_client_the_error_says_what_is_missing(nc: Client) -> None:
    js = nc.jetstream()
    del js._nc  # a nats-py that keeps the client elsewhere
    with pytest.raises(UnsupportedNatsPy, match=r"JetStreamContext\._nc"):
        nats_internals.client_of(js)
    with pytest.raises(UnsupportedNatsPy, match="pip install"):
        await publish(js, "rc.in.cmd.x", b"{}")


async def test_without_batches_outputs_go_one_by_one_and_stay_exactly_once(
    nc: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(nats_internals, "writes_batches", lambda nc: False)
    assert not wire.supported(nc)
    js = nc.jetstream()
    await ensure_streams(js, StreamNames.for_prefix("rc"))
    outs = [Output(f"out.decision.r{i}", f"decision:r{i}:final", b"{}") for i in range(5)]
    acks = await publish_outputs(nc, outs, prefix="rc")
    assert [a.seq for a in acks] == [1, 2, 3, 4, 5]
    again = await publish_outputs(nc, outs, prefix="rc")
    assert all(a.duplicate for a in again)
    assert (await js.stream_info("RC_OUT")).state.messages == 5
    got = await BusClient(nc).outputs()
    assert [m.msg_id for m in got] == [f"decision:r{i}:final" for i in range(5)]


async def test_without_direct_hand_over_the_input_consumer_reads_through_callbacks(
    nc: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(nats_internals, "routes_messages", lambda nc: False)
    assert not direct.supported(nc)
    bus = BusClient(nc)
    await bus.ensure_streams()
    for i in range(12):
        await bus.send_raw(f"rc.in.cmd.x{i}", b"{}", msg_id=f"in:x{i}")
    consumer = InputConsumer(nc, bus.js, stream="RC_IN", durable="c", batch=5, fetch_timeout_s=0.3)
    await consumer.start(from_seq=3)
    assert consumer._sub is not None and not consumer._sub.direct
    seqs: list[int] = []
    with anyio.fail_after(10):
        while len(seqs) < 10:
            got = await consumer.fetch()
            seqs += [d.stream_seq for d in got]
            await consumer.ack(got)
    assert seqs == list(range(3, 13))
    # a pull request's status (408, expired) reaches the reader through the callback too
    assert await consumer.fetch() == []
    assert consumer.broken is None
    await consumer.close()
    info = await bus.js.consumer_info("RC_IN", "c")
    assert info.num_ack_pending == 0


async def test_without_the_tls_guard_a_tls_connection_is_refused_before_any_byte(
    nats_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(nats_internals, "guards_tls", lambda client_class=Client: False)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        port = listener.getsockname()[1]
        for opts in (
            ConnectOptions(urls=(f"tls://127.0.0.1:{port}",), initial_timeout_s=2),
            ConnectOptions(
                urls=(f"nats://127.0.0.1:{port}",), tls_ca_file="/nonexistent", initial_timeout_s=2
            ),
        ):
            with pytest.raises(UnsupportedNatsPy, match="falling back to plaintext"):
                await connect(opts)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody even tried to connect
    # plaintext asked for is plaintext: the guard is not needed for it
    nc = await connect(ConnectOptions(urls=(nats_url,), initial_timeout_s=5))
    assert nc.is_connected and not isinstance(nc, nats_internals.TlsOnlyClient)
    await nc.close()
