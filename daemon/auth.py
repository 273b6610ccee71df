"""Authentication of every RPC: a shared token sent as gRPC metadata, compared in constant time, and TLS.

The standard health service's Check stays open (it reveals only whether the server is serving), so load balancers and
systemd checks need no secret. The token itself is never logged.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from tfelastic.daemon.endpoint import TlsConfig

METADATA_KEY = "authorization"
# Health Check stays open for load balancers and probes; Watch, a stream that never ends, needs the token.
_OPEN_METHODS = ("/grpc.health.v1.Health/Check",)
if TYPE_CHECKING:  # the grpc classes are generic only in their stubs
    Handler = grpc.RpcMethodHandler[Any, Any]
    _Interceptor = grpc.aio.ServerInterceptor[Any, Any]
else:
    Handler = grpc.RpcMethodHandler
    _Interceptor = grpc.aio.ServerInterceptor


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return ((METADATA_KEY, f"Bearer {token}"),)


class TokenInterceptor(_Interceptor):
    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler]],
        details: grpc.HandlerCallDetails,
    ) -> Handler:
        handler = await continuation(details)
        if handler is None or details.method.startswith(_OPEN_METHODS):
            return handler
        presented = dict(details.invocation_metadata or ()).get(METADATA_KEY, "")
        if isinstance(presented, str) and hmac.compare_digest(presented.encode(), self._expected):
            return handler
        return _refusal(handler)


def _refusal(handler: Handler) -> Handler:
    async def refuse(_request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                            "missing or wrong token: pass the job's shared secret with --token-file")

    kind = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]
    return kind(refuse, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


def server_credentials(tls: TlsConfig) -> grpc.ServerCredentials:
    ca = Path(tls.ca).read_bytes() if tls.ca else None
    pair = (Path(tls.key).read_bytes(), Path(tls.cert).read_bytes())
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)


def channel_credentials(tls: TlsConfig) -> grpc.ChannelCredentials:
    ca = Path(tls.ca).read_bytes() if tls.ca else None
    key = Path(tls.key).read_bytes() if tls.key else None
    cert = Path(tls.cert).read_bytes() if tls.cert else None
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
