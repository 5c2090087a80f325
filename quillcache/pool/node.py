"""``PoolNode``: one node of the pool: a DRAM segment served over the transfer engine, an SSD tier behind it.

Mooncake's model (REFERENCE §4): the master allocates offsets inside each node's mounted segment;
clients move the bytes one-sided with the transfer engine; the node is passive for data.

What a node does:
- Maps ONE anonymous DRAM buffer of ``dram_bytes`` (rounded down to 64), writes every page once at start
  (no first-touch faults during transfers), registers it writable with its ``TransferEngine`` and mounts
  it at the master as ``SegmentDescriptor(node_id, segment_id, capacity, endpoint=engine address,
  transport, region_ids=(region,))``. ``segment_id`` is drawn at random in u32 (retried on
  SEGMENT_ALREADY_EXISTS) so ids are unique in the pool. Before mounting, every segment the master still
  lists under this ``node_id`` (a previous incarnation that was killed) is unmounted: its replicas point
  into memory this process does not hold.
- Each (re)mount registers the buffer as a NEW region (and unregisters the previous one): a client still
  holding replica descriptors of the expired mount names a region this node no longer serves, so its stale
  READ or WRITE is refused by the node instead of touching memory the master has handed out again (also
  across a restart at the same address: region ids start at a random number in each process).
- The DRAM region's name carries the node's control address and id (``pool-dram;gen=G;ctl=tcp://HOST:PORT;node=ID``):
  a client that opened the segment to move bytes also knows where to send ``persist`` (no directory
  needed), and checks that the endpoint still belongs to the replica's node (a port reused by another
  node after a crash is refused before any byte moves).
- At start, mounting is retried with backoff for ``mount_timeout_s`` while the master does not answer.
- Heartbeats the master every ``heartbeat_s`` (keep it <= client_ttl_s / 3; more than ``MAX_HEARTBEAT_S`` is
  refused with ValueError before anything starts). On NEED_REMOUNT (the master expired this node, or lost it)
  it mounts again and re-announces its SSD blocks (below); the master then holds nothing in this node's DRAM,
  so the whole segment starts free. While the master is unreachable it retries and keeps serving transfers.
- Control RPC (``quillcache.rpc``): ``info()`` -> dict (node id, ``boot_id``: random per process, segment id,
  capacity/used bytes, SSD block count, transfer and control addresses, pid, counters); ``persist(items)``
  (``[(key, offset, size, put_id)]``) and
  ``flush()``: the write-behind of completed objects to the SSD tier, :mod:`.writebehind` (verified copies,
  bounded per call and in its queue, durable at ``flush()`` or reported as not). The RPC layer has no
  handshake, so ``persist`` and ``flush`` carry a proof on the pool secret (:mod:`.control_auth`; refused with
  ``ControlAuthError`` before their arguments are looked at, on every backend but ``local``), and the server
  refuses a request frame past ``CONTROL_MAX_FRAME_BYTES``, which fits the largest legitimate call
  (``MAX_PERSIST_ITEMS`` items whose keys have up to ``MAX_KEY_CHARS`` UTF-8 bytes).
- With an SSD directory, at start, before the DRAM is mapped or a port is bound: the SSD tier is opened (it locks
  its directory, so a second node on it fails here with ``DataDirInUseError`` naming it, then runs its own
  crash recovery). Once mounted, the node re-announces every recovered block: keys the master already has are
  skipped; the others are ``batch_put_start_returning``-ed with one replica preferring this segment, copied into
  the DRAM buffer (a local memcpy) and ``batch_put_end``-ed. The master refuses a block older than its last word
  on the key (the key was removed since, or its last object had other bytes; ``StaleObjectError``, counted in
  ``reannounce_stale``), and the node then deletes that record (``ssd_stale_dropped``). It stops when the segment
  has no room for the next block (counted in ``reannounce_unfit``): re-announcing never makes the master evict
  live objects.
- Registers in a ``NodeRegistry`` (etcd, under a lease) when ``etcd`` is given, and publishes its descriptor again
  after every remount, so its ``regions`` name the region served now (retried each heartbeat while refused).
- ``close()`` unmounts (best effort) and stops everything (idempotent).

What the SSD tier guarantees here (write-behind): a persist acknowledged by ``flush()`` survives a crash of the
node process and comes back to the pool when the node restarts with the same SSD directory (if the master does
not already hold the key, and its last word on the key is not newer). Objects not yet flushed may or may not
survive. The DRAM content of a killed node is gone; the master drops its replicas when the node's client TTL runs
out. A block never comes back older than the pool's last word on its key while the master remembers that word
(``MasterConfig.max_forgotten_keys`` dropped keys, and across its restarts): a key removed since stays removed, a
key put again with other bytes does not come back with the old ones. A key the master forgot (past that bound)
comes back with the bytes last persisted for it here, as before. Each persist carries its put's id, and a record
is never replaced by an earlier put's bytes (a late persist; ``persist_superseded``) while the node knows the
record's put id (persisted or re-announced since its last mount). The tier holds at most its capacity, and a
persist that finds it full deletes the oldest records, those whose keys the master no longer holds first
(:mod:`.writebehind`; counted in ``ssd_evicted``).
"""

