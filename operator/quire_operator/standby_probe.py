"""A liveness endpoint for the time a replica waits to lead, before kopf serves its own."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit


@contextlib.contextmanager
def standby_probe(url: str | None) -> Iterator[None]:
    """Answer 200 at kopf's liveness URL until the block ends (then kopf takes the port)."""
    if not url:
        yield
        return
    parts = urlsplit(url)
    path = parts.path or "/"

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            ok = self.path.split("?")[0] == path
            body = b'{"standby": true}' if ok else b"{}"
            self.send_response(200 if ok else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:  # probes every few seconds: not worth a line
            pass

    server = ThreadingHTTPServer((parts.hostname or "0.0.0.0", parts.port or 80), Handler)
    thread = threading.Thread(target=server.serve_forever, name="standby-probe", daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()
