"""``NodeRegistry``: which nodes are alive and what segments they serve; where the leader master listens.

Two implementations behind one protocol, registered by name in ``NODE_REGISTRIES``:
- ``"memory"`` (``InMemoryRegistry``, the embedded default): one process; liveness by an optional TTL on
  an injected clock (``heartbeat`` renews, ``expire()`` drops the stale), so expiry is tested without
  sleeping; watch callbacks run synchronously in the thread that caused the change. A change made
  (on another thread) while a new watcher's replay runs is held for that watcher and delivered after
  the replay, so the replay-then-changes order holds for it too.
- ``"etcd"`` (``EtcdRegistry``): every node this registry registers lives under ONE etcd lease of
  ``ttl_s`` kept alive by a background thread, so a node whose process dies leaves when its lease
  expires; watch callbacks run on the watch's thread. ``close()`` also closes the ``EtcdClient`` when
  the registry made it (from an endpoint); a client passed in stays the caller's.

Invariants (both):
- ``nodes()`` lists live nodes sorted by ``node_id``. A ``node_id`` is held by one registration at a time:
  registering it again through the same registry replaces the descriptor ("update"); a node id live
  under another etcd lease is refused with ``NodeIdTakenError``.
- ``watch(callback)`` first reports every live node as a "join" (``replay=True``), then each change once,
  in order: "join", "update", "leave". A lease that expires is a "leave" carrying the last descriptor.
- ``master_address()`` is the ``host:port`` the current leader master listens on (the record
  ``LeaderElection`` writes), or None while no leader is known.
- ``EtcdRegistry`` re-registers its nodes under a new lease when etcd reports the old one expired (a long
  pause, an etcd restart that lost it); watchers then see a leave and a join.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Protocol

from quillcache._checks import check_float, check_int
from quillcache.cluster.client import (Backoff, EtcdClient, EtcdError, compare_create, compare_lease, delete_op,
                                       put_op, range_op)
from quillcache.cluster.descriptors import (DEFAULT_PREFIX, DescriptorError, LeaderInfo, MembershipEvent,
                                            SegmentDescriptor, check_endpoint, election_key, node_key, nodes_prefix)
from quillcache.cluster.lease import LeaseKeeper
from quillcache.cluster.watch import Watch, WatchEvent
from quillcache.registry import Registry
from quillcache.types import NodeId

__all__ = ["NODE_REGISTRIES", "EtcdRegistry", "InMemoryRegistry", "NodeIdTakenError", "NodeRegistry",
           "RegistryError", "UnknownNodeError", "WatchHandle", "make_registry"]

log = logging.getLogger(__name__)

Callback = Callable[[MembershipEvent], None]


class RegistryError(Exception):
    """Base class of the registry's errors."""


class NodeIdTakenError(RegistryError):
    """The node id is live under another registration."""


class UnknownNodeError(RegistryError, KeyError):
    """No live node with that id (never registered, unregistered, or expired: register again)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class WatchHandle(Protocol):
    def cancel(self) -> None: ...


class NodeRegistry(Protocol):
    """Node membership and the leader's address (see the module invariants)."""

    def register(self, segment: SegmentDescriptor) -> None:
        """Publish ``segment`` under its node id and keep it alive until ``unregister`` or ``close``."""
        raise NotImplementedError

    def unregister(self, node_id: str) -> bool:
        """Withdraw a node this registry registered; False when it was not live."""
        raise NotImplementedError

    def nodes(self) -> list[SegmentDescriptor]:
        """Every live node's descriptor, sorted by node id."""
        raise NotImplementedError

    def watch(self, callback: Callback, *, replay: bool = True) -> WatchHandle:
        """Report membership changes to ``callback`` until the handle's ``cancel()``."""
        raise NotImplementedError

    def master_address(self) -> str | None:
        """``host:port`` of the current leader master, or None."""
        raise NotImplementedError

    def close(self) -> None:
        """Withdraw this registry's nodes and stop its watches and threads."""
        raise NotImplementedError


NODE_REGISTRIES: Registry[Callable[..., NodeRegistry]] = Registry("node registry")


def make_registry(name: str = "memory", **options) -> NodeRegistry:
    """The registry registered as ``name`` ("memory" or "etcd"), built with ``options``."""
    return NODE_REGISTRIES.create(name, **options)  # type: ignore[return-value]


def _check_segment(segment: object) -> SegmentDescriptor:
    if not isinstance(segment, SegmentDescriptor):
        raise TypeError(f"register takes a SegmentDescriptor, got {type(segment).__name__}")
    return segment


