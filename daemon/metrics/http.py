"""The /metrics listener: prometheus-client's exposition, behind a bearer token when it is not on loopback.

Prometheus sends the token with ``authorization: {credentials_file: ...}`` in its scrape config.
"""

from __future__ import annotations

import hmac
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    allow_reuse_address = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass  # one line per scrape would drown the daemon's log


@dataclass
class MetricsServer:
    port: int
    _server: _Server

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def serve_metrics(registry: CollectorRegistry, host: str, port: int, token: str | None) -> MetricsServer:
    """Starts serving in a daemon thread; port 0 picks a free one. Raises OSError if it cannot listen."""
    app: WsgiApp = make_wsgi_app(registry)
    if token:
        app = _with_token(app, token)
    server = make_server(host, port, app, server_class=_Server, handler_class=_QuietHandler)
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
