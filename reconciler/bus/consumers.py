"""Every JetStream consumer the project reads through, configured in one place.

All of them are pull consumers read by :class:`~reconciler.bus.reader.PullReader`.

- **The replica's input consumer** ``<PREFIX>_IN-<replica>`` on the IN stream
  (:func:`input_consumer`, read by :class:`~reconciler.bus.input_consumer.InputConsumer`):
  durable, but recreated at every start to deliver from the store's position
  (``BY_START_SEQUENCE``), since the position of record is the store's, not the
  consumer's. Cumulative acks (``AckPolicy.ALL``: one ``+ACK`` of a committed batch's
  last delivery acknowledges the batch), never given up on (``max_deliver`` -1), room
  for :data:`INPUT_ACK_PENDING_BATCHES` batches unacknowledged (at least 1,000). It
  keeps nothing worth keeping: one replica, in memory, even on an R3 stream (after a
  node dies it is recreated on a live one in seconds, where an R3 consumer first waits
  for its own leader election). :data:`INPUT_LOOKAHEAD` batches are asked for ahead.
  The replay's own fold (``--db``) reads through one too, named ``replay-<random>`` and
  deleted afterwards.
- **The replay's readers** ``replay-<random>`` of both streams (:func:`replay_reader`,
  read by :class:`~reconciler.replay.readers.StreamReader`): ephemeral, gone by
  themselves :data:`REPLAY_INACTIVE_S` after their last use, no acks (nothing to ack,
  nothing redelivered), from the start, a sequence or a time; one replica, in memory;
  :data:`REPLAY_CHUNK` messages a request, :data:`REPLAY_AHEAD` requests ahead.
- **The executors' consumers** ``executor-<host>`` on the OUT stream
  (:func:`executor_consumer`, :func:`ensure_executor_consumer`): durable, filtered to
  ``<prefix>.out.exec.<host>.>``, explicit acks (a command is acked once done), at most
  ``max_in_hand`` commands unacknowledged, never given up on. Made by the executor, or
  by ``reconciler provision`` for an executor that may not create consumers, with the
  same settings: a consumer made now delivers the commands of the last ``catch_up_s``
  seconds (:data:`EXECUTOR_CATCH_UP_S`, one hour, by default; 0: only new ones), so an
  executor started (or provisioned) after the reconciler decided still gets the creates
  it is waiting for, while a new one on an old stream does not replay a month of
  history. The start is found as a sequence by a short-lived probe
  (:func:`first_seq_since`): a consumer starting by time cannot be updated on
  nats-server 2.9 ("start time can not be updated"), one starting by sequence can.
- Every consumer allows :data:`MAX_WAITING` pull requests at once and delivers at once
  (``ReplayPolicy.INSTANT``). Requests expire after a second; a reader that hears
  nothing :data:`STALL_S` after that binds again.
"""

from __future__ import annotations

import datetime as dt
import enum
import functools
from typing import Any

import anyio
import structlog
from nats.aio.client import Client
from nats.js import JetStreamContext, api
from nats.js.errors import NotFoundError

from reconciler.bus.reader import PullReader, parse_ack_subject
from reconciler.bus.violations import guarded
from reconciler.core.messages import Subjects

__all__ = [
    "EXECUTOR_AHEAD",
    "EXECUTOR_CATCH_UP_S",
    "INPUT_ACK_PENDING_BATCHES",
    "INPUT_LOOKAHEAD",
    "MAX_WAITING",
    "REPLAY_AHEAD",
    "REPLAY_CHUNK",
    "REPLAY_INACTIVE_S",
    "STALL_S",
    "Ensured",
    "ensure_executor_consumer",
    "executor_consumer",
    "executor_consumer_name",
    "executor_filter",
    "first_seq_since",
    "input_consumer",
    "replay_reader",
]

logger = structlog.get_logger(__name__)

#: pull requests a consumer holds at once
MAX_WAITING = 16
#: how long past a pull request's expiry a reader waits for any answer before it binds
#: again (a known nats-py stall after reconnects)
STALL_S = 5.0

#: the replica's input consumer: batches asked for ahead of the caller, buffered or owed
INPUT_LOOKAHEAD = 2
#: unacknowledged deliveries the server allows the input consumer, in batches: the
#: lookahead plus what the caller holds (a batch in hand grown by merging, and the one
#: being committed)
INPUT_ACK_PENDING_BATCHES = 8
INPUT_ACK_PENDING_MIN = 1000

