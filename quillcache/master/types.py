"""The master's boundary types: segments, replica descriptors, replica configs, pins, results.

Invariants:
- A segment is owned by exactly one node (``node_id``), which is also the client that mounted it
  and whose heartbeats keep it alive; ``segment_id`` is unique in the whole pool (u32, because the
  residency index stores it as one).
- A :class:`ReplicaDescriptor` says where one copy of an object's bytes is:
  ``[offset_bytes, offset_bytes + size_bytes)`` of segment ``segment_id`` on node ``node_id``,
  reachable at ``endpoint`` over ``transport``. The replicas of one object are on distinct nodes.
- Configs are frozen; hot records are slotted. Times are seconds of the master's injected clock.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NewType

from quillcache.types import CacheTier

__all__ = [
    "ClientId",
    "MAX_DURATION_S",
    "MasterConfig",
    "MasterStats",
    "ObjectInfo",
    "ObjectKey",
    "ObjectStatus",
    "PinKind",
    "PutRequest",
    "PutStartResult",
    "ReplicaConfig",
    "ReplicaDescriptor",
    "SegmentDescriptor",
    "TickReport",
]

# The name of a stored object (Mooncake's key): a non-empty str. A KV block's key made by
# ``quillcache.master.residency.kv_object_key`` carries its block hash and identity.
ObjectKey = NewType("ObjectKey", str)
# A client = the node that mounts segments and heartbeats (one id for both roles, as in Mooncake).
ClientId = NewType("ClientId", str)

MAX_KEY_CHARS = 4096
MAX_DIGEST_BYTES = 64
MAX_REPLICAS = 16
U32_MAX = (1 << 32) - 1
# The longest TTL, timer period or timeout a master takes (MasterConfig's lease and client TTLs and restart
# budget; the server's tick, plain-TCP idle timeout, HA lease TTL and warm-up): far above any useful setting,
# far below where time arithmetic overflows (a wait longer than threading.TIMEOUT_MAX kills the waiting thread).
MAX_DURATION_S = 86_400.0
DEFAULT_MAX_FORGOTTEN = 1 << 17  # MasterConfig.max_forgotten_keys


class ObjectStatus(enum.IntEnum):
    """PENDING: put_start done, bytes being written, never readable. COMPLETE: put_end done, immutable."""

    PENDING = 1
    COMPLETE = 2


class PinKind(enum.IntEnum):
    """NONE: evictable. SOFT: evicted only after every unpinned candidate, and only until the soft
    pin's TTL ends (then it is unpinned). HARD: never evicted (an explicit remove still works)."""

    NONE = 0
    SOFT = 1
    HARD = 2


@dataclass(frozen=True, slots=True, kw_only=True)
class SegmentDescriptor:
    """A memory segment a node contributes: capacity, and how peers reach it."""

    node_id: str
    segment_id: int
    capacity_bytes: int
    endpoint: str = ""
    transport: str = "tcp"
    region_ids: tuple[int, ...] = ()
    tier: CacheTier = CacheTier.DRAM


@dataclass(frozen=True, slots=True)
class ReplicaDescriptor:
    """One copy of an object's bytes (Mooncake's memory replica descriptor plus node/segment ids)."""

    node_id: str
    segment_id: int
    endpoint: str
    transport: str
    region_id: int
    offset_bytes: int
    size_bytes: int


def _slot_setters(cls: type) -> tuple:
    return tuple(getattr(cls, name).__set__ for name in cls.__slots__)


_new = object.__new__
_RD_SET = _slot_setters(ReplicaDescriptor)


def new_replica_descriptor(node_id: str, segment_id: int, endpoint: str, transport: str, region_id: int,
                           offset_bytes: int, size_bytes: int) -> ReplicaDescriptor:
    """``ReplicaDescriptor(...)`` with the same fields, built by setting its slots directly instead of
    through the frozen dataclass's ``__init__`` (one ``object.__setattr__`` per field): an equal
    object with the same hash, for the master's hot result paths (tested against the constructor)."""
    a, b, c, d, e, f, g = _RD_SET
    o = _new(ReplicaDescriptor)
    a(o, node_id)
    b(o, segment_id)
    c(o, endpoint)
    d(o, transport)
    e(o, region_id)
    f(o, offset_bytes)
    g(o, size_bytes)
    return o


@dataclass(frozen=True, kw_only=True)
class ReplicaConfig:
    """How many copies (on distinct nodes, best effort) and where to try first."""

    replica_num: int = 1
    preferred_segment: int | None = None


@dataclass(frozen=True, kw_only=True)
class PutRequest:
    """One ``put_start`` of a batch."""

    key: str
    size_bytes: int
    config: ReplicaConfig = field(default_factory=ReplicaConfig)
    pin: PinKind = PinKind.NONE
    digest: bytes | None = None


@dataclass(frozen=True, slots=True)
class PutStartResult:
    """Where to write the object's bytes. ``existing`` is True when a put of the same key with the
    same content digest is already in flight or complete: then the caller writes nothing and calls
    neither put_end nor put_revoke (it waits for the object to become readable). ``put_id``
    identifies this put; put_end/put_revoke given a ``put_id`` refuse any other put of the key (a
    pre-empted zombie writer's late put_end cannot complete its successor)."""

    replicas: tuple[ReplicaDescriptor, ...]
    put_id: int
    existing: bool = False


_PSR_SET = _slot_setters(PutStartResult)


