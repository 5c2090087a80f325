"""``TransferEngine``: register regions, open peers' segments, submit batches of one-sided READ/WRITE.

``TransferEngine(backend="tcp", **backend_options)`` starts the backend (for ``tcp``: a server on
``host:port`` answering authenticated peers, and a client pool). Then:
``register_region(buffer)`` / ``register_store(store)`` → ``RegionDescriptor``s (nothing copied);
``open_segment("host:port")`` → ``SegmentInfo`` (the peer's regions); ``submit([TransferRequest,
…], timeout_s=…)`` → a ``TransferBatch`` handle; ``status(batch)``/``wait(batch, timeout_s)`` → one
``RequestStatus`` per request; ``transfer_sync`` and ``read``/``write`` as synchronous conveniences.

Invariants:
- A request whose local or remote range is invalid (checked against this engine's regions and the
  peer's advertised regions) ends FAILED at submit with the reason and is never sent; the peer
  re-checks every range anyway.
- A batch's requests to one peer are spread over at most ``backend.lanes(peer)`` concurrent lanes
  (connections), each carrying many requests in flight; ``transfer_sync`` runs one lane on the
  calling thread, so a single synchronous request crosses no thread.
- At most ``max_inflight_requests`` requests are in flight per engine; a submit past that raises
  ``TransferError`` (bounded memory), nothing of it started.
- ``close`` stops the backend (serving and connections) and the I/O threads; it is idempotent. A
  batch submitted while ``close`` runs ends every request it could not start FAILED.
- A request that ended FAILED or TIMEOUT leaves its destination range undefined: a failed READ's
  local range may hold part of the data or the peer's reason; a failed WRITE's remote range may hold
  part of its bytes, and more of them may still land there LATER -- even after a later WRITE to the
  same range was acknowledged -- until the peer has read or dropped the abandoned connection (it is
  closed with a reset, which discards what this side had not sent, but not what the peer already
  received). Nothing orders it against later requests: a caller that must know what the range holds
  verifies it (the pool verifies every value by its key when it reads it back).
- An engine whose backend serves at a fixed address (``backend.fixed_address``: the ``tcp`` and
  ``rdma`` backends given a port; peers name its regions by id) numbers its regions from a random
  id drawn per engine (``RegionTable.start_ids_at``), so a region id a peer kept from an EARLIER
  process at that address names no region here: its transfer is refused (``no region N``) instead of
  landing in memory this process hands out. ``random_region_ids=True`` does the same on any backend (a
  pool node, whose port the kernel may hand to a later process); otherwise ids count up from 1.
"""

from __future__ import annotations

import itertools
import math
import os
import random
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from quillcache._checks import check_float, check_int
from quillcache.registry import Registry
from quillcache.transfer.backends.base import Backend
from quillcache.transfer.backends.local import LocalBackend
from quillcache.transfer.backends.tcp import TcpBackend
from quillcache.transfer.batch import Item, TransferBatch
from quillcache.transfer.regions import RegionTable
from quillcache.transfer.types import (
    Op,
    Outcome,
    RegionDescriptor,
    RegionError,
    RequestStatus,
    SegmentInfo,
    TransferError,
    TransferRequest,
)

__all__ = ["BACKENDS", "SECRET_ENV", "TransferEngine"]

BACKENDS: Registry[type] = Registry("transfer backend")
BACKENDS.register("local", LocalBackend)
BACKENDS.register("tcp", TcpBackend)
BACKENDS.register_lazy("rdma", "quillcache.transfer.backends.rdma:RdmaBackend")

SECRET_ENV = "QUILLCACHE_TRANSFER_SECRET"
DEFAULT_TIMEOUT_S = 30.0
FIRST_REGION_ID_MAX = 1 << 31  # a random first region id lies in [1, this]: room for 2**31 more regions


