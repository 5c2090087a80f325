"""``KvEventPublisher``: vLLM's KV-event publishing protocol over ZeroMQ (used by the stand-in engine).

Wire protocol (vLLM ``ZmqEventPublisher``, REFERENCE section 10):

- a PUB socket sends each batch as 3 frames ``(topic, seq, payload)``: ``seq`` an 8-byte big-endian sequence
  number starting at 0 and increasing by one per batch, ``payload`` the msgpack ``EventBatch`` (``codec``);
- an optional ROUTER replay socket: a client sends ``(b"", start_seq)`` (8-byte big-endian; a DEALER or REQ
  client) and receives one ``(b"", seq, payload)`` message per buffered batch with ``seq >= start_seq``, in
  order, then ``(b"", -1 as 8-byte big-endian signed, b"")``. The buffer keeps the last ``buffer_steps`` batches
  (older ones are gone: a client asking for them receives what is left, starting later than it asked). As in
  vLLM, the answer is sent in one loop through a ROUTER with a high-water mark (``replay_hwm``, ZeroMQ's default
  1000, which vLLM leaves as it is), and a ROUTER drops silently what does not fit its peer's pipe: a long answer
  of large batches loses a stretch of batches, often with the end marker. The subscriber reads replays in pages
  for that reason (:mod:`quillcache.kvevents.subscriber`).

Here both sockets BIND (the stand-in engine is the stable end; subscribers connect). A port of 0 binds a free port;
``endpoint`` / ``replay_endpoint`` then give the bound addresses. Sockets are used only by the publisher thread
(ZeroMQ sockets are not thread-safe). ``publish`` checks and encodes the batch in the caller's thread
(``codec.check_batch``: a batch a subscriber would refuse raises ``ValueError`` naming the bad field, one that is not
a batch of events ``TypeError``; nothing is queued) and enqueues the payload; the thread numbers, buffers and sends
it. A send that fails anyway is counted (``stats.send_errors``) and logged, and the thread goes on (the batch keeps
its number and its place in the replay buffer, so a subscriber sees a gap it can fill). Malformed replay requests
are counted and ignored.

Fault knob (the stand-in engine's ``--kv-events-drop-rate``): ``drop_rate`` drops a batch from the PUB socket
with that probability (seeded) while still numbering and buffering it, which is what a subscriber sees when a
message is lost on the way (PUB high-water mark, a reconnect): a sequence gap that the replay socket can fill.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
from collections import deque
from dataclasses import dataclass

import zmq

from quillcache.kvevents.codec import Encoding, HashForm, KvEventDecodeError, check_batch, encode_batch
from quillcache.kvevents.types import EventBatch

__all__ = ["END_SEQ", "KvEventPublisher", "PublisherStats"]

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_POLL_S = 0.01


def _bindable(endpoint: str) -> str:
    if not endpoint.startswith("tcp://") and not endpoint.startswith("ipc://") and not endpoint.startswith("inproc://"):
        raise ValueError(f"KV-event endpoint {endpoint!r} must be tcp://HOST:PORT, ipc://PATH or inproc://NAME")
    if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
        return endpoint[:-2] + ":*"
    return endpoint


@dataclass(slots=True)
class PublisherStats:
    published: int = 0
    dropped_by_fault: int = 0
    replay_requests: int = 0
    replay_bad_requests: int = 0
    send_errors: int = 0  # batches numbered and buffered whose send failed (logged; the thread goes on)


class KvEventPublisher:
    """PUB + optional ROUTER replay, vLLM's protocol (module docstring). Always ``close()`` it (or use ``with``)."""

    def __init__(self, endpoint: str, *, replay_endpoint: str | None = None, buffer_steps: int = 10_000,
                 topic: str = "", encoding: Encoding = "tagged", hash_form: HashForm = "u64",
                 drop_rate: float = 0.0, seed: int = 0, hwm: int = 100_000, replay_hwm: int = 1000) -> None:
        if buffer_steps < 1:
            raise ValueError(f"buffer_steps must be >= 1, got {buffer_steps}")
        if not 0.0 <= drop_rate < 1.0:
            raise ValueError(f"drop_rate must be in [0, 1), got {drop_rate}")
        encode_batch(EventBatch(0.0, ()), encoding=encoding, hash_form=hash_form)  # validates both names
        self._encoding, self._hash_form = encoding, hash_form
        self._topic = topic.encode("utf-8")
        self._drop_rate = drop_rate
        self._rng = random.Random(seed)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._queue: queue.Queue[bytes | threading.Event | None] = queue.Queue()
        self._seq = 0
        self.stats = PublisherStats()
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay: zmq.Socket | None = None
        try:
            self._pub.set_hwm(hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.bind(_bindable(endpoint))
            self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            self.replay_endpoint: str | None = None
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.setsockopt(zmq.SNDHWM, replay_hwm)
                self._replay.bind(_bindable(replay_endpoint))
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except BaseException:
            self._close_sockets()
            raise
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()

    # ---- API ----------------------------------------------------------------------------------
    def publish(self, batch: EventBatch) -> None:
        """Check and encode one batch, then enqueue it; it gets the next sequence number when the thread sends it.
        ``ValueError`` naming the bad field (``TypeError`` for what is not a batch of events), nothing queued, for a
        batch a subscriber would refuse."""
        if not self._running:
            raise RuntimeError("KvEventPublisher is closed")
        try:
            check_batch(batch)
            payload = encode_batch(batch, encoding=self._encoding, hash_form=self._hash_form)
        except KvEventDecodeError as e:
            raise ValueError(f"KvEventPublisher.publish: {e}") from None
        except (ValueError, OverflowError) as e:  # what the checks let through but msgpack refuses (a huge ts...)
            raise ValueError(f"KvEventPublisher.publish: cannot encode the batch: {type(e).__name__}: {e}") from None
        self._queue.put(payload)

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every enqueued batch was sent (or dropped by the fault knob); False on timeout."""
        done = threading.Event()
        self._queue.put(done)  # type: ignore[arg-type]
        return done.wait(timeout_s)

    @property
    def next_seq(self) -> int:
        return self._seq

    def close(self) -> None:
        if self._running:
            self._running = False
            self._queue.put(None)
            self._thread.join(timeout=5.0)
        self._close_sockets()

    def __enter__(self) -> KvEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- thread -------------------------------------------------------------------------------
    def _close_sockets(self) -> None:
        for s in (self._pub, self._replay):
            if s is not None and not s.closed:
                s.close(linger=0)

    def _run(self) -> None:
        while True:
            if self._replay is not None:
                while self._replay.poll(0):
                    self._serve_replay()
            try:
                item = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            try:
                self._send(item)
            except Exception:  # never let one batch stop the publisher (every later batch would wait forever)
                self.stats.send_errors += 1
                log.exception("KV-event publisher: sending batch %d failed (the publisher goes on)", self._seq - 1)

    def _send(self, payload: bytes) -> None:
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        if self._drop_rate and self._rng.random() < self._drop_rate:
            self.stats.dropped_by_fault += 1
            return
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self.stats.published += 1

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            self.stats.replay_bad_requests += 1
            return
        client, _, start_bytes = frames
        self.stats.replay_requests += 1
        start = int.from_bytes(start_bytes, "big", signed=True)
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))
