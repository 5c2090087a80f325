"""High availability of the master through etcd: etcd is the replicated operation log, fenced by the epoch.

Longer than 600 lines because the roles below (follower, writer, promotion and demotion) share one state machine
over one service and one election, whose exactly-one-role invariant every transition must keep.

Roles. ``HaMaster`` is one master process of a group ``name``: a :class:`~quillcache.master.MasterService`
over its own data dir in replicated mode, a :class:`~quillcache.cluster.election.LeaderElection`
candidate, a follower of the log in etcd, and (leader only) the writer of that log. Exactly one role:
``standby`` (follows the log, answers NOT_LEADER to every data call) or ``leader`` (serves).
Each candidate has a data dir of its own, locked (:mod:`~quillcache.durability.dirlock`) until ``close``,
across reopens.

The log (``{prefix}/master/{name}/log/``). The leader commits every state-changing call as etcd txns
guarded by ``EpochFence.compares()`` (``create_revision(election key) == epoch`` and its value is this
candidate's record): one key per commit group, ``{first_lsn:020d}/{epoch:020d}/{part:06d}``, value
msgpack ``[n_records, n_parts, chunk]`` where the chunks of a group concatenate to the msgpack array of its
records (the same payloads as the local WAL; a group above ``LOG_CHUNK_BYTES`` takes several parts, one
fenced txn each, and counts only once every part is there). The call is acknowledged only after every
txn succeeded, and its records reach the local WAL only after that (``MasterService(replicate=...)``):
the local log never holds a record the replicated log lacks. A refused txn (fenced: STALE_EPOCH), a
deposed or expired leader (NOT_LEADER) or etcd unreachable (LOG_FAILED, outcome unknown) fails the
call, and the process reopens its service from its data dir and catches up from etcd: its memory held
records nobody may rely on.

Standbys watch the log prefix and apply each complete group in LSN order (``MasterService.follow``: also appended to
their own WAL and snapshotted on the same cadence, so any standby restarts from its own data dir). A gap (a group
beyond the next LSN) re-reads the log from etcd; a standby whose next LSN is older than the oldest group (the log was
trimmed past it) fetches the leader's state over RPC (``snapshot_bytes``), installs it as its snapshot and follows
from its LSN.

Promotion. A candidate that wins the election key (``create_revision == 0`` txn; epoch = the key's create revision)
warms up for ``warmup_s``, then, under the node lock, reads the log from etcd to its end (a linearizable read after
its key exists: no older epoch can commit anything after that point, the fence refuses it), applies what it lacked,
and commits an EPOCH record of its epoch (through the fence: a candidate already deposed fails here). Only then does
it serve. Soft state restarts as after a restart: every complete object is leased for one lease TTL, every client
counted seen.

Warm-up (default ``DEFAULT_WARMUP_S`` = 0.5 s, not one TTL). Writes need no warm-up at all: every commit is an etcd
txn compared against the epoch, so a deposed leader (SIGSTOPped across an election, or partitioned) commits nothing
once a successor's key exists, and its writes fail with STALE_EPOCH. The warm-up only guards reads
(``get_replicas``/``exists`` never touch etcd). A leader serves only while ``LeaderElection.is_leader``, checked on
every call against its lease's *local* deadline: the send time of the last keep-alive etcd confirmed plus the TTL.
etcd starts the same TTL when it *receives* that keep-alive, later, so the old leader stops serving reads before etcd
can delete its key, and the new leader can only win after that deletion: the intervals in which the two serve cannot
overlap, for any warm-up >= 0, when the key goes by lease expiry (SIGKILL, SIGSTOP, partition). The warm-up covers
what that argument leaves out: clock-rate drift between hosts (ppm of a TTL) and a key deleted by other means (a
resign, an operator), which the old leader learns through its watch of the key within milliseconds. Half a second
covers both with a wide margin, and keeps failover at about TTL + 0.5 s (etcd's expiry check) + warm-up + catch-up,
within 2×TTL from TTL 2 s up (one TTL of warm-up would put it at 2×TTL + 0.5 s + catch-up, above that bound).

Growth. After a local snapshot at LSN L the leader deletes (fenced) the log groups that start before
``min(L - log_margin + 1, first LSN of its newest group)`` and compacts etcd's history to the revision
of the previous trim (a watcher lagging that far re-reads, and finds it must fetch a snapshot).
"""

from __future__ import annotations

import base64
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable

import msgpack

