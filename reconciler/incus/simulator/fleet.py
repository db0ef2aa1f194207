"""A fleet of simulated Incus hosts, each its own endpoint, and the file that lists them.

Rules:

- One aiohttp application per host, listening on its own unix socket
  (``DIR/<host>.socket``) or TCP port (``base``, ``base+1``, …; base 0 = any free port),
  plain HTTP. The pylxd endpoint URL is ``http+unix://<quoted socket path>`` or
  ``http://HOST:PORT``.
- :meth:`Fleet.start` binds every host, then writes the fleet file (if asked) in one
  atomic rename: host name → ``{url, socket?, fingerprint, server_name, shape}``. A
  reader that sees the file can connect to every host in it.
- :meth:`Fleet.stop` is graceful and complete: event streams are closed, running
  operations end Cancelled, timers are cancelled, sockets and the fleet file are removed.
- :class:`SimulatorThread` runs a fleet on its own event loop in a background thread,
  for blocking callers (pylxd) and synchronous tests; :meth:`SimulatorThread.call` runs a
  control on that loop and returns its result.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, TypeVar, cast, overload
from urllib.parse import quote

import orjson
from aiohttp import web

from reconciler.incus.simulator.api import (
    HOST_KEY,
    PING_INTERVAL_KEY,
    add_incus_routes,
    error_middleware,
)
from reconciler.incus.simulator.control import add_control_routes
from reconciler.incus.simulator.host import SimHost, Timing
from reconciler.incus.simulator.shapes import HostShape, shape_to_json
from reconciler.incus.simulator.versions import DEFAULT_VERSION, parse_version

__all__ = ["Fleet", "FleetOptions", "Listen", "SimulatorThread", "unix_url"]

T = TypeVar("T")


def unix_url(path: Path) -> str:
    """pylxd's endpoint URL for a unix socket."""
    return "http+unix://" + quote(str(path), safe="")


@dataclass(frozen=True, kw_only=True)
class Listen:
    """Where hosts listen: ``unix:DIR`` or ``tcp:HOST:PORT`` (PORT is the first host's)."""

    kind: Literal["unix", "tcp"]
    directory: Path | None = None
    address: str = "127.0.0.1"
    base_port: int = 0

    @classmethod
    def parse(cls, text: str) -> Listen:
        kind, _, rest = text.partition(":")
        if kind == "unix" and rest:
            return cls(kind="unix", directory=Path(rest))
        if kind == "tcp" and rest:
            address, _, port = rest.rpartition(":")
            if address and port.isdigit():
                return cls(kind="tcp", address=address.strip("[]"), base_port=int(port))
        raise ValueError(f"--listen wants unix:DIR or tcp:HOST:PORT, got {text!r}")

    def __str__(self) -> str:
        if self.kind == "unix":
            return f"unix:{self.directory}"
        return f"tcp:{self.address}:{self.base_port}"


@dataclass(frozen=True, kw_only=True)
class FleetOptions:
    """Timings and knobs shared by every host of a fleet (seconds)."""

    boot_delay_s: float = 2.0
    ready_delay_s: float = 0.0
    action_delay_s: float = 0.0
    shutdown_delay_s: float = 0.0
    report_ready: bool = True
    ping_interval_s: float = 10.0
    operation_retention_s: float = 5.0
    seed: int = 0
    #: the Incus release played: 6.0 LTS by default, or 7.x (:mod:`.versions`)
    incus_version: str = DEFAULT_VERSION

    def timing(self) -> Timing:
        return Timing(
            boot_delay_s=self.boot_delay_s,
            ready_delay_s=self.ready_delay_s,
            action_delay_s=self.action_delay_s,
            shutdown_delay_s=self.shutdown_delay_s,
            report_ready=self.report_ready,
        )


@dataclass
class _Endpoint:
    runner: web.AppRunner
    url: str
    socket: Path | None = None