# ------------------------------------------------------------------------------------------------------
class _MemoryWatch:
    """While ``replay()`` runs, changes are held (those after the replay's snapshot, ``revision``) and
    delivered, in revision order, when it ends; afterwards ``deliver`` calls the callback at once."""

    def __init__(self, owner: InMemoryRegistry, callback: Callback, revision: int) -> None:
        self._owner, self.callback = owner, callback
        self._after = revision              # events up to this revision are in the replay
        self._held: list[MembershipEvent] | None = []  # None once the replay is over
        self._lock = threading.Lock()

    def deliver(self, ev: MembershipEvent) -> None:
        if ev.revision <= self._after:  # made before the snapshot, emitted after it: the replay has it
            return
        with self._lock:
            if self._held is not None:
                self._held.append(ev)
                return
        self.callback(ev)

    def replay(self, current: list[SegmentDescriptor]) -> None:
        for seg in sorted(current, key=lambda s: s.node_id):
            self.callback(MembershipEvent(kind="join", node_id=seg.node_id, segment=seg, revision=self._after))
        while True:
            with self._lock:
                held = sorted(self._held or (), key=lambda ev: ev.revision)
                self._held = [] if held else None
            if not held:
                return
            for ev in held:
                self.callback(ev)

    def cancel(self) -> None:
        self._owner._unwatch(self)

    def __enter__(self) -> _MemoryWatch:
        return self

    def __exit__(self, *exc) -> None:
        self.cancel()


@NODE_REGISTRIES.register("memory")
class InMemoryRegistry:
    """One process's registry; ``ttl_s=None`` keeps nodes until unregistered (see the module docstring)."""

    def __init__(self, *, ttl_s: float | None = None, clock: Callable[[], float] = time.monotonic,
                 master_address: str | None = None) -> None:
        self.ttl_s = None if ttl_s is None else check_float("ttl_s", ttl_s, 0.0, lo_open=True)
        self._clock = clock
        self._nodes: dict[str, tuple[SegmentDescriptor, float]] = {}  # node id → (descriptor, expiry)
        self._watches: list[_MemoryWatch] = []
        self._master: str | None = None if master_address is None else check_endpoint(master_address)
        self._revision = 0
        self._lock = threading.RLock()

    def _expiry(self) -> float:
        return math.inf if self.ttl_s is None else self._clock() + self.ttl_s

    def _emit(self, events: list[MembershipEvent]) -> None:
        with self._lock:
            watches = list(self._watches)
        for ev in events:
            for w in watches:
                w.deliver(ev)

    def _event(self, kind, segment: SegmentDescriptor) -> MembershipEvent:
        self._revision += 1
        return MembershipEvent(kind=kind, node_id=segment.node_id, segment=segment, revision=self._revision)

    def _collect_expired(self) -> list[MembershipEvent]:
        now = self._clock()
        gone = [nid for nid, (_, end) in self._nodes.items() if end <= now]
        return [self._event("leave", self._nodes.pop(nid)[0]) for nid in sorted(gone)]

    def expire(self) -> list[NodeId]:
        """Drop nodes whose TTL ran out (reported as leaves); their ids."""
        with self._lock:
            events = self._collect_expired()
        self._emit(events)
        return [ev.node_id for ev in events]

    def register(self, segment: SegmentDescriptor) -> None:
        segment = _check_segment(segment)
        with self._lock:
            events = self._collect_expired()
            kind = "update" if segment.node_id in self._nodes else "join"
            self._nodes[segment.node_id] = (segment, self._expiry())
            events.append(self._event(kind, segment))
        self._emit(events)

    def heartbeat(self, node_id: str) -> None:
        """Renew a node's TTL; ``UnknownNodeError`` when it is not live (it must register again)."""
        with self._lock:
            events = self._collect_expired()
            entry = self._nodes.get(node_id)
            if entry is not None:
                self._nodes[node_id] = (entry[0], self._expiry())
        self._emit(events)
        if entry is None:
            raise UnknownNodeError(f"node {node_id!r} is not registered (or expired): register it again")

    def unregister(self, node_id: str) -> bool:
        with self._lock:
            events = self._collect_expired()
            entry = self._nodes.pop(node_id, None)
            if entry is not None:
                events.append(self._event("leave", entry[0]))
        self._emit(events)
        return entry is not None

    def nodes(self) -> list[SegmentDescriptor]:
        self.expire()
        with self._lock:
            return [self._nodes[nid][0] for nid in sorted(self._nodes)]

    def watch(self, callback: Callback, *, replay: bool = True) -> _MemoryWatch:
        self.expire()
        with self._lock:
            handle = _MemoryWatch(self, callback, self._revision)
            self._watches.append(handle)
            current = [seg for seg, _ in self._nodes.values()] if replay else []
        handle.replay(current)
        return handle

    def _unwatch(self, handle: _MemoryWatch) -> None:
        with self._lock:
            if handle in self._watches:
                self._watches.remove(handle)

    def set_master_address(self, address: str | None) -> None:
        """Record where the (embedded) leader master listens; None when there is none."""
        self._master = None if address is None else check_endpoint(address)

    def master_address(self) -> str | None:
        return self._master

    def close(self) -> None:
        with self._lock:
            ids = sorted(self._nodes)
        for nid in ids:
            self.unregister(nid)
        with self._lock:
            self._watches.clear()


