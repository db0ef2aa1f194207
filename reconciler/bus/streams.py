"""The JetStream streams and the leader bucket of docs/interface.md ("Streams"), created
idempotently.

Rules:

- Names derive from the subject prefix only: prefix ``rc`` gives streams ``RC_IN``
  (``rc.in.>``) and ``RC_OUT`` (``rc.out.>``) and the KV bucket ``rc_leader``.
- :func:`ensure_streams` may run on every replica at every start-up, concurrently. A
  missing stream is created; an existing one with the wanted settings is left alone; one
  whose settings differ gets the fields this module manages updated (everything else the
  operator set is kept), and each change is logged. Settings the server cannot change
  (storage, retention, or cancelling ``deny_delete``) are logged as errors and left as
  they are, so a replica still starts on an operator's deliberate choice.
- ``replicas`` (``--stream-replicas``) is the streams' and the bucket's replica count
  when they are created. On existing ones it is only compared (a warning when it
  differs) unless ``manage_replicas`` (``reconciler provision``, an admin's job) asks
  for it to be updated: a replica started with the default must never shrink an R3
  stream.
- Streams are looked up before anything is created, so a component whose user has no
  stream-create permission runs when the streams exist. When one is missing and the
  server refuses to create it (or refuses the look-up), :class:`StreamSetupError` says
  at once which permission on which subject is missing, instead of a timeout. An
  update the server refuses is logged as an error and the stream is used as it is.
- Only nats-server 2.9 features are used.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from enum import Enum
from typing import Any

import structlog
from nats import errors as nats_errors
from nats.js import JetStreamContext, api
from nats.js.errors import APIError, BadRequestError, NotFoundError

from reconciler.bus.nats_internals import client_of
from reconciler.bus.violations import PermissionViolation, guarded
from reconciler.core.messages import DEFAULT_PREFIX, Subjects

__all__ = [
    "DEFAULT_DUPLICATE_WINDOW_S",
    "DEFAULT_LEADER_TTL_S",
    "DEFAULT_MAX_AGE_S",
    "LEADER_KEY",
    "StreamNames",
    "StreamSetupError",
    "cluster_forming",
    "ensure_streams",
]

logger = structlog.get_logger(__name__)

DEFAULT_MAX_AGE_S = 30 * 24 * 3600.0
DEFAULT_DUPLICATE_WINDOW_S = 600.0
DEFAULT_LEADER_TTL_S = 10.0
LEADER_KEY = "leader"

_STREAM_NAME_IN_USE = 10058  # "stream name already in use with a different configuration"
#: a cluster still forming: "no suitable peers for placement" (fewer nodes known than
#: replicas asked for) and "JetStream system temporarily unavailable" (no meta leader yet)
_NO_SUITABLE_PEERS = 10005
_JETSTREAM_UNAVAILABLE = 10008
_KV_DUPLICATE_WINDOW_MAX_S = 120.0  # what nats-py gives a KV bucket's stream


class StreamSetupError(RuntimeError):
    """A stream or the leader bucket cannot be looked up or created by this user."""


def _is_api(violation: PermissionViolation) -> bool:
    return violation.subject.upper().startswith("$JS.API.")


async def _api(js: JetStreamContext, call: Any, *, what: str, subject: str) -> Any:
    """A JetStream API call (on the API ``subject``) whose permission violation becomes a
    :class:`StreamSetupError`."""
    try:
        return await guarded(client_of(js), call, match=_is_api, subjects=(subject,))
    except PermissionViolation as exc:
        raise StreamSetupError(
            f"{what}: the NATS server refused this user {exc.operation} permission on "
            f"{exc.subject!r}. Grant it, or have an admin create the streams, consumers "
            f"and leader bucket first with `reconciler provision` (docs/operations.md)"
        ) from None


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
    def for_prefix(cls, prefix: str = DEFAULT_PREFIX) -> StreamNames:
        subjects = Subjects(prefix)  # refuses a prefix that is not one subject token
        upper = prefix.upper()
        return cls(
            prefix=prefix,
            in_stream=f"{upper}_IN",
            in_subjects=subjects.inputs,
            out_stream=f"{upper}_OUT",
            out_subjects=subjects.outputs,
            leader_bucket=f"{prefix}_leader",
        )

    @property
    def subjects(self) -> Subjects:
        """The contract's subjects under this prefix."""
        return Subjects(self.prefix)

    @property
    def leader_stream(self) -> str:
        """The stream behind the leader bucket (``KV_<bucket>``)."""
        return f"KV_{self.leader_bucket}"

    def replica_consumer(self, replica: str) -> str:
        """A replica's durable consumer of the IN stream (``RC_IN-<replica>``)."""
        return f"{self.in_stream}-{replica}"


async def ensure_streams(
    js: JetStreamContext,
    names: StreamNames,
    *,
    max_age_s: float = DEFAULT_MAX_AGE_S,
    duplicate_window_s: float = DEFAULT_DUPLICATE_WINDOW_S,
    leader_ttl_s: float = DEFAULT_LEADER_TTL_S,
    replicas: int = 1,
    manage_replicas: bool = False,
) -> None:
    """Create or reconcile the IN and OUT streams and the leader bucket of ``names``.

    The OUT stream keeps its messages as long as IN (``max_age_s``), so a replay finds
    the decisions of every input it still has.
    """
    if duplicate_window_s <= 0 or leader_ttl_s <= 0 or max_age_s < 0:
        raise ValueError("duplicate_window_s and leader_ttl_s must be > 0, max_age_s >= 0")
    if max_age_s and duplicate_window_s > max_age_s:
        raise ValueError(f"duplicate_window_s {duplicate_window_s} exceeds max_age_s {max_age_s}")
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    storage = {"storage": api.StorageType.FILE, "retention": api.RetentionPolicy.LIMITS}
    wanted_replicas = {"num_replicas": replicas}
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
        replicas=wanted_replicas,
        manage_replicas=manage_replicas,
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
        replicas=wanted_replicas,
        manage_replicas=manage_replicas,
    )
    await _ensure_leader_bucket(
        js, names, ttl_s=float(leader_ttl_s), replicas=replicas, manage_replicas=manage_replicas
    )


