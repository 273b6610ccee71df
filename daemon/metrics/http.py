"""The /metrics listener: prometheus-client's exposition, behind a bearer token when it is not on loopback.

Prometheus sends the token with ``authorization: {credentials_file: ...}`` in its scrape config.

What a client that never sends a request can hold is bounded: each connection has a thread only while it is
served, a client that stays silent for ``READ_TIMEOUT_SECONDS`` is disconnected, and at most
``MAX_CONNECTIONS`` connections are served at once, ``MAX_CONNECTIONS_PER_ADDRESS`` from any one address, so that
idle connections from one host cannot keep Prometheus (at another address) out. Connections beyond are closed at
once. Prometheus itself holds one connection per scrape.
"""

from __future__ import annotations

import hmac
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]
READ_TIMEOUT_SECONDS = 5.0
MAX_CONNECTIONS = 128
MAX_CONNECTIONS_PER_ADDRESS = 16


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = MAX_CONNECTIONS  # the listen backlog: a burst is accepted (and judged), not left in SYN
    read_timeout = READ_TIMEOUT_SECONDS

    def server_activate(self) -> None:
        super().server_activate()
        self._lock = threading.Lock()
        self._served: Counter[str] = Counter()

    def process_request(self, request: Any, client_address: Any) -> None:
        address = str(client_address[0])
        with self._lock:
            admitted = (self._served.total() < MAX_CONNECTIONS
                        and self._served[address] < MAX_CONNECTIONS_PER_ADDRESS)
            if admitted:
                self._served[address] += 1
        if not admitted:
            self.shutdown_request(request)  # too many at once: closed without a thread
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._lock:
                self._served[str(client_address[0])] -= 1
                self._served += Counter()  # drop addresses at zero

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that went away or stayed silent: nothing to report, and no traceback on stderr


class _QuietHandler(WSGIRequestHandler):
    server: _Server

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.server.read_timeout)  # a silent client is disconnected, its thread ends

    def log_message(self, format: str, *args: Any) -> None:
        pass  # one line per scrape would drown the daemon's log


@dataclass
class MetricsServer:
    port: int
    _server: _Server

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def serve_metrics(registry: CollectorRegistry, host: str, port: int, token: str | None,
                  read_timeout: float = READ_TIMEOUT_SECONDS) -> MetricsServer:
    """Starts serving in a daemon thread; port 0 picks a free one. Raises OSError if it cannot listen."""
    app: WsgiApp = make_wsgi_app(registry)
    if token:
        app = _with_token(app, token)
    server = make_server(host, port, app, server_class=_Server, handler_class=_QuietHandler)
    server.read_timeout = read_timeout
    threading.Thread(target=server.serve_forever, name="tfelastic-metrics", daemon=True).start()
    return MetricsServer(int(server.server_port), server)


def _with_token(app: WsgiApp, token: str) -> WsgiApp:
    expected = f"Bearer {token}".encode()

    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        presented = environ.get("HTTP_AUTHORIZATION", "").encode()
        if not hmac.compare_digest(presented, expected):
            start_response("401 Unauthorized", [("Content-Type", "text/plain"),
                                                ("WWW-Authenticate", 'Bearer realm="tfelastic"')])
            return [b"missing or wrong bearer token\n"]
        return app(environ, start_response)

    return guarded

