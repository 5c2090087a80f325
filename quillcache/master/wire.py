"""What the master's RPC carries: the served methods, the codec registrations, per-key errors in batches.

Contract (shared by :mod:`.server` and :mod:`.client`, so both sides agree by construction):
- ``SERVICE_METHODS``: the whitelisted :class:`~quillcache.master.MasterService` methods (every per-key
  operation and its batch form, plus introspection); ``NODE_METHODS``: what the server process adds
  (``master_status``, ``snapshot_bytes``). ``WRITE_METHODS`` change state (a client never resends one
  after a timeout unless told to: it may have run); ``BATCH_METHODS`` return per-key lists.
- ``MAX_BATCH_KEYS``: the most keys (requests, rows) one batch call may carry. The server refuses a longer
  batch with INVALID_PARAMS before any work (the service runs a call under one lock, so the cap bounds how long
  one call holds up every other client); ``MasterClient`` sends a longer batch as several calls.
- ``register_master_types(codec)`` registers the master's dataclasses, enums and every error class
  (each under its own tag, so an ``ObjectNotFoundError`` arrives as one, with its ``code``).
- A batch's per-key :class:`~quillcache.master.MasterError` travels as :class:`BatchError` (code +
  message, cut to the RPC layer's ``MAX_MESSAGE_CHARS`` like any error message on the wire):
  ``encode_batch`` / ``decode_batch`` turn one into the other.
- ``COMPACT_METHODS``: the compact forms of the hot calls (``get_replicas_compact``,
  ``get_replica_list_compact``, ``batch_put_start_compact``): requests and replies are msgpack-native
  arrays (no per-object dataclass through the codec); a reply is ``[segments, rows]`` with the
  descriptor fields of each segment named once (see ``MasterService.get_replicas_compact``).
  :func:`put_rows` builds the request rows, :func:`expand_replicas` / :func:`expand_put_results`
  rebuild exactly the values the plain methods return, so ``MasterClient`` returns the same types.
- ``COLUMNS_METHODS``: the columnar batch forms (``batch_put_start_columns``, ``get_replicas_columns``).
  Request: keys as a msgpack array of str, sizes as raw little-endian int64 bytes (:func:`encode_sizes`;
  a list of ints is accepted as well), digests None or a list. Reply (:func:`encode_columns`): ``[segments,
  errors, *arrays]``: ``segments`` rows ``[segment_id, node_id, endpoint, transport, region_id]``,
  ``errors`` rows ``[row, code, message]`` (``code`` an :class:`ErrorCode` number), then each array of
  ``PUT_FIELDS`` / ``REPLICA_FIELDS`` as raw bytes of its dtype in ``columns.PUT_DTYPES`` /
  ``REPLICA_DTYPES``. Neither side does per-key Python work: the arrays are one ``tobytes`` each way and
  :func:`decode_columns` rebuilds them with ``np.frombuffer`` (read-only views of the reply's bytes),
  checks the layout (``check()``) and raises :class:`~quillcache.rpc.RpcProtocolError` naming what is
  wrong with a malformed reply. :func:`decode_sizes` is the server's side of the request: a buffer whose
  length is not a multiple of 8, or sizes of another type, are INVALID_PARAMS naming the problem.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from quillcache.master import errors as _errors
from quillcache.master.columns import PUT_DTYPES, REPLICA_DTYPES, PutColumns, ReplicaColumns
from quillcache.master.errors import ErrorCode, MasterError, error_for
from quillcache.master.types import (MasterConfig, MasterStats, ObjectInfo, ObjectStatus, PinKind, PutRequest,
                                     PutStartResult, ReplicaConfig, ReplicaDescriptor, SegmentDescriptor, TickReport)
from quillcache.rpc.codec import DEFAULT_CODEC, Codec
from quillcache.rpc.errors import RpcProtocolError, clip
from quillcache.types import CacheTier

__all__ = ["BATCH_METHODS", "BatchError", "COLUMNS_METHODS", "COMPACT_BATCH_METHODS", "COMPACT_METHODS",
           "MAX_BATCH_KEYS", "NODE_METHODS", "PUT_FIELDS", "REPLICA_FIELDS", "SERVICE_METHODS", "WRITE_METHODS", "decode_batch",
           "decode_columns", "decode_sizes", "encode_batch", "encode_columns", "encode_sizes", "expand_put_results",
           "expand_replicas", "put_rows", "register_master_types"]

WRITE_METHODS = frozenset({
    "mount_segment", "unmount_segment", "put_start", "batch_put_start", "put_end", "batch_put_end", "put_revoke",
    "batch_put_revoke", "remove", "batch_remove", "evict", "tick", "batch_put_start_compact",
    "batch_put_start_columns", "batch_put_start_returning",
})
READ_METHODS = frozenset({
    "heartbeat",  # soft state only (no log record): safe to repeat
    "get_replicas", "get_replica_list", "exists", "exist_key", "object_info", "keys", "segments", "segment_usage",
    "clients", "stats", "get_replicas_compact", "get_replica_list_compact", "get_replicas_columns",
})
SERVICE_METHODS = tuple(sorted(WRITE_METHODS | READ_METHODS))
NODE_METHODS = ("master_status", "snapshot_bytes")
BATCH_METHODS = frozenset({"batch_put_start", "batch_put_start_returning", "batch_put_end", "batch_put_revoke",
                           "batch_remove", "get_replicas", "exists"})
COMPACT_METHODS = frozenset({"get_replicas_compact", "get_replica_list_compact", "batch_put_start_compact"})
COMPACT_BATCH_METHODS = frozenset({"get_replicas_compact", "batch_put_start_compact"})  # rows hold per-key errors
COLUMNS_METHODS = frozenset({"batch_put_start_columns", "get_replicas_columns"})
# Keys per batch call. A key the master does not hold costs its most (a per-key error object, encoded): at this cap
# one call of missing keys holds the master well under a client's default timeout; far above the batches the pool
# and the studies send, and large enough that a call's fixed cost is small beside its keys'.
MAX_BATCH_KEYS = 16_384
PUT_FIELDS = ("counts", "segment_ids", "offsets", "sizes", "put_ids", "existing")  # reply order of the arrays
REPLICA_FIELDS = ("counts", "segment_ids", "offsets", "sizes")
_SIZE_DTYPE = np.dtype("<i8")
_INT64_MAX = np.iinfo(np.int64).max


@dataclass(frozen=True, slots=True)
class BatchError:
    """One key's refusal inside a batch result."""

    code: ErrorCode
    message: str


