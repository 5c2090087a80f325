"""A small request/response RPC: one object's whitelisted methods served over TCP (pyzmq + msgpack).

Layers, one per module: ``errors`` (what can go wrong, ``RpcErrorCode``), ``codec`` (msgpack + the registry of
dataclasses, enums and exceptions that may cross the wire), ``wire`` (the versioned request and reply frames and
the exception mapping), ``dispatch`` (one request frame in, one reply out: what both servers share), ``server``
(``RpcServer``: a ROUTER socket, one serving thread), ``stream`` (``StreamServer``: the same over plain TCP with
length-prefixed frames, addresses ``qtcp://``, a thread per connection; ``frames``: reading and closing such frames,
what both of its ends share), ``client`` (``RpcClient``: a DEALER
socket or a plain TCP socket by the address's scheme, timeouts, leader retries; ``InProcessClient``: the same API
without sockets).

``experiments/rpc_choice.py`` compares pyzmq + msgpack with grpcio (single-key round trips from one client and
batched keys per second, two processes on loopback); it is run by hand (grpcio is not a dependency) and its
results are not kept in ``results/``. The plain-TCP transport was added beside it because a
ZeroMQ round trip passes libzmq's I/O threads on both sides: ``experiments/master_study.py`` measures the master's
single-key and batched calls over both transports, interleaved in the same run (``quillcache rpc`` and
``quillcache rpc (zmq)``), and ``MasterClient`` prefers the plain-TCP one.

Usage::

    register_type(ReplicaDescriptor); register_type(ErrorCode); register_error(MasterError)
    with RpcServer(master, ["put_start", "put_end"]) as server, RpcClient(server.address) as client:
        replicas = client.put_start(key, size)
"""

from quillcache.rpc.client import InProcessClient, RpcClient
from quillcache.rpc.codec import DEFAULT_CODEC, Codec, register_error, register_type
from quillcache.rpc.errors import (RpcConnectionError, RpcEncodeError, RpcError, RpcErrorCode, RpcProtocolError,
                                   RpcRejectedError, RpcRemoteError, RpcTimeoutError)
from quillcache.rpc.server import RpcServer
from quillcache.rpc.stream import StreamServer
from quillcache.rpc.wire import PROTOCOL_VERSION

__all__ = ["Codec", "DEFAULT_CODEC", "InProcessClient", "PROTOCOL_VERSION", "RpcClient", "RpcConnectionError",
           "RpcEncodeError", "RpcError", "RpcErrorCode", "RpcProtocolError", "RpcRejectedError", "RpcRemoteError",
           "RpcServer", "RpcTimeoutError", "StreamServer", "register_error", "register_type"]
