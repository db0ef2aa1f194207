"""SIGTERM and SIGINT for the long-running commands: the first asks for a graceful stop,
the second stops at once."""

from __future__ import annotations

import signal
from collections.abc import Awaitable, Callable

import anyio
import click

__all__ = ["run_until_signalled"]


async def run_until_signalled(
    main: Callable[[anyio.Event], Awaitable[None]],
    *,
    stopping: str,
    started: anyio.Event | None = None,
) -> None:
    """Run ``main(stop)``; the first SIGTERM/SIGINT sets ``stop`` (and prints
    ``<SIGNAL>: <stopping>``), a second one cancels ``main``.

    With ``started``, a signal before ``main`` sets it (still connecting, waiting for
    its store, loading its state: nothing in hand) cancels ``main`` at once and raises
    :class:`KeyboardInterrupt` (the command line prints ``interrupted``)."""
    stop = anyio.Event()
    interrupted = False
    async with anyio.create_task_group() as tg:

        async def on_signals() -> None:
            nonlocal interrupted
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for signum in signals:
                    if started is not None and not started.is_set():
                        interrupted = True
                        tg.cancel_scope.cancel()  # nothing in hand yet: stop now
                        return
                    if stop.is_set():
                        tg.cancel_scope.cancel()  # second signal: stop now
                        return
                    click.echo(f"{signal.Signals(signum).name}: {stopping}", err=True)
                    stop.set()

        tg.start_soon(on_signals)
        await main(stop)
        tg.cancel_scope.cancel()
    if interrupted:
        raise KeyboardInterrupt
