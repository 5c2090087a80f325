"""Gateway replicas share their routing-time speculation, so every replica attributes engine events alike.

Every replica subscribes to every engine's KV events, so confirmed state would converge by itself -
except that a stored ROOT block is attributed to a scope only through a pending speculation (see
:mod:`.residency`), and a speculation lives in the replica that routed the request. ``PeerLink``
closes that gap: each replica PUBlishes its requests' claims with their speculations, their
retractions and their ends on ``bind``, and SUBscribes to every address in ``peers``; a peer's
speculation enters this replica's tracker as if routed here (pending, with the same TTL, confirmed
by the same engine event), so both replicas hold the same entries and route the next turn of a
conversation alike. A peer's CLAIM (:meth:`.ResidencyTracker.claim`) on an events engine (including
the request's reused blocks) enters it too and stays open
until that peer says its request ended (``"e"``, sent when its tracker first sees the lease
released) or for at most ``claim_max_s`` (a lost ``"e"``, a peer gone): so a speculation of that
request that expired here by TTL, or was retracted, still keeps its store from being credited to
another scope here, exactly as in the replica that routed it.

Wire format (one ZeroMQ frame, msgpack): ``[kind, origin, engine, digest, hashes, cid, n_reused,
n_spec, first]``: ``kind`` ``"p"`` (a request's whole prompt ``hashes``: its first ``n_reused``
blocks were found on the engine by the sender's plan, and it speculated the next ``n_spec``;
``first``: the leading tokens of its first block (all but its last) as little-endian u64 bytes when
it reused nothing - the whole prompt for a prompt with no full block, whose claim is a short claim,
:meth:`.ResidencyTracker.claim_short`), ``"r"`` (retract the speculation of claim ``cid``) or
``"e"`` (claim ``cid``'s request ended); ``origin`` the sender's 8 random bytes (claim ids are per
sender), ``digest`` the 16-byte scope digest, ``hashes`` the chain hashes as little-endian u64 bytes
(``hashes`` and ``first`` are empty for ``"r"``/``"e"``; repeats are dropped by the claim). The
receiver decides what the request claims from its OWN confirmed entries
(:meth:`.ResidencyTracker.claim_prompt`, as the sender did from its own): the reused blocks it does
not see confirmed are claimed too, so a replica whose view lags the sender's (it resynced after a
replay gap) still refuses another scope the store of a reused block the engine evicted and
recomputes. (Frames of earlier formats - 9-field ``"c"`` frames, which carried only the blocks the
sender claimed, and 8-field ``"p"`` frames, without ``first`` - are refused as malformed.) A frame that
does not decode to exactly that, or names an engine this replica does not route to, is counted and
dropped (a peer can never crash the link).

Memory: a peer's claim on an ``approximate`` engine (nothing is attributed there, and no ``"e"`` is
ever sent for it) enters this tracker as speculation only; just its entries are kept, for a
retraction. What is kept per peer claim for ``"r"``/``"e"`` is bounded by the total number of hashes
(``_MAX_REMOTE_HASHES``: its claimed and weakly held chain hashes and its entries, counting each
claim as one more; about 0.15 GiB with approximate engines' entries; the tracker empties a claim when
its sweep unindexes it): past it the oldest are forgotten (an events engine's claim then stays open here until
``claim_max_s``: the safe side).

Invariants: the tracker is touched only on the event loop (the SUB thread hands every message over
with ``call_soon_threadsafe``); a retraction from a peer removes only entries that peer's
speculation created and that no event confirmed. Ordering between a peer's message and the
engine's event is NOT guaranteed (nor is delivery: a full PUB queue drops, counted in
``send_dropped``): an engine event that overtakes the claim of the request that caused it finds
no claim here; if another scope is pending here on that chain hash alone, the store is credited
to it (the replica that routed the request refuses it). The claim is published when the request's
speculation is recorded, right after its bytes left, so such an overtaking needs the peer link to
lag the engine's whole prefill plus its event path; closing it fully needs per-peer watermarks.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import msgpack
import numpy as np
import zmq

from quillcache.gateway.residency import Claim, ResidencyTracker

__all__ = ["PeerLink", "PeerStats"]

log = logging.getLogger(__name__)
_DIGEST_BYTES = 16
_MAX_FRAME_BYTES = 1 << 20
_ORIGIN_BYTES = 8
_MAX_FIRST_BYTES = 8 << 12  # a first block of at most 4,096 tokens
_MAX_REMOTE_HASHES = 1 << 20  # kept for peers' claims (hashes + entries + 1 each): the oldest forgotten past this


@dataclass(slots=True)
class PeerStats:
    sent: int = 0
    received: int = 0
    malformed: int = 0
    send_dropped: int = 0  # the PUB queue was full (a slow peer): that speculation is not shared


class PeerLink:
    def __init__(self, tracker: ResidencyTracker, loop: asyncio.AbstractEventLoop, *, bind: str,
                 peers: tuple[str, ...] = (), claim_max_s: float = 900.0) -> None:
        """``claim_max_s``: how long a peer's claim stays open without its end message."""
        if not claim_max_s > 0:
            raise ValueError(f"claim_max_s must be > 0, got {claim_max_s!r}")
        self.tracker = tracker
        self.loop = loop
        self.claim_max_s = float(claim_max_s)
        self.origin = os.urandom(_ORIGIN_BYTES)
        self.stats = PeerStats()
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        try:
            self._pub.bind(bind[:-2] + ":*" if bind.startswith("tcp://") and bind.endswith(":0") else bind)
        except BaseException:  # the address is taken or malformed: the socket is not left open
            self._pub.close(0)
            raise
        self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.peers = tuple(peers)
        # (origin, cid) -> a peer's claim (None on an approximate engine), the entries its speculation created
        # here, and its size (hashes + entries + 1); oldest first, ``_remote_size`` in all (module doc)
        self._remote: OrderedDict[tuple[bytes, int], tuple[Claim | None, list, int]] = OrderedDict()
        self._remote_size = 0
        self._apply_kind: dict[str, Callable[..., None]] = {
            "p": self._apply_claim, "r": self._apply_retract, "e": self._apply_end}
        self._running = threading.Event()
        self._thread: threading.Thread | None = None
        tracker.on_claim_end = self._claim_ended

    # ---- outgoing (event loop) ---------------------------------------------------------------
    def _send(self, kind: str, c: Claim, hashes: bytes = b"", n_reused: int = 0, n_spec: int = 0,
              first: bytes = b"") -> None:
        try:
            self._pub.send(msgpack.packb([kind, self.origin, c.engine, c.digest, hashes, c.cid, n_reused, n_spec,
                                          first]), zmq.NOBLOCK)
            self.stats.sent += 1
        except zmq.Again:
            self.stats.send_dropped += 1

    def claimed(self, c: Claim, prompt, n_reused: int, n_spec: int, first=()) -> None:
        """A request routed here made claim ``c``: ``prompt`` is its whole prompt's chain hashes, of which
        the plan found the first ``n_reused`` on ``c.engine`` and the speculation covers the next
        ``n_spec``; ``first``: its first block's tokens when it reused nothing (module doc)."""
        if len(prompt) or len(first):
            self._send("p", c, np.ascontiguousarray(prompt, dtype="<u8").tobytes(), n_reused, n_spec,
                       np.ascontiguousarray(first, dtype="<u8").tobytes())

    def retracted(self, c: Claim) -> None:
        self._send("r", c)

    def _claim_ended(self, c: Claim) -> None:
        """The tracker saw a local request's lease released (its sweep, on the event loop)."""
        self._send("e", c)

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
        if not (isinstance(msg, list) and len(msg) == 9 and msg[0] in self._apply_kind
                and isinstance(msg[1], bytes) and len(msg[1]) == _ORIGIN_BYTES
                and isinstance(msg[2], str) and msg[2] in self.tracker.modes
                and isinstance(msg[3], bytes) and len(msg[3]) == _DIGEST_BYTES
                and isinstance(msg[4], bytes) and len(msg[4]) % 8 == 0
                and type(msg[5]) is int and msg[5] >= 0
                and type(msg[6]) is int and type(msg[7]) is int and msg[6] >= 0 and msg[7] >= 0
                and msg[6] + msg[7] <= len(msg[4]) // 8
                and isinstance(msg[8], bytes) and len(msg[8]) % 8 == 0 and len(msg[8]) <= _MAX_FIRST_BYTES):
            return None
        return (msg[0], msg[1], msg[2], msg[3], np.frombuffer(msg[4], dtype="<u8").astype(np.uint64), msg[5],
                msg[6], msg[7], np.frombuffer(msg[8], dtype="<u8").tolist())

    def _apply(self, kind: str, origin: bytes, engine: str, digest: bytes, hashes: np.ndarray, cid: int,
               n_reused: int, n_spec: int, first: list[int]) -> None:
        self.stats.received += 1
        self._apply_kind[kind]((origin, cid), engine, digest, hashes, n_reused, n_spec, first)

    def _forget(self, key):
        got = self._remote.pop(key, None)
        if got is not None:
            self._remote_size -= got[2]
        return got

    def _apply_claim(self, key, engine, digest, hashes, n_reused, n_spec, first) -> None:
        tr = self.tracker
        self._forget(key)  # a repeated claim id replaces the earlier one here (the tracker keeps both claims)
        n = n_reused + n_spec
        c = (tr.claim_prompt(engine, hashes, digest, None, reused_blocks=n_reused, speculated_blocks=n_spec,
                             open_for_s=self.claim_max_s, tokens=first)
             if tr.modes[engine] == "events" else None)  # approximate: speculation only (module doc)
        recs = tr.speculate(engine, hashes[:n], [digest] * n, reused_blocks=n_reused, claim=c, root_tokens=first)
        size = 1 + len(recs) + (len(c.hashes) + len(c.weak or ()) if c is not None else 0)
        self._remote[key] = (c, recs, size)
        self._remote_size += size
        while self._remote_size > _MAX_REMOTE_HASHES:  # ends lost, or approximate engines': forget the oldest
            self._remote_size -= self._remote.popitem(last=False)[1][2]

    def _apply_retract(self, key, engine, digest, hashes, n_reused, n_spec, first) -> None:
        got = self._remote.get(key)  # the claim stays open until its "e"
        if got is not None:
            self.tracker.retract(got[1])

    def _apply_end(self, key, engine, digest, hashes, n_reused, n_spec, first) -> None:
        got = self._forget(key)
        if got is not None and got[0] is not None:
            self.tracker.end_claim(got[0])

    def close(self) -> None:
        if self.tracker.on_claim_end == self._claim_ended:
            self.tracker.on_claim_end = None
        self._running.clear()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None
        self._pub.close(0)
