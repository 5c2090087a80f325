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
- ``COMPACT_METHODS``: the compact forms of the hot calls (``get_replicas_compact``,
  ``get_replica_list_compact``, ``batch_put_start_compact``): requests and replies are msgpack-native
  arrays (no per-object dataclass through the codec); a reply is ``[segments, rows]`` with the
  descriptor fields of each segment named once (see ``MasterService.get_replicas_compact``).
  :func:`put_rows` builds the request rows, :func:`expand_replicas` / :func:`expand_put_results`
  rebuild exactly the values the plain methods return, so ``MasterClient`` returns the same types.
"""

from __future__ import annotations

from dataclasses import dataclass

from quillcache.master import errors as _errors
from quillcache.master.errors import ErrorCode, MasterError, error_for
from quillcache.master.types import (MasterConfig, MasterStats, ObjectInfo, ObjectStatus, PinKind, PutRequest,
                                     PutStartResult, ReplicaConfig, ReplicaDescriptor, SegmentDescriptor, TickReport)
from quillcache.rpc.codec import DEFAULT_CODEC, Codec
from quillcache.types import CacheTier

__all__ = ["BATCH_METHODS", "BatchError", "COMPACT_BATCH_METHODS", "COMPACT_METHODS", "NODE_METHODS",
           "SERVICE_METHODS", "WRITE_METHODS", "decode_batch", "encode_batch", "expand_put_results",
           "expand_replicas", "put_rows", "register_master_types"]

WRITE_METHODS = frozenset({
    "mount_segment", "unmount_segment", "put_start", "batch_put_start", "put_end", "batch_put_end", "put_revoke",
    "batch_put_revoke", "remove", "batch_remove", "evict", "tick", "batch_put_start_compact",
})
READ_METHODS = frozenset({
    "heartbeat",  # soft state only (no log record): safe to repeat
    "get_replicas", "get_replica_list", "exists", "exist_key", "object_info", "keys", "segments", "segment_usage",
    "clients", "stats", "get_replicas_compact", "get_replica_list_compact",
})
SERVICE_METHODS = tuple(sorted(WRITE_METHODS | READ_METHODS))
NODE_METHODS = ("master_status", "snapshot_bytes")
BATCH_METHODS = frozenset({"batch_put_start", "batch_put_end", "batch_put_revoke", "batch_remove", "get_replicas",
                           "exists"})
COMPACT_METHODS = frozenset({"get_replicas_compact", "get_replica_list_compact", "batch_put_start_compact"})
COMPACT_BATCH_METHODS = frozenset({"get_replicas_compact", "batch_put_start_compact"})  # rows hold per-key errors


@dataclass(frozen=True, slots=True)
class BatchError:
    """One key's refusal inside a batch result."""

    code: ErrorCode
    message: str


def encode_batch(values: list) -> list:
    return [BatchError(v.code, v.message) if isinstance(v, MasterError) else v for v in values]


def decode_batch(values: list) -> list:
    return [error_for(v.code, v.message) if isinstance(v, BatchError) else v for v in values]


def _segment_table(segments: list) -> dict[int, tuple]:
    return {row[0]: (row[1], row[2], row[3], row[4]) for row in segments}


def _descriptors(table: dict[int, tuple], row: list, first: int) -> tuple[ReplicaDescriptor, ...]:
    size = row[first - 1]
    out = []
    for i in range(first, len(row), 2):
        s = row[i]
        node, endpoint, transport, region = table[s]
        out.append(ReplicaDescriptor(node, s, endpoint, transport, region, row[i + 1], size))
    return tuple(out)


def expand_replicas(segments: list, rows: list) -> list:
    """``get_replicas``' value from ``get_replicas_compact``'s (rows already through ``decode_batch``)."""
    table = _segment_table(segments)
    return [row if isinstance(row, BaseException) else _descriptors(table, row, 1) for row in rows]


def expand_put_results(segments: list, rows: list) -> list:
    """``batch_put_start``' value from ``batch_put_start_compact``'s (rows through ``decode_batch``)."""
    table = _segment_table(segments)
    return [row if isinstance(row, BaseException) else PutStartResult(_descriptors(table, row, 3), row[0], row[1])
            for row in rows]


def put_rows(requests: list) -> list[list] | None:
    """The compact rows of ``requests``; None when one is not a ``PutRequest`` with a ``ReplicaConfig``
    (then the plain method reports it, as it always did)."""
    rows = []
    for r in requests:
        if type(r) is not PutRequest or type(r.config) is not ReplicaConfig:
            return None
        pin = r.pin
        rows.append([r.key, r.size_bytes, r.config.replica_num, r.config.preferred_segment,
                     pin.value if type(pin) is PinKind else pin, r.digest])
    return rows


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