def new_put_start_result(replicas: tuple[ReplicaDescriptor, ...], put_id: int, existing: bool) -> PutStartResult:
    """``PutStartResult(replicas, put_id, existing)`` built as ``new_replica_descriptor`` builds its value."""
    a, b, c = _PSR_SET
    o = _new(PutStartResult)
    a(o, replicas)
    b(o, put_id)
    c(o, existing)
    return o


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """A read-only view of one object's metadata."""

    key: str
    size_bytes: int
    status: ObjectStatus
    replicas: tuple[ReplicaDescriptor, ...]
    put_id: int
    lease_end_s: float
    last_access_s: float
    pin: PinKind
    soft_pin_end_s: float
    digest: bytes | None


@dataclass(frozen=True, kw_only=True)
class MasterConfig:
    """Mooncake's defaults (REFERENCE §4/§9). ``alignment_bytes`` is the allocation unit of every
    segment (sizes round up to it); ``epoch`` None = continue the newest epoch found in the log;
    a snapshot is taken once the log holds ``snapshot_due_changes(objects)`` state changes, or after
    ``snapshot_every_s``. That is the largest of: ``snapshot_every_records`` (a floor); ``snapshot_growth
    x objects`` (a snapshot costs O(objects), so its cost per change stays bounded as the table grows);
    and the restart budget: the changes a restart can replay, after loading the snapshot, within
    ``restart_budget_s`` (``(restart_budget_s - restart_s_per_object x objects) / restart_s_per_change -
    snapshot_inflight_records``; 0 s turns it off). So snapshots come as rarely as the restart budget allows
    while the table is small, and by the floor and growth once loading alone takes the budget. The rates are
    what the master study measured on its 2-core machine (snapshot load and log replay, in-process), the
    budget leaves room below the study's 2 s bound for starting the process; the floor and growth were
    chosen there so that the largest tail they allow at 1M objects restarts within that bound;
    ``snapshot_writer`` names who writes it (:mod:`quillcache.master.snapshot_writer`): ``"fork"``
    (default) a forked child, while the master goes on serving; ``"inline"`` the serving thread;
    while a snapshot is in flight the log may take ``snapshot_inflight_records`` more changes, then the
    master waits for it, so a restart never replays more than ``max(snapshot_every_records, snapshot_growth
    x objects) + snapshot_inflight_records`` changes (plus one call's);
    ``index_on_disk`` keeps the residency index under ``<data_dir>/index`` (else in memory, rebuilt at
    restart from the master's snapshot and log);
    ``sync_put_start`` False (default): a call whose only records start puts (PUT_START, PUT_START_MANY)
    is written to the log before it returns but not fsynced; the next call that changes anything else
    (a put_end, a remove, a mount...) fsyncs it with its own records, because the log is sequential. A
    process crash loses nothing (the bytes are in the kernel's page cache); a power loss may forget
    puts that were started and never ended, always a suffix of the log, never a COMPLETE object, so
    no acknowledged object is lost. Mooncake's operation log has no put start at all. The exposure
    this leaves (after a power loss only): a forgotten put's writer still writing when the restarted
    master hands the same range to a new put. True fsyncs every put start as well (one more fsync
    per two-phase put);
    ``defer_index_publish`` False (default): a call's residency rows reach the index before it returns.
    True: they wait until the next call that changes state (before its first record), ``publish_index()``
    or ``close``/``snapshot``, whichever comes first; the master server turns it on and calls
    ``publish_index()`` after sending each reply and before serving each call, so the index work overlaps
    the reply's trip and every RPC sees the index complete;
    ``max_forgotten_keys``: how many dropped keys the master remembers the last word on (the digest of the
    last object, or that it was removed), so that a node's SSD copy older than that word is not put back
    (``batch_put_start_returning``); each costs its key's UTF-8 bytes plus about 130 in memory and about 35 in
    every snapshot (whatever this bound, at most ``quillcache.master.state.FORGOTTEN_MAX_BYTES`` of keys and digests
    are kept: an HA standby fetches the snapshot in one call); 0 remembers none."""

    lease_ttl_s: float = 10.0
    client_ttl_s: float = 10.0
    zombie_preempt_s: float = 30.0
    zombie_reclaim_s: float = 600.0
    soft_pin_ttl_s: float = 1800.0
    high_watermark: float = 0.90
    evict_fraction: float = 0.05
    alignment_bytes: int = 64
    max_allocs_per_segment: int = 1 << 20
    max_object_bytes: int = U32_MAX
    snapshot_every_records: int = 100_000
    snapshot_growth: float = 0.1
    snapshot_every_s: float = 600.0
    snapshot_writer: str = "fork"
    snapshot_inflight_records: int = 40_000
    restart_budget_s: float = 1.5
    restart_s_per_object: float = 1.6e-6
    restart_s_per_change: float = 1.0e-6
    index_kind: str = "art"
    index_on_disk: bool = False
    sync_put_start: bool = False
    defer_index_publish: bool = False
    epoch: int | None = None
    max_forgotten_keys: int = DEFAULT_MAX_FORGOTTEN

    def snapshot_due_changes(self, objects: int) -> int:
        """The log changes after which a snapshot is due, for a table of ``objects`` (class docstring)."""
        budget = 0.0
        if self.restart_budget_s > 0:
            budget = ((self.restart_budget_s - self.restart_s_per_object * objects) / self.restart_s_per_change
                      - self.snapshot_inflight_records)
        return int(max(self.snapshot_every_records, self.snapshot_growth * objects, budget))


@dataclass(frozen=True, slots=True)
class TickReport:
    """What one ``tick()`` did."""

    expired_clients: tuple[str, ...] = ()
    reclaimed_puts: tuple[str, ...] = ()
    reclaimed_bytes: int = 0
    evicted: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class MasterStats:
    num_objects: int
    num_pending: int
    num_segments: int
    num_clients: int
    capacity_bytes: int
    used_bytes: int
    lsn: int
    epoch: int
