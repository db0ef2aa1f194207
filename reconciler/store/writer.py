"""The store's writer process: commits happen in a child process, off the event loop's GIL.

Why: a commit is a few hundred ``sqlite3`` steps, and CPython's ``sqlite3`` releases the
GIL around each one. On the event loop's process, every step then waits for the busy
loop to hand the GIL back (up to ``sys.getswitchinterval()``, 5 ms), and the loop waits
for the database thread's share of it in turn: measured in ``scripts/bench`` at a
thousand commands a second, the database thread needed 1.3 ms of wall time for 0.35 ms
of work per commit. A child process has a GIL of its own, so commits run on the second
core at the speed of SQLite while the loop goes on folding.

Rules:

- One writer per database, for its whole life: the child takes an exclusive ``flock``
  on ``<db>.writer-lock`` before it says it is ready, and writes its replica's pid
  into that file. A writer left behind by a killed replica (finishing the transaction
  in hand) makes the next one wait for it, so the next replica never loads a state
  that an old commit is still changing; a writer whose replica is alive is another
  replica on the same store, which is refused at once (:class:`StoreLocked`, naming
  its pid).
- The child ignores SIGINT and SIGTERM (a Ctrl-C reaches the whole process group, and
  the parent must be able to commit the batch in hand on its way out). It stops when its
  input closes: the parent closed the store, or died, since the kernel closes a dead
  process's pipes. Either way the transaction in hand completes or rolls back whole.
- Requests are served in order, one reply each, and a request once sent always has its
  reply read, even when its caller is cancelled (one task of the parent reads every
  reply, in order, and hands it to the request's future): cancelling a caller never
  puts the pipe out of step. Requests may be sent while earlier ones are being served.
- The requests: ``write`` (a batch, with the same
  :func:`~reconciler.store.transactions.write_batch` the in-process writer runs) and
  ``mark`` (:func:`~reconciler.store.transactions.mark_published`). A ``sqlite3`` error
  is replied, the child goes on; the parent raises it as :class:`StoreError`.
- The child checkpoints the WAL on a thread of its own (``PRAGMA
  wal_checkpoint(PASSIVE)`` every :data:`CHECKPOINT_EVERY_S`, never blocking a commit),
  with automatic checkpoints off: the 16 MiB checkpoint that a commit used to run
  inline (tens of milliseconds, with an fsync) no longer stalls the pipeline. Passive
  checkpoints never catch up with a writer that commits every millisecond, and the WAL
  would grow for as long as the load lasts (800 MB in the bench's soak): past
  :data:`~reconciler.store.writer_child.WAL_FINISH_BYTES` the thread copies what the
  passive checkpoint left between two transactions, so that the next one starts the WAL
  over (:func:`~reconciler.store.writer_child.checkpoints`).
- Frames on the pipes: a 4-byte big-endian length, then a pickle. The pipes are private
  to the two processes of one replica. The child is
  :mod:`reconciler.store.writer_child`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import pickle
import sys
from pathlib import Path
from typing import Any

from reconciler.store.errors import StoreError, StoreLocked
from reconciler.store.pipes import widen_pipe
from reconciler.store.transactions import Writes
from reconciler.store.writer_child import CHECKPOINT_EVERY_S, FRAME_HEADER

__all__ = ["CHECKPOINT_EVERY_S", "FRAME_HEADER", "WriterProcess"]

#: how long a new writer waits for a previous one to let go of the database
READY_TIMEOUT_S = 60.0
#: where ``reconciler`` is importable from, for the child's ``-m``
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


#: the size asked for the request pipe (Linux caps it at ``/proc/sys/fs/pipe-max-size``)
PIPE_BYTES = 1 << 20


def _widen(stdin: asyncio.StreamWriter | None) -> None:
    """Widen the request pipe (Linux; elsewhere, or when refused, the default 64 KiB
    stays). A batch of a thousand inputs is about a megabyte: with the default it
    crosses in some twenty writes, each waiting for the event loop's next turn."""
    pipe = stdin.get_extra_info("pipe") if stdin is not None else None
    if pipe is not None:
        widen_pipe(pipe, PIPE_BYTES)


# ============================================================================= parent