from quillcache._checks import check_int
from quillcache.cluster.client import Backoff, EtcdClient, EtcdError, EtcdUnavailableError, put_op, prefix_end
from quillcache.cluster.descriptors import DEFAULT_PREFIX, LeaderInfo
from quillcache.cluster.election import EpochFence, FencedError, LeaderElection
from quillcache.cluster.election import NotLeaderError as ElectionNotLeaderError
from quillcache.cluster.watch import Watch, WatchEvent
from quillcache.master.errors import LogFailedError, MasterError, NotLeaderError, StaleEpochError
from quillcache.durability.fs import RealFs
from quillcache.durability.dirlock import DataDirLock
from quillcache.master.oplog import log_files
from quillcache.master.service import MasterService
from quillcache.master.snapshot import SNAPSHOT_NAME
from quillcache.master.types import MAX_DURATION_S, MasterConfig
from quillcache.master.validate import check_duration_s
from quillcache.master.wire import register_master_types
from quillcache.rpc import RpcClient

__all__ = ["DEFAULT_LOG_MARGIN", "DEFAULT_WARMUP_S", "EtcdLog", "HaMaster", "LOG_CHUNK_BYTES", "log_prefix"]

log = logging.getLogger(__name__)

LOG_CHUNK_BYTES = 1_000_000  # under etcd's default 1.5 MiB request limit once base64'd into the gateway's JSON
DEFAULT_WARMUP_S = 0.5
DEFAULT_LOG_MARGIN = 10_000


def log_prefix(prefix: str, name: str) -> str:
    return f"{prefix}/master/{name}/log/"


def _b64(s: str) -> str:
    return base64.b64encode(s.encode()).decode("ascii")


def _range_op(key: str, end: str) -> dict:
    return {"request_range": {"key": _b64(key), "range_end": _b64(end)}}


def _delete_range_op(key: str, end: str) -> dict:
    return {"request_delete_range": {"key": _b64(key), "range_end": _b64(end)}}


class _Groups:
    """Log groups read or watched, assembled from their parts; hands out records in LSN order."""

    def __init__(self) -> None:
        self._parts: dict[tuple[int, int], dict] = {}
        self.complete: dict[int, list[bytes]] = {}  # first lsn -> payloads

    def add(self, base: str, key: str, value: bytes) -> None:
        try:
            first_s, epoch_s, part_s = key[len(base):].split("/")
            first, epoch, part = int(first_s), int(epoch_s), int(part_s)
            n_records, n_parts, chunk = msgpack.unpackb(value, raw=False)
            g = self._parts.setdefault((first, epoch), {"n_records": n_records, "n_parts": n_parts, "chunks": {}})
            g["chunks"][part] = chunk
            if len(g["chunks"]) != g["n_parts"]:
                return
            del self._parts[(first, epoch)]
            payloads = msgpack.unpackb(b"".join(g["chunks"][i] for i in range(g["n_parts"])), raw=False)
            if not isinstance(payloads, list) or not all(type(p) is bytes for p in payloads) \
                    or len(payloads) != g["n_records"]:
                raise ValueError(f"group {first} of epoch {epoch} must assemble to an array of {g['n_records']!r} "
                                 f"bytes payloads, got {payloads!r:.60}")
        except Exception as e:  # not ours: never stop following for one odd key (nor for a group it completes)
            log.warning("master log: ignoring key %r (%s: %s)", key, type(e).__name__, e)
            return
        self.complete[first] = payloads

    def take(self, lsn: int) -> list[tuple[int, bytes]]:
        """The records after ``lsn`` that follow it without a gap (consumed groups are dropped)."""
        out: list[tuple[int, bytes]] = []
        cur = lsn
        while True:
            first = cur + 1
            payloads = self.complete.pop(first, None)
            if payloads is None:  # a group that starts earlier and overlaps (after a snapshot install)
                for f in sorted(self.complete):
                    if f <= cur + 1 < f + len(self.complete[f]):
                        first, payloads = f, self.complete.pop(f)
                        break
            if payloads is None:
                break
            for i, p in enumerate(payloads):
                if first + i > cur:
                    out.append((first + i, p))
            cur = first + len(payloads) - 1
        for f in [f for f, p in self.complete.items() if f + len(p) - 1 <= cur]:
            del self.complete[f]
        for k in [k for k in self._parts if k[0] <= cur]:
            del self._parts[k]
        return out

    def ahead(self, lsn: int) -> bool:
        """A complete group starts past ``lsn + 1`` (and nothing covers ``lsn + 1``): a gap."""
        return any(f > lsn + 1 for f in self.complete)

    def min_first(self) -> int | None:
        firsts = [f for f in self.complete] + [k[0] for k in self._parts]
        return min(firsts) if firsts else None


