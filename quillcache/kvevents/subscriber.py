"""``KvEventSubscriber``: follow one engine's vLLM KV events (ZeroMQ SUB + replay) and feed a sink.

Longer than 600 lines because the sequence, replay-paging and publisher-identity rules below act on one
connection's state (last seq and digest, the SUB socket and its monitor, the replay socket) and change together;
the wire format is ``codec``'s and the event types are ``types``'.

Protocol handling (``publisher`` states the wire side):

- Frames: exactly 3, ``(topic, seq, payload)`` with an 8-byte big-endian ``seq``; anything else is counted as
  malformed and skipped. A payload that does not decode (``codec.decode_batch``) is counted and skipped whole: its
  ``seq`` is not trusted and nothing advances, so if it was a real batch the next one shows a gap and the replay is
  asked for it. No frame larger than ``MAX_PAYLOAD_BYTES`` plus ``_FRAME_SLACK_BYTES`` is received, on the SUB or
  the replay socket (``zmq.MAXMSGSIZE``): ZeroMQ refuses it from its size header, before reading it, and drops the
  connection; the SUB socket is then replaced (publisher identity, below), so the batch shows as a gap, and a replay
  answer cut this way ends by silence (the batch is a hole).
- Start: with a replay socket, the subscriber first asks it for everything from seq 0 (the engine's history
  before this subscriber connected; ``on_resync`` first if the buffer no longer reaches back to 0). Live batches
  that repeat a replayed one (same seq, same bytes) are counted as duplicates and skipped. Once the catch-up was
  attempted (applied, refused, timed out, or no replay socket), ``caught_up`` is set and the sink's optional
  ``on_caught_up`` is called, after every call the catch-up made.
- Sequence: one publisher numbers its batches 0, 1, 2... A first batch with ``seq > 0``, or ``seq > last + 1``, is a
  GAP: the subscriber asks the replay socket (a DEALER sends ``(b"", start)``) for ``[start, seq)``, applies the
  replayed batches in order, then the current one. When there is no replay socket, the replay does not answer
  within ``replay_timeout_s``, or the buffer no longer holds part of the range (or holds garbage there), the sink
  gets ``on_resync`` (forget this engine's state) and only batches after the last hole are applied. A resync is
  only signalled when some event reached the sink since the start (or the previous resync): history lost before the
  sink heard anything leaves nothing to forget (``stats.resyncs_skipped`` counts those). A ``seq <=
  last`` on the PUB socket (other than a start-up duplicate) means the publisher restarted (a PUB never repeats a
  number): ``on_resync``, then the batch is handled as a first one.
- Publisher identity. A restarted engine numbers from 0 again on the same endpoints, and vLLM's batches name no
  process, so while the subscriber was disconnected or slow the new numbers may continue the old ones (no gap) or
  jump (a gap the NEW publisher's buffer would fill). INVARIANT: a batch that follows a gap, or that is the first
  one received over a new SUB connection, is applied on the sink's state only when the replay socket still holds
  the batch ``last_seq`` that was applied, byte for byte (the digest of the last applied payload is kept; one
  replay of ``[last_seq, seq)`` checks it and fills the gap). A different batch there is a restart
  (``stats.restarts``); an answer without it cannot be told from one (``stats.unverified``; e.g. a buffer that
  rolled past it); both: ``on_resync``, then the batch is handled as a first one (the new publisher's history
  from its replay). Without a replay socket, or when it does not answer, a new connection is a resync
  (``stats.unverified``) and a gap a hole. Payloads carry the engine's timestamp, so two publishers' batches with
  one seq differ unless they are the same bytes. Connections are followed by a socket monitor, and a SUB socket
  carries ONE connection: at its first ``EVENT_DISCONNECTED`` after a handshake it is closed and a new one
  connects, so what the lost connection left queued (possibly a dead publisher's batches, behind which the new
  one's would come unchecked) is dropped unread and shows as a gap; this also re-opens a connection that ZeroMQ
  itself drops for good (it does not reconnect after a protocol error, e.g. an oversized frame).
  ``EVENT_HANDSHAKE_SUCCEEDED`` (``stats.reconnects`` after the first) marks the next batch for the check: ZeroMQ
  reports a handshake before any message of that connection reaches the socket, and the monitor is read after a
  message is received and before it is handled (a message read with the disconnection pending is dropped too).
- Replay answers arrive in pages. vLLM's publisher answers a request by sending every buffered batch from
  ``start`` on in one loop through a ROUTER socket with the default high-water mark, and a ROUTER silently drops
  what does not fit: an answer of more than about a thousand large batches loses a stretch of them and often its
  end marker. So a replay is read as a series of requests: each keeps the run of consecutive batches it got from
  the next wanted seq on, and the next request starts after that run, until an answer ends (end marker) with no
  batch missing, the wanted range is complete, or a request adds nothing (then what is still missing is a hole,
  as above). An answer ends at its end marker, or when nothing arrives for ``replay_timeout_s`` before its first
  frame or for ``replay_idle_s`` between frames (the publisher sends its answer in one burst, so a pause there
  means the rest, end marker included, was dropped); a request that timed out closes its socket, so a late frame
  of that answer is never read as part of the next one.
- Nothing a peer sends crashes the thread: every failure is counted in :class:`SubscriberStats` and skipped; an
  exception raised by the sink is counted (``sink_errors``) and does not stop the subscriber.

Sink calls (from the subscriber's thread, in event order; a sink that owns an event loop hops with
``call_soon_threadsafe``):

- ``on_stored(engine_id, StoredBlocks)``; ``on_removed(engine_id, RemovedHashes)`` — iterating a ``RemovedHashes``
  yields the engine hashes; ``on_cleared(engine_id)``; ``on_resync(engine_id)``.

Hash mapping (for the gateway, which keys residency by its own hashes): for every stored block the subscriber
computes the **Dynamo-compatible UNSCOPED chain hash** of the block's whole token prefix (REFERENCE section 1:
``hashing.hash_blocks(prefix_tokens, block_size)`` with no LoRA and no namespace, seed 1337), block by block from the
parent's chain hash: ``chain[0] = local[0]`` for a root block, else ``chain = xxh3_64(le_u64(parent_chain) ||
le_u64(local), 1337)``. The LoRA adapter is NOT mixed in: ``StoredBlocks.lora_name`` carries it, and the gateway's
identity scope is what separates adapters. The map ``engine hash -> chain hash`` is kept per engine (this
subscriber) as a bounded LRU of ``max_mapped_blocks``: an entry is refreshed when its block is stored and each time
it is the parent of a stored run (so a shared prefix in use is never aged out however many blocks are stored under
it), and the least recently refreshed entry goes first; a removal's lookup does not refresh it. The relation is a
function of the block's content (an engine hash commits to its whole prefix), so an entry stays valid after the
block's removal and is kept, so that a removal, and a later store under that parent, can be mapped. When a stored
run's parent is not in the map (stored before this subscriber saw it, or aged out of the LRU), its chain hashes are
``None``; ``RemovedHashes.chain_hashes`` is ``None`` for an engine hash never seen stored.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterator, Protocol

import xxhash
import zmq
from zmq.utils.monitor import recv_monitor_message

from quillcache._ratelog import BurstLog
from quillcache.hashing import DYNAMO_BASE_SEED, local_hashes
from quillcache.kvevents.codec import MAX_PAYLOAD_BYTES, KvEventDecodeError, decode_batch
from quillcache.kvevents.types import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch

__all__ = ["KvEventSink", "KvEventSubscriber", "RemovedHashes", "StoredBlocks", "SubscriberStats",
           "chain_step"]

log = logging.getLogger(__name__)
_END = -1
_FRAME_SLACK_BYTES = 64  # a frame is a payload (at most MAX_PAYLOAD_BYTES), an 8-byte seq or a topic
_MONITORED = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
_MONITOR_IDS = itertools.count()
_CONN_LOG_WINDOW_S, _CONN_LOG_BURST = 60.0, 5  # a publisher can drop connections at will (oversized frames)


def _digest(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


def chain_step(parent_chain: int | None, local: int) -> int:
    """One link of Dynamo's sequence-hash chain (module docstring)."""
    if parent_chain is None:
        return local
    return xxhash.xxh3_64_intdigest(struct.pack("<QQ", parent_chain, local), seed=DYNAMO_BASE_SEED)


