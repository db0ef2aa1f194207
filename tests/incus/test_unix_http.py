"""The unix-socket session given to pylxd: a failed connect leaves no socket open."""

from __future__ import annotations

import gc
import http.server
import socketserver
import threading
import warnings
from pathlib import Path
from urllib.parse import quote

import pytest
import requests

from reconciler.incus.unix_http import UNIX_SCHEME, unix_session


def test_a_connect_to_a_missing_socket_fails_and_closes_its_socket(tmp_path: Path) -> None:
    session = unix_session()
    url = UNIX_SCHEME + quote(str(tmp_path / "no-daemon.socket"), safe="") + "/1.0"
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        for _ in range(3):
            with pytest.raises(requests.exceptions.ConnectionError):
                session.get(url, timeout=2)
        gc.collect()  # an unclosed socket would warn here (an error under pytest)
    session.close()


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b'{"metadata": {"path": "%s"}}' % self.path.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


def test_requests_reach_the_socket_with_their_path(tmp_path: Path) -> None:
    path = tmp_path / "incus.socket"
    server = socketserver.UnixStreamServer(str(path), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        session = unix_session()
        base = UNIX_SCHEME + quote(str(path), safe="")
        for name in ("a", "b"):
            answer = session.get(f"{base}/1.0/instances/{name}?recursion=1", timeout=5)
            assert answer.json() == {"metadata": {"path": f"/1.0/instances/{name}?recursion=1"}}
        session.close()
    finally:
        server.shutdown()
        server.server_close()
