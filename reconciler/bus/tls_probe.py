"""Why a NATS server hung up on a TLS connection: a second handshake that sends nothing.

Under TLS 1.3 a client's handshake is complete as soon as it has sent its certificate;
the server checks that certificate afterwards. A server that refuses it (signed by a CA
it does not trust, or none given while it requires one) sends an alert and closes. But
nats-py writes ``CONNECT`` the moment its handshake completes: when those bytes reach
the server after it has closed, the server's kernel answers with a reset, and the
client usually sees ``Connection reset by peer`` instead of the alert (three attempts
in four on a loaded machine). Retrying is a lottery: each attempt has a small chance of
reading the alert first.

:func:`hangup_cause` asks again without that race: it connects to the same server with
the same TLS context, completes the handshake, and then only reads. With nothing
written after the handshake, the server's close is a clean one, the alert arrives
whole, and the client reads it as the :class:`ssl.SSLError` it is. A server that accepts
the certificate waits for ``CONNECT``, which never comes: the read times out, and the
probe says nothing.

Rules:

- The probe sends no credentials and nothing of the NATS protocol: a TCP connection, the
  server's ``INFO`` read, a TLS handshake, then a read.
- Its answer is only the error the TLS layer raised (for the caller to classify), or
  ``None`` when the server did not refuse the handshake within the timeout.
- WebSocket URLs are not probed (the handshake there is the HTTP server's).
"""

from __future__ import annotations

import asyncio
import ssl
from urllib.parse import urlsplit

import anyio

__all__ = ["hangup_cause"]

#: the longest ``INFO`` line read before the handshake (a server's is about 300 bytes)
_INFO_LIMIT = 64 * 1024


async def hangup_cause(url: str, context: ssl.SSLContext, timeout_s: float) -> ssl.SSLError | None:
    """The TLS error with which the server at ``url`` refuses a handshake made with
    ``context``, or ``None`` (it accepted it, could not be reached, or did not answer
    within ``timeout_s``)."""
    parts = urlsplit(url if "://" in url else f"nats://{url}")
    if parts.scheme.lower() in ("ws", "wss") or parts.hostname is None:
        return None
    host, port = parts.hostname, parts.port or 4222
    with anyio.move_on_after(timeout_s):
        try:
            reader, writer = await asyncio.open_connection(host, port, limit=_INFO_LIMIT)
        except OSError:
            return None
        try:
            info = await reader.readline()
            if not info.startswith(b"INFO "):
                return None
            await writer.start_tls(context, server_hostname=host)
            await reader.read(1)  # the server's verdict: an alert, or silence
        except ssl.SSLError as exc:
            return exc
        except (OSError, ValueError, EOFError):
            return None
        finally:
            writer.transport.abort()  # no TLS shutdown to wait for: the socket goes at once
    return None
