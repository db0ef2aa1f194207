"""Leader election over the leader bucket (docs/interface.md: KV ``<prefix>_leader``, key
``leader``).

Rules (docs/architecture.md, rule 1: liveness lives in the leader, safety in the fold):

- A replica becomes leader by *creating* the key (it succeeds only when the key is
  absent: never held, deleted, or expired by the bucket's TTL). It stays leader by
  *updating* the key with the revision it last wrote, every ``ttl / 3``. Both are awaited
  publishes with an expected-sequence header, so two replicas can never both succeed.
- A leader that cannot renew stops being leader *locally* before the bucket could let
  anyone else in: its work is cancelled at once when a renewal is refused (someone else
  holds the key) or when ``ttl * SAFETY`` has passed since its last successful renewal
  was sent. A stale leader can at worst finish an in-flight publish; the fold makes that
  harmless.
- On a graceful stop the leader deletes the key (with its revision), so a successor
  takes over at once instead of after the TTL.
- The key's value is ``{"holder", "since", "published_seq"}``: every follower reads it
  while it waits, and learns from ``published_seq`` how far the leader has put the
  outbox on the bus (see :meth:`reconciler.store.sqlite.Store.mark_published_through`).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import anyio
import orjson
import structlog
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from reconciler.bus.streams import LEADER_KEY

__all__ = ["SAFETY", "LeaderElection", "Leadership"]

logger = structlog.get_logger(__name__)

#: fraction of the TTL after the last renewal at which a leader gives up by itself
SAFETY = 0.75

Clock = Callable[[], float]


@dataclass(slots=True)
class Leadership:
    """What a leader's work can see and tell: whether it still leads, and its progress."""

    holder: str
    since: float
    #: every output of every input up to here is on the bus (the outbox publisher sets it)
    published_seq: int = 0


LeaderWork = Callable[[Leadership], Awaitable[None]]
FollowerHook = Callable[[int], Awaitable[None]]


class LeaderElection:
    """Campaign for the leader key; run the leader's work only while holding it."""

    def __init__(
        self,
        js: JetStreamContext,
        *,
        bucket: str,
        holder: str,
        ttl_s: float,
        clock: Clock = time.monotonic,
        wall: Clock = time.time,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self._js = js
        self.bucket = bucket
        self.holder = holder
        self.ttl_s = ttl_s
        self._clock = clock
        self._wall = wall
        self._kv: KeyValue | None = None
        self.leading: Leadership | None = None
        self.terms = 0
        self._revision = 0
        self._log = logger.bind(bucket=bucket, holder=holder)

    async def run(self, work: LeaderWork, on_follower: FollowerHook | None = None) -> None:
        """Campaign forever: lead while the key is ours, follow otherwise. Cancel to stop;
        a leader deletes its key on the way out."""
        self._kv = await self._js.key_value(self.bucket)
        while True:
            revision = await self._try_acquire()
            if revision is None:
                await self._follow(on_follower)
                await anyio.sleep(self.ttl_s / 4)
                continue
            await self._lead(revision, work)

    # ------------------------------------------------------------------ follow

    async def _try_acquire(self) -> int | None:
        assert self._kv is not None
        leadership = Leadership(holder=self.holder, since=self._wall())
        try:
            with anyio.fail_after(self.ttl_s / 3):
                revision = await self._kv.create(LEADER_KEY, self._value(leadership))
        except KeyWrongLastSequenceError:
            return None
        except Exception as exc:  # NATS unreachable: keep campaigning
            self._log.warning("leader.campaign_failed", error=repr(exc))
            return None
        self.leading = leadership
        return revision

    async def _follow(self, on_follower: FollowerHook | None) -> None:
        assert self._kv is not None
        if on_follower is None:
            return
        try:
            with anyio.fail_after(self.ttl_s / 3):
                entry = await self._kv.get(LEADER_KEY)
        except (KeyNotFoundError, TimeoutError):
            return
        except Exception as exc:
            self._log.debug("leader.read_failed", error=repr(exc))
            return
        try:
            published = int(orjson.loads(entry.value or b"{}").get("published_seq", 0))
        except (orjson.JSONDecodeError, AttributeError, TypeError, ValueError):
            return
        if published > 0:
            await on_follower(published)

    # -------------------------------------------------------------------- lead

    async def _lead(self, revision: int, work: LeaderWork) -> None:
        leadership = self.leading
        assert leadership is not None
        self.terms += 1
        self._log.info("leader.elected", term=self.terms, revision=revision)
        self._revision = revision
        lost = "cancelled"
        try:
            async with anyio.create_task_group() as tg:

                async def keep() -> None:
                    nonlocal lost
                    lost = await self._renew(leadership)
                    self.leading = None
                    tg.cancel_scope.cancel()  # leadership lost: stop the work at once

                async def guarded() -> None:
                    nonlocal lost
                    try:
                        await work(leadership)
                    except Exception:
                        self._log.exception("leader.work_failed", term=self.terms)
                        lost = "work failed"
                        tg.cancel_scope.cancel()

                tg.start_soon(keep, name="leader-renew")
                tg.start_soon(guarded, name="leader-work")
        finally:
            self.leading = None
            if lost in ("cancelled", "work failed"):
                with anyio.CancelScope(shield=True):
                    await self._resign(self._revision)
            level = self._log.info if lost == "cancelled" else self._log.warning
            level("leader.stepped_down", term=self.terms, why=lost)
        if lost == "work failed":
            await anyio.sleep(self.ttl_s)  # let another replica try before campaigning again

    async def _renew(self, leadership: Leadership) -> str:
        """Renew until refused or out of time; why it ended. Keeps ``_revision`` current."""
        assert self._kv is not None
        interval = self.ttl_s / 3
        deadline = self._clock() + self.ttl_s * SAFETY
        while True:
            await anyio.sleep(min(interval, max(0.0, deadline - self._clock())))
            if self._clock() >= deadline:
                return "renewal overdue"
            sent = self._clock()
            try:
                with anyio.fail_after(max(0.001, deadline - sent)):
                    self._revision = await self._kv.update(
                        LEADER_KEY, self._value(leadership), last=self._revision
                    )
            except KeyWrongLastSequenceError:
                return "key taken by another replica"
            except TimeoutError:
                return "renewal overdue"
            except Exception as exc:
                self._log.warning("leader.renew_failed", error=repr(exc))
                continue
            deadline = sent + self.ttl_s * SAFETY

    async def _resign(self, revision: int) -> None:
        assert self._kv is not None
        try:
            with anyio.fail_after(2.0):
                await self._kv.delete(LEADER_KEY, last=revision)
            self._log.info("leader.resigned", revision=revision)
        except Exception as exc:
            self._log.info("leader.resign_failed", error=repr(exc))

    def _value(self, leadership: Leadership) -> bytes:
        return orjson.dumps(
            {
                "holder": leadership.holder,
                "since": leadership.since,
                "published_seq": leadership.published_seq,
            }
        )
