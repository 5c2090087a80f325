"""What the master's RPC carries: the served methods, the codec registrations, per-key errors in batches.

Contract (shared by :mod:`.server` and :mod:`.client`, so both sides agree by construction):
- ``SERVICE_METHODS``: the whitelisted :class:`~quillcache.master.MasterService` methods (every per-key
  operation and its batch form, plus introspection); ``NODE_METHODS``: what the server process adds
  (``master_status``, ``snapshot_bytes``). ``WRITE_METHODS`` change state (a client never resends one
  after a timeout unless told to: it may have run); ``BATCH_METHODS`` return per-key lists.
- ``register_master_types(codec)`` registers the master's dataclasses, enums and every error class
  (each under its own tag, so an ``ObjectNotFoundError`` arrives as one, with its ``code``).
- A batch's per-key :class:`~quillcache.master.MasterError` travels as :class:`BatchError` (code +
  message): ``encode_batch`` / ``decode_batch`` turn one into the other.
"""

from __future__ import annotations

from dataclasses import dataclass

from quillcache.master import errors as _errors
from quillcache.master.errors import ErrorCode, MasterError, error_for
from quillcache.master.types import (MasterConfig, MasterStats, ObjectInfo, ObjectStatus, PinKind, PutRequest,
                                     PutStartResult, ReplicaConfig, ReplicaDescriptor, SegmentDescriptor, TickReport)
from quillcache.rpc.codec import DEFAULT_CODEC, Codec
from quillcache.types import CacheTier

__all__ = ["BATCH_METHODS", "BatchError", "NODE_METHODS", "SERVICE_METHODS", "WRITE_METHODS", "decode_batch",
           "encode_batch", "register_master_types"]

WRITE_METHODS = frozenset({
    "mount_segment", "unmount_segment", "put_start", "batch_put_start", "put_end", "batch_put_end", "put_revoke",
    "batch_put_revoke", "remove", "batch_remove", "evict", "tick",
})
READ_METHODS = frozenset({
    "heartbeat",  # soft state only (no log record): safe to repeat
    "get_replicas", "get_replica_list", "exists", "exist_key", "object_info", "keys", "segments", "segment_usage",
    "clients", "stats",
})
SERVICE_METHODS = tuple(sorted(WRITE_METHODS | READ_METHODS))
NODE_METHODS = ("master_status", "snapshot_bytes")
BATCH_METHODS = frozenset({"batch_put_start", "batch_put_end", "batch_put_revoke", "batch_remove", "get_replicas",
                           "exists"})


@dataclass(frozen=True, slots=True)
class BatchError:
    """One key's refusal inside a batch result."""

    code: ErrorCode
    message: str


def encode_batch(values: list) -> list:
    return [BatchError(v.code, v.message) if isinstance(v, MasterError) else v for v in values]


def decode_batch(values: list) -> list:
    return [error_for(v.code, v.message) if isinstance(v, BatchError) else v for v in values]


_ERRORS = tuple(getattr(_errors, name) for name in _errors.__all__
                if isinstance(getattr(_errors, name), type) and issubclass(getattr(_errors, name), MasterError))


def register_master_types(codec: Codec = DEFAULT_CODEC) -> Codec:
    """Register everything the master's RPC carries with ``codec`` (idempotent)."""
    for cls in (ErrorCode, ObjectStatus, PinKind, CacheTier, ReplicaConfig, ReplicaDescriptor, SegmentDescriptor,
                PutRequest, PutStartResult, ObjectInfo, MasterStats, TickReport, MasterConfig, BatchError):
        _register(codec.register_type, cls)
    for cls in _ERRORS:
        _register(codec.register_error, cls)
    return codec


def _register(register, cls: type) -> None:
    try:
        register(cls, name=f"{cls.__module__}.{cls.__qualname__}")
    except ValueError as e:  # registered earlier under another tag (by another module): that tag works as well
        if "is already registered as" not in str(e):
            raise