from __future__ import annotations

import logging
import mmap
import os
import random
import secrets
import socket
import threading
import time
from dataclasses import dataclass

from quillcache._checks import check_float
from quillcache.master.client import MasterClient
from quillcache.master.errors import (MasterError, NeedRemountError, NoSpaceError, SegmentExistsError,
                                     SegmentNotFoundError, StaleObjectError)
from quillcache.master.types import MAX_DURATION_S, MAX_KEY_CHARS, PutRequest, ReplicaConfig, SegmentDescriptor
from quillcache.pool.control_auth import check as check_control_auth
from quillcache.pool.control_auth import control_key
from quillcache.pool.errors import (ControlAuthError, NodeIdInUseError, NoSsdTierError, PersistRefusedError,
                                    PoolClosedError)
from quillcache.pool.frame import TRAILER_BYTES, check, digest_of
from quillcache.pool.keys import decode_record, store_key
from quillcache.pool.writebehind import MAX_PERSIST_ITEMS, PERSIST_QUEUE_ITEMS, WriteBehind, skip_log
from quillcache.store.errors import BlockNotFoundError
from quillcache.rpc import RpcServer, register_error

__all__ = ["CONTROL_MAX_FRAME_BYTES", "CONTROL_METHODS", "MAX_PERSIST_ITEMS", "PersistRefusedError", "PoolNode",
           "parse_region_name", "region_name"]

log = logging.getLogger(__name__)

CONTROL_METHODS = ["info", "persist", "flush"]
PAGE_BYTES = 4096
ALIGN_BYTES = 64
U32_MAX = (1 << 32) - 1
REANNOUNCE_CHUNK = 32
LIVE_PROBE_TIMEOUT_S = 2.0  # at start: how long the endpoint of a segment under this node id gets to answer
MAX_HEARTBEAT_S = MAX_DURATION_S  # a heartbeat must come within the master's client TTL, which is at most this
REGION_PREFIX = "pool-dram;"
# A persist request on the wire: a fixed envelope, then per item a 1-byte array head, a str head of up to 5 bytes,
# the key and three uint64s of 9 bytes each (offset, size, put id); the largest legitimate call holds
# MAX_PERSIST_ITEMS items of MAX_KEY_CHARS-byte keys (every ASCII key the master accepts).
CONTROL_MAX_FRAME_BYTES = 1024 + MAX_PERSIST_ITEMS * (1 + 5 + MAX_KEY_CHARS + 3 * 9)
_NODE_SEP = ";node="


def region_name(control_address: str, node_id: str, generation: int = 0) -> str:
    """The DRAM region's name: ``pool-dram;gen=<mount generation>;ctl=<control address>;node=<node id>``."""
    return f"{REGION_PREFIX}gen={generation};ctl={control_address}{_NODE_SEP}{node_id}"


def parse_region_name(name: str) -> tuple[str, str] | None:
    """``(control address, node id)`` a pool node's region name carries, or None for another region."""
    if not name.startswith(REGION_PREFIX) or _NODE_SEP not in name:
        return None
    head, _, node = name[len(REGION_PREFIX):].partition(_NODE_SEP)
    fields = dict(f.partition("=")[::2] for f in head.split(";"))
    ctl = fields.get("ctl")
    return (ctl, node) if ctl else None


