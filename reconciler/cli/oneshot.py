"""What the commands that talk to NATS once share: a bounded connection and clear errors.

Rules:

- ``replay``, ``audit``, ``cmd``, ``query`` and ``apply`` connect once and give up after
  ``--connect-timeout`` seconds (``RC_CONNECT_TIMEOUT``, default 10) with a
  :class:`click.ClickException` naming the servers tried, never retrying forever as the
  daemons (``run``, ``bridge``, ``executor``) do.
- A stream that does not exist is an error that names it and the prefix, never an empty
  answer.
- They log warnings and errors only, unless ``--log-level`` asks for more.
- The schemas are loaded before anything is sent: a payload is checked against its schema
  and against the fold's own domain checks, so bad input is refused here, untouched; so
  is a field the schema does not name (a typo), even in a command, which the bus would
  carry and the fold ignore.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, TypeVar

import click
from nats.aio.client import Client

from reconciler.bus.connection import ConnectOptions, ConnectRefused, connect
from reconciler.bus.decoder import Decoder
from reconciler.bus.schemas import SchemaLoadError, input_schema_path, load

__all__ = ["connect_once", "input_problems", "missing_stream", "once"]

F = TypeVar("F", bound=Callable[..., Any])


def once(nats: ConnectOptions, timeout_s: float) -> ConnectOptions:
    """``nats`` for a connection that gives up after ``timeout_s`` (``TimeoutError``)."""
    return dataclasses.replace(nats, initial_timeout_s=timeout_s)


async def connect_once(nats: ConnectOptions, timeout_s: float) -> Client:
    """A connection within ``timeout_s``, or a :class:`click.ClickException` saying so."""
    try:
        return await connect(once(nats, timeout_s))
    except TimeoutError as exc:
        raise click.ClickException(
            f"{exc} (--connect-timeout {timeout_s:g}); is nats-server running, and is "
            "--nats-url (RC_NATS_URL) right?"
        ) from None
    except ConnectRefused as exc:  # already says which server and why
        raise click.ClickException(str(exc)) from None
    except (OSError, ValueError, RuntimeError) as exc:
        raise click.ClickException(f"cannot connect to NATS: {exc}") from None


def missing_stream(stream: str, prefix: str) -> click.ClickException:
    """The error for a stream that is not on the server."""
    return click.ClickException(
        f"stream {stream} does not exist on this NATS server: start `reconciler run "
        f"--prefix {prefix}` once (it creates the streams), or check --prefix and --nats-url"
    )


@functools.cache
def _decoder() -> Decoder:
    return Decoder()


def input_problems(kind: str, payload: Any, *, subject_token: str | None = None) -> list[str]:
    """Why ``payload`` is not a valid input of ``kind`` (empty when it is): every field
    its schema does not name (a typo: refused here, even where the bus would ignore it),
    its schema, then the checks the fold makes after the schema, as the reconciler's
    decoder checks them (:meth:`reconciler.bus.decoder.Decoder.problems`)."""
    try:
        decoder = _decoder()
        schemas = load()
    except SchemaLoadError as exc:
        raise click.ClickException(str(exc)) from None
    unknown = [str(u) for u in schemas.unknown_fields(input_schema_path(kind), payload)]
    return unknown + decoder.problems(kind, payload, subject_token=subject_token)