def encode_batch(values: list) -> list:
    if type(values) is list and values.count(None) == len(values):  # every key succeeded (batch_put_end & co)
        return values
    return [BatchError(v.code, clip(v.message)) if isinstance(v, MasterError) else v for v in values]


def decode_batch(values: list) -> list:
    if type(values) is list and values.count(None) == len(values):
        return values
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


def encode_sizes(sizes) -> bytes | list:
    """The client's ``sizes`` for the wire: raw little-endian int64 bytes when they are integers that
    fit (a NumPy integer array or a sequence of ints); anything else as a list, as it is, so the
    master answers for it exactly as the service would in-process (a per-key error, or INVALID_PARAMS)."""
    arr = sizes if isinstance(sizes, np.ndarray) else None
    if arr is None:
        if isinstance(sizes, (str, bytes, bytearray, memoryview)):
            return sizes  # refused by the server, naming the type
        try:
            sizes = list(sizes)
        except TypeError:
            return sizes  # refused by the server, naming the type
        if not sizes:
            return b""
        if not all(type(v) is int for v in sizes):
            return sizes
        try:
            arr = np.asarray(sizes, dtype=_SIZE_DTYPE)
        except OverflowError:
            return sizes
        return arr.tobytes()
    if arr.ndim != 1 or arr.dtype.kind not in "iu" or (arr.dtype.kind == "u" and arr.size and arr.max() > _INT64_MAX):
        return arr.tolist()
    return arr.astype(_SIZE_DTYPE, copy=False).tobytes()


def decode_sizes(sizes) -> np.ndarray | list:
    """The server's side of ``encode_sizes``: raw bytes as an int64 array (one ``frombuffer``), a list as
    it is; InvalidParamsError naming the problem for anything else."""
    if type(sizes) is bytes:
        if len(sizes) % 8:
            raise _errors.InvalidParamsError(f"sizes: a buffer of {len(sizes)} bytes is not a whole number of "
                                             f"little-endian int64 values (8 bytes each)")
        return np.frombuffer(sizes, dtype=_SIZE_DTYPE)
    if type(sizes) is list:
        return sizes
    raise _errors.InvalidParamsError(f"sizes must be raw little-endian int64 bytes or a list of int, "
                                     f"got {type(sizes).__name__}")