@dataclass
class NodeCounters:
    persisted: int = 0  # made durable in the SSD tier (counted at its group commit)
    persist_skipped: int = 0  # did not verify (range reused / bad offset) or the SSD tier refused it
    persist_failed: int = 0  # a commit failed (callback error)
    persist_refused: int = 0  # items of persist calls refused whole (over MAX_PERSIST_ITEMS or the queue's bounds)
    reannounced: int = 0
    reannounce_skipped: int = 0  # already in the pool, or the record did not verify
    reannounce_unfit: int = 0
    reannounce_stale: int = 0  # refused by the master: older than its last word on the key (removed or re-put)
    remounts: int = 0
    ssd_evicted: int = 0  # SSD records deleted to make room for newer ones (a full tier; writebehind)
    ssd_stale_dropped: int = 0  # SSD records deleted because the master refused them as stale
    persist_superseded: int = 0  # persists of an earlier put than the one the key's SSD record holds (not stored)


register_error(PersistRefusedError)  # a client that imports the pool gets these as themselves
register_error(NoSsdTierError)
register_error(ControlAuthError)


class _Control:
    """The RPC target (only these three methods are served; ``persist`` and ``flush`` need a proof on the pool
    secret: :mod:`.control_auth`)."""

    def __init__(self, node: PoolNode) -> None:
        self._node = node

    def info(self) -> dict:
        return self._node.info()

    def persist(self, items: list, auth: object = None) -> int:
        self._node.check_control("persist", items, auth)
        return self._node.persist(items)

    def flush(self, auth: object = None) -> dict:
        self._node.check_control("flush", [], auth)
        return self._node.flush()


