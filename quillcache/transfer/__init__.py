"""Transfer engine: batched one-sided READ/WRITE of registered memory between nodes.

``TransferEngine`` (``engine``) is the API; backends live in ``BACKENDS``: ``tcp`` (default; an
authenticated, pipelined, zero-copy TCP protocol, see ``protocol``), ``local`` (in-process memcpy,
the embedded default) and ``rdma`` (one-sided verbs through ``pyverbs``; unverified until it runs on
RDMA hardware). Shaped like Mooncake's Transfer Engine and NIXL.
"""

from quillcache.transfer.backends.sockets import TcpConfig
from quillcache.transfer.batch import TransferBatch
from quillcache.transfer.engine import BACKENDS, SECRET_ENV, TransferEngine
from quillcache.transfer.types import (
    AuthenticationError,
    Op,
    Outcome,
    ProtocolError,
    RegionDescriptor,
    RegionError,
    RemoteRegion,
    RequestStatus,
    SegmentInfo,
    TransferError,
    TransferRequest,
    TransferTimeoutError,
)

__all__ = [
    "BACKENDS",
    "SECRET_ENV",
    "AuthenticationError",
    "Op",
    "Outcome",
    "ProtocolError",
    "RegionDescriptor",
    "RegionError",
    "RemoteRegion",
    "RequestStatus",
    "SegmentInfo",
    "TcpConfig",
    "TransferBatch",
    "TransferEngine",
    "TransferError",
    "TransferRequest",
    "TransferTimeoutError",
]