def encode_columns(cols: PutColumns | ReplicaColumns) -> list:
    """The reply of a columnar method (module docstring): a few bytes objects, no per-key Python work."""
    put = isinstance(cols, PutColumns)
    fields, dtypes = (PUT_FIELDS, PUT_DTYPES) if put else (REPLICA_FIELDS, REPLICA_DTYPES)
    segments = [[s, *where] for s, where in cols.segments.items()]
    errors = [[i, int(e.code), clip(e.message)] for i, e in cols.errors.items()]
    return [segments, errors, *[np.ascontiguousarray(getattr(cols, f), dtype=dtypes[f]).tobytes() for f in fields]]


_SEGMENT_TYPES = (int, str, str, str, int)


def decode_columns(reply, *, put: bool) -> PutColumns | ReplicaColumns:
    """``encode_columns``' value rebuilt (arrays by ``np.frombuffer``); RpcProtocolError naming what is
    wrong when ``reply`` does not fit the module docstring's layout."""
    what = "batch_put_start_columns" if put else "get_replicas_columns"
    fields, dtypes = (PUT_FIELDS, PUT_DTYPES) if put else (REPLICA_FIELDS, REPLICA_DTYPES)
    if type(reply) is not list or len(reply) != 2 + len(fields):
        raise RpcProtocolError(f"{what} reply: expected a list of {2 + len(fields)} items (segments, errors, "
                               f"{', '.join(fields)}), got {type(reply).__name__} of {_len(reply)}")
    seg_rows, err_rows = reply[0], reply[1]
    if type(seg_rows) is not list or type(err_rows) is not list:
        raise RpcProtocolError(f"{what} reply: segments and errors must be lists")
    segments: dict[int, tuple] = {}
    for row in seg_rows:
        if type(row) is not list or len(row) != 5 or not all(type(v) is t for v, t in zip(row, _SEGMENT_TYPES)):
            raise RpcProtocolError(f"{what} reply: segment row {row!r:.120} is not [segment_id, node_id, endpoint, "
                                   f"transport, region_id]")
        segments[row[0]] = (row[1], row[2], row[3], row[4])
    errors: dict[int, MasterError] = {}
    for row in err_rows:
        if type(row) is not list or len(row) != 3 or type(row[0]) is not int or type(row[1]) is not int \
                or type(row[2]) is not str:
            raise RpcProtocolError(f"{what} reply: error row {row!r:.120} is not [row, code, message]")
        try:
            errors[row[0]] = error_for(row[1], row[2])
        except (ValueError, KeyError):
            raise RpcProtocolError(f"{what} reply: error row {row!r:.120} has an unknown error code") from None
    arrays = {}
    for f, b in zip(fields, reply[2:]):
        dt = np.dtype(dtypes[f])
        if type(b) is not bytes or len(b) % dt.itemsize:
            raise RpcProtocolError(f"{what} reply: {f} must be raw {dt.str} bytes (a multiple of {dt.itemsize}), "
                                   f"got {type(b).__name__} of {_len(b)}")
        arrays[f] = np.frombuffer(b, dtype=dt)
    try:
        if put:
            cols = PutColumns(arrays["counts"], arrays["segment_ids"], arrays["offsets"], arrays["sizes"], errors,
                              segments, arrays["put_ids"], arrays["existing"])
            if len(cols.put_ids) != len(cols.counts) or len(cols.existing) != len(cols.counts):
                raise _errors.InvalidParamsError(f"{len(cols.counts)} counts but {len(cols.put_ids)} put ids and "
                                                 f"{len(cols.existing)} existing flags")
        else:
            cols = ReplicaColumns(arrays["counts"], arrays["segment_ids"], arrays["offsets"], arrays["sizes"],
                                  errors, segments)
        cols.check()
    except MasterError as e:
        raise RpcProtocolError(f"{what} reply: {e.message}") from None
    return cols


def _len(v) -> str:
    return f"length {len(v)}" if isinstance(v, (list, bytes, str)) else "no length"


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
