"""HTTP over an Incus unix socket for pylxd, closing every socket it could not connect.

pylxd's own unix-socket connection makes a socket and then connects it; when the connect
fails (a daemon restarting: no socket file yet, or nobody listening) the socket is
dropped unclosed, and only the garbage collector closes it, with a ``ResourceWarning``.
The bridge and the executor retry a restarting daemon many times, so that is one open
descriptor per failed attempt until a collection runs.

:func:`unix_session` is a ``requests.Session`` for ``http+unix://`` endpoints, passed to
pylxd's ``Client(session=…)`` (the extension point pylxd documents for customising its
session). Its adapter keeps one connection pool per socket path, and its connections
close the socket whenever the connect fails.
"""

from __future__ import annotations

import socket
import threading
from typing import Any
from urllib.parse import unquote, urlparse

import requests
import urllib3
from requests.adapters import HTTPAdapter

__all__ = ["UNIX_SCHEME", "unix_session"]

UNIX_SCHEME = "http+unix://"


class _UnixConnection(urllib3.connection.HTTPConnection):
    """One HTTP connection over the unix socket at ``socket_path``."""

    def __init__(self, socket_path: str, **kwargs: Any) -> None:
        super().__init__("localhost", **kwargs)
        self.socket_path = socket_path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout)  # urllib3 sets the request's connect timeout
            sock.connect(self.socket_path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


class _UnixPool(urllib3.HTTPConnectionPool):
    def __init__(self, socket_path: str) -> None:
        super().__init__("localhost")
        self.socket_path = socket_path

    def _new_conn(self) -> _UnixConnection:
        return _UnixConnection(self.socket_path, timeout=self.timeout.connect_timeout)


class _UnixAdapter(HTTPAdapter):
    """Requests to ``http+unix://<quoted socket path>/…``, one pool per socket."""

    def __init__(self) -> None:
        super().__init__()
        self._pools_by_socket: dict[str, _UnixPool] = {}
        self._lock = threading.Lock()

    def _pool(self, url: str) -> _UnixPool:
        path = unquote(urlparse(url).netloc)
        with self._lock:
            pool = self._pools_by_socket.get(path)
            if pool is None:
                pool = self._pools_by_socket[path] = _UnixPool(path)
            return pool

    def get_connection_with_tls_context(
        self,
        request: requests.PreparedRequest,
        verify: bool | str | None,
        proxies: Any = None,
        cert: Any = None,
    ) -> _UnixPool:
        return self._pool(str(request.url))

    def request_url(self, request: requests.PreparedRequest, proxies: Any) -> str:
        return str(request.path_url)

    def close(self) -> None:
        with self._lock:
            pools, self._pools_by_socket = list(self._pools_by_socket.values()), {}
        for pool in pools:
            pool.close()


def unix_session() -> requests.Session:
    """A session for ``http+unix://`` endpoints (see the module's doc)."""
    session = requests.Session()
    session.mount(UNIX_SCHEME, _UnixAdapter())
    return session
