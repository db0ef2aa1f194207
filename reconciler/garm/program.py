"""The executable GARM runs: read the environment and stdin, run one command, answer.

Rules:

- stdout gets exactly one answer (JSON, or the plain version string) and nothing else;
  logs are JSON lines on stderr (``GARM_PROVIDER_LOG_LEVEL`` is never read: GARM passes
  no such variable; the level is ``info``).
- A failure prints one sentence on stderr and exits with GARM's code (1, or 30 for
  what is not found); an unknown ``GARM_COMMAND`` or malformed stdin is exit 1.
- Works with an empty environment: nothing here needs PATH or HOME.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Mapping
from importlib.metadata import PackageNotFoundError, version
from typing import Any, TextIO

import anyio
import orjson
import structlog

from reconciler.garm.install import check_template
from reconciler.garm.protocol import ExitCode, Invocation, ProviderError, parse_bootstrap
from reconciler.garm.schemas import CONFIG_SCHEMA, EXTRA_SPECS_SCHEMA
from reconciler.garm.specs import parse_extra_specs

__all__ = ["COMMANDS", "main", "run"]

INTERFACE_VERSIONS = ["v0.1.0", "v0.1.1"]
#: commands that need neither the bus nor Incus
_LOCAL = {
    "GetVersion",
    "GetSupportedInterfaceVersions",
    "GetConfigJSONSchema",
    "GetExtraSpecsJSONSchema",
    "ValidatePoolInfo",
}
COMMANDS = (
    "CreateInstance",
    "DeleteInstance",
    "GetInstance",
    "ListInstances",
    "RemoveAllInstances",
    "StartInstance",
    "StopInstance",
    *sorted(_LOCAL),
)


def _configure_logging(stderr: TextIO) -> None:
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(serializer=lambda o, **_: orjson.dumps(o).decode()),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        logger_factory=structlog.WriteLoggerFactory(stderr),
        cache_logger_on_first_use=False,
    )


def _package_version() -> str:
    try:
        return version("reconciler")
    except PackageNotFoundError:
        return "unknown"


def _local(invocation: Invocation) -> Any:
    command = invocation.command
    if command == "GetVersion":
        return _package_version()
    if command == "GetSupportedInterfaceVersions":
        return INTERFACE_VERSIONS
    if command == "GetConfigJSONSchema":
        return CONFIG_SCHEMA
    if command == "GetExtraSpecsJSONSchema":
        return EXTRA_SPECS_SCHEMA
    # ValidatePoolInfo: the extra specs are read as a create reads them, and the
    # template parsed (not rendered: the runner's values are not known yet)
    specs = parse_extra_specs(invocation.extra_specs)
    if specs.install_template is not None:
        check_template(specs.install_template)
    return None


async def _remote(invocation: Invocation, stdin: bytes) -> Any:
    # Imported here: the local commands answer without loading nats-py or pylxd.
    from reconciler.bus.connection import connect
    from reconciler.garm.admission import Admission
    from reconciler.garm.config import load_config
    from reconciler.garm.provider import Provider

    command = invocation.command
    bootstrap = parse_bootstrap(stdin) if command == "CreateInstance" else None
    config = load_config(invocation.config_file)
    controller = invocation.require_controller()
    try:
        nc = await connect(config.nats)
    except TimeoutError as exc:
        raise ProviderError(str(exc)) from None
    provider = Provider(
        config=config,
        bus=Admission(
            nc,
            prefix=config.prefix,
            decision_timeout_s=config.decision_timeout_s,
            query_timeout_s=config.query_timeout_s,
        ),
        controller_id=controller,
    )
    try:
        if bootstrap is not None:
            return await provider.create(bootstrap)
        if command == "DeleteInstance":
            return await provider.delete(invocation.require_instance_id())
        if command == "GetInstance":
            return await provider.get(invocation.require_instance_id())
        if command == "ListInstances":
            return await provider.list(invocation.pool_id)
        if command == "RemoveAllInstances":
            return await provider.remove_all()
        running = command == "StartInstance"
        return await provider.set_running(invocation.require_instance_id(), running=running)
    finally:
        await provider.aclose()
        with anyio.CancelScope(shield=True):
            await nc.close()


def run(
    env: Mapping[str, str],
    stdin: bytes,
    *,
    stdout: TextIO,
    stderr: TextIO,
) -> int:
    """Run one GARM command; the exit code."""
    _configure_logging(stderr)
    log = structlog.get_logger("reconciler.garm")
    try:
        invocation = Invocation.from_environ(env)
        if invocation.command not in COMMANDS:
            raise ProviderError(
                f"unknown GARM_COMMAND {invocation.command!r}; known: {', '.join(COMMANDS)}"
            )
        structlog.contextvars.bind_contextvars(command=invocation.command)
        if invocation.command in _LOCAL:
            answer = _local(invocation)
        else:
            answer = _ungrouped(lambda: anyio.run(_remote, invocation, stdin))
    except ProviderError as exc:
        log.error("garm.failed", error=exc.message, exit_code=int(exc.code))
        print(exc.message, file=stderr)
        return int(exc.code)
    except Exception as exc:  # a bug or an unexpected failure: a clear line, exit 1
        log.exception("garm.crashed", error=f"{type(exc).__name__}: {exc}")
        print(f"unexpected {type(exc).__name__}: {exc}", file=stderr)
        return int(ExitCode.FAILED)
    if invocation.command == "GetVersion":
        stdout.write(str(answer))
    elif answer is not None or invocation.command in ("CreateInstance", "GetInstance"):
        stdout.write(orjson.dumps(answer).decode())
    elif invocation.command == "ListInstances":
        stdout.write("[]")
    stdout.flush()
    return int(ExitCode.OK)


def _ungrouped(call: Callable[[], Any]) -> Any:
    """``call()``, a failure inside a task group raised as itself (the first of its
    kind when several tasks failed alike), never as an ``ExceptionGroup``."""
    try:
        return call()
    except BaseExceptionGroup as group:
        leaves: list[BaseException] = []
        pending: list[BaseException] = [group]
        while pending:
            exc = pending.pop(0)
            if isinstance(exc, BaseExceptionGroup):
                pending.extend(exc.exceptions)
            else:
                leaves.append(exc)
        raise next((e for e in leaves if isinstance(e, ProviderError)), leaves[0]) from group


def _without_websocket_transport() -> None:
    """GARM starts one process per call, so start-up is paid per runner. nats-py imports
    aiohttp (about a quarter of a second, a third of the start-up) only for servers
    reached over WebSocket, which the provider's configuration refuses
    (:func:`reconciler.garm.config.load_config`). The console script, a process of its
    own, marks aiohttp as absent before nats-py is imported; nothing else it runs uses
    aiohttp. (``reconciler garm-provider`` runs inside the CLI and keeps it.)"""
    if "aiohttp" not in sys.modules and "nats" not in sys.modules:
        sys.modules["aiohttp"] = None  # type: ignore[assignment]


def _read_stdin() -> bytes:
    try:
        return sys.stdin.buffer.read() if sys.stdin is not None else b""
    except (OSError, ValueError):
        return b""


def main(argv: list[str] | None = None, *, reader: Callable[[], bytes] = _read_stdin) -> None:
    """The console script ``reconciler-garm-provider``: GARM passes no arguments."""
    del argv
    _without_websocket_transport()
    code = run(dict(os.environ), reader(), stdout=sys.stdout, stderr=sys.stderr)
    sys.exit(code)