async def _ensure_stream(
    js: JetStreamContext,
    *,
    name: str,
    wanted: dict[str, Any],
    immutable: dict[str, Any],
    replicas: dict[str, Any],
    manage_replicas: bool,
) -> None:
    log = logger.bind(stream=name)
    for _ in range(3):
        try:
            info = await _api(
                js,
                lambda: js.stream_info(name),
                what=f"cannot look up stream {name}",
                subject=f"$JS.API.STREAM.INFO.{name}",
            )
        except NotFoundError:
            config = api.StreamConfig(name=name, **immutable, **wanted, **replicas)
            try:
                await _api(
                    js,
                    functools.partial(js.add_stream, config),
                    what=f"stream {name} does not exist and cannot be created",
                    subject=f"$JS.API.STREAM.CREATE.{name}",
                )
            except BadRequestError as exc:
                if exc.err_code != _STREAM_NAME_IN_USE:
                    raise
                continue  # another replica created it meanwhile: reconcile theirs
            log.info("stream.created", **_loggable(wanted), **_loggable(immutable), **replicas)
            return
        if manage_replicas:
            wanted = {**wanted, **replicas}
        else:
            _compare_replicas(info.config, replicas["num_replicas"], log)
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
    try:
        await _api(
            js,
            lambda: js.update_stream(current.evolve(**changes)),
            what=f"cannot update stream {current.name}",
            subject=f"$JS.API.STREAM.UPDATE.{current.name}",
        )
    except StreamSetupError as exc:
        # an operator's stream, and a user without update rights: use it as it is
        log.error("stream.update_refused", error=str(exc), wanted=_loggable(changes))
        return
    log.warning("stream.updated", before=_loggable(before), after=_loggable(changes))


def _compare_replicas(current: api.StreamConfig, wanted: int, log: Any) -> None:
    if (current.num_replicas or 1) != wanted:
        log.warning(
            "stream.replicas_differ",
            current=current.num_replicas or 1,
            wanted=wanted,
            hint="reconciler provision --stream-replicas changes it",
        )


def _differs(field: str, current: Any, wanted: Any) -> bool:
    if field in ("max_age", "duplicate_window"):
        return abs(float(current or 0) - float(wanted)) > 1e-6
    if field == "subjects":
        return sorted(current or []) != sorted(wanted)
    return bool(current != wanted)


async def _ensure_leader_bucket(
    js: JetStreamContext,
    names: StreamNames,
    *,
    ttl_s: float,
    replicas: int,
    manage_replicas: bool,
) -> None:
    # nats-py derives the bucket stream's duplicate window from its TTL; mirror that rule.
    duplicate_window = min(ttl_s, _KV_DUPLICATE_WINDOW_MAX_S)
    stream = names.leader_stream
    log = logger.bind(stream=stream, bucket=names.leader_bucket)
    for _ in range(3):
        try:
            info = await _api(
                js,
                lambda: js.stream_info(stream),
                what=f"cannot look up bucket {stream}",
                subject=f"$JS.API.STREAM.INFO.{stream}",
            )
        except NotFoundError:
            bucket = api.KeyValueConfig(
                bucket=names.leader_bucket,
                history=1,
                ttl=ttl_s,
                storage=api.StorageType.FILE,
                replicas=replicas,
            )
            try:
                await _api(
                    js,
                    functools.partial(js.create_key_value, bucket),
                    what=f"bucket {names.leader_bucket} does not exist and cannot be created",
                    subject=f"$JS.API.STREAM.CREATE.{stream}",
                )
            except BadRequestError as exc:
                if exc.err_code != _STREAM_NAME_IN_USE:
                    raise
                continue
            log.info("bucket.created", ttl_s=ttl_s, num_replicas=replicas)
            return
        wanted: dict[str, Any] = {"max_age": ttl_s, "duplicate_window": duplicate_window}
        if manage_replicas:
            wanted["num_replicas"] = replicas
        else:
            _compare_replicas(info.config, replicas, log)
        await _reconcile(js, info.config, wanted=wanted, immutable={}, log=log)
        return
    raise RuntimeError(f"bucket {names.leader_bucket} kept changing while it was being created")


def _plain(value: Any) -> Any:
    return value.value if isinstance(value, Enum) else value


def _loggable(values: dict[str, Any]) -> dict[str, Any]:
    return {field: _plain(value) for field, value in values.items()}


def cluster_forming(exc: Exception) -> str | None:
    """Why a JetStream API call failed, when a cluster that is still forming explains it
    (its nodes started, not all known to the meta leader yet, or no meta leader yet)."""
    if isinstance(exc, APIError) and (
        exc.err_code in (_NO_SUITABLE_PEERS, _JETSTREAM_UNAVAILABLE) or exc.code == 503
    ):
        return exc.description or type(exc).__name__
    if isinstance(exc, (nats_errors.NoRespondersError, nats_errors.TimeoutError)):
        return "no answer from the JetStream API"
    return None
