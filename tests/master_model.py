"""A plain-Python model of the master's semantics (dicts and lists; no allocator, no log).

Space is counted in allocation units per segment: the tests that drive this model use objects of
at most one unit (``alignment_bytes``), so a segment can take a replica exactly when it has a free
unit, whatever the allocator's fragmentation — the outcomes compared (success / error code, which
segments, replica counts and distinct nodes, what exists / is complete / is leased, what eviction
evicts) then do not depend on placement details. Every rule below restates one sentence of
``quillcache.master.service``'s docstring; nothing is imported from the package except the enums.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from quillcache.master import ErrorCode


@dataclass
class MObject:
    key: str
    size: int
    status: str  # "pending" | "complete"
    segments: list[int]
    put_id: int
    started: float
    completed: float = -math.inf
    lease_end: float = -math.inf
    last_access: float = -math.inf
    pin: int = 0  # 0 none, 1 soft, 2 hard
    soft_end: float = -math.inf
    digest: bytes | None = None


@dataclass
class MSegment:
    node: str
    units: int
    used: int = 0


@dataclass
class ModelMaster:
    unit: int
    lease_ttl: float = 10.0
    client_ttl: float = 10.0
    zombie_preempt: float = 30.0
    zombie_reclaim: float = 600.0
    soft_ttl: float = 1800.0
    high_watermark: float = 0.90
    evict_fraction: float = 0.05
    segments: dict[int, MSegment] = field(default_factory=dict)
    clients: dict[str, float] = field(default_factory=dict)  # node -> last seen
    objects: dict[str, MObject] = field(default_factory=dict)
    discarded: list[tuple[float, int]] = field(default_factory=list)  # (deadline, segment) of one unit each
    next_put_id: int = 1

    # ---------------------------------------------------------------- helpers
    @property
    def capacity(self) -> int:
        return sum(s.units for s in self.segments.values()) * self.unit

    @property
    def used(self) -> int:
        return sum(s.used for s in self.segments.values()) * self.unit

    def _free(self, seg: int) -> None:
        self.segments[seg].used -= 1

    def _drop(self, obj: MObject) -> None:
        for s in obj.segments:
            self._free(s)
        del self.objects[obj.key]

    def _drop_segments(self, segs: set[int]) -> None:
        for obj in list(self.objects.values()):
            obj.segments = [s for s in obj.segments if s not in segs]
            if not obj.segments:
                del self.objects[obj.key]
        self.discarded = [d for d in self.discarded if d[1] not in segs]
        for s in segs:
            del self.segments[s]

    def _place(self, n: int, preferred: int | None) -> list[int]:
        order = sorted(self.segments, key=lambda s: (-(self.segments[s].units - self.segments[s].used), s))
        if preferred in self.segments:
            order.remove(preferred)
            order.insert(0, preferred)
        chosen, nodes = [], set()
        for s in order:
            seg = self.segments[s]
            if len(chosen) == n:
                break
            if seg.node in nodes or seg.used >= seg.units:
                continue
            chosen.append(s)
            nodes.add(seg.node)
        return chosen

    def evict(self, now: float, target: int | None = None) -> list[str]:
        if target is None:
            target = math.ceil(self.evict_fraction * self.capacity)
        cands = [o for o in self.objects.values()
                 if o.status == "complete" and o.pin != 2 and now >= o.lease_end]
        first = sorted((o for o in cands if not (o.pin == 1 and now < o.soft_end)), key=lambda o: (o.last_access, o.key))
        second = sorted((o for o in cands if o.pin == 1 and now < o.soft_end), key=lambda o: (o.last_access, o.key))
        out, freed = [], 0
        for o in first + second:
            if freed >= target:
                break
            out.append(o.key)
            freed += self.unit * len(o.segments)
        for k in out:
            self._drop(self.objects[k])
        return out

    # ---------------------------------------------------------------- operations (outcome = value or ErrorCode)
    def mount(self, now: float, node: str, seg: int, units: int):
        if seg in self.segments:
            return ErrorCode.SEGMENT_ALREADY_EXISTS
        self.segments[seg] = MSegment(node, units)
        self.clients[node] = max(self.clients.get(node, -math.inf), now)
        return None

    def unmount(self, now: float, seg: int):
        if seg not in self.segments:
            return ErrorCode.SEGMENT_NOT_FOUND
        self._drop_segments({seg})
        return None

    def heartbeat(self, now: float, node: str):
        if node not in self.clients:
            return ErrorCode.NEED_REMOUNT
        self.clients[node] = now
        return None

    def put_start(self, now: float, key: str, size: int, n: int, preferred: int | None, pin: int,
                  digest: bytes | None):
        """``(segments, put_id, existing)`` or an ErrorCode."""
        obj = self.objects.get(key)
        if obj is not None:
            same = digest is not None and obj.digest == digest
            if obj.status == "complete" or now - obj.started < self.zombie_preempt:
                return (list(obj.segments), obj.put_id, True) if same else ErrorCode.OBJECT_ALREADY_EXISTS
        chosen = self._place(n, preferred)
        if not chosen and self.segments:
            self.evict(now)
            chosen = self._place(n, preferred)
        if not chosen:
            return ErrorCode.NO_SPACE
        if obj is not None:  # pre-empt a zombie: its units stay taken until its reclaim deadline
            self.discarded += [(obj.started + self.zombie_reclaim, s) for s in obj.segments]
            del self.objects[key]
        for s in chosen:
            self.segments[s].used += 1
        put_id = self.next_put_id
        self.next_put_id += 1
        self.objects[key] = MObject(key, size, "pending", chosen, put_id, now, last_access=now, pin=pin,
                                    soft_end=now + self.soft_ttl if pin == 1 else -math.inf, digest=digest)
        return (list(chosen), put_id, False)

    def put_end(self, now: float, key: str, put_id: int | None):
        obj = self.objects.get(key)
        if obj is None or (put_id is not None and put_id != obj.put_id):
            return ErrorCode.OBJECT_NOT_FOUND
        if obj.status == "complete":
            return ErrorCode.OBJECT_ALREADY_EXISTS
        obj.status = "complete"
        obj.completed = obj.last_access = now
        if obj.pin == 1:
            obj.soft_end = now + self.soft_ttl
        return None

    def put_revoke(self, now: float, key: str, put_id: int | None):
        obj = self.objects.get(key)
        if obj is None or (put_id is not None and put_id != obj.put_id):
            return ErrorCode.OBJECT_NOT_FOUND
        if obj.status == "complete":
            return ErrorCode.INVALID_PARAMS
        self._drop(obj)
        return None

    def get(self, now: float, keys: list[str]) -> list:
        out = []
        for k in keys:
            obj = self.objects.get(k)
            if obj is None:
                out.append(ErrorCode.OBJECT_NOT_FOUND)
            elif obj.status != "complete":
                out.append(ErrorCode.OBJECT_NOT_READY)
            else:
                obj.lease_end = max(obj.lease_end, now + self.lease_ttl)
                obj.last_access = now
                out.append(list(obj.segments))
        return out

    def exists(self, keys: list[str]) -> list[bool]:
        return [k in self.objects and self.objects[k].status == "complete" for k in keys]

    def remove(self, now: float, key: str, force: bool):
        obj = self.objects.get(key)
        if obj is None:
            return ErrorCode.OBJECT_NOT_FOUND
        if obj.status != "complete":
            return ErrorCode.OBJECT_NOT_READY
        if not force and now < obj.lease_end:
            return ErrorCode.LEASE_HELD
        self._drop(obj)
        return None

    def tick(self, now: float) -> tuple[list[str], list[str], list[str]]:
        """(expired clients, reclaimed pending keys, evicted keys)."""
        expired = sorted(c for c, seen in self.clients.items() if now - seen > self.client_ttl)
        for c in expired:
            self._drop_segments({s for s, seg in self.segments.items() if seg.node == c})
            del self.clients[c]
        for deadline, s in [d for d in self.discarded if d[0] <= now]:
            self._free(s)
        self.discarded = [d for d in self.discarded if d[0] > now]
        reclaimed = sorted(k for k, o in self.objects.items()
                           if o.status == "pending" and o.started + self.zombie_reclaim <= now)
        for k in reclaimed:
            self._drop(self.objects[k])
        evicted = []
        if self.capacity and self.used > self.high_watermark * self.capacity:
            evicted = self.evict(now)
        return expired, reclaimed, evicted

    def restart(self, now: float) -> None:
        """Soft state after a restart: leases for one TTL, last access = completion, clients seen now."""
        for obj in self.objects.values():
            if obj.status == "complete":
                obj.lease_end = now + self.lease_ttl
                obj.last_access = obj.completed
        for c in self.clients:
            self.clients[c] = now