class TransferEngine:
    def __init__(self, backend: str = "tcp", *, io_threads: int = 4, max_inflight_requests: int = 1 << 16,
                 default_timeout_s: float = DEFAULT_TIMEOUT_S, random_region_ids: bool | None = None,
                 **backend_options: object) -> None:
        BACKENDS.check(backend)
        io_threads = check_int("io_threads", io_threads, 1, 256)
        self.max_inflight_requests = check_int("max_inflight_requests", max_inflight_requests, 1)
        self.default_timeout_s = check_float("default_timeout_s", default_timeout_s, 0, lo_open=True)
        if backend in ("tcp", "rdma") and backend_options.get("secret") is None:
            env = os.environ.get(SECRET_ENV)
            if not env:
                raise ValueError(f"the {backend} backend needs the cluster's shared secret: pass secret=... or set {SECRET_ENV}")
            backend_options["secret"] = env
        self.regions = RegionTable()
        self.backend: Backend = BACKENDS.create(backend, **backend_options)  # type: ignore[assignment]
        if random_region_ids is None:
            random_region_ids = getattr(self.backend, "fixed_address", False)
        if random_region_ids:  # a stale peer's region id names none here (module docstring)
            self.regions.start_ids_at(random.SystemRandom().randint(1, FIRST_REGION_ID_MAX))
        self.backend_name = backend
        self.address = self.backend.start(self.regions)
        self._transfer_one = getattr(self.backend, "transfer_one", None)
        self._segments: dict[int, SegmentInfo] = {}
        self._segment_ids = itertools.count(1)
        self._io = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="qc-transfer-io")
        self._inflight = 0
        self._lock = threading.Lock()
        self._closed = False

    # ---- regions ----------------------------------------------------------------------------------------------

    def register_region(self, buffer: object, *, name: str = "", writable: bool | None = None) -> RegionDescriptor:
        """Serve ``buffer`` (any writable or read-only buffer) to peers and use it locally; nothing copied."""
        self._check_open()
        return self.regions.register(buffer, name=name, writable=writable)

    def register_store(self, store: object, *, prefix: str = "dram") -> list[RegionDescriptor]:
        """Register every segment of a ``LocalKvStore`` as a region named ``{prefix}-{segment id}``."""
        from quillcache.store.dram import LocalKvStore

        if not isinstance(store, LocalKvStore):
            raise TypeError(f"register_store takes a LocalKvStore, got {type(store).__name__}")
        return [self.register_region(store.segment_view(i), name=f"{prefix}-{i}")
                for i in range(store.num_segments)]

    def unregister_region(self, region: RegionDescriptor | int, *, timeout_s: float = 30.0) -> None:
        self.regions.unregister(region, timeout_s=timeout_s)

    # ---- segments ---------------------------------------------------------------------------------------------

    def open_segment(self, address: str, *, timeout_s: float = 5.0) -> SegmentInfo:
        """Reach the peer at ``address`` and learn the regions it serves (re-opening refreshes them)."""
        self._check_open()
        if not isinstance(address, str) or not address:
            raise ValueError(f"a segment address must be a non-empty str, got {address!r}")
        try:
            regions = self.backend.open_segment(address, timeout_s)
        except TransferError:
            raise
        except OSError as e:  # unreachable, refused, stalled: one error type for callers
            raise TransferError(f"cannot open the segment at {address}: {e or type(e).__name__}") from e
        with self._lock:
            for seg in self._segments.values():
                if seg.address == address:
                    seg = SegmentInfo(seg.segment_id, address, regions)
                    self._segments[seg.segment_id] = seg
                    return seg
            seg = SegmentInfo(next(self._segment_ids), address, regions)
            self._segments[seg.segment_id] = seg
            return seg

    def segment(self, segment_id: int) -> SegmentInfo:
        with self._lock:
            seg = self._segments.get(segment_id)
        if seg is None:
            raise RegionError(f"segment {segment_id} is not open")
        return seg

    # ---- transfers --------------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError("the transfer engine is closed")

    def _validate(self, req: object) -> TransferRequest:
        if (type(req) is TransferRequest and type(req.op) is Op and type(req.local_region) is int
                and type(req.local_offset_bytes) is int and type(req.segment) is int
                and type(req.remote_region) is int and type(req.remote_offset_bytes) is int
                and type(req.length_bytes) is int and req.local_offset_bytes >= 0 and req.remote_offset_bytes >= 0
                and req.length_bytes >= 1 and req.local_region >= 0 and req.remote_region >= 0):
            return req  # the common case, checked without a call per field
        if not isinstance(req, TransferRequest):
            raise TypeError(f"a batch holds TransferRequest objects, got {type(req).__name__}")
        if not isinstance(req.op, Op):
            raise TypeError(f"TransferRequest.op must be an Op, got {req.op!r}")
        for name in ("local_region", "local_offset_bytes", "segment", "remote_region", "remote_offset_bytes"):
            check_int(f"TransferRequest.{name}", getattr(req, name), 0)
        check_int("TransferRequest.length_bytes", req.length_bytes, 1)
        return req

    def _timeout_s(self, timeout_s: float | None) -> float:
        if timeout_s is None:
            return self.default_timeout_s
        if type(timeout_s) is float and 0.0 < timeout_s < math.inf:
            return timeout_s
        return check_float("timeout_s", timeout_s, 0, lo_open=True)

    def _reserve(self, n: int) -> None:
        """Count ``n`` more requests in flight, or refuse them all (``TransferError``) past the bound."""
        with self._lock:
            if self._inflight + n > self.max_inflight_requests:
                raise TransferError(f"{self._inflight} requests in flight; {n} more would pass the "
                                    f"limit of {self.max_inflight_requests}")
            self._inflight += n

    def _remote(self, segment_id: int, region_id: int, offset: int, length: int, op: Op) -> SegmentInfo:
        """The open segment a request targets, after checking its range against the peer's advertised region
        (``RegionError`` naming the range otherwise); the peer re-checks every range anyway."""
        seg = self._segments.get(segment_id)
        if seg is None:
            raise RegionError(f"segment {segment_id} is not open")
        remote = seg.region(region_id)
        if offset + length > remote.length_bytes:
            raise RegionError(f"remote range [{offset}, {offset + length}) lies outside region {region_id} "
                              f"of {remote.length_bytes} bytes at {seg.address}")
        if op is Op.WRITE and not remote.writable:
            raise RegionError(f"remote region {region_id} at {seg.address} is read-only")
        return seg

    def _release_for(self, batch_requests: tuple[TransferRequest, ...], held: list[bool]):
        def release(index: int) -> None:
            if held[index]:
                held[index] = False
                self.regions.release(batch_requests[index].local_region)
            with self._lock:
                self._inflight -= 1
        return release

    def _prepare(self, requests: Sequence[TransferRequest], timeout_s: float | None
                 ) -> tuple[TransferBatch, dict[str, list[Item]]]:
        self._check_open()
        reqs = tuple(self._validate(r) for r in requests)
        timeout_s = self._timeout_s(timeout_s)
        self._reserve(len(reqs))
        held = [False] * len(reqs)
        batch = TransferBatch(reqs, self._release_for(reqs, held))
        deadline = batch.submitted_at_s + timeout_s
        by_peer: dict[str, list[Item]] = {}
        for i, req in enumerate(reqs):
            try:
                seg = self._remote(req.segment, req.remote_region, req.remote_offset_bytes, req.length_bytes, req.op)
                view = self.regions.checkout(req.local_region, req.local_offset_bytes, req.length_bytes,
                                             write=req.op is Op.READ)
            except RegionError as e:
                batch.finish(i, Outcome.FAILED, str(e))
                continue
            held[i] = True
            by_peer.setdefault(seg.address, []).append(Item(batch, i, req, view, deadline))
        return batch, by_peer

    def _lanes(self, address: str, items: list[Item]) -> list[list[Item]]:
        """Split one peer's items into contiguous lanes of similar byte counts."""
        if len(items) == 1:
            return [items]
        total = sum(it.request.length_bytes for it in items)
        min_bytes = getattr(getattr(self.backend, "config", None), "lane_min_bytes", 1)
        n = max(1, min(self.backend.lanes(address), len(items), total // max(1, min_bytes)))
        if n == 1:
            return [items]
        lanes: list[list[Item]] = [[] for _ in range(n)]
        share, acc, lane = total / n, 0, 0
        for it in items:
            if acc >= share * (lane + 1) and lane < n - 1:
                lane += 1
            lanes[lane].append(it)
            acc += it.request.length_bytes
        return [ln for ln in lanes if ln]

    def _run(self, address: str, items: list[Item]) -> None:
        try:
            self.backend.execute(address, items)
        except BaseException as e:  # a backend bug must not leave requests pending forever
            for it in items:
                it.finish(Outcome.FAILED, f"backend {self.backend_name} failed: {type(e).__name__}: {e}")
            if not isinstance(e, Exception):
                raise

    def _start(self, address: str, lane: list[Item]) -> None:
        """Run ``lane`` on an I/O thread; once ``close`` has stopped them (it ran since ``_prepare`` checked),
        its requests end FAILED at once, so none stays pending, counted in flight or holding its range."""
        try:
            self._io.submit(self._run, address, lane)
        except RuntimeError:  # "cannot schedule new futures after shutdown"
            if not self._closed:
                raise
            for it in lane:
                it.finish(Outcome.FAILED, "the transfer engine was closed before the request was sent")

    def submit(self, requests: Sequence[TransferRequest], *, timeout_s: float | None = None) -> TransferBatch:
        """Start ``requests`` and return at once; each ends by ``timeout_s`` (default ``default_timeout_s``).
        A ``close`` racing this submit ends the requests it has not started FAILED (never left pending)."""
        batch, by_peer = self._prepare(requests, timeout_s)
        for address, items in by_peer.items():
            for lane in self._lanes(address, items):
                self._start(address, lane)
        return batch

    def transfer_sync(self, requests: Sequence[TransferRequest], *, timeout_s: float | None = None
                      ) -> list[RequestStatus]:
        """Run ``requests`` to completion (first lane on this thread) and return their statuses."""
        return self.run_sync(requests, timeout_s=timeout_s).wait()

    def run_sync(self, requests: Sequence[TransferRequest], *, timeout_s: float | None = None) -> TransferBatch:
        """``transfer_sync`` returning the finished batch itself (for its per-request latencies)."""
        batch, by_peer = self._prepare(requests, timeout_s)
        if len(by_peer) == 1 and len(batch.requests) == 1:  # one request: straight through on this thread
            for address, items in by_peer.items():
                self._run(address, items)
        else:
            lanes = [(address, lane) for address, items in by_peer.items() for lane in self._lanes(address, items)]
            for address, lane in lanes[1:]:
                self._start(address, lane)
            if lanes:
                self._run(*lanes[0])
        if not batch.done:
            batch.wait()
        return batch

    def status(self, batch: TransferBatch) -> list[RequestStatus]:
        return batch.statuses()

    def wait(self, batch: TransferBatch, timeout_s: float | None = None) -> list[RequestStatus]:
        return batch.wait(timeout_s)

    def _one(self, op: Op, local: RegionDescriptor | int, local_offset_bytes: int, segment: SegmentInfo | int,
             remote_region: int, remote_offset_bytes: int, length_bytes: int, timeout_s: float | None) -> None:
        local_id = local.region_id if type(local) is RegionDescriptor else local
        segment_id = segment.segment_id if type(segment) is SegmentInfo else segment
        one = self._transfer_one
        if one is not None:  # the backend's lean path: no batch, no status objects
            if self._closed:
                raise TransferError("the transfer engine is closed")
            if not (type(local_id) is int and type(segment_id) is int and type(remote_region) is int
                    and type(local_offset_bytes) is int and type(remote_offset_bytes) is int
                    and type(length_bytes) is int and local_offset_bytes >= 0 and remote_offset_bytes >= 0
                    and length_bytes >= 1):
                self._validate(TransferRequest(op, local_id, local_offset_bytes, segment_id, remote_region,
                                               remote_offset_bytes, length_bytes))  # raises, naming the field
            deadline = time.monotonic() + self._timeout_s(timeout_s)
            seg = self._remote(segment_id, remote_region, remote_offset_bytes, length_bytes, op)
            self._reserve(1)
            try:
                view = self.regions.checkout(local_id, local_offset_bytes, length_bytes, write=op is Op.READ)
                try:
                    one(seg.address, op, view, remote_region, remote_offset_bytes, length_bytes, deadline)
                finally:
                    self.regions.release(local_id)
            finally:
                with self._lock:
                    self._inflight -= 1
            return
        req = TransferRequest(op, local_id, local_offset_bytes, segment_id, remote_region, remote_offset_bytes,
                              length_bytes)
        (st,) = self.transfer_sync([req], timeout_s=timeout_s)
        if st.outcome is not Outcome.COMPLETED:
            raise TransferError(f"{op.name} of {length_bytes} bytes {st.outcome.value}: {st.reason}")

    def read(self, local: RegionDescriptor | int, local_offset_bytes: int, segment: SegmentInfo | int,
             remote_region: int, remote_offset_bytes: int, length_bytes: int, *, timeout_s: float | None = None
             ) -> None:
        """Synchronous READ of one range on the calling thread; raises ``TransferError`` (or
        ``TransferTimeoutError``, ``RegionError``) with the reason unless every byte landed. After a
        failed READ the destination range holds undefined bytes (part of the data, or the peer's reason)."""
        self._one(Op.READ, local, local_offset_bytes, segment, remote_region, remote_offset_bytes, length_bytes,
                  timeout_s)

    def write(self, local: RegionDescriptor | int, local_offset_bytes: int, segment: SegmentInfo | int,
              remote_region: int, remote_offset_bytes: int, length_bytes: int, *, timeout_s: float | None = None
              ) -> None:
        """Synchronous WRITE of one range, returning once the peer acknowledged the bytes in its memory; raises
        like ``read`` otherwise. After a failed or timed-out WRITE the remote range is undefined, and bytes of
        it may still land there later (after a later WRITE to that range completed) until the peer has read or
        dropped the abandoned connection; a caller that needs to know verifies the range (as the pool does by
        key; module docstring)."""
        self._one(Op.WRITE, local, local_offset_bytes, segment, remote_region, remote_offset_bytes, length_bytes,
                  timeout_s)

    @property
    def inflight_requests(self) -> int:
        return self._inflight

    # ---- lifetime ---------------------------------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._io.shutdown(wait=True, cancel_futures=False)
        self.backend.close()
        self.regions.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "TransferEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"TransferEngine({self.backend_name}, address={self.address!r}, {len(self.regions)} regions, "
                f"{len(self._segments)} segments open{', closed' if self._closed else ''})")