class WriterProcess:
    """The parent's handle on the child that writes one store."""

    def __init__(self, proc: asyncio.subprocess.Process, path: Path) -> None:
        self._proc = proc
        self.path = path
        #: held while a request is sent (requests go out whole, one after the other)
        self._lock = asyncio.Lock()
        #: the replies still owed, in the order their requests were sent (see :meth:`_call`)
        self._waiting: collections.deque[asyncio.Future[tuple[Any, ...]]] = collections.deque()
        self._idle = asyncio.Event()
        self._idle.set()
        self._replies: asyncio.Task[None] | None = None
        #: why the writer can no longer be used, once it cannot
        self._broken: str | None = None

    @property
    def pid(self) -> int:
        return self._proc.pid

    @classmethod
    async def start(cls, path: Path, *, ready_timeout_s: float = READY_TIMEOUT_S) -> WriterProcess:
        """Start the writer of ``path`` and wait until it holds the database."""
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "reconciler.store.writer_child",
            str(path),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=env,
        )
        _widen(proc.stdin)
        writer = cls(proc, path)
        try:
            async with asyncio.timeout(ready_timeout_s):
                hello = await writer._receive()
        except (TimeoutError, StoreError) as exc:
            await writer.close(timeout_s=0)  # never ready: nothing of ours to finish
            why = str(exc) or f"not ready within {ready_timeout_s} s (another writer holds it?)"
            raise StoreError(f"store {path}: the writer process did not start: {why}") from exc
        if hello[0] == "busy":
            await writer.close()
            raise StoreLocked(
                f"store {path} is in use by another `reconciler run` (PID {hello[1]}): stop "
                "it first, or give this replica a --db of its own"
            )
        if hello[0] != "ready":
            await writer.close()
            raise StoreError(f"store {path}: the writer process failed: {hello[1]}")
        writer._replies = asyncio.create_task(writer._read_replies(), name=f"writer-{proc.pid}")
        return writer

    async def write(self, applied_seq: int, writes: Writes) -> bool:
        result = await self._call(("write", applied_seq, writes), f"commit up to seq {applied_seq}")
        return bool(result)

    async def mark_published(self, input_seq: int) -> int:
        return int(await self._call(("mark", input_seq), "mark published"))

    async def _call(self, request: tuple[Any, ...], what: str) -> Any:
        # The request is written at once and its reply awaited as a future that one
        # task, reading every reply in order, resolves: a caller that gives up (a leader
        # stepping down while it marks the outbox published) leaves its reply to be read
        # all the same, so the pipe stays in step and the next commit goes through. The
        # request itself is harmless to complete: a commit is one transaction, and a
        # mark only moves a position forward. (No task per request: a commit costs two
        # turns of the event loop fewer.)
        async with self._lock:  # uncontended, it takes no turn of the loop
            if self._broken is not None:
                raise StoreError(f"store {self.path}: {what}: {self._broken}")
            reply = asyncio.get_running_loop().create_future()
            self._send(request)
            self._waiting.append(reply)
            self._idle.clear()
        answer = await reply
        if answer[0] == "error":
            raise StoreError(f"store {self.path}: {what} failed: {answer[1]}")
        if answer[0] == "broken":
            raise StoreError(f"store {self.path}: {what}: {answer[1]}")
        return answer[1]

    async def _read_replies(self) -> None:
        """Hand every reply to the request it answers, in order, until the child is gone;
        then fail whatever is still owed."""
        try:
            while True:
                message = await self._receive()
                if not self._waiting:
                    self._broken = self._broken or f"an unrequested reply {message[0]!r}"
                    break
                reply = self._waiting.popleft()
                if not reply.done():  # its caller may have given up
                    reply.set_result(message)
                if not self._waiting:
                    self._idle.set()
        except StoreError:
            pass  # the child exited: _receive said why
        except BaseException:
            self._broken = self._broken or "the writer's replies are no longer read"
            raise
        finally:
            self._broken = why = self._broken or "the writer process is closed"
            while self._waiting:
                reply = self._waiting.popleft()
                if not reply.done():
                    reply.set_result(("broken", why))
            self._idle.set()

    def _send(self, message: tuple[Any, ...]) -> None:
        stdin = self._proc.stdin
        if stdin is None or stdin.is_closing():
            raise StoreError(f"store {self.path}: the writer process is closed")
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            stdin.write(FRAME_HEADER.pack(len(data)) + data)
        except BaseException:
            self._broken = self._broken or "a request was interrupted"
            raise

    async def _receive(self) -> tuple[Any, ...]:
        stdout = self._proc.stdout
        assert stdout is not None
        try:
            header = await stdout.readexactly(FRAME_HEADER.size)
            body = await stdout.readexactly(FRAME_HEADER.unpack(header)[0])
        except asyncio.IncompleteReadError:
            code = await self._proc.wait()
            self._broken = f"the writer process exited with status {code}"
            raise StoreError(f"store {self.path}: {self._broken}") from None
        message: tuple[Any, ...] = pickle.loads(body)
        return message

    async def close(self, timeout_s: float = 30.0) -> None:
        """Close its input and wait for it to finish (killed after ``timeout_s``)."""
        if self._waiting and timeout_s > 0:
            # requests whose callers gave up: let their replies come in first
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await self._idle.wait()
        self._broken = self._broken or "the writer process is closed"
        stdin = self._proc.stdin
        if stdin is not None and not stdin.is_closing():
            stdin.close()
        try:
            if timeout_s <= 0:
                raise TimeoutError
            async with asyncio.timeout(timeout_s):
                await self._proc.wait()
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()
            await self._proc.wait()
        finally:
            replies, self._replies = self._replies, None
            if replies is not None:
                replies.cancel()
                with contextlib.suppress(asyncio.CancelledError, StoreError):
                    await replies