# ------------------------------------------------------------------------------------------------------
class _EtcdMembershipWatch:
    """A registry watch: list, report, then follow etcd's events from the revision after the list."""

    def __init__(self, registry: EtcdRegistry, callback: Callback, replay: bool) -> None:
        self._registry = registry
        self._callback = callback
        self._known: dict[str, SegmentDescriptor] = {}
        self._lock = threading.Lock()
        segments, revision = registry._list()
        for seg in segments:
            self._known[seg.node_id] = seg
            if replay:
                callback(MembershipEvent(kind="join", node_id=seg.node_id, segment=seg, revision=revision))
        self._watch = Watch(registry.client, registry._nodes_prefix, self._on_event, prefix=True,
                            start_revision=revision + 1, on_compacted=self._resync, name="node registry")

    def _on_event(self, ev: WatchEvent) -> None:
        node_id = ev.key[len(self._registry._nodes_prefix):]
        with self._lock:
            if ev.kind == "delete":
                last = self._known.pop(node_id, None)
                if last is None and ev.prev is not None:
                    last = _decode_or_none(ev.prev.value, ev.key)
                out = MembershipEvent(kind="leave", node_id=NodeId(node_id), segment=last, revision=ev.revision)
            else:
                seg = _decode_or_none(ev.kv.value, ev.key)
                if seg is None:
                    return
                kind = "update" if node_id in self._known else "join"
                self._known[node_id] = seg
                out = MembershipEvent(kind=kind, node_id=seg.node_id, segment=seg, revision=ev.revision)
        self._callback(out)

    def _resync(self, _compacted: int) -> int:
        """Events were compacted away: diff a fresh listing against what the callback has been told; the
        revision listed at (the watch goes on after it, so no change after the listing is missed)."""
        segments, revision = self._registry._list()
        now = {s.node_id: s for s in segments}
        with self._lock:
            events = [MembershipEvent(kind="leave", node_id=NodeId(nid), segment=seg, revision=revision)
                      for nid, seg in sorted(self._known.items()) if nid not in now]
            events += [MembershipEvent(kind="update" if nid in self._known else "join", node_id=seg.node_id,
                                       segment=seg, revision=revision)
                       for nid, seg in sorted(now.items()) if self._known.get(nid) != seg]
            self._known = dict(now)
        for ev in events:
            self._callback(ev)
        return revision

    def cancel(self) -> None:
        self._watch.cancel()
        self._registry._forget(self)

    def __enter__(self) -> _EtcdMembershipWatch:
        return self

    def __exit__(self, *exc) -> None:
        self.cancel()


def _decode_or_none(value: bytes, key: str) -> SegmentDescriptor | None:
    try:
        return SegmentDescriptor.from_bytes(value)
    except DescriptorError as e:
        log.warning("ignoring %s: %s", key, e)
        return None


