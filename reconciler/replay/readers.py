"""The replay's readers of the streams (:mod:`reconciler.replay.replay`), and the child
process that reads the OUT stream on a core of its own.

Rules:

- Both streams are only read: ephemeral pull consumers without acks
  (``AckPolicy.NONE``), in memory, one replica, deleted afterwards (and gone by
  themselves once inactive; :func:`~reconciler.bus.consumers.replay_reader`), read by
  the project's one pull reader (:class:`~reconciler.bus.reader.PullReader`), with pull
  requests of ``chunk`` messages made ahead so the next deliveries are on their way
  while the caller folds.
- Deliveries are taken in order; one lost between server and client (the consumer's
  own sequence skips, or, at the tail, requests end with nothing short of the sequence
  the stream is known to hold) restarts the consumer after the last one taken.
- The OUT stream is read while the snapshot is fetched and the tail folded, in a child
  process when the replay knows how to connect (:class:`ReaderProcess`, ``python -m
  reconciler.replay.reader_child``), else on the replay's own loop
  (:class:`OutputReader`). Either keeps every output with a ``Nats-Msg-Id`` (stream
  sequence, id, subject, payload) until told the stream's last sequence once the fold
  is done, or until nothing comes for :data:`COMPARE_STALL_S` after that. Once it has
  read up to that sequence it asks the stream's end again, until it stays put (at most
  :data:`_END_RECHECKS` times), and the comparison goes to where it stopped.
- The child's pipes carry frames of a 4-byte big-endian length then a pickle. To the
  child: the request (connection options, prefix, start time, chunk), then
  ``("in", first, last)`` (read the inputs), ``("until", out_last)`` (the OUT stream's
  last sequence), or the pipe closing (stop). Back: ``("in", inputs)`` (``None`` after
  the last), ``("found", outputs)`` as the OUT stream is read (:data:`_FORWARD_EVERY`
  at a time), then ``("out", (the rest, the last sequence read to))``, or ``("error",
  why)``. Its stdout is the pipe
  alone (anything printed goes to stderr).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import os
import pickle
import secrets
import signal
import struct
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, BinaryIO

import anyio
import anyio.to_thread
import structlog
from anyio.abc import ByteSendStream
from anyio.streams.buffered import BufferedByteReceiveStream
from nats.aio.client import Client
from nats.js import JetStreamContext, api

from reconciler.bus.connection import ConnectOptions, connect
from reconciler.bus.consumers import REPLAY_AHEAD, REPLAY_CHUNK, STALL_S, replay_reader
from reconciler.bus.direct import header_value
from reconciler.bus.reader import PullReader, RawMessage, rfc3339_nanos
from reconciler.bus.streams import StreamNames
from reconciler.core.messages import MSG_ID
from reconciler.store.pipes import widen_pipe

__all__ = [
    "COMPARE_STALL_S",
    "READ_CHUNK",
    "Found",
    "InputReader",
    "LocalReaders",
    "OutputReader",
    "RawInput",
    "ReaderError",
    "ReaderProcess",
    "StreamReader",
]

logger = structlog.get_logger(__name__)

#: how long reading the OUT stream may go without a message before the rest is missing
COMPARE_STALL_S = 30.0


class ReaderError(RuntimeError):
    """The reader child failed (the message says why: it could not connect, say)."""


#: an output kept for the comparison: stream sequence, ``Nats-Msg-Id``, subject, payload
Found = tuple[int, str, str, bytes]
#: an input as read: subject, payload, stream sequence, deliveries, storage time (RFC
#: 3339, as the live line's deliveries have it: made by the reader, off the fold's core)
RawInput = tuple[str, bytes, int, int, str]
#: frames of inputs on their way between the child's reader and the fold
_PIPE_FRAMES = 4
#: outputs the child hands over at a time while it reads the OUT stream: the replay takes
#: them in during the fold, instead of all of them (and their unpickling) at its end
_FORWARD_EVERY = 2000
#: frames of inputs queued for the fold below which the child reads no outputs
_INPUTS_WANTED = 2
#: frames of inputs the child reads ahead of the fold: while the replay fetches and
#: decodes the snapshot, the tail's first inputs are read (16 chunks: ~16,000 inputs)
_CHILD_READ_AHEAD = 16
#: bytes the child's pipe to the replay holds (Linux, at most ``fs.pipe-max-size``,
#: 1 MiB unless raised): frames of inputs (about 150 KB for 1,000) wait in it for the
#: replay, which reads the pipe only when its fold lets the loop run. At the default
#: 64 KiB a frame crossed a piece at a time, each only while the fold waited for it, and
#: the fold waited for nearly every frame though the child had 16 ready
_PIPE_BYTES = 4 << 20

#: how many times the OUT stream's end is asked again once the reader reached it
_END_RECHECKS = 5
#: messages per pull request of the replay's readers (at least; ``batch`` if larger)
READ_CHUNK = REPLAY_CHUNK


class StreamReader(PullReader):
    """A read-only, in-order reader of one stream for the replay: an ephemeral pull
    consumer without acks (:func:`~reconciler.bus.consumers.replay_reader`), read by a
    :class:`~reconciler.bus.reader.PullReader` asking for ``chunk`` messages a request,
    :data:`~reconciler.bus.consumers.REPLAY_AHEAD` requests ahead. A delivery lost
    between server and client (the consumer's own sequence skips) restarts the consumer
    after the last one taken; a gap in the stream sequence with no skip is the stream's
    own (a purge) and is read over."""

    def __init__(
        self,
        nc: Client,
        js: JetStreamContext,
        *,
        stream: str,
        chunk: int,
        start_seq: int | None = None,
        start_time: dt.datetime | None = None,
        timeout_s: float = 1.0,
    ) -> None:
        super().__init__(
            nc, stream=stream, batch=chunk, ahead=REPLAY_AHEAD, expires_s=timeout_s, stall_s=STALL_S
        )
        self._js = js
        self.chunk = chunk
        self.timeout_s = timeout_s
        self._start_time = start_time if start_seq is None else None
        self._start_seq = start_seq
        self.name = ""
        #: the stream sequence of the last message taken; the consumer sequence expected
        self.last_taken = 0
        self._next_cseq = 1

    async def start(self) -> None:
        await self._close_consumer()
        self.name = f"replay-{secrets.token_hex(6)}"
        if self.last_taken:
            config = replay_reader(self.name, start_seq=self.last_taken + 1)
        else:
            config = replay_reader(
                self.name, start_seq=self._start_seq, start_time=self._start_time
            )
        await self._js.add_consumer(self.stream, config=config)
        await self.bind(self.name)
        self._next_cseq = 1
        await self.pull_ahead()

    async def take(self, *, until: int | None = None) -> list[tuple[RawMessage, int, int, int]]:
        """Up to ``chunk`` messages in order, each with ``(stream_seq, delivered,
        timestamp_ns)``; ``[]`` when none came within the timeout. ``until``: the last
        sequence the stream is known to hold. Requests that end with nothing delivered
        short of it mean a delivery was lost at the tail, where no later one shows the
        consumer sequence skipping: the consumer restarts after the last one taken."""
        if self.needs_binding():
            await self.start()
        if not self._buffer:
            await self.wait()
            if self.broken is not None:  # stalled: the server lost the requests
                return []
            if not self._buffer and until is not None and self.last_taken < until:
                logger.warning(
                    "replay.read_stalled", stream=self.stream, after=self.last_taken, until=until
                )
                self.broken = "read stalled"
                return []
        out: list[tuple[RawMessage, int, int, int]] = []
        for msg in self.pop_buffered(self.chunk):
            tokens = msg[1].split(".")
            if len(tokens) == 9:
                base = 4
            elif len(tokens) >= 12:
                base = 6
            else:
                continue  # not a delivery
            cseq = int(tokens[base + 2])
            if cseq != self._next_cseq:
                # a delivery lost on the way: read again after the last one taken
                logger.warning("replay.read_gap", stream=self.stream, after=self.last_taken)
                self.broken = "read gap"
                return out
            self._next_cseq = cseq + 1
            seq = int(tokens[base + 1])
            self.last_taken = seq
            out.append((msg, seq, int(tokens[base]), int(tokens[base + 3])))
        await self.pull_ahead()
        return out

    async def stream_info(self) -> api.StreamInfo:
        """The stream's info, as the server has it now."""
        return await self._js.stream_info(self.stream)

    async def _close_consumer(self) -> None:
        await self.unbind()
        name, self.name = self.name, ""
        if name:
            try:
                await self._js.delete_consumer(self.stream, name)
            except Exception as exc:  # it goes by itself once inactive
                logger.debug("replay.consumer_not_deleted", error=repr(exc))

    async def close(self) -> None:
        with anyio.CancelScope(shield=True):
            await self._close_consumer()


class OutputReader:
    """Reads the OUT stream alongside the fold, keeping every output with a
    ``Nats-Msg-Id`` (stream sequence, id, subject, payload), until :meth:`until` names
    the stream's last sequence once the fold is done, or nothing comes for
    :data:`COMPARE_STALL_S` after that (the rest is then missing)."""

    def __init__(
        self,
        nc: Client,
        js: JetStreamContext,
        names: StreamNames,
        *,
        chunk: int,
        since: dt.datetime | None,
        forward: Callable[[list[Found]], Awaitable[None]] | None = None,
        forward_every: int = 0,
        pace: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.subjects = names.subjects
        self.reader = StreamReader(nc, js, stream=names.out_stream, chunk=chunk, start_time=since)
        #: what was kept and not forwarded yet (everything, without ``forward``)
        self.found: list[tuple[int, str, str, bytes]] = []
        #: hands the outputs kept over as they come, ``forward_every`` (default
        #: :data:`_FORWARD_EVERY`) at a time
        self.forward = forward
        self.forward_every = forward_every or _FORWARD_EVERY
        #: awaited before each read while the stream's end is not named yet: lets
        #: something more urgent go first (the child's reading of the inputs)
        self.pace = pace
        self.last: int | None = None
        self.done = anyio.Event()
        self._quiet_since = time.monotonic()

    def until(self, out_last: int) -> None:
        self.last = out_last
        self._quiet_since = time.monotonic()  # the stall is counted from here on
        self.reader.wake()

    async def run(self) -> None:
        reader, found = self.reader, self.found
        rechecks = 0
        try:
            while True:
                if self.last is not None and reader.last_taken >= self.last:
                    # the end named once the fold was done may be behind the stream's (a
                    # clustered stream's answer just after a leader moved): ask again
                    # until it stays put
                    if self.last == 0 or rechecks >= _END_RECHECKS:
                        break
                    rechecks += 1
                    end = await self._stream_end()
                    if end <= self.last:
                        break
                    logger.info("replay.out_end_moved", named=self.last, now=end)
                    self.last = end
                if self.pace is not None and self.last is None:
                    await self.pace()
                msgs = await reader.take(until=self.last)
                if not msgs:
                    quiet = time.monotonic() - self._quiet_since
                    if self.last is not None and quiet >= COMPARE_STALL_S:
                        break  # what is not here yet is slow or lost: reported missing
                    continue
                self._quiet_since = time.monotonic()
                for (subject, _, data, headers), seq, _, _ in msgs:
                    msg_id = header_value(headers, MSG_ID)
                    if msg_id is not None:
                        found.append((seq, msg_id, subject, data))
                if self.forward is not None and len(found) >= self.forward_every:
                    await self.forward(found[:])
                    found.clear()
        finally:
            self.done.set()
            await reader.close()

    async def _stream_end(self) -> int:
        info = await self.reader.stream_info()
        return int(info.state.last_seq or 0)


_FRAME = struct.Struct(">I")
#: the directory holding the ``reconciler`` package, for the child's ``PYTHONPATH``
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


def _frame(value: Any) -> bytes:
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    return _FRAME.pack(len(data)) + data


def _read_frame(pipe: BinaryIO) -> Any:
    """The next frame's value, or ``None`` when the pipe closed."""
    head = pipe.read(_FRAME.size)
    if len(head) < _FRAME.size:
        return None
    (size,) = _FRAME.unpack(head)
    data = pipe.read(size)
    if len(data) < size:
        return None
    return pickle.loads(data)


class InputReader:
    """The IN stream from one sequence up to another, in order, as :data:`RawInput`."""

    def __init__(self, nc: Client, js: JetStreamContext, names: StreamNames, *, chunk: int):
        self._nc, self._js, self._stream, self._chunk = nc, js, names.in_stream, chunk
        self._reader: StreamReader | None = None
        self._taken = self._last = 0

    async def start_inputs(self, from_seq: int, last: int) -> None:
        self._reader = StreamReader(
            self._nc, self._js, stream=self._stream, chunk=self._chunk, start_seq=from_seq
        )
        self._taken, self._last = from_seq - 1, last

    async def take_inputs(self) -> list[RawInput] | None:
        """The next inputs; ``None`` once the last one was taken."""
        reader = self._reader
        assert reader is not None
        last = self._last
        while self._taken < last:
            batch: list[RawInput] = []
            for (subject, _, data, _), seq, delivered, ts in await reader.take(until=last):
                if seq > last:
                    self._taken = last
                    break
                batch.append((subject, data, seq, delivered, rfc3339_nanos(ts)))
                self._taken = seq
            if batch:
                return batch
        return None

    async def close_inputs(self) -> None:
        reader, self._reader = self._reader, None
        if reader is not None:
            await reader.close()


class LocalReaders(InputReader):
    """Both streams read on the replay's own loop: the IN stream when the fold asks, the
    OUT stream by :meth:`run` alongside."""

    def __init__(
        self,
        nc: Client,
        js: JetStreamContext,
        names: StreamNames,
        *,
        chunk: int,
        since: dt.datetime | None,
    ) -> None:
        super().__init__(nc, js, names, chunk=chunk)
        self.outputs = OutputReader(nc, js, names, chunk=chunk, since=since)
        self.subjects = self.outputs.subjects
        self.done = self.outputs.done

    @property
    def found(self) -> list[Found]:
        return self.outputs.found

    @property
    def last(self) -> int | None:
        return self.outputs.last

    def until(self, out_last: int) -> None:
        self.outputs.until(out_last)

    async def run(self) -> None:
        await self.outputs.run()


class ReaderProcess:
    """Both streams read by a child process (see the module's rules): the IN stream's
    inputs come through its pipe as plain tuples, and the OUT stream's outputs as they
    are read; the reading and the parsing of every message take another core than the
    fold's. The same methods as :class:`LocalReaders`."""

    def __init__(
        self,
        opts: ConnectOptions,
        names: StreamNames,
        *,
        chunk: int,
        since: dt.datetime | None,
    ) -> None:
        self.subjects = names.subjects
        name = f"{opts.name}-reader" if opts.name else "reconciler-replay-reader"
        self._request = (replace(opts, name=name), names.prefix, since, chunk)
        self.found: list[Found] = []
        self.last: int | None = None
        self.done = anyio.Event()
        self._started = anyio.Event()
        self._last_known = anyio.Event()
        self._stdin: ByteSendStream | None = None
        self._inputs_started = False
        #: why the child failed, once it has
        self.failure: str | None = None
        self._in_send, self._in_receive = anyio.create_memory_object_stream[list[RawInput] | None](
            _PIPE_FRAMES
        )

    def until(self, out_last: int) -> None:
        self.last = out_last
        self._last_known.set()

    async def _command(self, command: tuple[Any, ...]) -> None:
        await self._started.wait()
        assert self._stdin is not None
        await self._stdin.send(_frame(command))

    async def start_inputs(self, from_seq: int, last: int) -> None:
        self._inputs_started = True
        await self._command(("in", from_seq, last))

    async def take_inputs(self) -> list[RawInput] | None:
        """The next inputs; ``None`` once the last one was taken."""
        try:
            return await self._in_receive.receive()
        except anyio.EndOfStream:
            await self.done.wait()  # and say why
            raise ReaderError(self.failure or "the replay's reader process stopped") from None

    async def close_inputs(self) -> None:
        """No more inputs wanted: those still coming are dropped."""
        self._in_receive.close()

    async def run(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
        try:
            command = [sys.executable, "-m", "reconciler.replay.reader_child"]
            if not any(url.startswith(("ws://", "wss://")) for url in self._request[0].urls):
                command.append("--no-websocket")
            async with await anyio.open_process(
                command, stdin=-1, stdout=-1, stderr=None, env=env
            ) as proc:
                assert proc.stdin is not None and proc.stdout is not None
                self._stdin = proc.stdin
                await proc.stdin.send(_frame(self._request))
                self._started.set()
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._send_until)
                    failure = await self._receive(BufferedByteReceiveStream(proc.stdout))
                    tg.cancel_scope.cancel()
                await proc.wait()
            if failure is not None:  # raised here, not inside the task group
                self.failure = failure
                raise ReaderError(failure)
        finally:
            self._in_send.close()
            if not self._inputs_started:  # nobody will take them
                self._in_receive.close()
            self.done.set()

    async def _send_until(self) -> None:
        await self._last_known.wait()
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
            await self._command(("until", self.last))  # a child that died says why

    async def _receive(self, stdout: BufferedByteReceiveStream) -> str | None:
        """Hand the inputs over until the outputs come; why not, if they never do."""
        while True:
            try:
                (size,) = _FRAME.unpack(await stdout.receive_exactly(_FRAME.size))
                kind, value = pickle.loads(await stdout.receive_exactly(size))
            except (anyio.IncompleteRead, anyio.EndOfStream):
                return "the replay's reader process ended without an answer"
            if kind == "in":
                with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                    await self._in_send.send(value)
            elif kind == "found":
                self.found.extend(value)
            elif kind == "out":
                found, self.last = value
                self.found.extend(found)
                return None
            else:
                return f"reading the streams failed: {value}"


class _InputsQueued:
    """Frames of inputs on their way to the replay's fold: while fewer than
    :data:`_INPUTS_WANTED` are, the OUT stream's reader waits (:meth:`enough`), so that
    the child's core parses the inputs the fold is about to need first and the outputs,
    needed only at the end, in the time left over."""

    def __init__(self) -> None:
        self.count = 0
        self.reading = False
        self._changed = anyio.Event()

    def change(self, by: int) -> None:
        self.count += by
        self._changed.set()
        self._changed = anyio.Event()

    def stop(self) -> None:
        """Nothing more to wait for: the outputs are read on regardless."""
        self.reading = False
        self.change(0)

    async def enough(self) -> None:
        while self.reading and self.count < _INPUTS_WANTED:
            await self._changed.wait()


async def _child_read(request: tuple[Any, ...], stdin: BinaryIO, answers: BinaryIO) -> None:
    opts, prefix, since, chunk = request
    nc = await connect(opts)
    cleanup = contextlib.ExitStack()
    try:
        js = nc.jetstream()
        names = StreamNames.for_prefix(prefix)
        send, receive = anyio.create_memory_object_stream[tuple[bool, bytes]](_CHILD_READ_AHEAD)
        inputs_queued = _InputsQueued()

        async def forward(found: list[Found]) -> None:
            await send.send((False, _frame(("found", found))))

        outputs = OutputReader(
            nc, js, names, chunk=chunk, since=since, forward=forward, pace=inputs_queued.enough
        )
        cleanup.callback(send.close)
        cleanup.callback(receive.close)

        async def write() -> None:
            async with receive:
                async for is_input, frame in receive:
                    await anyio.to_thread.run_sync(_write, answers, frame)
                    if is_input:
                        inputs_queued.change(-1)

        async def read_inputs(from_seq: int, last: int) -> None:
            inputs = InputReader(nc, js, names, chunk=chunk)
            await inputs.start_inputs(from_seq, last)
            inputs_queued.reading = True
            try:
                while True:
                    batch = await inputs.take_inputs()
                    inputs_queued.change(+1)
                    await send.send((True, _frame(("in", batch))))
                    if batch is None:
                        return
            finally:
                inputs_queued.stop()
                await inputs.close_inputs()

        async with anyio.create_task_group() as tg:
            tg.start_soon(write)
            tg.start_soon(outputs.run)
            async with anyio.create_task_group() as reading:
                while True:
                    command = await anyio.to_thread.run_sync(
                        _read_frame, stdin, abandon_on_cancel=True
                    )
                    if command is None:  # the replay gave up
                        tg.cancel_scope.cancel()
                        return
                    if command[0] == "in":
                        reading.start_soon(read_inputs, command[1], command[2])
                    elif command[0] == "until":
                        outputs.until(command[1])
                        inputs_queued.stop()  # the outputs are wanted now, whatever is left
                        await outputs.done.wait()
                        reading.cancel_scope.cancel()  # inputs nobody takes any more
                        break
            await send.send((False, _frame(("out", (outputs.found, outputs.last)))))
            send.close()
    finally:
        cleanup.close()
        with anyio.CancelScope(shield=True):
            await nc.close()


def _write(pipe: BinaryIO, data: bytes) -> None:
    pipe.write(data)
    pipe.flush()


def child_main() -> None:
    """The child's main (:mod:`reconciler.replay.reader_child`): its stdout is the pipe
    to the replay, nothing else."""
    # a Ctrl-C reaches the whole process group: the replay stops its reader (closing
    # the pipe), which then ends quietly, never with a traceback of its own
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    widen_pipe(answers, _PIPE_BYTES)
    # the replay reports; its reader only warns (a lost delivery, a consumer not deleted)
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        logger_factory=structlog.WriteLoggerFactory(sys.stderr),
    )
    stdin = sys.stdin.buffer
    request = _read_frame(stdin)
    if request is None:
        return
    try:
        anyio.run(_child_read, request, stdin, answers)
    except Exception as exc:
        _write(answers, _frame(("error", repr(exc))))
    answers.close()
