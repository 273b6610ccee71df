"""Whether a worker task's TensorFlow server answers: one gRPC call, any reply. The agent's hands for
:class:`~tfelastic.daemon.agent.replacements.ServerProbe`.

A listening socket alone proves nothing: the kernel completes TCP handshakes for a process that is stopped or
wedged. A gRPC call needs the server's own threads to answer, so a reply of any status (TensorFlow's worker
service answers GetStatus; a server without that method answers UNIMPLEMENTED) means it serves, and only silence
(the deadline) or a refused connection means it does not.
"""

from __future__ import annotations

import grpc

METHOD = "/tensorflow.WorkerService/GetStatus"  # its request, GetStatusRequest, has no fields: b"" is one
NOT_SERVING = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


async def answers(address: str, timeout: float) -> bool:
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.unary_unary(METHOD, None, None)  # no serializers: bytes in, bytes out
        try:
            await call(b"", timeout=timeout)
        except grpc.aio.AioRpcError as e:
            return e.code() not in NOT_SERVING
        return True
