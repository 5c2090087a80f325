"""Gateway replicas share their routing-time speculation, so every replica attributes engine events alike.

Every replica subscribes to every engine's KV events, so confirmed state would converge by itself -
except that a stored ROOT block is attributed to a scope only through a pending speculation (see
:mod:`.residency`), and a speculation lives in the replica that routed the request. ``PeerLink``
closes that gap: each replica PUBlishes its speculations (and their retractions) on ``bind``, and
SUBscribes to every address in ``peers``; a peer's speculation enters this replica's tracker as if
routed here (pending, with the same TTL, confirmed by the same engine event), so both replicas hold
the same entries and route the next turn of a conversation alike.

Wire format (one ZeroMQ frame, msgpack): ``[kind, engine, digest, hashes]`` where ``kind`` is
``"s"`` (speculate) or ``"r"`` (retract), ``digest`` the 16-byte scope digest and ``hashes`` the
block hashes as little-endian u64 bytes. A frame that does not decode to exactly that, or names an
engine this replica does not route to, is counted and dropped (a peer can never crash the link).

Invariants: the tracker is touched only on the event loop (the SUB thread hands every message over
with ``call_soon_threadsafe``); a retraction from a peer removes only entries that peer's
speculation created and that no event confirmed. Ordering between a peer's message and the
engine's event is not guaranteed: an event that arrives first finds no speculation and the block
stays unattributed here (never mis-attributed), so the replicas may differ by such blocks.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass

import msgpack
import numpy as np
import zmq

from quillcache.gateway.residency import ResidencyTracker

__all__ = ["PeerLink", "PeerStats"]

log = logging.getLogger(__name__)
_DIGEST_BYTES = 16
_MAX_FRAME_BYTES = 1 << 20


@dataclass(slots=True)
class PeerStats:
    sent: int = 0
    received: int = 0
    malformed: int = 0
    send_dropped: int = 0  # the PUB queue was full (a slow peer): that speculation is not shared


class PeerLink:
    def __init__(self, tracker: ResidencyTracker, loop: asyncio.AbstractEventLoop, *, bind: str,
                 peers: tuple[str, ...] = ()) -> None:
        self.tracker = tracker
        self.loop = loop
        self.stats = PeerStats()
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self._pub.bind(bind[:-2] + ":*" if bind.startswith("tcp://") and bind.endswith(":0") else bind)
        self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.peers = tuple(peers)
        self._remote: dict[tuple[str, int, bytes], object] = {}
        self._running = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- outgoing (event loop) ---------------------------------------------------------------
    def _send(self, kind: str, engine: str, digest: bytes, hashes) -> None:
        arr = np.ascontiguousarray(hashes, dtype="<u8")
        try:
            self._pub.send(msgpack.packb([kind, engine, digest, arr.tobytes()]), zmq.NOBLOCK)
            self.stats.sent += 1
        except zmq.Again:
            self.stats.send_dropped += 1

    def speculated(self, engine: str, digest: bytes, hashes) -> None:
        if len(hashes):
            self._send("s", engine, digest, hashes)

    def retracted(self, engine: str, digest: bytes, hashes) -> None:
        if len(hashes):
            self._send("r", engine, digest, hashes)

    # ---- incoming (SUB thread -> event loop) -------------------------------------------------
    def start(self) -> PeerLink:
        self._running.set()
        self._thread = threading.Thread(target=self._run, name="gateway-peers", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.MAXMSGSIZE, _MAX_FRAME_BYTES)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        for p in self.peers:
            sub.connect(p)
        try:
            while self._running.is_set():
                if not sub.poll(50):
                    continue
                frames = sub.recv_multipart(zmq.NOBLOCK)
                msg = self._decode(frames)
                if msg is None:
                    self.stats.malformed += 1
                    continue
                try:
                    self.loop.call_soon_threadsafe(self._apply, *msg)
                except RuntimeError:  # loop closed: shutting down
                    return
        except zmq.ZMQError as exc:
            if self._running.is_set():
                log.warning("peer link stopped: %s", exc)
        finally:
            sub.close(0)

    def _decode(self, frames: list[bytes]):
        if len(frames) != 1:
            return None
        try:
            msg = msgpack.unpackb(frames[0], raw=False)
        except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, RecursionError):
            return None
        if not (isinstance(msg, list) and len(msg) == 4 and msg[0] in ("s", "r") and isinstance(msg[1], str)
                and isinstance(msg[2], bytes) and len(msg[2]) == _DIGEST_BYTES and isinstance(msg[3], bytes)
                and len(msg[3]) % 8 == 0 and msg[1] in self.tracker.modes):
            return None
        return msg[0], msg[1], msg[2], np.frombuffer(msg[3], dtype="<u8").astype(np.uint64)

    def _apply(self, kind: str, engine: str, digest: bytes, hashes: np.ndarray) -> None:
        self.stats.received += 1
        if kind == "s":
            for rec in self.tracker.speculate(engine, hashes, [digest] * len(hashes)):
                self._remote[(engine, rec.h, digest)] = rec
        else:
            recs = [r for r in (self._remote.pop((engine, int(h), digest), None) for h in hashes) if r is not None]
            self.tracker.retract(recs)
        if len(self._remote) > 1_000_000:  # entries long confirmed or expired: forget the oldest half
            for k in list(self._remote)[: len(self._remote) // 2]:
                del self._remote[k]

    def close(self) -> None:
        self._running.clear()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None
        self._pub.close(0)