@NODE_REGISTRIES.register("etcd")
class EtcdRegistry:
    """The registry in etcd (see the module docstring); ``endpoint`` is ``host:port`` or an ``EtcdClient``."""

    def __init__(self, endpoint: str | EtcdClient = "127.0.0.1:2379", *, prefix: str = DEFAULT_PREFIX,
                 ttl_s: int = 10, master_election: str = "master", connect_timeout_s: float = 10.0,
                 backoff: Backoff = Backoff()) -> None:
        self.ttl_s = check_int("ttl_s", ttl_s, 1)
        self._owns_client = not isinstance(endpoint, EtcdClient)  # close() closes a client made here
        self.client = endpoint if isinstance(endpoint, EtcdClient) else \
            EtcdClient(endpoint, connect_timeout_s=connect_timeout_s, backoff=backoff)
        self.prefix = prefix
        self._nodes_prefix = nodes_prefix(prefix)
        self._master_key = election_key(master_election, prefix)
        self._backoff = backoff
        self._mine: dict[str, SegmentDescriptor] = {}  # what this registry registered
        self._keeper: LeaseKeeper | None = None
        self._watches: list[_EtcdMembershipWatch] = []
        self._lock = threading.RLock()
        self._closed = threading.Event()

    # -- the lease ----------------------------------------------------------------------------------
    def _lease(self) -> int:
        with self._lock:
            if self._keeper is None or self._keeper.lost_reason is not None:
                keeper = LeaseKeeper(self.client, self.ttl_s, on_lost=self._on_lease_lost, name="node registry")
                keeper.grant()
                self._keeper = keeper
            return self._keeper.lease_id

    def _on_lease_lost(self, reason: str) -> None:
        """Runs on the old keeper's thread: grant a new lease and publish every node again."""
        delays = self._backoff.delays()
        while not self._closed.is_set():
            try:
                with self._lock:
                    mine = list(self._mine.values())
                    for seg in mine:
                        self._put(seg)
                if mine:
                    log.warning("node registry: re-registered %s under a new lease after: %s",
                                [s.node_id for s in mine], reason)
                return
            except (EtcdError, NodeIdTakenError) as e:
                log.warning("node registry: re-registration failed (%s); retrying", e)
                self._closed.wait(next(delays))

    # -- nodes --------------------------------------------------------------------------------------
    def _put(self, segment: SegmentDescriptor) -> None:
        key = node_key(segment.node_id, self.prefix)
        lease = self._lease()
        value = segment.to_bytes()
        what = f"register node {segment.node_id!r}"
        for _ in range(3):  # the key may come and go between the two txns
            if self.client.txn([compare_create(key, 0)], [put_op(key, value, lease)], what=what).succeeded:
                return
            # the key exists: replace it only if it is ours (same lease)
            res = self.client.txn([compare_lease(key, lease)], [put_op(key, value, lease)], [range_op(key)],
                                  what=what)
            if res.succeeded:
                return
            if res.ranges and res.ranges[0]:
                raise NodeIdTakenError(f"node id {segment.node_id!r} is live under another registration (lease "
                                       f"{res.ranges[0][0].lease:x}) in etcd at {self.client.endpoint}")
        raise NodeIdTakenError(f"node id {segment.node_id!r} keeps being registered and withdrawn by another "
                               f"registration in etcd at {self.client.endpoint}")

    def register(self, segment: SegmentDescriptor) -> None:
        segment = _check_segment(segment)
        if self._closed.is_set():
            raise RegistryError("registry is closed")
        with self._lock:
            self._put(segment)
            self._mine[segment.node_id] = segment

    def unregister(self, node_id: str) -> bool:
        with self._lock:
            if self._mine.pop(node_id, None) is None or self._keeper is None:
                return False
            key = node_key(node_id, self.prefix)
            return self.client.txn([compare_lease(key, self._keeper.lease_id)], [delete_op(key)],
                                   what=f"unregister node {node_id!r}").succeeded

    def _list(self) -> tuple[list[SegmentDescriptor], int]:
        kvs, revision = self.client.get_prefix(self._nodes_prefix)
        segments = [seg for kv in kvs if (seg := _decode_or_none(kv.value, kv.key)) is not None]
        return sorted(segments, key=lambda s: s.node_id), revision

    def nodes(self) -> list[SegmentDescriptor]:
        return self._list()[0]

    def watch(self, callback: Callback, *, replay: bool = True) -> _EtcdMembershipWatch:
        handle = _EtcdMembershipWatch(self, callback, replay)
        with self._lock:
            self._watches.append(handle)
        return handle

    def _forget(self, handle: _EtcdMembershipWatch) -> None:
        with self._lock:
            if handle in self._watches:
                self._watches.remove(handle)

    def master(self) -> LeaderInfo | None:
        kv = self.client.get(self._master_key)
        return None if kv is None else LeaderInfo.decode(kv.value, kv.create_revision)

    def master_address(self) -> str | None:
        leader = self.master()
        return None if leader is None else leader.address

    def close(self, *, revoke: bool = True) -> None:
        """Stop; with ``revoke`` (default) this registry's nodes leave at once, else when the lease expires.
        The client is closed too when this registry made it."""
        self._closed.set()
        with self._lock:
            watches, self._watches = list(self._watches), []
            keeper, self._keeper = self._keeper, None
            self._mine.clear()
        for w in watches:
            w.cancel()
        if keeper is not None:
            keeper.stop(revoke=revoke)
        if self._owns_client:
            self.client.close()

    def __enter__(self) -> EtcdRegistry:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