class PoolNode:
    """See the module docstring."""

    def __init__(self, master: MasterClient | str, *, dram_bytes: int, ssd_dir: str | os.PathLike | None = None,
                 ssd_bytes: int | None = None, etcd: str | None = None, node_id: str | None = None,
                 host: str = "127.0.0.1", port: int = 0, control_port: int = 0, secret: str | bytes | None = None,
                 heartbeat_s: float = 1.0, backend: str = "tcp", master_timeout_s: float = 2.0,
                 mount_timeout_s: float = 30.0, persist_queue_items: int = PERSIST_QUEUE_ITEMS,
                 persist_queue_bytes: int | None = None) -> None:
        from quillcache.transfer import SECRET_ENV, TransferEngine

        if not isinstance(dram_bytes, int) or dram_bytes < PAGE_BYTES:
            raise ValueError(f"dram_bytes must be an int >= {PAGE_BYTES}, got {dram_bytes!r}")
        check_float("heartbeat_s", heartbeat_s, 0.0, MAX_HEARTBEAT_S, lo_open=True)  # (a longer wait kills its thread)
        self.node_id = node_id or f"node-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self.boot_id = secrets.token_hex(8)  # this process: a store tells a restarted node from the one it persisted to
        self.heartbeat_s = float(heartbeat_s)
        self.capacity_bytes = dram_bytes // ALIGN_BYTES * ALIGN_BYTES
        self.counters = NodeCounters()
        self._closed = False
        self._stop = threading.Event()
        self._hb_on = threading.Event()
        self._reannounce_wanted = threading.Event()
        self._generation = 0  # mounts so far (the region of mount g is named gen=g)
        self._hb_on.set()
        self._lock = threading.RLock()  # mount state
        self._owns_master = not isinstance(master, MasterClient)
        self.master = (MasterClient(master, timeout_s=master_timeout_s, retry_s=master_timeout_s)
                       if self._owns_master else master)
        self.engine = None
        self.server = None
        self.ssd = None
        self.registry = None
        self.segment_id: int | None = None
        self._threads: list[threading.Thread] = []
        self.write_behind: WriteBehind | None = None
        self._control_key: bytes | None = None  # persist/flush need a proof made with it (None: local backend)
        self._auth_log = skip_log(self.node_id, "control calls refused")
        self._publish_wanted = False  # the registry still names a region of an earlier mount
        try:
            if ssd_dir is not None:  # first: a directory another node holds is refused before anything starts
                from quillcache.store.ssd import SsdTier

                cap = ssd_bytes if ssd_bytes is not None else 4 * self.capacity_bytes
                cap = max(PAGE_BYTES * 16, cap // PAGE_BYTES * PAGE_BYTES)
                os.makedirs(ssd_dir, exist_ok=True)
                self.ssd = SsdTier(ssd_dir, capacity_bytes=cap, slab_bytes=min(64 << 20, cap))
            # the master answers before the DRAM is mapped and touched (seconds per GiB): a wrong address or a
            # master that is down fails within mount_timeout_s, not after the whole buffer was faulted in
            self._retry_master(self.master.master_status, mount_timeout_s)
            self._mm = mmap.mmap(-1, self.capacity_bytes)
            self._buf = memoryview(self._mm)
            for off in range(0, self.capacity_bytes, PAGE_BYTES):  # touch every page now
                self._mm[off] = 0
            if self.ssd is not None:
                self.write_behind = WriteBehind(self.node_id, self._buf, self.ssd, self.counters,
                                                queue_items=persist_queue_items, queue_bytes=persist_queue_bytes,
                                                held=lambda keys: self.master.exists(list(keys)))
            key_secret = secret if secret is not None else os.environ.get(SECRET_ENV)
            self._control_key = control_key(key_secret) if backend != "local" and key_secret else None
            self.server = RpcServer(_Control(self), CONTROL_METHODS, host, control_port, name=f"node-{self.node_id}",
                                    max_frame_bytes=CONTROL_MAX_FRAME_BYTES)
            self.server.start()
            self.control_address = self.server.address
            opts: dict = {} if backend == "local" else {"secret": secret, "host": host, "port": port}
            self.engine = TransferEngine(backend, random_region_ids=True, **opts)  # ids differ per process
            self.transfer_address = self.engine.address
            self.region = self.engine.register_region(self._buf, name=region_name(self.control_address, self.node_id),
                                                      writable=True)
            self._mount_at_start(mount_timeout_s)
            self._start_thread(self._heartbeat_loop, "heartbeat")  # before re-announcing: that may take a while
            if self.ssd is not None:
                self.reannounce()
                self._start_thread(self._reannounce_loop, "reannounce")
            if etcd is not None:
                self._publish(etcd)
            if self.write_behind is not None:
                self.write_behind.start()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ lifetime
    def _start_thread(self, fn, what: str) -> None:
        t = threading.Thread(target=fn, name=f"pool-node-{what}", daemon=True)
        t.start()
        self._threads.append(t)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._auth_log.tick(final=True)
        if self.write_behind is not None:
            self.write_behind.stop()
        self._stop.set()
        for t in self._threads:
            t.join(timeout=10)
        if self.segment_id is not None:
            try:
                self.master.unmount_segment(self.segment_id, client_id=self.node_id)
            except Exception as e:  # best effort: the master expires us anyway
                log.info("node %s: unmount of segment %s at close failed: %s", self.node_id, self.segment_id, e)
        if self.registry is not None:
            try:
                self.registry.close()
            except Exception as e:
                log.info("node %s: registry close failed: %s", self.node_id, e)
        if self.server is not None:
            self.server.close()
        if self.engine is not None:
            self.engine.close()
        if self.ssd is not None:
            try:
                self.ssd.close()
            except Exception as e:
                log.warning("node %s: SSD tier close failed: %s", self.node_id, e)
        if self._owns_master:
            self.master.close()

    def __enter__(self) -> PoolNode:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"PoolNode({self.node_id!r}, segment {self.segment_id}, {self.capacity_bytes} bytes, "
                f"transfer {getattr(self, 'transfer_address', None)})")

    # ------------------------------------------------------------------ master membership
    def _descriptor(self, segment_id: int) -> SegmentDescriptor:
        return SegmentDescriptor(node_id=self.node_id, segment_id=segment_id, capacity_bytes=self.capacity_bytes,
                                 endpoint=self.transfer_address, transport=self.engine.backend_name,
                                 region_ids=(self.region.region_id,))

    def _live_holder(self, seg: SegmentDescriptor) -> bool:
        """Whether another process still serves ``seg`` (a segment under this node id): its endpoint
        answers an authenticated region list that includes one of the segment's regions. Our own
        endpoint, an unreachable one, or one that no longer serves those regions is a stale mount."""
        from quillcache.transfer import TransferError

        if not seg.endpoint or seg.endpoint == self.transfer_address or seg.transport != self.engine.backend_name:
            return False
        try:
            info = self.engine.open_segment(seg.endpoint, timeout_s=LIVE_PROBE_TIMEOUT_S)
        except (TransferError, OSError, ValueError):
            return False
        return any(r.region_id in seg.region_ids for r in info.regions)

    def _mount(self) -> None:
        """Unmount this node id's stale segments, then mount the buffer under a fresh random id. At
        start, a segment under this node id that a live process still serves is not stale: the node
        refuses to start (``NodeIdInUseError``) instead of taking that node's memory out of the pool."""
        with self._lock:
            segments = self.master.segments()
            if not self._generation:
                for seg in segments:
                    if seg.node_id == self.node_id and self._live_holder(seg):
                        raise NodeIdInUseError(
                            f"node id {self.node_id!r} is in use: segment {seg.segment_id} at {seg.endpoint} is "
                            f"still served there; give this node another --node-id, or stop that node first")
            for seg in segments:
                if seg.node_id == self.node_id:
                    try:
                        self.master.unmount_segment(seg.segment_id)
                    except MasterError as e:
                        log.info("node %s: stale segment %s: %s", self.node_id, seg.segment_id, e)
            if self._generation:  # a remount: stale descriptors must not reach the buffer through the old region
                if self.write_behind is not None:  # (a master that lost its state numbers puts from 1 again)
                    self.write_behind.forget_versions()
                old = self.region
                self.region = self.engine.register_region(
                    self._buf, name=region_name(self.control_address, self.node_id, self._generation), writable=True)
                try:
                    self.engine.unregister_region(old, timeout_s=5.0)
                except Exception as e:
                    log.warning("node %s: old region %d not unregistered: %s", self.node_id, old.region_id, e)
            rng = random.SystemRandom()
            for _ in range(64):
                sid = rng.randint(1, U32_MAX)
                try:
                    self.master.mount_segment(self._descriptor(sid))
                except SegmentExistsError:
                    continue
                self.segment_id = sid
                self._generation += 1
                log.info("node %s: mounted segment %d (%d bytes) at %s", self.node_id, sid, self.capacity_bytes,
                         self.transfer_address)
                return
            raise RuntimeError("64 random segment ids were all taken")

    def suspend_heartbeats(self) -> None:
        """Stop heartbeating (the node keeps serving transfers): a failure-injection hook that stands for a
        process stalled longer than the master's client TTL, for in-process pools."""
        self._hb_on.clear()

    def resume_heartbeats(self) -> None:
        self._hb_on.set()

    def _mount_at_start(self, timeout_s: float) -> None:
        """``_mount``, retried with backoff while the master does not answer (it may be restarting)."""
        self._retry_master(self._mount, timeout_s)

    def _retry_master(self, call, timeout_s: float):
        """``call()``, retried with backoff while the master does not answer, for at most ``timeout_s``."""
        from quillcache.rpc import RpcConnectionError, RpcTimeoutError

        deadline, delay = time.monotonic() + timeout_s, 0.05
        while True:
            try:
                return call()
            except (RpcTimeoutError, RpcConnectionError) as e:
                if time.monotonic() + delay > deadline:
                    raise
                log.info("node %s: the master does not answer (%s); retrying", self.node_id, e)
                time.sleep(delay)
                delay = min(1.0, 2 * delay)

    def _heartbeat_loop(self) -> None:
        delay = 0.05
        while not self._stop.wait(self.heartbeat_s):
            if not self._hb_on.is_set():
                continue
            try:
                self.master.heartbeat(self.node_id)
                delay = 0.05
                if self._publish_wanted and self.registry is not None:
                    self._publish()
            except NeedRemountError:
                log.warning("node %s: the master asks for a remount (expired or lost); mounting again", self.node_id)
                try:
                    self._mount()
                    self.counters.remounts += 1
                    self._reannounce_wanted.set()  # on its own thread: heartbeats go on meanwhile
                    if self.registry is not None:
                        self._publish()
                except Exception as e:
                    log.warning("node %s: remount failed: %s", self.node_id, e)
                    self._stop.wait(delay)
                    delay = min(1.0, delay * 2)
            except Exception as e:  # master unreachable / paused / restarting: keep serving, keep trying
                log.info("node %s: heartbeat failed (%s: %s); retrying", self.node_id, type(e).__name__, e)
                self._stop.wait(delay)
                delay = min(1.0, delay * 2)

    def _reannounce_loop(self) -> None:
        while not self._stop.is_set():
            if not self._reannounce_wanted.wait(0.2):
                continue
            self._reannounce_wanted.clear()
            try:
                self.reannounce()
            except Exception as e:
                log.warning("node %s: re-announce failed: %s", self.node_id, e)

    def _publish(self, etcd: str | None = None) -> None:
        """Register in etcd with the region served NOW: at start (``etcd``; a failure raises) and after each
        remount (a failure then is retried at the next heartbeat: ``_publish_wanted``)."""
        from quillcache.cluster.descriptors import RegionInfo
        from quillcache.cluster.descriptors import SegmentDescriptor as RegistryDescriptor
        from quillcache.cluster.registry import EtcdRegistry

        if etcd is not None:
            self.registry = EtcdRegistry(etcd, ttl_s=max(1, int(round(3 * self.heartbeat_s))))
        with self._lock:  # the region read here is the one served: a remount publishes again after this
            try:
                self.registry.register(RegistryDescriptor(  # type: ignore[union-attr]
                    node_id=self.node_id, endpoint=self.transfer_address, transport=self.engine.backend_name,
                    regions=(RegionInfo(self.region.region_id, self.capacity_bytes),),
                    capacity_bytes=self.capacity_bytes))
                self._publish_wanted = False
            except Exception as e:
                if etcd is not None:
                    raise
                self._publish_wanted = True
                log.warning("node %s: registry not updated (%s); retried at the next heartbeat", self.node_id, e)

    # ------------------------------------------------------------------ SSD: re-announce
    def reannounce(self) -> tuple[int, int]:
        """Bring the SSD tier's blocks back into the pool (module docstring); returns (announced, unfit).

        Runs chunk by chunk under the mount lock (a remount waits for the chunk in progress, so no block is
        copied to an offset of a segment that is no longer ours); stops early when the master forgets this
        node meanwhile (the heartbeat thread then remounts and asks for a new pass)."""
        if self.ssd is None:
            return 0, 0
        keys = list(self.ssd.keys())
        announced = unfit = 0
        for i in range(0, len(keys), REANNOUNCE_CHUNK):
            if self._stop.is_set():
                break
            try:
                with self._lock:
                    a, u, full = self._reannounce_chunk(keys[i:i + REANNOUNCE_CHUNK])
            except (NeedRemountError, SegmentNotFoundError) as e:
                log.warning("node %s: re-announce interrupted (%s); it resumes after the remount", self.node_id, e)
                break
            announced, unfit = announced + a, unfit + u
            if full:  # the segment is full: the remaining chunks are not tried
                unfit += max(0, len(keys) - i - REANNOUNCE_CHUNK)
                break
        self.counters.reannounced += announced
        self.counters.reannounce_unfit += unfit
        log.info("node %s: re-announced %d SSD blocks (%d did not fit)", self.node_id, announced, unfit)
        return announced, unfit

    def _reannounce_chunk(self, chunk: list) -> tuple[int, int, bool]:
        ssd = self.ssd
        records: list[tuple[str, memoryview]] = []
        for sk in chunk:
            try:
                key, framed = decode_record(ssd.get(sk))
                if store_key(key) != sk:
                    raise ValueError("record key does not hash to its block name")
                check(framed, key)
            except BlockNotFoundError:  # evicted meanwhile by the write-behind (a full tier): nothing to announce
                continue
            except Exception as e:  # a block the tier verified but that is not a pool record of ours
                log.warning("node %s: SSD block %s skipped: %s", self.node_id, sk.hex(), e)
                self.counters.reannounce_skipped += 1
                continue
            records.append((key, framed))
            if self.write_behind is not None:  # a full tier evicts by age, keys the pool dropped first
                self.write_behind.learn(sk, key)
        if not records:
            return 0, 0, False
        have = self.master.exists([k for k, _ in records])
        todo = [(k, f) for (k, f), h in zip(records, have) if h is not True]
        self.counters.reannounce_skipped += len(records) - len(todo)
        seg_id = self.segment_id
        used, cap = self.master.segment_usage(seg_id)
        free = cap - used
        fit: list[tuple[str, memoryview]] = []
        for k, f in todo:
            need = -(-f.nbytes // ALIGN_BYTES) * ALIGN_BYTES
            if need > free:
                break
            free -= need
            fit.append((k, f))
        unfit, full = len(todo) - len(fit), len(fit) < len(todo)
        if not fit:
            return 0, unfit, full
        reqs = [PutRequest(key=k, size_bytes=f.nbytes, digest=digest_of(f[f.nbytes - TRAILER_BYTES:]),
                           config=ReplicaConfig(replica_num=1, preferred_segment=seg_id))
                for k, f in fit]
        results = self.master.batch_put_start_returning(reqs, client_id=self.node_id)
        ends, ids, revoke, revoke_ids = [], [], [], []
        for (k, f), r in zip(fit, results):
            if isinstance(r, MasterError):
                if isinstance(r, StaleObjectError):  # removed or re-put since: never to come back
                    self.counters.reannounce_stale += 1
                    if self.write_behind is not None:
                        self.write_behind.drop_if_stale(store_key(k), f[f.nbytes - TRAILER_BYTES:])
                elif isinstance(r, NoSpaceError):
                    unfit += 1
                else:
                    self.counters.reannounce_skipped += 1
                continue
            if r.existing:
                self.counters.reannounce_skipped += 1
                continue
            rep = r.replicas[0] if len(r.replicas) == 1 else None
            if rep is None or rep.segment_id != seg_id:
                revoke.append(k)
                revoke_ids.append(r.put_id)
                unfit += 1
                continue
            self._buf[rep.offset_bytes:rep.offset_bytes + f.nbytes] = f
            ends.append(k)
            ids.append(r.put_id)
        if revoke:
            self.master.batch_put_revoke(revoke, put_ids=revoke_ids)
        announced = 0
        for k, pid, o in zip(ends, ids, self.master.batch_put_end(ends, put_ids=ids) if ends else ()):
            if o is None:
                announced += 1
                if self.write_behind is not None:  # the record now holds the pool's object of put ``pid``
                    self.write_behind.note_version(store_key(k), pid)
        return announced, unfit, full

    # ------------------------------------------------------------------ SSD: write-behind
    def check_control(self, method: str, args: object, auth: object) -> None:
        """``ControlAuthError`` unless ``auth`` proves ``method(args)`` on the pool secret (:mod:`.control_auth`;
        nothing is checked on the local backend)."""
        if self._control_key is None:
            return
        why = check_control_auth(self._control_key, method, args, auth)
        if why is not None:
            self._auth_log.note("refused (no valid proof)", "%s", why)
            raise ControlAuthError(f"node {self.node_id}: {why}")

    def persist(self, items: list) -> int:
        """Queue ``[(key, offset, size)]`` for write-behind (:mod:`.writebehind`); returns how many were queued.
        ``PersistRefusedError`` when the call is over the bounds; ``NoSsdTierError`` (one) on a node without an SSD
        tier, where nothing can be made durable (it returned 0 and its flush reported nothing wrong)."""
        if self._closed:
            raise PoolClosedError(f"node {self.node_id} is closed")
        if self.write_behind is None:
            raise NoSsdTierError(f"node {self.node_id} has no SSD tier (started without --ssd): persist of "
                                 f"{len(items) if isinstance(items, (list, tuple)) else '?'} items not made durable")
        return self.write_behind.persist(items)

    def flush(self) -> dict:
        """Wait for every queued persist and make them durable; returns :meth:`info` (at once after ``close()``).
        PersistFailedError (naming how many and the first cause) when a persist since the previous flush is not
        durable."""
        if self.write_behind is not None and not self._closed:
            self.write_behind.flush()
        return self.info()

    # ------------------------------------------------------------------ introspection
    def info(self) -> dict:
        used = None
        try:
            used = self.master.segment_usage(self.segment_id)[0] if self.segment_id is not None else None
        except Exception:
            pass
        c = self.counters
        return {"node_id": self.node_id, "boot_id": self.boot_id, "segment_id": self.segment_id,
                "capacity_bytes": self.capacity_bytes,
                "used_bytes": used, "ssd_blocks": len(self.ssd) if self.ssd is not None else 0,
                "transfer_address": self.transfer_address, "control_address": self.control_address,
                "pid": os.getpid(), "persisted": c.persisted, "persist_skipped": c.persist_skipped,
                "persist_failed": c.persist_failed, "persist_refused": c.persist_refused, "reannounced": c.reannounced,
                "reannounce_skipped": c.reannounce_skipped, "reannounce_unfit": c.reannounce_unfit,
                "reannounce_stale": c.reannounce_stale, "remounts": c.remounts, "ssd_evicted": c.ssd_evicted,
                "ssd_stale_dropped": c.ssd_stale_dropped, "persist_superseded": c.persist_superseded}

    def view(self) -> memoryview:
        """The node's DRAM buffer (tests inject corruption through it)."""
        return self._buf