#: messages per pull request of the replay's readers (at least; the replay's ``batch``
#: if larger)
REPLAY_CHUNK = 1000
#: pull requests of a replay's reader buffered or owed
REPLAY_AHEAD = 3
#: an ephemeral reader of the replay goes by itself this long after its last use
REPLAY_INACTIVE_S = 60.0

#: an executor's requests: one batch of ``fetch_batch`` asked for ahead (the consumer's
#: ``max_ack_pending`` bounds what is delivered and not yet done)
EXECUTOR_AHEAD = 1
#: a new executor consumer delivers the commands of the last hour
EXECUTOR_CATCH_UP_S = 3600.0
#: the probe that finds where that is, gone by itself after this long unused
_PROBE_INACTIVE_S = 30.0


# ---------------------------------------------------------------- the replica's inputs


def input_consumer(
    durable: str, *, from_seq: int, batch: int, ack_wait_s: float
) -> api.ConsumerConfig:
    """The replica's input consumer, delivering from stream sequence ``from_seq``."""
    return api.ConsumerConfig(
        durable_name=durable,
        name=durable,
        deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
        opt_start_seq=from_seq,
        ack_policy=api.AckPolicy.ALL,
        ack_wait=ack_wait_s,
        max_deliver=-1,
        max_ack_pending=max(INPUT_ACK_PENDING_BATCHES * batch, INPUT_ACK_PENDING_MIN),
        max_waiting=MAX_WAITING,
        replay_policy=api.ReplayPolicy.INSTANT,
        # recreated at every start from the store's position: its own state needs no
        # replicas nor disk, and one replica is quicker to move off a dead node
        num_replicas=1,
        mem_storage=True,
    )


# ------------------------------------------------------------------- the replay's reads


def replay_reader(
    name: str, *, start_seq: int | None = None, start_time: dt.datetime | None = None
) -> api.ConsumerConfig:
    """A replay's reader of a whole stream: from ``start_seq``, else from ``start_time``,
    else from the start."""
    if start_seq is not None:
        policy, start_time = api.DeliverPolicy.BY_START_SEQUENCE, None
    elif start_time is not None:
        policy = api.DeliverPolicy.BY_START_TIME
    else:
        policy = api.DeliverPolicy.ALL
    return api.ConsumerConfig(
        name=name,
        deliver_policy=policy,
        opt_start_seq=start_seq,
        opt_start_time=start_time,
        ack_policy=api.AckPolicy.NONE,
        replay_policy=api.ReplayPolicy.INSTANT,
        max_waiting=MAX_WAITING,
        num_replicas=1,
        mem_storage=True,
        inactive_threshold=REPLAY_INACTIVE_S,
    )


# ----------------------------------------------------------------- the executors' commands


def executor_consumer_name(host: str) -> str:
    """The durable consumer of ``host``'s commands."""
    return f"executor-{host}"


def executor_filter(prefix: str, host: str) -> str:
    """The subjects of ``host``'s commands."""
    return Subjects(prefix).exec_commands(host)


def executor_consumer(
    *,
    prefix: str,
    host: str,
    ack_wait_s: float,
    max_in_hand: int,
    start_seq: int | None,
    replicas: int | None = None,
) -> api.ConsumerConfig:
    """``host``'s executor consumer, delivering from ``start_seq`` (``None``: only
    commands stored from now on). ``replicas``: the stream's when not given."""
    config = api.ConsumerConfig(
        durable_name=executor_consumer_name(host),
        description=f"reconciler executor of host {host}",
        filter_subject=executor_filter(prefix, host),
        ack_policy=api.AckPolicy.EXPLICIT,
        ack_wait=ack_wait_s,
        max_deliver=-1,
        max_ack_pending=max_in_hand,
        replay_policy=api.ReplayPolicy.INSTANT,
        num_replicas=replicas,
    )
    if start_seq is None:
        config.deliver_policy = api.DeliverPolicy.NEW
    else:
        config.deliver_policy = api.DeliverPolicy.BY_START_SEQUENCE
        config.opt_start_seq = start_seq
    return config


class Ensured(enum.Enum):
    """What :func:`ensure_executor_consumer` found or did."""

    CREATED = "created"
    UPDATED = "updated"
    UNCHANGED = "unchanged"