class EtcdLog:
    """The replicated log's keys (module docstring): append through a fence, read, trim."""

    def __init__(self, client: EtcdClient, prefix: str, name: str) -> None:
        self.client = client
        self.base = log_prefix(prefix, name)
        self.end = prefix_end(self.base)

    def key(self, first: int, epoch: int, part: int) -> str:
        return f"{self.base}{first:020d}/{epoch:020d}/{part:06d}"

    def append(self, fence: EpochFence, records: list[tuple[int, bytes]]) -> int:
        """Commit one group (FencedError when the epoch no longer leads); the last txn's revision."""
        first = records[0][0]
        blob = msgpack.packb([p for _, p in records], use_bin_type=True)
        parts = [blob[i:i + LOG_CHUNK_BYTES] for i in range(0, len(blob), LOG_CHUNK_BYTES)] or [b""]
        rev = 0
        for i, chunk in enumerate(parts):
            value = msgpack.packb([len(records), len(parts), chunk], use_bin_type=True)
            rev = fence.txn([put_op(self.key(first, fence.epoch, i), value)],
                            what=f"master log group {first}+{len(records)} part {i + 1}/{len(parts)}").revision
        return rev

    def read(self, from_lsn: int | None = None) -> tuple[_Groups, int]:
        """The groups starting at ``from_lsn`` or later (every group: None), and the read's revision."""
        start = self.base if from_lsn is None else f"{self.base}{from_lsn:020d}"
        res = self.client.txn([], [_range_op(start, self.end)], what=f"read master log from {start}")
        groups = _Groups()
        for kv in res.ranges[0] if res.ranges else ():
            groups.add(self.base, kv.key, kv.value)
        return groups, res.revision

    def trim(self, fence: EpochFence, below_first: int) -> int:
        """Delete (fenced) every group that starts before ``below_first``; the txn's revision."""
        return fence.txn([_delete_range_op(self.base, f"{self.base}{below_first:020d}")],
                         what=f"trim master log below {below_first}").revision


