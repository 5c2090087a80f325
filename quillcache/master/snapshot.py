"""Snapshots of the master's tables (one msgpack document of columns, published atomically) and restart.

File ``<data_dir>/master.snap``: ``magic "QCMSNAP1" | crc32c u32 | payload_len u64 | payload``, the
crc covering the payload, a msgpack map whose per-object fields are columns (numpy arrays packed as
msgpack ``bin``; keys and digests as arrays), so a million objects load with a handful of
``frombuffer`` calls instead of a million small documents. ``lsn`` is the last record the snapshot
covers; recovery replays the log records after it.

Publication (REFERENCE §7): write ``master.snap.tmp``, fsync it, rename it over ``master.snap``,
fsync the directory; only then may the log be rotated. A damaged snapshot (bad magic, crc or
document) is refused with :class:`SnapshotError` naming the file — never guessed about.

Soft state is not stored (leases, last-access times, heartbeats; see :mod:`quillcache.master.state`).

:func:`recover` is the whole restart: snapshot, log tail, allocators, soft state.
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import crc32c as _crc
import msgpack
import numpy as np

from quillcache.durability.fs import CREATE_EXCL, READ, FileSystem, RealFs
from quillcache.master.oplog import Op, OpLog, decode_record, num_changes
from quillcache.index.keys import IDENTITY_BYTES
from quillcache.master._residency import residency_keys
from quillcache.master.residency import RESIDENCY_KEY_VERSION, IndexProjection
from quillcache.master.state import MasterState
from quillcache.master.table import COLUMN_DTYPES
from quillcache.master.types import ObjectStatus

__all__ = ["SNAPSHOT_NAME", "SnapshotError", "fill_index", "load_snapshot", "publish_snapshot", "recover",
           "snapshot_lsn", "stale_temporaries", "write_snapshot"]

SNAPSHOT_NAME = "master.snap"
_MAGIC = b"QCMSNAP1"
_COMPLETE = int(ObjectStatus.COMPLETE)
_HEAD = struct.Struct("<8sIQ")


class SnapshotError(ValueError):
    """A snapshot file that is damaged or not a master snapshot."""


def encode_state(state: MasterState) -> bytes:
    keys, cols, rep_count, rep_seg, rep_off, digests = state.objects.columns()
    doc = {
        "lsn": state.lsn,
        "epoch": state.epoch,
        "next_put_id": state.next_put_id,
        "segments": [[s.desc.node_id, s.desc.segment_id, s.desc.capacity_bytes, s.desc.endpoint, s.desc.transport,
                      list(s.desc.region_ids), int(s.desc.tier)] for s in state.segments.values()],
        "clients": sorted(state.clients),
        "discarded": [list(d) for d in state.discarded],
        "keys": keys,
        **{name: np.ascontiguousarray(arr, dtype=COLUMN_DTYPES[name]).tobytes() for name, arr in cols.items()},
        "digest_at": np.asarray(sorted(digests), dtype="<i8").tobytes(),
        "digests": [digests[i] for i in sorted(digests)],
        "rep_count": np.ascontiguousarray(rep_count, dtype="u1").tobytes(),
        "rep_seg": np.ascontiguousarray(rep_seg, dtype="<u4").tobytes(),
        "rep_off": np.ascontiguousarray(rep_off, dtype="<i8").tobytes(),
    }
    doc["forgotten_keys"] = list(state.forgotten)  # oldest first (MasterState.returning_refusal)
    doc["forgotten_digests"] = list(state.forgotten.values())
    hashes, idents = residency_keys(keys)  # per object: a restart fills the index without recomputing them
    doc["res_hash"] = np.ascontiguousarray(hashes, dtype="<u8").tobytes()
    doc["res_ident"] = bytes(idents)
    doc["res_version"] = RESIDENCY_KEY_VERSION  # the mapping they were made with (older ones are recomputed)
    payload = msgpack.packb(doc, use_bin_type=True)
    return _HEAD.pack(_MAGIC, _crc.crc32c(payload), len(payload)) + payload


def write_snapshot(fs: FileSystem, data_dir: str, state: MasterState) -> int:
    """Publish a snapshot of ``state`` atomically; returns its size in bytes."""
    return publish_snapshot(fs, data_dir, encode_state(state), state.lsn)


def publish_snapshot(fs: FileSystem, data_dir: str, blob: bytes, lsn: int, *, tmp_suffix: str = "",
                     still_wanted: Callable[[], bool] | None = None) -> int:
    """Write ``blob`` (an encoded snapshot covering ``lsn``) to a temporary file, fsync it, and rename
    it over ``master.snap`` unless that file already covers a later LSN or ``still_wanted()`` says
    no; then fsync the directory. Returns the bytes published, 0 when it was not published.

    The check and the rename happen under an exclusive ``flock`` of ``master.snap.lock`` (on the real
    file system), so a snapshot never replaces a newer one, whichever process writes it."""
    path = os.path.join(data_dir, SNAPSHOT_NAME)
    tmp = path + ".tmp" + tmp_suffix
    if fs.exists(tmp):
        fs.unlink(tmp)
    fd = fs.open(tmp, CREATE_EXCL)
    try:
        fs.pwrite(fd, blob, 0)
        fs.fsync(fd)
    except BaseException:
        fs.close(fd)
        fs.unlink(tmp)
        raise
    fs.close(fd)
    with _publish_lock(fs, data_dir):
        on_disk = snapshot_lsn(fs, data_dir)
        if (on_disk is not None and on_disk > lsn) or (still_wanted is not None and not still_wanted()):
            fs.unlink(tmp)
            return 0
        fs.rename(tmp, path)
        fs.fsync_dir(data_dir)
    return len(blob)


@contextlib.contextmanager
def _publish_lock(fs: FileSystem, data_dir: str) -> Iterator[None]:
    if not isinstance(fs, RealFs):  # a simulated file system lives in one process: nothing to exclude
        yield
        return
    fd = os.open(os.path.join(data_dir, SNAPSHOT_NAME + ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def snapshot_lsn(fs: FileSystem, data_dir: str) -> int | None:
    """The LSN ``<data_dir>/master.snap`` covers (read from the start of its document), or None when
    there is no snapshot or it cannot be read (a damaged one is refused later, by ``load_snapshot``)."""
    path = os.path.join(data_dir, SNAPSHOT_NAME)
    if not fs.exists(path):
        return None
    fd = fs.open(path, READ)
    try:
        head = fs.pread(fd, _HEAD.size + 64, 0)
    finally:
        fs.close(fd)
    try:
        if head[:8] != _MAGIC:
            return None
        unpacker = msgpack.Unpacker(raw=False)
        unpacker.feed(head[_HEAD.size:])
        unpacker.read_map_header()
        key, lsn = unpacker.unpack(), unpacker.unpack()
    except Exception:  # msgpack raises several unrelated types; "unknown" is the answer
        return None
    return lsn if key == "lsn" and type(lsn) is int else None


def stale_temporaries(fs: FileSystem, data_dir: str) -> list[str]:
    """Temporary snapshot files left by a writer that died before publishing (``master.snap.tmp*``)."""
    return [os.path.join(data_dir, n) for n in fs.listdir(data_dir) if n.startswith(SNAPSHOT_NAME + ".tmp")]


@dataclass(frozen=True)
class LoadedRows:
    """What a snapshot holds per object beyond the table, in its row order (for ``fill_index``):
    ``res_hash`` / ``res_ident`` the residency keys (uint64 array, 16 bytes each), and the columns
    the index rows come from. ``res_hash`` is None for a snapshot written before they were stored, or
    with another key mapping (``legacy``: no ``res_version`` or an older one; e.g. upper-case kv: keys
    were parsed, now hashed), whose columns are therefore ignored and recomputed."""

    status: np.ndarray
    size: np.ndarray
    rep_count: np.ndarray
    rep_seg: np.ndarray
    rep_off: np.ndarray
    res_hash: np.ndarray | None
    res_ident: bytes | None
    legacy: bool = False


def load_snapshot(fs: FileSystem, data_dir: str, state: MasterState) -> LoadedRows | None:
    """Fill an empty ``state`` from ``<data_dir>/master.snap``; None when there is none."""
    path = os.path.join(data_dir, SNAPSHOT_NAME)
    if not fs.exists(path):
        return None
    blob = fs.read_file(path)
    if len(blob) < _HEAD.size:
        raise SnapshotError(f"{path}: {len(blob)} bytes is too short for a master snapshot")
    magic, crc, n = _HEAD.unpack_from(blob)
    if magic != _MAGIC:
        raise SnapshotError(f"{path}: not a master snapshot (magic {magic!r})")
    payload = memoryview(blob)[_HEAD.size:]
    if len(payload) != n or _crc.crc32c(payload) != crc:
        raise SnapshotError(f"{path}: snapshot is damaged (length {len(payload)} vs {n}, or crc mismatch)")
    try:
        doc = msgpack.unpackb(payload, raw=False)
        return _fill(state, doc)
    except SnapshotError as exc:
        raise SnapshotError(f"{path}: {exc}") from None
    except Exception as exc:
        raise SnapshotError(f"{path}: snapshot document is malformed ({type(exc).__name__}: {exc})") from None


def _fill(state: MasterState, doc: dict) -> LoadedRows:
    state.detach_space()
    for node, seg_id, cap, endpoint, transport, regions, tier in doc["segments"]:
        state.apply([Op.MOUNT, doc["epoch"], -math.inf, node, seg_id, cap, endpoint, transport, regions, tier])
    for node in doc["clients"]:
        state.clients.setdefault(node, set())
    keys = doc["keys"]
    n = len(keys)
    cols = {}
    for name, dtype in COLUMN_DTYPES.items():
        cols[name] = np.frombuffer(doc[name], dtype=dtype)
        if len(cols[name]) != n:
            raise SnapshotError(f"column {name!r} has {len(cols[name])} rows, expected {n}")
    counts = np.frombuffer(doc["rep_count"], dtype="u1")
    rep_seg = np.frombuffer(doc["rep_seg"], dtype="<u4")
    rep_off = np.frombuffer(doc["rep_off"], dtype="<i8")
    if len(counts) != n or len(rep_seg) != int(counts.sum(dtype=np.int64)) or len(rep_off) != len(rep_seg):
        raise SnapshotError("replica columns do not match the number of objects / rep_count")
    if n and counts.min() == 0:
        raise SnapshotError("an object has no replica")
    digest_at = np.frombuffer(doc["digest_at"], dtype="<i8").tolist()
    if len(digest_at) != len(doc["digests"]):
        raise SnapshotError("digest columns differ in length")
    state.objects.load_columns(keys, cols, counts, rep_seg, rep_off, dict(zip(digest_at, doc["digests"])))
    if len(state.objects) != n:
        raise SnapshotError("duplicate keys in snapshot")
    state.pending = {keys[i] for i in np.flatnonzero(cols["status"] == 1).tolist()}
    used = {s: 0 for s in state.segments}
    if len(rep_seg):
        per_rep = np.repeat(cols["alloc"], counts)
        segs, inverse = np.unique(rep_seg, return_inverse=True)
        for s, u in zip(segs.tolist(), np.bincount(inverse, weights=per_rep).tolist()):
            if s not in used:
                raise SnapshotError(f"a replica is on segment {s}, which the snapshot does not mount")
            used[s] += int(u)
    state.discarded = [tuple(d) for d in doc["discarded"]]
    for _, s, _, a in state.discarded:
        used[s] += a
    for s, u in used.items():
        state.segments[s].used_bytes = u
    state.used_bytes = sum(used.values())
    state.epoch = doc["epoch"]
    state.lsn = doc["lsn"]
    state.next_put_id = doc["next_put_id"]
    fk, fd = doc.get("forgotten_keys", []), doc.get("forgotten_digests", [])  # (absent from older snapshots)
    if not (isinstance(fk, list) and isinstance(fd, list) and len(fk) == len(fd)
            and all(type(k) is str for k in fk) and all(type(d) is bytes for d in fd)):
        raise SnapshotError("the forgotten-keys columns are malformed (a list of str keys and one of bytes digests "
                            "of the same length)")
    state.load_forgotten(fk, fd)  # trimmed to this master's bounds (a smaller one than the snapshot's writer had)
    res_hash, res_ident = doc.get("res_hash"), doc.get("res_ident")
    legacy = doc.get("res_version") != RESIDENCY_KEY_VERSION
    if legacy:  # made with another mapping (module docstring of residency.py): never trusted
        res_hash = res_ident = None
    if res_hash is not None or res_ident is not None:
        if not isinstance(res_hash, bytes) or not isinstance(res_ident, bytes) \
                or len(res_hash) != 8 * n or len(res_ident) != IDENTITY_BYTES * n:
            raise SnapshotError(f"residency columns do not match the {n} objects")
        res_hash = np.frombuffer(res_hash, dtype="<u8")
    return LoadedRows(cols["status"], cols["size"], counts, rep_seg, rep_off, res_hash, res_ident, legacy)


def fill_index(state: MasterState, projection: IndexProjection, rows: LoadedRows | None = None) -> None:
    """Write every COMPLETE object's replicas into an empty index (a restart with an in-memory index,
    or an on-disk one that was lost), from the table's columns: no record is materialized. With the
    ``rows`` of a snapshot just loaded (and no change since) that stores the residency keys, the index
    rows are cut from its arrays; otherwise the keys are hashed again (``complete_replicas``)."""
    if rows is not None and rows.res_hash is not None:
        per_obj = rows.status == _COMPLETE
        per_rep = np.repeat(per_obj, rows.rep_count)
        if not per_rep.any():
            return
        take = np.repeat(np.arange(len(per_obj)), rows.rep_count)[per_rep]
        hashes = rows.res_hash[take].astype(np.uint64)
        idents = np.frombuffer(rows.res_ident, dtype=np.uint8).reshape(-1, IDENTITY_BYTES)[take].tobytes()
        segs, offs, sizes = rows.rep_seg[per_rep], rows.rep_off[per_rep], rows.size[take]
        nodes, tiers = _where(state, segs)
        projection.add_hashed_columns(hashes, idents, nodes, tiers, segs.astype(np.uint32), offs.astype(np.uint64),
                                      sizes.astype(np.uint32))
        projection.publish()
        return
    keys, segs, offs, sizes = state.objects.complete_replicas()
    if not keys:
        return
    nodes, tiers = _where(state, segs)
    projection.add_columns(keys, nodes, tiers, segs.astype(np.uint32), offs.astype(np.uint64), sizes.astype(np.uint32))
    projection.publish()


def _where(state: MasterState, segs: np.ndarray) -> tuple[list[str], np.ndarray]:
    """The node name and tier of each replica's segment."""
    ids = np.asarray(sorted(state.segments), dtype=np.int64)  # few segments: a search, not a sort of the replicas
    inverse = np.searchsorted(ids, segs)
    if len(segs) and (inverse.max() >= len(ids) or not np.array_equal(ids[inverse], segs)):
        raise SnapshotError("a replica is on a segment the snapshot does not mount")
    descs = [state.segments[s].desc for s in ids.tolist()]
    node_of = [d.node_id for d in descs]
    return [node_of[i] for i in inverse.tolist()], np.asarray([int(d.tier) for d in descs], dtype=np.uint8)[inverse]


