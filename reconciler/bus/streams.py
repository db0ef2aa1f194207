"""The JetStream streams and the leader bucket of CONTRACT.md ("Streams"), created idempotently.

Rules:

- Names derive from the subject prefix only: prefix ``rc`` gives streams ``RC_IN``
  (``rc.in.>``) and ``RC_OUT`` (``rc.out.>``) and the KV bucket ``rc_leader``.
- :func:`ensure_streams` may run on every replica at every start-up, concurrently. A
  missing stream is created; an existing one with the wanted settings is left alone; one
  whose settings differ gets the fields this module manages updated (everything else the
  operator set is kept), and each change is logged. Settings the server cannot change
  (storage, retention, or cancelling ``deny_delete``) are logged as errors and left as
  they are, so a replica still starts on an operator's deliberate choice.
- Only nats-server 2.9 features are used.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from typing import Any

import structlog
from nats.js import JetStreamContext, api
from nats.js.errors import BadRequestError, NotFoundError

__all__ = [
    "DEFAULT_DUPLICATE_WINDOW_S",
    "DEFAULT_LEADER_TTL_S",
    "DEFAULT_MAX_AGE_S",
    "LEADER_KEY",
    "StreamNames",
    "ensure_streams",
]

logger = structlog.get_logger(__name__)

DEFAULT_MAX_AGE_S = 30 * 24 * 3600.0
DEFAULT_DUPLICATE_WINDOW_S = 600.0
DEFAULT_LEADER_TTL_S = 10.0
LEADER_KEY = "leader"

_PREFIX = re.compile(r"[A-Za-z0-9_-]{1,128}")
_STREAM_NAME_IN_USE = 10058  # "stream name already in use with a different configuration"
_KV_DUPLICATE_WINDOW_MAX_S = 120.0  # what nats-py gives a KV bucket's stream


@dataclass(frozen=True, kw_only=True)
class StreamNames:
    """The stream, subject and bucket names for one prefix."""

    prefix: str
    in_stream: str
    in_subjects: str
    out_stream: str
    out_subjects: str
    leader_bucket: str

    @classmethod
    def for_prefix(cls, prefix: str = "rc") -> StreamNames:
        if not _PREFIX.fullmatch(prefix):
            raise ValueError(f"prefix must be one subject token [A-Za-z0-9_-]{{1,128}}: {prefix!r}")
        upper = prefix.upper()
        return cls(
            prefix=prefix,
            in_stream=f"{upper}_IN",
            in_subjects=f"{prefix}.in.>",
            out_stream=f"{upper}_OUT",
            out_subjects=f"{prefix}.out.>",
            leader_bucket=f"{prefix}_leader",
        )

    @property
    def leader_stream(self) -> str:
        """The stream behind the leader bucket (``KV_<bucket>``)."""
        return f"KV_{self.leader_bucket}"


async def ensure_streams(
    js: JetStreamContext,
    names: StreamNames,
    *,
    max_age_s: float = DEFAULT_MAX_AGE_S,
    duplicate_window_s: float = DEFAULT_DUPLICATE_WINDOW_S,
    leader_ttl_s: float = DEFAULT_LEADER_TTL_S,
) -> None:
    """Create or reconcile the IN and OUT streams and the leader bucket of ``names``.

    The OUT stream keeps its messages as long as IN (``max_age_s``), so a replay finds
    the decisions of every input it still has.
    """
    if duplicate_window_s <= 0 or leader_ttl_s <= 0 or max_age_s < 0:
        raise ValueError("duplicate_window_s and leader_ttl_s must be > 0, max_age_s >= 0")
    if max_age_s and duplicate_window_s > max_age_s:
        raise ValueError(f"duplicate_window_s {duplicate_window_s} exceeds max_age_s {max_age_s}")
    storage = {"storage": api.StorageType.FILE, "retention": api.RetentionPolicy.LIMITS}
    await _ensure_stream(
        js,
        name=names.in_stream,
        wanted={
            "subjects": [names.in_subjects],
            "max_age": float(max_age_s),
            "duplicate_window": float(duplicate_window_s),
            "deny_delete": True,
        },
        immutable=storage,
    )
    await _ensure_stream(
        js,
        name=names.out_stream,
        wanted={
            "subjects": [names.out_subjects],
            "max_age": float(max_age_s),
            "duplicate_window": float(duplicate_window_s),
        },
        immutable=storage,
    )
    await _ensure_leader_bucket(js, names, ttl_s=float(leader_ttl_s))


async def _ensure_stream(
    js: JetStreamContext,
    *,
    name: str,
    wanted: dict[str, Any],
    immutable: dict[str, Any],
) -> None:
    log = logger.bind(stream=name)
    for _ in range(3):
        try:
            info = await js.stream_info(name)
        except NotFoundError:
            config = api.StreamConfig(name=name, **immutable, **wanted)
            try:
                await js.add_stream(config)
            except BadRequestError as exc:
                if exc.err_code != _STREAM_NAME_IN_USE:
                    raise
                continue  # another replica created it meanwhile: reconcile theirs
            log.info("stream.created", **_loggable(wanted), **_loggable(immutable))
            return
        await _reconcile(js, info.config, wanted=wanted, immutable=immutable, log=log)
        return
    raise RuntimeError(f"stream {name} kept changing while it was being created")


async def _reconcile(
    js: JetStreamContext,
    current: api.StreamConfig,
    *,
    wanted: dict[str, Any],
    immutable: dict[str, Any],
    log: Any,
) -> None:
    for field, value in immutable.items():
        if getattr(current, field) != value:
            log.error(
                "stream.config_not_updatable",
                field=field,
                current=_plain(getattr(current, field)),
                wanted=_plain(value),
            )
    changes = {
        field: value
        for field, value in wanted.items()
        if _differs(field, getattr(current, field), value)
    }
    if changes.get("deny_delete") is False:
        # The server refuses to cancel deny_delete; keep it rather than fail to start.
        log.error("stream.config_not_updatable", field="deny_delete", current=True, wanted=False)
        del changes["deny_delete"]
    if not changes:
        return
    before = {field: getattr(current, field) for field in changes}
    await js.update_stream(current.evolve(**changes))
    log.warning("stream.updated", before=_loggable(before), after=_loggable(changes))


def _differs(field: str, current: Any, wanted: Any) -> bool:
    if field in ("max_age", "duplicate_window"):
        return abs(float(current or 0) - float(wanted)) > 1e-6
    if field == "subjects":
        return sorted(current or []) != sorted(wanted)
    return bool(current != wanted)


async def _ensure_leader_bucket(js: JetStreamContext, names: StreamNames, *, ttl_s: float) -> None:
    # nats-py derives the bucket stream's duplicate window from its TTL; mirror that rule.
    duplicate_window = min(ttl_s, _KV_DUPLICATE_WINDOW_MAX_S)
    for _ in range(3):
        try:
            info = await js.stream_info(names.leader_stream)
        except NotFoundError:
            try:
                await js.create_key_value(
                    api.KeyValueConfig(
                        bucket=names.leader_bucket,
                        history=1,
                        ttl=ttl_s,
                        storage=api.StorageType.FILE,
                    )
                )
            except BadRequestError as exc:
                if exc.err_code != _STREAM_NAME_IN_USE:
                    raise
                continue
            logger.info("bucket.created", bucket=names.leader_bucket, ttl_s=ttl_s)
            return
        await _reconcile(
            js,
            info.config,
            wanted={"max_age": ttl_s, "duplicate_window": duplicate_window},
            immutable={},
            log=logger.bind(stream=names.leader_stream, bucket=names.leader_bucket),
        )
        return
    raise RuntimeError(f"bucket {names.leader_bucket} kept changing while it was being created")


def _plain(value: Any) -> Any:
    return value.value if isinstance(value, Enum) else value


def _loggable(values: dict[str, Any]) -> dict[str, Any]:
    return {field: _plain(value) for field, value in values.items()}