class HaMaster:
    """One master of an HA group (module docstring). ``lock`` serialises every use of ``service``."""

    def __init__(self, data_dir: str, config: MasterConfig, *, etcd: str, name: str, candidate: str, ttl_s: int = 5,
                 prefix: str = DEFAULT_PREFIX, warmup_s: float = DEFAULT_WARMUP_S,
                 log_margin: int = DEFAULT_LOG_MARGIN, clock: Callable[[], float] = time.time,
                 backoff: Backoff = Backoff(initial_s=0.2, max_s=5.0)) -> None:
        check_int("ttl_s", ttl_s, 1, int(MAX_DURATION_S))  # (whole seconds: an etcd lease)
        warmup_s = check_duration_s("warmup_s", warmup_s, zero_ok=True)
        self.data_dir = data_dir
        self.config = config
        self.etcd_endpoint = etcd
        self.name = name
        self.candidate = candidate
        self.ttl_s = ttl_s
        self.prefix = prefix
        self.warmup_s = warmup_s
        self.log_margin = max(1, int(log_margin))
        self.clock = clock
        self.backoff = backoff
        self.lock = threading.RLock()
        self.role = "standby"
        self.epoch = 0  # the epoch this master leads with (0: none yet)
        self.address: str | None = None
        self.client: EtcdClient | None = None
        self.log: EtcdLog | None = None
        self.election: LeaderElection | None = None
        self._fence: EpochFence | None = None
        self._fenced_epoch = 0
        self._groups = _Groups()
        self._queue: list[tuple[str, bytes]] = []
        self._qlock = threading.Lock()
        self._need_resync = True
        self._last_group_first = 0
        self._trimmed_below = 0
        self._compact_next = 0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._watch: Watch | None = None
        os.makedirs(data_dir, exist_ok=True)
        self._dir_lock = DataDirLock(data_dir)  # held for this master's life, across every reopen of its service
        try:
            self.service = self._open()
        except BaseException:
            self._dir_lock.release()
            raise

    # ------------------------------------------------------------------ service life
    def _open(self) -> MasterService:
        return MasterService(self.config, clock=self.clock, data_dir=self.data_dir, replicate=self._replicate,
                             dir_lock=self._dir_lock)

    def _reopen(self, why: str) -> None:
        """Drop the in-memory state (it may hold records nobody committed) and reload it from the data dir."""
        log.warning("master %r: reopening its state from %s (%s)", self.candidate, self.data_dir, why)
        try:
            self.service.close()
        except Exception as e:
            log.warning("master %r: closing the failed service: %s", self.candidate, e)
        self.service = self._open()
        self.role = "standby"
        self._fence = None
        self._groups = _Groups()
        self._need_resync = True
        self._wake.set()

    def after_call(self) -> None:
        """(Node lock held) after a data call, or before a standby follows: a failed service (refused or
        unknown commit; a leader's record it could not apply) is reopened."""
        failed = self.service.failed
        if failed is not None:
            if isinstance(failed, StaleEpochError):
                self._fenced(self.epoch, failed)
            self._reopen(f"{type(failed).__name__}: {failed}")

    def _fenced(self, epoch: int, why: Exception) -> None:
        """(Node lock held) a write of ``epoch`` was fenced: never promote it again, and make the election give it
        up too (its key is no longer what this master wrote, even if the watch on it missed that), so the campaign
        goes on instead of holding a seat nobody serves."""
        self._fenced_epoch = max(self._fenced_epoch, epoch)
        if self.election is not None:
            self.election.step_down(epoch, f"a write of epoch {epoch} was fenced: {why}")

    # ------------------------------------------------------------------ serving
    def admit(self, method: str) -> None:
        """(Node lock held) NotLeaderError unless this master leads now."""
        el = self.election
        if self.role == "leader" and el is not None and el.is_leader:
            return
        leader = None
        if el is not None:
            try:
                info = el.leader()
                leader = None if info is None else f"{info.candidate_id!r} at {info.address} (epoch {info.epoch})"
            except EtcdError:
                leader = "unknown (etcd unreachable)"
        raise NotLeaderError(f"{method}: master {self.candidate!r} is a {self.role if self.role != 'leader' else 'deposed leader'}"
                             f"; the leader is {leader or 'not elected yet'}")

    def status(self) -> dict:
        st = self.service.stats()
        leader = None
        if self.election is not None:
            try:
                info = self.election.leader()
                leader = None if info is None else info.address
            except EtcdError:
                pass
        leading = self.role == "leader" and self.election is not None and self.election.is_leader
        return {"role": "leader" if leading else "standby", "epoch": self.epoch if leading else self.service.log_epoch,
                "lsn": st.lsn, "candidate": self.candidate, "leader": leader, "address": self.address,
                "objects": st.num_objects}

    # ------------------------------------------------------------------ the replicated log
    def _replicate(self, records: list[tuple[int, bytes]]) -> None:
        fence, el = self._fence, self.election
        if fence is None or el is None or not el.is_leader:
            raise NotLeaderError(f"master {self.candidate!r} no longer leads (its lease is over): nothing committed")
        try:
            self.log.append(fence, records)  # type: ignore[union-attr]
        except FencedError as e:
            raise StaleEpochError(f"fenced: {e}") from None
        except EtcdUnavailableError as e:
            raise LogFailedError(f"etcd unreachable while committing lsn {records[0][0]}..{records[-1][0]} "
                                 f"(outcome unknown; the state is reloaded from the log): {e}") from None
        except EtcdError as e:
            raise LogFailedError(f"etcd refused the commit of lsn {records[0][0]}..{records[-1][0]}: {e}") from None
        self._last_group_first = records[0][0]

    def _on_log_event(self, ev: WatchEvent) -> None:
        if ev.kind == "put":
            with self._qlock:
                self._queue.append((ev.key, ev.kv.value))
            self._wake.set()

    def _on_compacted(self, _revision: int) -> None:
        self._need_resync = True
        self._wake.set()

    def _drain(self) -> None:
        """(Node lock held, standby) apply what the watch delivered; resync on a gap."""
        with self._qlock:
            queue, self._queue = self._queue, []
        assert self.log is not None
        for key, value in queue:
            self._groups.add(self.log.base, key, value)
        if self._need_resync:
            self._resync()
            return
        self._apply(self._groups)
        if self._groups.ahead(self.service.lsn):
            self._resync()

    def _apply(self, groups: _Groups) -> None:
        records = groups.take(self.service.lsn)
        if records:
            self.service.follow(records)

    def _resync(self) -> None:
        """(Node lock held) read the log from etcd and apply everything after this master's LSN; fetch the
        leader's snapshot when the log no longer reaches back to it."""
        assert self.log is not None
        lsn = self.service.lsn
        groups, _rev = self.log.read(lsn + 1)
        if not groups.complete.get(lsn + 1) and groups.min_first() is not None:
            groups, _rev = self.log.read()  # the next record may sit inside an earlier group
        self._apply(groups)
        self._groups = groups
        lsn = self.service.lsn
        if groups.ahead(lsn):
            oldest = groups.min_first()
            log.warning("master %r: at lsn %d but the log in etcd starts at %s: fetching the leader's snapshot",
                        self.candidate, lsn, oldest)
            self._fetch_snapshot()
            groups, _rev = self.log.read()
            self._apply(groups)
            self._groups = groups
        self._need_resync = False

    def _fetch_snapshot(self) -> None:
        info: LeaderInfo | None = self.election.leader() if self.election is not None else None
        if info is None or info.candidate_id == self.candidate:
            raise LogFailedError("the log was trimmed past this master's state and no other leader serves a snapshot")
        register_master_types()
        with RpcClient(info.address, timeout_s=60.0, max_retries=0) as client:
            blob = client.call("snapshot_bytes")
        self._install_snapshot(blob)

    def _install_snapshot(self, blob: bytes) -> None:
        self.service.close()
        path = os.path.join(self.data_dir, SNAPSHOT_NAME)
        tmp = path + ".fetched"
        with open(tmp, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        for stale in log_files(self.data_dir, RealFs()):  # the active log and any sealed segments
            os.unlink(stale)
        shutil.rmtree(os.path.join(self.data_dir, "index"), ignore_errors=True)  # refilled from the tables
        fd = os.open(self.data_dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        self.service = self._open()
        log.warning("master %r: installed the leader's snapshot at lsn %d (%d objects)", self.candidate,
                    self.service.lsn, self.service.stats().num_objects)

    # ------------------------------------------------------------------ roles
    def _on_elected(self, epoch: int) -> None:
        with self.lock:
            if self._stop.is_set():
                return
            self._promote(epoch)

    def _promote(self, epoch: int) -> None:
        """(Node lock held) catch up to the end of the log, then commit this epoch's first record. Both
        ``on_elected`` and the follow loop (which sees the election's epoch first) ask for it: an epoch this master
        already leads with is not promoted again (one EPOCH record and one soft-state reset per win; a reopen,
        which drops the leader role, is followed by a promotion again)."""
        if epoch <= self._fenced_epoch or (self.role == "leader" and self.epoch == epoch):
            return
        el = self.election
        assert el is not None
        t0 = time.monotonic()
        try:
            self._fence = el.fence()
            if self.service.failed is not None:
                self._reopen("failed before promotion")
                self._fence = el.fence()
            self._resync()
            self.epoch = epoch
            self.service.promote(epoch)
        except (MasterError, EtcdError, ElectionNotLeaderError) as e:
            log.error("master %r: promotion to epoch %d failed: %s", self.candidate, epoch, e)
            if isinstance(e, StaleEpochError):
                self._fenced(epoch, e)
            self._reopen(f"promotion failed: {e}")
            return
        self.role = "leader"
        log.warning("master %r leads with epoch %d at lsn %d (%d objects; caught up in %.3f s)", self.candidate,
                    epoch, self.service.lsn, self.service.stats().num_objects, time.monotonic() - t0)

    def _step_down(self, why: str) -> None:
        """(Node lock held) leader → standby."""
        log.warning("master %r steps down from epoch %d: %s", self.candidate, self.epoch, why)
        self.role = "standby"
        self._fence = None
        if self.service.failed is None:
            self.service.demote()
        else:
            self._reopen(why)
        self._need_resync = True

    def _trim(self) -> None:
        """(Node lock held, leader) bound the log in etcd after a local snapshot."""
        snap = self.service.last_snapshot_lsn
        below = min(snap - self.log_margin + 1, self._last_group_first)
        if below <= self._trimmed_below + 1 or self._fence is None or self.log is None:
            return
        rev = self.log.trim(self._fence, below)
        self._trimmed_below = below
        if self._compact_next:
            try:
                self.client.compact(self._compact_next)  # type: ignore[union-attr]
            except EtcdError as e:
                log.warning("master %r: compacting etcd to revision %d: %s", self.candidate, self._compact_next, e)
        self._compact_next = rev
        log.info("master %r: trimmed the log in etcd below lsn %d", self.candidate, below)

    # ------------------------------------------------------------------ threads
    def _follow_loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(0.2)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                with self.lock:
                    el = self.election
                    assert el is not None
                    if self.role == "leader":
                        if not el.is_leader:
                            self._step_down("the election says this master no longer leads")
                        else:
                            with self._qlock:
                                self._queue.clear()
                            self._trim()
                    if self.role == "standby":
                        self.after_call()  # a follow that failed: reload from the data dir, then catch up
                        self._drain()
                        epoch = el.epoch
                        if epoch is not None and epoch > self._fenced_epoch:
                            self._promote(epoch)  # won, but an earlier promotion failed (etcd blip)
            except (EtcdError, MasterError, OSError) as e:
                log.warning("master %r: following the log: %s; retrying", self.candidate, e)
                self._need_resync = True
                self._stop.wait(0.5)
            except Exception:
                log.exception("master %r: following the log failed; retrying", self.candidate)
                self._need_resync = True
                self._stop.wait(0.5)

    def _campaign_loop(self) -> None:
        el = self.election
        assert el is not None
        delays = self.backoff.delays()
        while not self._stop.is_set():
            try:
                el.campaign()
                delays = self.backoff.delays()
            except ElectionNotLeaderError:
                return  # cancelled (close)
            except (EtcdError, TimeoutError) as e:
                delay = next(delays)
                log.error("master %r: campaign failed (%s); retrying in %.1f s", self.candidate, e, delay)
                self._stop.wait(delay)
                continue
            while not self._stop.is_set() and el.is_leader:
                self._stop.wait(0.05)
            self._wake.set()

    def start(self, address: str) -> bool:
        """Connect to etcd (retrying with backoff until it answers or ``close``), follow the log, campaign.
        False when closed before etcd answered."""
        self.address = address
        delays = self.backoff.delays()
        while self.client is None:
            try:
                self.client = EtcdClient(self.etcd_endpoint, connect_timeout_s=0)
            except EtcdUnavailableError as e:
                delay = next(delays)
                log.error("master %r: %s; standing by, retrying in %.1f s", self.candidate, e, delay)
                if self._stop.wait(delay):
                    return False
        self.log = EtcdLog(self.client, self.prefix, self.name)
        self.election = LeaderElection(self.client, self.name, self.candidate, address, ttl_s=self.ttl_s,
                                       prefix=self.prefix, warmup_s=self.warmup_s, on_elected=self._on_elected,
                                       backoff=self.backoff)
        while not self._stop.is_set():
            try:
                with self.lock:
                    rev = self.log.read(self.service.lsn + 1)[1]
                    self._resync()
                break
            except (EtcdError, MasterError) as e:
                delay = next(delays)
                log.error("master %r: reading the log: %s; retrying in %.1f s", self.candidate, e, delay)
                self._stop.wait(delay)
        else:
            return False
        self._watch = Watch(self.client, self.log.base, self._on_log_event, prefix=True, start_revision=rev + 1,
                            on_compacted=self._on_compacted, name=f"master {self.name} log")
        for target, what in ((self._follow_loop, "follow"), (self._campaign_loop, "campaign")):
            t = threading.Thread(target=target, name=f"master-{what}", daemon=True)
            t.start()
            self._threads.append(t)
        return True

    def wait_decided(self, timeout_s: float) -> str:
        """Block until this master leads, or another holds the leader key: "leader" / "standby"."""
        deadline = time.monotonic() + timeout_s
        while not self._stop.is_set():
            with self.lock:
                if self.role == "leader":
                    return "leader"
            try:
                info = self.election.leader() if self.election is not None else None
            except EtcdError:
                info = None
            if (info is not None and info.candidate_id != self.candidate) or time.monotonic() > deadline:
                return "standby"
            self._stop.wait(0.02)
        return "standby"

    def tick(self) -> None:
        with self.lock:
            if self.role == "leader" and self.election is not None and self.election.is_leader:
                try:
                    self.service.tick()
                finally:
                    self.after_call()

    def request_stop(self) -> None:
        """(Signal handler) stop waiting for etcd and stop the background loops soon."""
        self._stop.set()
        self._wake.set()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self.election is not None:
            self.election.resign()
        for t in self._threads:
            t.join(timeout=10)
        if self.election is not None:  # again: a campaign begun between the loop's stop check and the first
            self.election.resign()  # resign (which did not wait for it) may have won since
        if self._watch is not None:
            self._watch.cancel()
        with self.lock:
            try:
                self.service.close()
            finally:
                self._dir_lock.release()
                if self.client is not None:
                    self.client.close()