@dataclass(frozen=True, slots=True)
class StoredBlocks:
    """A ``BlockStored`` event with the gateway's view added: ``local_hashes`` (Dynamo's per-block ``tokens_hash``,
    no LoRA) and ``chain_hashes`` (unscoped Dynamo chain hashes, ``None`` when the parent's chain is unknown)."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None
    lora_name: str | None
    medium: str | None
    local_hashes: tuple[int, ...]
    chain_hashes: tuple[int | None, ...]


@dataclass(frozen=True, slots=True)
class RemovedHashes:
    """A ``BlockRemoved`` event: engine ``block_hashes`` (what iteration yields), their ``chain_hashes`` where
    known, and the ``medium``."""

    block_hashes: tuple[int, ...]
    chain_hashes: tuple[int | None, ...]
    medium: str | None

    def __iter__(self) -> Iterator[int]:
        return iter(self.block_hashes)

    def __len__(self) -> int:
        return len(self.block_hashes)


class KvEventSink(Protocol):
    def on_stored(self, engine_id: str, stored: StoredBlocks) -> None: ...

    def on_removed(self, engine_id: str, removed: RemovedHashes) -> None: ...

    def on_cleared(self, engine_id: str) -> None: ...

    def on_resync(self, engine_id: str) -> None: ...

    # optional: ``on_caught_up(engine_id)``, called once the start-up catch-up was attempted, after every call
    # it made (a gateway is not ready before its residency holds the engine's replayed history)


@dataclass(slots=True)
class SubscriberStats:
    batches: int = 0  # applied, live or replayed
    events: int = 0
    unknown_events: int = 0
    malformed: int = 0  # frames or payloads refused
    duplicates: int = 0  # live batches the start-up replay had already applied
    gaps: int = 0
    replayed: int = 0  # batches applied from the replay socket
    replay_timeouts: int = 0  # replay answers that ended by silence, not by their end marker
    replay_pages: int = 0  # replay requests answered (a replay may take several: module doc)
    resyncs: int = 0
    resyncs_skipped: int = 0  # lost history before anything reached the sink: nothing to forget
    restarts: int = 0  # a seq that went back, or a replay whose batch last_seq is not the one applied
    reconnects: int = 0  # SUB connections after the first (each one's first batch is checked: module doc)
    unverified: int = 0  # a new connection or gap after which the publisher could not be checked: resynced
    sink_errors: int = 0
    internal_errors: int = 0


class KvEventSubscriber:
    """Follow one engine's KV events in a thread (module docstring). ``start()``/``close()`` or ``with``."""

    def __init__(self, endpoint: str, *, replay_endpoint: str | None = None, engine_id: str, sink: KvEventSink,
                 topic: str = "", replay_timeout_s: float = 2.0, replay_idle_s: float = 0.25,
                 max_mapped_blocks: int = 1 << 21, poll_interval_s: float = 0.05) -> None:
        if max_mapped_blocks < 1:
            raise ValueError(f"max_mapped_blocks must be >= 1, got {max_mapped_blocks}")
        for name, v in (("replay_timeout_s", replay_timeout_s), ("replay_idle_s", replay_idle_s)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 3600:
                raise ValueError(f"{name} must be a number of seconds in (0, 3600), got {v!r}")
        self.replay_idle_s = float(replay_idle_s)
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.engine_id = engine_id
        self.sink = sink
        self._topic = topic.encode("utf-8")
        self.replay_timeout_s = replay_timeout_s
        self._max_mapped = max_mapped_blocks
        self._poll_ms = max(1, int(poll_interval_s * 1000))
        self._chain: OrderedDict[int, int] = OrderedDict()
        self._told_since_resync = False  # an event reached the sink since the start or the last resync
        self._caught_up: dict[int, bytes] = {}  # seq -> payload digest of batches the start-up replay applied
        self.last_seq: int | None = None
        self._last_digest: bytes | None = None  # of the payload applied as ``last_seq`` (publisher identity)
        self._check_next = False  # a new SUB connection: its first batch is checked (module docstring)
        self._handshaken = 0  # connections the monitor reported (the first is not a reconnect)
        self.stats = SubscriberStats()
        self._ctx = zmq.Context.instance()
        self._sub: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self._sub_handshaken = False  # the current SUB socket has had a connection (then it is replaced at its loss)
        self._replay: zmq.Socket | None = None
        self._conn_log = BurstLog(log, "KV-event connections replaced or publishers found restarted",
                                  window_s=_CONN_LOG_WINDOW_S, burst=_CONN_LOG_BURST, prefix=f"kv events {engine_id}: ")
        self._running = threading.Event()
        self._connected = threading.Event()
        # set once the start-up catch-up was attempted (applied, refused, timed out or impossible); the sink's
        # optional ``on_caught_up`` is called at that point, after every replayed call it received
        self.caught_up = threading.Event()
        self._thread: threading.Thread | None = None
        self._progress = threading.Condition()

    # ---- lifecycle --------------------------------------------------------------------------------
    def start(self) -> KvEventSubscriber:
        if self._thread is not None:
            raise RuntimeError("KvEventSubscriber already started")
        self._running.set()
        self._thread = threading.Thread(target=self._run, name=f"kv-events-{self.engine_id}", daemon=True)
        self._thread.start()
        self._connected.wait(5.0)
        return self

    def close(self) -> None:
        self._running.clear()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def __enter__(self) -> KvEventSubscriber:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def chain_hash(self, engine_hash: int) -> int | None:
        """The unscoped chain hash mapped to ``engine_hash`` (None if never seen stored). Thread-safe enough for
        reads (a dict lookup); for tests and diagnostics."""
        return self._chain.get(engine_hash)

    def wait_for_seq(self, seq: int, timeout_s: float) -> bool:
        """Block until a batch with sequence number >= ``seq`` was handled (True) or ``timeout_s`` passed."""
        deadline = time.monotonic() + timeout_s
        with self._progress:
            while self.last_seq is None or self.last_seq < seq:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._progress.wait(left)
        return True

    # ---- thread ---------------------------------------------------------------------------------
    def _open_sub(self) -> None:
        """A new SUB socket with its connection monitor, connecting (``ZMQError`` if the endpoint is refused)."""
        sub = self._ctx.socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, 100_000)  # like vLLM's PUB side: a burst is queued, not dropped
            sub.setsockopt(zmq.MAXMSGSIZE, MAX_PAYLOAD_BYTES + _FRAME_SLACK_BYTES)
            sub.setsockopt(zmq.SUBSCRIBE, self._topic)
            # before connecting, so the first handshake is seen too; a fresh name, as a closed monitor's may still
            # be registered (pyzmq's default name reuses the socket's descriptor number)
            monitor = sub.get_monitor_socket(_MONITORED, f"inproc://quillcache-kvevents-monitor-{next(_MONITOR_IDS)}")
        except BaseException:
            sub.close(0)
            raise
        self._sub, self._monitor, self._sub_handshaken = sub, monitor, False
        try:
            sub.connect(self.endpoint)
        except BaseException:
            self._close_sub()
            raise

    def _close_sub(self) -> None:
        sub, monitor = self._sub, self._monitor
        self._sub = self._monitor = None
        if sub is not None:
            if monitor is not None:
                try:
                    sub.disable_monitor()
                except zmq.ZMQError:
                    pass
                monitor.close(0)
            sub.close(0)

    def _connection_lost(self) -> bool:
        """Read the SUB socket's connection events (module docstring: publisher identity); True when its connection
        was lost, so the socket must be replaced."""
        monitor = self._monitor
        lost = False
        while monitor is not None and monitor.poll(0):
            event = recv_monitor_message(monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._sub_handshaken = True
                self._check_next = True
                self._handshaken += 1
                if self._handshaken > 1:
                    self.stats.reconnects += 1
            elif event == zmq.EVENT_DISCONNECTED and self._sub_handshaken:
                lost = True  # (a connection that failed its handshake brought nothing: ZeroMQ retries it)
        return lost

    def _reopen_sub(self) -> None:
        """Replace the SUB socket whose connection was lost; what it still holds is dropped unread (a gap)."""
        self._conn_log.note("connection lost", "connection to %s lost; reconnecting with a new socket",
                            self.endpoint, level=logging.INFO)
        self._close_sub()
        try:
            self._open_sub()
        except zmq.ZMQError as e:  # the same endpoint was accepted before: retried at the next turn of the loop
            self.stats.internal_errors += 1
            log.error("kv events %s: cannot reconnect to %s: %s", self.engine_id, self.endpoint, e)

    def _run(self) -> None:
        try:
            self._open_sub()
        except zmq.ZMQError as e:
            log.error("kv events %s: cannot connect to %s: %s", self.engine_id, self.endpoint, e)
            self._connected.set()
            self._signal_caught_up()
            return
        self._connected.set()
        try:
            if self.replay_endpoint is not None:
                try:
                    self._catch_up()
                except Exception:
                    self.stats.internal_errors += 1
                    log.exception("kv events %s: catch-up replay failed (continuing live)", self.engine_id)
                with self._progress:
                    self._progress.notify_all()
            self._signal_caught_up()
            while self._running.is_set():
                sub = self._sub
                if sub is None:  # a failed re-open: try again after a poll interval
                    time.sleep(self._poll_ms / 1000)
                    self._reopen_sub()
                    continue
                frames = sub.recv_multipart() if sub.poll(self._poll_ms) else None
                if self._connection_lost():  # read after the message, before it is handled (module docstring)
                    self._reopen_sub()
                    continue
                if frames is None:
                    self._conn_log.tick()
                    continue
                try:
                    self._handle(frames)
                except Exception:  # never let a bug or a peer's bytes stop the stream
                    self.stats.internal_errors += 1
                    log.exception("kv events %s: internal error on a batch (skipped)", self.engine_id)
                with self._progress:
                    self._progress.notify_all()
        finally:
            self._conn_log.tick(final=True)
            self._close_sub()
            if self._replay is not None:
                self._replay.close(0)

    def _handle(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.stats.malformed += 1
            return
        seq = int.from_bytes(frames[1], "big")
        try:
            batch = decode_batch(frames[2])
        except KvEventDecodeError as e:  # ignored whole: its seq is not trusted, nothing advances
            self.stats.malformed += 1
            log.debug("kv events %s: seq %d refused: %s", self.engine_id, seq, e)
            return
        digest = _digest(frames[2])
        got: dict[int, bytes] | None = None
        if self.last_seq is not None and seq <= self.last_seq:
            if self._caught_up.get(seq) == digest:
                self.stats.duplicates += 1  # a batch the catch-up replay already applied
                return
            self.stats.restarts += 1
            self._forget()
        elif self.last_seq is not None and (seq > self.last_seq + 1 or self._check_next):
            got = self._same_publisher(seq)
        self._check_next = False
        start = 0 if self.last_seq is None else self.last_seq + 1
        if seq > start:
            self._fill_gap(start, seq, got)
        self._apply(batch)
        self.last_seq = seq
        self._last_digest = digest
        self._caught_up.clear()

    def _forget(self) -> None:
        """The publisher is not (provably) the one followed so far: resync, and handle the batch as a first one."""
        self._resync()
        self.last_seq = None
        self._last_digest = None

    def _same_publisher(self, seq: int) -> dict[int, bytes] | None:
        """After a gap or a new connection (``last_seq < seq``): the replay of ``[last_seq, seq)`` when it holds the
        batch ``last_seq`` that was applied, byte for byte (the same publisher; the caller fills the gap from it).
        Otherwise (module docstring: publisher identity) the sink resyncs and, when the replay answered, ``last_seq``
        is forgotten (the caller asks the new publisher's history from 0); with no answer, ``{}`` (a gap is a
        hole)."""
        assert self.last_seq is not None
        got = self._collect_replay(self.last_seq, seq) if self.replay_endpoint is not None else None
        if got is None:  # no replay socket, or no answer: nothing tells the publishers apart
            if self._check_next:
                self.stats.unverified += 1
            if seq == self.last_seq + 1:
                self._resync()  # (a gap resyncs as a hole)
            return {}
        held = got.get(self.last_seq)
        if held is not None and _digest(held) == self._last_digest:
            return got
        if held is None:
            self.stats.unverified += 1
        else:
            self.stats.restarts += 1
        if held is None:  # most often a buffer that rolled past it; a restart cannot be ruled out
            self._conn_log.note("publisher not verified", "the replay no longer holds batch %d, the last applied (its "
                                "buffer rolled past it, or the publisher restarted): resyncing", self.last_seq)
        else:
            self._conn_log.note("publisher restarted", "the replay's batch %d is not the one applied: a restarted "
                                "publisher, resyncing", self.last_seq)
        self._forget()
        return None

    def _signal_caught_up(self) -> None:
        self.caught_up.set()
        hook = getattr(self.sink, "on_caught_up", None)  # optional in KvEventSink
        if hook is not None:
            try:
                hook(self.engine_id)
            except Exception:
                self.stats.internal_errors += 1
                log.exception("kv events %s: on_caught_up failed", self.engine_id)

    def _catch_up(self) -> None:
        """At start: replay whatever the publisher still buffers (the engine's history before this subscriber
        connected); ``on_resync`` first when the buffer no longer starts at seq 0. Applies the run of consecutive
        batches from the first one held; a hole after it is left for the live stream's gap handling."""
        got = self._collect_replay(0)
        if not got:
            return
        decoded: list[tuple[int, EventBatch]] = []
        for s in sorted(got):
            if decoded and s != decoded[-1][0] + 1:
                break
            payload = got[s]
            try:
                decoded.append((s, decode_batch(payload)))
            except KvEventDecodeError:
                self.stats.malformed += 1
                break
            self._caught_up[s] = _digest(payload)
        if not decoded:
            return
        if decoded[0][0] != 0:
            self._resync()
        for s, b in decoded:
            self._apply(b)
            self.stats.replayed += 1
        self.last_seq = decoded[-1][0]
        self._last_digest = self._caught_up[self.last_seq]

    def _fill_gap(self, start: int, end: int, got: dict[int, bytes] | None = None) -> None:
        """Replay ``[start, end)`` (module docstring), or take it from ``got`` (a replay already read); resync when
        any part of it cannot be had."""
        self.stats.gaps += 1
        if got is None and self.replay_endpoint is not None:
            got = self._collect_replay(start, end)
        batches: dict[int, EventBatch | None] = {}
        for s, payload in (got or {}).items():
            if not start <= s < end:
                continue
            try:
                batches[s] = decode_batch(payload)
            except KvEventDecodeError:
                self.stats.malformed += 1
                batches[s] = None
        # the batches after the last hole, found from the end (the range may be huge: a late join to an engine that
        # published millions of batches; the replay holds at most its buffer)
        after = end
        while after > start and batches.get(after - 1) is not None:
            after -= 1
        if after > start:
            self._resync()
        for s in range(after, end):
            b = batches[s]
            assert b is not None
            self._apply(b)
            self.stats.replayed += 1

    def _collect_replay(self, start: int, end: int | None = None) -> dict[int, bytes] | None:
        """The buffered batches with ``start <= seq < end`` (``end=None``: to the buffer's end) that a series of
        replay requests could get, by seq (module docstring: answers arrive in pages); None when no request was
        answered."""
        got: dict[int, bytes] = {}
        answered = False
        want = start  # the next seq of the consecutive run being assembled
        while self._thread is None or self._running.is_set():  # (not started: a direct call, tests)
            answer = self._request_replay(want)
            if answer is None:
                break
            frames, complete = answer
            answered = True
            self.stats.replay_pages += 1
            for s, payload in frames:
                if s >= want and (end is None or s < end):
                    got.setdefault(s, payload)
            if want not in got and got and not any(s < want for s in got):
                want = min(got)  # the buffer no longer reaches back to ``want``: the run starts where it does
            before = want
            while want in got:
                want += 1
            if (end is not None and want >= end) or (complete and all(s < want for s, _ in frames)):
                break  # the range is complete, or the buffer's end was reached with nothing missing
            if want == before:
                break  # this request added nothing: what is missing stays a hole
        return got if answered else None

    def _request_replay(self, start: int) -> tuple[list[tuple[int, bytes]], bool] | None:
        """One replay request from ``start``: ``(frames, ended)`` where ``ended`` says the end marker came, or
        None when nothing came within ``replay_timeout_s``."""
        if self._replay is None:
            self._replay = self._ctx.socket(zmq.DEALER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.setsockopt(zmq.RCVHWM, 0)  # never drop on this side: the buffer bounds an answer
            self._replay.setsockopt(zmq.MAXMSGSIZE, MAX_PAYLOAD_BYTES + _FRAME_SLACK_BYTES)
            self._replay.connect(self.replay_endpoint)  # type: ignore[arg-type]
        sock = self._replay
        sock.send_multipart((b"", start.to_bytes(8, "big", signed=True)))
        out: list[tuple[int, bytes]] = []
        deadline = time.monotonic() + self.replay_timeout_s
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not sock.poll(left_ms):
                # no (complete) answer: drop the socket so a late frame cannot be read as the next answer's
                self.stats.replay_timeouts += 1
                sock.close(0)
                self._replay = None
                return (out, False) if out else None
            frames = sock.recv_multipart()
            if len(frames) != 3 or frames[0] != b"" or len(frames[1]) != 8:
                self.stats.malformed += 1
                continue
            s = int.from_bytes(frames[1], "big", signed=True)
            if s == _END:
                return out, True
            out.append((s, frames[2]))
            deadline = time.monotonic() + self.replay_idle_s

    # ---- applying events ------------------------------------------------------------------------------
    def _call(self, method: str, *args: object) -> None:
        try:
            getattr(self.sink, method)(self.engine_id, *args)
        except Exception:
            self.stats.sink_errors += 1
            log.exception("kv events %s: sink.%s raised (ignored)", self.engine_id, method)

    def _resync(self) -> None:
        """Tell the sink to forget this engine — only when it was told something since the last resync (before any
        event it knows nothing, so there is nothing to forget; a resync then would only drop what the sink inferred
        on its own, e.g. a gateway's routing-time entries)."""
        if not self._told_since_resync:
            self.stats.resyncs_skipped += 1
            return
        self._told_since_resync = False
        self.stats.resyncs += 1
        self._call("on_resync")

    def _remember(self, engine_hash: int, chain: int) -> None:
        self._chain[engine_hash] = chain
        self._chain.move_to_end(engine_hash)
        if len(self._chain) > self._max_mapped:
            self._chain.popitem(last=False)

    def _stored(self, ev: BlockStored) -> StoredBlocks:
        local = [int(h) for h in local_hashes(list(ev.token_ids), ev.block_size)] if ev.block_hashes else []
        prev: int | None = None
        known = True
        if ev.parent_block_hash is not None:
            prev = self._chain.get(ev.parent_block_hash)
            known = prev is not None
            if known:
                self._chain.move_to_end(ev.parent_block_hash)  # in use: a hot shared prefix is not aged out
        chains: list[int | None] = []
        for eh, lh in zip(ev.block_hashes, local):
            if not known:
                chains.append(None)
                continue
            prev = chain_step(prev, lh)
            chains.append(prev)
            self._remember(eh, prev)
        return StoredBlocks(ev.block_hashes, ev.parent_block_hash, ev.token_ids, ev.block_size, ev.lora_id,
                            ev.lora_name, ev.medium, tuple(local), tuple(chains))

    def _apply(self, batch: EventBatch) -> None:
        self.stats.batches += 1
        self.stats.unknown_events += batch.unknown_events
        if batch.events:
            self._told_since_resync = True
        for ev in batch.events:
            self.stats.events += 1
            if isinstance(ev, BlockStored):
                self._call("on_stored", self._stored(ev))
            elif isinstance(ev, BlockRemoved):
                self._call("on_removed", RemovedHashes(ev.block_hashes,
                                                       tuple(self._chain.get(h) for h in ev.block_hashes), ev.medium))
            elif isinstance(ev, AllBlocksCleared):
                self._call("on_cleared")
