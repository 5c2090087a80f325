"""Replica placement for a batch of puts: the segment order computed once per batch, kept as space is taken.

Rule (the master's, see :mod:`.service`): up to ``replica_num`` replicas on DISTINCT nodes, best effort;
the preferred segment (if mounted) first, then segments by most free bytes, ties by segment id; a segment
with fewer free bytes than the request, or whose allocator cannot fit it (fragmentation), is skipped.

:class:`BatchPlacer` applies that rule to one put after another without sorting the segments per put:
it keeps ``order``, the sorted list of ``(-free_bytes, segment_id)``, and its own ``free`` per segment
(the state's free bytes minus what this batch allocated and has not yet recorded), and moves a segment
to its new place after each allocation. Invariant: ``order == sorted((-free[s], s) for s in segments)``.
Anything else that changes free space (an eviction in the middle of the batch, once the batch's puts
so far are recorded) calls ``reset``. The allocations are real: a placed replica's range is live in its
segment's allocator (and its handle stored) when ``place`` returns.
"""

from __future__ import annotations

from bisect import insort

from quillcache.alloc import OutOfSpaceError

__all__ = ["BatchPlacer"]


class BatchPlacer:
    """Places the puts of one batch on ``segments`` (``segment_id -> SegmentRecord``; module docstring)."""

    __slots__ = ("segments", "order", "free")

    def __init__(self, segments: dict) -> None:
        self.segments = segments
        self.reset()

    def reset(self) -> None:
        """Recompute the order from the segments' recorded free bytes."""
        self.free = {sid: seg.free_bytes for sid, seg in self.segments.items()}
        self.order = sorted((-f, sid) for sid, f in self.free.items())

    def _take(self, sid: int, alloc: int) -> int | None:
        """Allocate ``alloc`` bytes on segment ``sid`` (its free bytes already checked); the offset or None."""
        seg = self.segments[sid]
        if seg.alloc is None:
            return None
        try:
            off, _, handle = seg.alloc.allocate(alloc)
        except OutOfSpaceError:
            return None
        seg.handles.fresh[off] = handle
        return off

    def _moved(self, sid: int, alloc: int) -> None:
        """Segment ``sid`` has ``alloc`` fewer free bytes: move it to its place in ``order``."""
        order = self.order
        old = self.free[sid]
        new = old - alloc
        self.free[sid] = new
        if order[0][1] == sid and (len(order) == 1 or (-new, sid) <= order[1]):
            order[0] = (-new, sid)  # still first (the common case: one segment takes a run of puts)
            return
        order.remove((-old, sid))
        insort(order, (-new, sid))

    def place_one(self, alloc: int) -> tuple[int, int] | None:
        """One replica, no preferred segment: ``(segment_id, offset)`` or None (``place`` then decides)."""
        order = self.order
        if not order:
            return None
        neg_free, sid = order[0]
        if -neg_free < alloc:
            return None
        seg = self.segments[sid]
        if seg.alloc is None:
            return None
        try:
            off, _, handle = seg.alloc.allocate(alloc)
        except OutOfSpaceError:
            return None
        seg.handles.fresh[off] = handle
        new = alloc + neg_free
        if len(order) == 1 or (new, sid) <= order[1]:  # still first (the common case): order[0] = (-free, sid)
            order[0] = (new, sid)
            self.free[sid] = -new
        else:
            self._moved(sid, alloc)
        return sid, off

    def place(self, alloc: int, replica_num: int, preferred: int | None) -> list[tuple[int, int]]:
        """Up to ``replica_num`` replicas (module docstring), allocated; ``[]`` when none fits."""
        if replica_num == 1 and preferred is None:
            one = self.place_one(alloc)
            if one is not None:
                return [one]
        sids = [sid for _, sid in self.order]
        if preferred is not None and preferred in self.free:
            sids.remove(preferred)
            sids.insert(0, preferred)
        segs, free = self.segments, self.free
        placed: list[tuple[int, int]] = []
        nodes: set[str] = set()
        for sid in sids:
            if len(placed) == replica_num:
                break
            node = segs[sid].desc.node_id
            if node in nodes or free[sid] < alloc:
                continue
            off = self._take(sid, alloc)
            if off is not None:
                placed.append((sid, off))
                nodes.add(node)
        for sid, _ in placed:
            self._moved(sid, alloc)
        return placed