def _replay(state: MasterState, tail: list[tuple[int, bytes]], data_dir: str) -> int:
    """Apply the log tail; returns the state changes it held (``num_changes``). A record that does not
    decode or apply is a SnapshotError naming the data dir, its LSN and op (never a bare KeyError)."""
    changes = 0
    apply = state.apply
    for lsn, payload in tail:
        rec = None
        try:
            rec = decode_record(payload)
            apply(rec, lsn)
        except Exception as exc:
            what = Op(rec[0]).name if rec is not None else "record"
            raise SnapshotError(f"{data_dir}: master log {what} at lsn {lsn} does not apply to the state "
                                f"({type(exc).__name__}: {exc}); the log does not continue this snapshot") from exc
        changes += num_changes(rec)
    return changes


def recover(state: MasterState, projection: IndexProjection, fs: FileSystem, data_dir: str, *, now: float,
            lease_ttl_s: float) -> tuple[OpLog, int]:
    """Restart: load the snapshot, replay the log tail, rebuild the allocators, reset soft state
    (state.py: every COMPLETE object leased until ``now + lease_ttl_s``, last access = completion,
    every client seen ``now``). Returns the reopened log and the number of records replayed.

    An empty index (in memory, the default; or an on-disk one that was lost) is filled from the
    snapshot's tables first (``fill_index``, O(objects), columnar), then gets the tail's changes. An
    on-disk index (``index_on_disk``) was flushed and checkpointed when the snapshot was taken, so
    replaying the tail brings it up to date; only the replicas it lacks (or still holds after a
    drop) are written (``IndexProjection.publish_missing``), so restarting again and again on the
    same tail does not grow the index's own log. An on-disk index next to a snapshot made with an older
    residency-key mapping (``LoadedRows.legacy``) may hold entries under keys no longer computed: it is
    emptied and refilled."""
    state.detach_space()
    for tmp in stale_temporaries(fs, data_dir):  # a writer that died before publishing
        try:
            fs.unlink(tmp)
        except FileNotFoundError:  # the forked writer of a killed master, still running, removed its own
            pass
    lease_end = now + lease_ttl_s
    state.objects.lease_floor_s = lease_end
    loaded = load_snapshot(fs, data_dir, state)
    refilled = projection.is_empty()
    if loaded is not None and loaded.legacy and not refilled:
        for node in projection.index.nodes():
            projection.index.remove_node(node)
        refilled = True
    if loaded is not None and refilled and len(state.objects):
        fill_index(state, projection, loaded)
    log = OpLog(data_dir, fs)
    tail = log.recover(state.lsn)
    try:
        changes = _replay(state, tail, data_dir)
    except BaseException:
        log.close()  # (a refused restart leaves no file open)
        raise
    log.records_since_rotate = changes  # the snapshot cadence counts state changes, as a live master does
    if refilled:  # built from the snapshot just now: the tail's changes are all missing from it
        projection.flush()  # (an on-disk index: durable, so the next restart finds it whole)
    else:
        written, _ = projection.publish_missing()  # a tail replayed before (a restart since the snapshot) is in it
        if written:
            projection.flush()  # durable now, so the next restart on the same tail finds it there
    state.attach_space()
    for obj in state.objects.materialized():
        if obj.status == _COMPLETE:
            obj.lease_end_s = max(obj.lease_end_s, lease_end)
            obj.last_access_s = obj.completed_s
    for node in state.clients:
        state.last_seen[node] = now
    return log, len(tail)