async def ensure_executor_consumer(
    nc: Client,
    js: JetStreamContext,
    *,
    stream: str,
    prefix: str,
    host: str,
    ack_wait_s: float,
    max_in_hand: int,
    catch_up_s: float,
    replicas: int | None = None,
    update: bool = True,
    log: Any = logger,
) -> Ensured:
    """Create ``host``'s executor consumer on ``stream`` if it is missing (delivering
    the last ``catch_up_s`` seconds of commands, see the module's rules). An existing
    one is left as it is, unless ``update``: then its ack wait and ``max_ack_pending``
    are brought to the ones given (a refusal is logged, and it is used as it is), and
    one filtering other subjects raises ``RuntimeError`` (bound to it, the executor
    would refuse, hence terminate, other hosts' commands)."""
    filter_subject = executor_filter(prefix, host)
    try:
        info = await js.consumer_info(stream, executor_consumer_name(host))
    except NotFoundError:
        pass
    else:
        if not update:
            return Ensured.UNCHANGED
        return await _update_executor_consumer(
            js, info.config, stream, filter_subject, ack_wait_s, max_in_hand, log
        )
    start = (
        await first_seq_since(
            nc, js, stream=stream, filter_subject=filter_subject, seconds=catch_up_s
        )
        if catch_up_s > 0
        else None
    )
    config = executor_consumer(
        prefix=prefix,
        host=host,
        ack_wait_s=ack_wait_s,
        max_in_hand=max_in_hand,
        start_seq=start,
        replicas=replicas,
    )
    # a refused permission fails at once (not a timeout)
    await guarded(nc, functools.partial(js.add_consumer, stream, config=config))
    log.info(
        "consumer.created",
        filter_subject=filter_subject,
        ack_wait_s=ack_wait_s,
        catch_up_s=catch_up_s,
        start_seq=start,
    )
    return Ensured.CREATED


async def _update_executor_consumer(
    js: JetStreamContext,
    current: api.ConsumerConfig,
    stream: str,
    filter_subject: str,
    ack_wait_s: float,
    max_in_hand: int,
    log: Any,
) -> Ensured:
    if current.filter_subject != filter_subject:
        raise RuntimeError(
            f"consumer {current.durable_name} filters {current.filter_subject!r}, not "
            f"{filter_subject!r}: delete it to have it recreated"
        )
    changes: dict[str, Any] = {}
    if abs(float(current.ack_wait or 0) - ack_wait_s) > 1e-3:
        changes["ack_wait"] = ack_wait_s
    if current.max_ack_pending != max_in_hand:
        changes["max_ack_pending"] = max_in_hand
    if not changes:
        return Ensured.UNCHANGED
    try:
        await js.add_consumer(stream, config=current.evolve(**changes))
    except Exception as exc:  # keep working with the consumer as it is
        log.warning("consumer.update_failed", error=repr(exc), **changes)
        return Ensured.UNCHANGED
    log.info("consumer.updated", **changes)
    return Ensured.UPDATED


async def first_seq_since(
    nc: Client, js: JetStreamContext, *, stream: str, filter_subject: str, seconds: float
) -> int:
    """The stream sequence of the first message of ``filter_subject`` stored in the last
    ``seconds`` (the stream's next sequence when there is none), found by a short-lived
    consumer that starts by time and reads one message."""
    last = int((await js.stream_info(stream)).state.last_seq or 0)
    since = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=seconds)
    probe = api.ConsumerConfig(
        deliver_policy=api.DeliverPolicy.BY_START_TIME,
        opt_start_time=since,
        filter_subject=filter_subject,
        ack_policy=api.AckPolicy.NONE,
        max_waiting=MAX_WAITING,
        inactive_threshold=_PROBE_INACTIVE_S,
    )
    info = await js.add_consumer(stream, config=probe)
    reader = PullReader(nc, stream=stream, batch=1, ahead=1)
    try:
        if not info.num_pending:
            return last + 1
        await reader.bind(info.name)
        with anyio.fail_after(5):
            while not reader.buffered and reader.broken is None:
                await reader.wait()
        if reader.broken is not None:
            raise RuntimeError(f"reading the first command since {since}: {reader.broken}")
        return parse_ack_subject(reader.pop_buffered(1)[0][1])[0]
    finally:
        await reader.unbind()
        try:
            await js.delete_consumer(stream, info.name)
        except Exception as exc:  # it goes by itself once inactive
            logger.debug("consumer.probe_not_deleted", error=repr(exc))
