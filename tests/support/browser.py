"""A real browser for the page tests: headless Chromium (Debian package ``chromium``),
driven over the DevTools protocol on a websocket (aiohttp's client).

:func:`chromium` starts one in a private profile directory and yields a
:class:`Browser`: :meth:`~Browser.goto` loads a URL and waits for its load event,
:meth:`~Browser.text` and :meth:`~Browser.texts` read what the page shows (``innerText``
of CSS selectors), :meth:`~Browser.click` clicks an element with the mouse, as a person
would (at its centre, pressed and released), and waits for the page it loads.
``scripts/test`` installs the package where it can; without it the tests that need it
skip, unless ``RC_REQUIRE_CHROMIUM`` is set (then they fail).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import tempfile
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import anyio
import orjson
import pytest

__all__ = ["Browser", "chromium", "chromium_binary"]

_LISTENING = re.compile(rb"DevTools listening on (ws://\S+)")


def chromium_binary() -> str:
    """The Chromium binary, or a skip (a failure under ``RC_REQUIRE_CHROMIUM``)."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        message = "no chromium binary (Debian package chromium; scripts/test installs it)"
        if os.environ.get("RC_REQUIRE_CHROMIUM"):
            pytest.fail(message)
        pytest.skip(message)
    return found


class Browser:
    """One page of a headless Chromium, over its DevTools websocket."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self._ids = itertools.count(1)
        self.events: list[dict[str, Any]] = []

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        """A DevTools command's result; events that arrive meanwhile are kept."""
        ident = next(self._ids)
        # a text frame: Chromium closes the socket on a binary one
        await self.ws.send_str(
            orjson.dumps({"id": ident, "method": method, "params": params}).decode()
        )
        while True:
            message = await self._receive()
            if message.get("id") == ident:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                result: dict[str, Any] = message.get("result", {})
                return result
            self.events.append(message)

    async def _receive(self) -> dict[str, Any]:
        message = await self.ws.receive()
        if message.type is not aiohttp.WSMsgType.TEXT:
            raise AssertionError(f"the DevTools socket sent {message.type.name}: {message.data}")
        found: dict[str, Any] = orjson.loads(message.data)
        return found

    async def _wait_event(self, method: str, within_s: float = 10.0) -> dict[str, Any]:
        with anyio.fail_after(within_s):
            while True:
                for i, event in enumerate(self.events):
                    if event.get("method") == method:
                        del self.events[: i + 1]
                        return event
                self.events.append(await self._receive())

    async def goto(self, url: str) -> None:
        self.events.clear()
        await self.send("Page.navigate", url=url)
        await self._wait_event("Page.loadEventFired")

    async def evaluate(self, expression: str) -> Any:
        found = await self.send("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in found:
            raise RuntimeError(f"{expression}: {found['exceptionDetails']}")
        return found["result"].get("value")

    async def url(self) -> str:
        return str(await self.evaluate("location.href"))

    async def text(self, selector: str) -> str:
        """The ``innerText`` of the first element ``selector`` matches ("" if none)."""
        found = await self.evaluate(
            f"(document.querySelector({orjson.dumps(selector).decode()}) || {{}}).innerText || ''"
        )
        return str(found)

    async def texts(self, selector: str) -> list[str]:
        """The ``innerText`` of every element ``selector`` matches."""
        found = await self.evaluate(
            f"Array.from(document.querySelectorAll({orjson.dumps(selector).decode()}), "
            "e => e.innerText)"
        )
        return [str(t) for t in found]

    async def click(self, selector: str) -> None:
        """Click the first element ``selector`` matches with the mouse, and wait for the
        page it loads."""
        box = await self.evaluate(
            f"(() => {{ const e = document.querySelector({orjson.dumps(selector).decode()});"
            " if (!e) return null; e.scrollIntoView({block: 'center'});"
            " const r = e.getBoundingClientRect();"
            " return [r.left + r.width / 2, r.top + r.height / 2]; })()"
        )
        if box is None:
            raise AssertionError(f"nothing on the page matches {selector}")
        x, y = box
        self.events.clear()
        for kind in ("mouseMoved", "mousePressed", "mouseReleased"):
            extra = {"button": "left", "clickCount": 1} if kind != "mouseMoved" else {}
            await self.send("Input.dispatchMouseEvent", type=kind, x=x, y=y, **extra)
        await self._wait_event("Page.loadEventFired")


async def _listening(log: str, within_s: float) -> str:
    """The browser's DevTools address, from the line Chromium writes to its stderr."""
    seen = b""
    with anyio.fail_after(within_s):
        while True:
            seen = await anyio.Path(log).read_bytes()
            found = _LISTENING.search(seen)
            if found:
                return found.group(1).decode()
            await anyio.sleep(0.05)
    raise AssertionError(f"chromium said no DevTools address: {seen[-2000:]!r}")


@contextlib.asynccontextmanager
async def chromium(*, width: int = 1400, height: int = 1000) -> AsyncIterator[Browser]:
    binary = chromium_binary()
    profile = tempfile.mkdtemp(prefix="chromium-")
    args = [
        binary,
        "--headless",
        "--no-sandbox",  # the tests run as root, where Chromium's sandbox will not start
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--no-default-browser-check",
        "--disable-extensions",
        "--disable-background-networking",
        "--remote-debugging-port=0",
        f"--user-data-dir={profile}",
        f"--window-size={width},{height}",
        "about:blank",
    ]
    log = os.path.join(profile, "stderr.log")
    # a file, not a pipe: a pipe left unread could stall Chromium
    with open(log, "wb") as stderr:  # noqa: ASYNC230 - creating an empty file
        process = await anyio.open_process(args, stdin=None, stdout=None, stderr=stderr)
    try:
        browser_ws = await _listening(log, within_s=15)
        port = browser_ws.split("//", 1)[1].split("/", 1)[0]
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://{port}/json/list") as response:
                targets = await response.json()
            page = next(t for t in targets if t.get("type") == "page")
            async with session.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                browser = Browser(ws)
                await browser.send("Page.enable")
                yield browser
    finally:
        with anyio.CancelScope(shield=True):
            process.terminate()
            with anyio.move_on_after(5):
                await process.wait()
            if process.returncode is None:
                process.kill()
                await process.wait()
            shutil.rmtree(profile, ignore_errors=True)