@dataclass
class Fleet:
    """Simulated Incus hosts, served; use ``async with Fleet(...) as fleet``."""

    shapes: Sequence[HostShape]
    listen: Listen
    options: FleetOptions = field(default_factory=FleetOptions)
    fleet_file: Path | None = None

    def __post_init__(self) -> None:
        if len({s.name for s in self.shapes}) != len(self.shapes):
            raise ValueError("duplicate host name in fleet")
        self.hosts: dict[str, SimHost] = {
            s.name: SimHost(
                s,
                timing=self.options.timing(),
                operation_retention_s=self.options.operation_retention_s,
                seed=self.options.seed,
                version=parse_version(self.options.incus_version),
            )
            for s in self.shapes
        }
        self._endpoints: dict[str, _Endpoint] = {}

    def host(self, name: str) -> SimHost:
        """The in-process control surface of host ``name``."""
        try:
            return self.hosts[name]
        except KeyError:
            raise KeyError(f"no host {name!r} in the fleet ({sorted(self.hosts)})") from None

    @property
    def endpoints(self) -> dict[str, str]:
        """Host name → pylxd endpoint URL (after :meth:`start`)."""
        return {name: e.url for name, e in self._endpoints.items()}

    def socket(self, name: str) -> Path | None:
        return self._endpoints[name].socket

    async def start(self) -> None:
        try:
            for index, host in enumerate(self.hosts.values()):
                self._endpoints[host.name] = await self._serve(host, index)
        except BaseException:
            await self.stop()
            raise
        if self.fleet_file is not None:
            self._write_fleet_file(self.fleet_file)

    async def stop(self) -> None:
        for host in self.hosts.values():
            await host.close()
        for endpoint in self._endpoints.values():
            await endpoint.runner.cleanup()
            if endpoint.socket is not None:
                with contextlib.suppress(FileNotFoundError):
                    endpoint.socket.unlink()
        self._endpoints.clear()
        if self.fleet_file is not None:
            with contextlib.suppress(FileNotFoundError):
                self.fleet_file.unlink()

    async def __aenter__(self) -> Fleet:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def describe(self) -> dict[str, Any]:
        """The fleet file's content."""
        hosts = {}
        for name, endpoint in self._endpoints.items():
            host = self.hosts[name]
            entry: dict[str, Any] = {
                "url": endpoint.url,
                "server_name": name,
                "fingerprint": host.tls.fingerprint,
                "shape": shape_to_json(host.shape),
            }
            if endpoint.socket is not None:
                entry["socket"] = str(endpoint.socket)
            hosts[name] = entry
        return {"listen": str(self.listen), "hosts": hosts}

    def _write_fleet_file(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        temporary.write_bytes(orjson.dumps(self.describe(), option=orjson.OPT_INDENT_2))
        temporary.replace(path)

    def _application(self, host: SimHost) -> web.Application:
        app = web.Application(middlewares=[error_middleware])
        app[HOST_KEY] = host
        app[PING_INTERVAL_KEY] = self.options.ping_interval_s
        add_incus_routes(app)
        add_control_routes(app)
        return app

    async def _serve(self, host: SimHost, index: int) -> _Endpoint:
        runner = web.AppRunner(
            self._application(host), handle_signals=False, access_log=None, shutdown_timeout=1.0
        )
        await runner.setup()
        try:
            if self.listen.kind == "unix":
                directory = cast(Path, self.listen.directory)
                directory.mkdir(parents=True, exist_ok=True)
                path = directory / f"{host.name}.socket"
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()  # a stale socket of a killed run
                await web.UnixSite(runner, str(path)).start()
                return _Endpoint(runner=runner, url=unix_url(path), socket=path)
            port = self.listen.base_port + index if self.listen.base_port else 0
            site = web.TCPSite(runner, self.listen.address, port)
            await site.start()
            bound = _bound_port(runner)
            return _Endpoint(runner=runner, url=f"http://{_url_host(self.listen.address)}:{bound}")
        except BaseException:
            await runner.cleanup()
            raise


def _bound_port(runner: web.AppRunner) -> int:
    for address in runner.addresses:
        if isinstance(address, tuple):
            return int(address[1])
    raise RuntimeError("the TCP site has no bound address")


def _url_host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


class SimulatorThread:
    """A :class:`Fleet` on its own event loop in a daemon thread; a context manager."""

    def __init__(self, fleet: Fleet, *, start_timeout_s: float = 10.0) -> None:
        self.fleet = fleet
        self._start_timeout_s = start_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    def __enter__(self) -> SimulatorThread:
        self._thread = threading.Thread(target=self._main, name="sim-incus", daemon=True)
        self._thread.start()
        if not self._ready.wait(self._start_timeout_s):
            raise TimeoutError("the simulated fleet did not start in time")
        if self._error is not None:
            self._thread.join()
            raise self._error
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def endpoints(self) -> dict[str, str]:
        return self.fleet.endpoints

    def host(self, name: str) -> SimHost:
        """The host object; call its controls through :meth:`call`, not directly."""
        return self.fleet.host(name)

    # Two signatures, so that a type checker reads ``call(host.drop_event_streams)`` (a
    # coroutine function) as the int it awaits, not as an awaitable of nothing.
    @overload
    def call(self, control: Callable[[], Awaitable[T]], *, timeout_s: float = ...) -> T: ...

    @overload
    def call(self, control: Callable[[], T], *, timeout_s: float = ...) -> T: ...

    def call(self, control: Callable[[], T | Awaitable[T]], *, timeout_s: float = 10.0) -> T:
        """Run ``control`` on the fleet's loop (awaiting it if it is a coroutine)."""
        if self._loop is None:
            raise RuntimeError("the simulator thread is not running")

        async def invoke() -> T:
            result = control()
            if inspect.isawaitable(result):
                return cast(T, await result)
            return result

        return asyncio.run_coroutine_threadsafe(invoke(), self._loop).result(timeout_s)

    def stop(self) -> None:
        loop, stopping, thread = self._loop, self._stopping, self._thread
        if loop is None or stopping is None or thread is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop already closed
            loop.call_soon_threadsafe(stopping.set)
        thread.join(timeout=15)
        self._loop = None

    def _main(self) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._serve(loop))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()

    async def _serve(self, loop: asyncio.AbstractEventLoop) -> None:
        self._stopping = asyncio.Event()
        try:
            await self.fleet.start()
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            return
        self._loop = loop
        self._ready.set()
        try:
            await self._stopping.wait()
        finally:
            await self.fleet.stop()
