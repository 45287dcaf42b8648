"""A tiny HTTP server answering /metrics in vLLM's exposition format, for the tests of what reads a server's
/metrics (the Server page, ``watch --metrics``, the Prometheus exporter's windowed hit rate)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@contextmanager
def serve_metrics(body: Callable[[], str]) -> Iterator[str]:
    """Serve ``body()`` (called on each GET) on 127.0.0.1 at a free port; yields the /metrics URL."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            data = body().encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    finally:
        server.shutdown()
        server.server_close()
