"""The entry point of the replay's reader child (:mod:`reconciler.replay.readers`):
``python -m reconciler.replay.reader_child [--no-websocket]``.

Its start-up is paid while the replay fetches the snapshot, on the core the snapshot's
reading also needs. nats-py imports aiohttp (about 0.15 s, more than a third of the
child's start-up) only for servers reached over WebSocket; with ``--no-websocket``
(the replay passes it when none of its server URLs is ``ws://`` or ``wss://``), aiohttp
is marked absent before nats-py is imported, as the GARM provider's console script does.
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> None:
    if "--no-websocket" in argv and "aiohttp" not in sys.modules and "nats" not in sys.modules:
        sys.modules["aiohttp"] = None  # type: ignore[assignment]
    from reconciler.replay.readers import child_main

    child_main()


if __name__ == "__main__":
    main(sys.argv[1:])
