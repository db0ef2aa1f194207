"""How every ``reconciler`` program ends when something expected goes wrong: one line.

Rules:

- An expected failure (a refused connection, a store that is not a replica's or is too
  new, a held writer lock, a file that cannot be read, a stream that cannot be replayed:
  :func:`describe` knows them) prints ``Error: <what is wrong and what to do>`` on
  stderr, one line, and exits with status 1 (a usage error keeps click's status 2).
  Wrapped in exception groups (the task groups of ``anyio``), the failure inside is
  what is reported.
- Ctrl-C (SIGINT) at any time prints ``interrupted`` and exits with status 130; a
  command that cleans up on its way out (``replay`` removes its partial ``--db``) has
  done so by then.
- Anything else is a bug: still one line, naming the exception, asking for ``--debug``.
- ``--debug`` anywhere on the command line (or ``RC_DEBUG=1``) shows the traceback
  instead of the line.

Nothing here imports the program's own modules: an exception's class is looked up in
the modules already loaded (an exception of a module that was never imported cannot
have been raised), so the console script imports no more than the command needs.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Sequence
from typing import NoReturn

import click

__all__ = [
    "DEBUG_ENV",
    "EXPECTED",
    "INTERRUPTED",
    "Interrupted",
    "describe",
    "leaves",
    "run_cli",
]

#: the environment variable that asks for tracebacks, as ``--debug`` does
DEBUG_ENV = "RC_DEBUG"
#: what a program interrupted by Ctrl-C prints, and its exit status (128 + SIGINT)
INTERRUPTED = ("interrupted", 130)

#: (module, class) of the failures that mean "the world is not as the program needs it",
#: each of which says what is wrong in its message
EXPECTED: tuple[tuple[str, str], ...] = (
    ("reconciler.store.errors", "StoreError"),
    ("reconciler.replica.replica", "StartupError"),
    ("reconciler.replay.replay", "ReplayError"),
    ("reconciler.replay.readers", "ReaderError"),
    ("reconciler.bus.connection", "ConnectRefused"),
    ("reconciler.bus.streams", "StreamSetupError"),
    ("reconciler.bus.nats_internals", "UnsupportedNatsPy"),
    ("reconciler.bus.embedded", "NatsServerNotFound"),
    ("reconciler.bus.schemas", "SchemaLoadError"),
    ("reconciler.deploy.fleet", "FleetError"),
    ("reconciler.client", "ClientError"),
    ("reconciler.incus.errors", "IncusError"),
    ("reconciler.store.snapshot_format", "SnapshotError"),
    ("nats.errors", "Error"),
    ("nats.js.errors", "Error"),
)


class Interrupted(Exception):
    """A :class:`KeyboardInterrupt` carried past click (which would print a blank line
    and ``Aborted!``) to :func:`run_cli`."""


def leaves(exc: BaseException) -> list[BaseException]:
    """``exc``, or the exceptions inside it when it is a group (nested groups flattened);
    a cancellation that only accompanies the real failure is left out."""
    if not isinstance(exc, BaseExceptionGroup):
        return [exc]
    found: list[BaseException] = []
    for inner in exc.exceptions:
        found.extend(leaves(inner))
    real = [e for e in found if not _is_cancellation(e)]
    return real or found


def _is_cancellation(exc: BaseException) -> bool:
    import asyncio

    return isinstance(exc, asyncio.CancelledError)


def _expected_types() -> tuple[type[BaseException], ...]:
    found: list[type[BaseException]] = []
    for module, name in EXPECTED:
        loaded = sys.modules.get(module)
        cls = getattr(loaded, name, None) if loaded is not None else None
        if isinstance(cls, type) and issubclass(cls, BaseException):
            found.append(cls)
    return tuple(found)


def describe(exc: BaseException) -> tuple[str, int] | None:
    """The line and exit status for an expected failure, or ``None`` for a bug."""
    if isinstance(exc, KeyboardInterrupt | click.Abort | Interrupted):
        return INTERRUPTED
    if isinstance(exc, click.ClickException):
        return exc.format_message(), exc.exit_code
    if isinstance(exc, UnicodeDecodeError):
        return f"not UTF-8 text ({exc.reason} at byte {exc.start}): save it as UTF-8", 1
    if isinstance(exc, TimeoutError):
        text = str(exc) or "timed out"
        return f"{text}: is the server up and reachable?", 1
    if isinstance(exc, OSError):
        return _os_error(exc), 1
    if isinstance(exc, _expected_types()):
        return _one_line(str(exc) or type(exc).__name__), 1
    return None


def _os_error(exc: OSError) -> str:
    what = exc.strerror or str(exc) or type(exc).__name__
    if exc.filename is not None:
        return f"{exc.filename}: {what}"
    return what


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _debug(args: Sequence[str]) -> bool:
    return "--debug" in args or os.environ.get(DEBUG_ENV, "").lower() in ("1", "true", "yes")


def run_cli(command: click.Command, args: Sequence[str] | None = None) -> NoReturn:
    """Run ``command`` on ``args`` (default: ``sys.argv[1:]``) and exit as the module's
    rules say."""
    argv = list(sys.argv[1:] if args is None else args)
    debug = _debug(argv)
    argv = [a for a in argv if a != "--debug"]
    try:
        result = command.main(argv, prog_name="reconciler", standalone_mode=False)
    except SystemExit:
        raise
    except click.exceptions.Exit as done:
        sys.exit(done.exit_code)
    except click.UsageError as usage:
        usage.show()
        sys.exit(usage.exit_code)
    except BaseException as exc:  # every failure ends here, as one line
        _fail(exc, debug)
    sys.exit(result if isinstance(result, int) else 0)


def _fail(exc: BaseException, debug: bool) -> NoReturn:
    found = leaves(exc)
    if any(isinstance(e, SystemExit) for e in found):
        raise next(e for e in found if isinstance(e, SystemExit))
    interrupted = any(isinstance(e, KeyboardInterrupt | click.Abort | Interrupted) for e in found)
    if debug and not interrupted:
        traceback.print_exception(exc)
        sys.exit(1)
    if interrupted:
        line, status = INTERRUPTED
        click.echo(line, err=True)
        sys.exit(status)
    described = [describe(e) for e in found]
    for known in described:
        if known is not None:
            click.echo(f"Error: {known[0]}", err=True)
            sys.exit(known[1])
    first = found[0]
    click.echo(
        f"Error: unexpected {type(first).__name__}: {_one_line(str(first))} (a bug: run "
        f"again with --debug or {DEBUG_ENV}=1 for the traceback, and report it)",
        err=True,
    )
    sys.exit(1)
