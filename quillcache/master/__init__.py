"""The master service: Mooncake's metadata semantics with an operation log and snapshots.

Modules, one concept each: ``errors`` (typed error codes), ``types`` (boundary records),
``residency`` (object key → residency-index records), ``oplog`` (the record format over the WAL),
``state`` (the deterministic state machine: tables + ``apply``), ``snapshot`` (columnar snapshots,
atomic publish) and ``service`` (``MasterService``: decisions, batching, group commit, timers).
"""

from quillcache.master.errors import (
    ErrorCode,
    InvalidParamsError,
    LeaseHeldError,
    LogFailedError,
    MasterError,
    NeedRemountError,
    NoSpaceError,
    NotLeaderError,
    ObjectExistsError,
    ObjectNotFoundError,
    ObjectNotReadyError,
    SegmentExistsError,
    SegmentNotFoundError,
    StaleEpochError,
    StaleObjectError,
    error_for,
)
from quillcache.master.residency import kv_object_key, residency_key
from quillcache.master.service import MasterService
from quillcache.master.snapshot import SnapshotError
from quillcache.master.types import (
    MasterConfig,
    MasterStats,
    ObjectInfo,
    ObjectStatus,
    PinKind,
    PutRequest,
    PutStartResult,
    ReplicaConfig,
    ReplicaDescriptor,
    SegmentDescriptor,
    TickReport,
)

__all__ = [
    "ErrorCode",
    "InvalidParamsError",
    "LeaseHeldError",
    "LogFailedError",
    "MasterConfig",
    "MasterError",
    "MasterService",
    "MasterStats",
    "NeedRemountError",
    "NoSpaceError",
    "NotLeaderError",
    "ObjectExistsError",
    "ObjectInfo",
    "ObjectNotFoundError",
    "ObjectNotReadyError",
    "ObjectStatus",
    "PinKind",
    "PutRequest",
    "PutStartResult",
    "ReplicaConfig",
    "ReplicaDescriptor",
    "SegmentDescriptor",
    "SegmentExistsError",
    "SegmentNotFoundError",
    "SnapshotError",
    "StaleEpochError",
    "StaleObjectError",
    "TickReport",
    "error_for",
    "kv_object_key",
    "residency_key",
]
