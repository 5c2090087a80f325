"""KvEventSubscriber against engines that restart while it is disconnected or slow (review M1), and frames over the
codec's size limit (review L2).

The engines here are a scripted vLLM-protocol publisher (``FakeEngine``: an XPUB, which reports each subscription,
and a ROUTER replay socket answering from its buffer, both owned by one thread): a restarted engine's first batches
can then be put in its replay buffer without reaching the subscriber, which is what a subscriber that was
disconnected when they were published sees, and a batch is sent only once a given number of SUB connections has
subscribed, so no test depends on timing."""

from __future__ import annotations

import queue
import socket
import threading
import time

import pytest
import zmq

from quillcache.kvevents import BlockStored, EventBatch, KvEventPublisher, KvEventSubscriber, encode_batch
from quillcache.kvevents.codec import MAX_PAYLOAD_BYTES

END = (-1).to_bytes(8, "big", signed=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _payload(block: int) -> bytes:
    return encode_batch(EventBatch(time.time(), (BlockStored((block,), None, (block % 256,), 1),)))


class FakeEngine:
    """A vLLM-protocol publisher whose sends are scripted: ``store`` buffers a batch only (published while no
    subscriber was connected), ``send`` buffers and publishes it, ``send_raw`` publishes frames only. Always
    ``close()``."""

    def __init__(self, endpoint: str, replay_endpoint: str, *, bind_timeout_s: float = 10.0) -> None:
        self.buffer: dict[int, bytes] = {}
        self.subscriptions = 0  # subscription messages seen on the XPUB (one per SUB connection)
        self._lock = threading.Lock()
        self._cmds: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        ctx = zmq.Context.instance()
        self._pub, self._router = ctx.socket(zmq.XPUB), ctx.socket(zmq.ROUTER)
        for s in (self._pub, self._router):
            s.setsockopt(zmq.LINGER, 0)
        deadline = time.monotonic() + bind_timeout_s
        try:
            for s, ep in ((self._pub, endpoint), (self._router, replay_endpoint)):
                while True:  # a closed engine's listener goes away asynchronously
                    try:
                        s.bind(ep)
                        break
                    except zmq.ZMQError:
                        assert time.monotonic() < deadline, f"{ep} was not released"
                        time.sleep(0.02)
        except BaseException:
            self._pub.close(0)
            self._router.close(0)
            raise
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pub, zmq.POLLIN)
        poller.register(self._router, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(10))
                if self._pub in ready:
                    msg = self._pub.recv()
                    if msg[:1] == b"\x01":
                        with self._lock:
                            self.subscriptions += 1
                if self._router in ready:
                    client, _, start = self._router.recv_multipart()
                    first = int.from_bytes(start, "big", signed=True)
                    for seq in sorted(self.buffer):
                        if seq >= first:
                            self._router.send_multipart([client, b"", seq.to_bytes(8, "big"), self.buffer[seq]],
                                                        copy=False)
                    self._router.send_multipart([client, b"", END, b""])
                while True:
                    try:
                        frames, done = self._cmds.get_nowait()
                    except queue.Empty:
                        break
                    self._pub.send_multipart(frames, copy=False)
                    done.set()
        finally:
            self._pub.close(0)
            self._router.close(0)

    def wait_subscriptions(self, n: int, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                if self.subscriptions >= n:
                    return
            assert time.monotonic() < deadline, f"no {n} subscription(s) came; got {self.subscriptions}"
            time.sleep(0.005)

    def store(self, seq: int, payload: bytes) -> None:
        self.buffer[seq] = payload

    def send_raw(self, frames: list[bytes]) -> None:
        done = threading.Event()
        self._cmds.put((frames, done))
        assert done.wait(10.0), "the fake engine did not send"

    def send(self, seq: int, payload: bytes) -> None:
        self.store(seq, payload)
        self.send_raw([b"", seq.to_bytes(8, "big"), payload])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10.0)


class Sink:
    """What the sink believes the engine holds; ``block_on`` blocks the subscriber's thread inside ``on_stored`` of
    that block until ``release`` is set (a slow subscriber)."""

    def __init__(self, block_on: int | None = None) -> None:
        self.held: set[int] = set()
        self.calls: list[str] = []
        self.block_on = block_on
        self.blocked = threading.Event()
        self.release = threading.Event()

    def on_stored(self, engine_id, stored):
        self.calls.append("stored")
        self.held.update(stored.block_hashes)
        if self.block_on in stored.block_hashes:
            self.blocked.set()
            self.release.wait(20.0)

    def on_removed(self, engine_id, removed):
        self.calls.append("removed")
        self.held.difference_update(removed)

    def on_cleared(self, engine_id):
        self.calls.append("cleared")
        self.held.clear()

    def on_resync(self, engine_id):
        self.calls.append("resync")
        self.held.clear()


def _send_until_seen(engine: FakeEngine, sub: KvEventSubscriber, first_seq: int, first_block: int,
                     timeout_s: float = 20.0) -> int:
    """Send batches ``first_seq``, ``first_seq + 1``... until the subscriber has handled one (a batch sent while its
    socket is being replaced is lost: the next one shows the gap); the last seq sent."""
    deadline = time.monotonic() + timeout_s
    seq = first_seq
    while True:
        engine.send(seq, _payload(first_block + seq))
        if sub.wait_for_seq(seq, 0.3):
            return seq
        assert time.monotonic() < deadline, sub.stats
        seq += 1


def _seen(sink: Sink, block: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while block not in sink.held:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)
    return True


@pytest.mark.parametrize("slow", [False, True], ids=["disconnected", "slow"])
@pytest.mark.parametrize("missed", [5, 7], ids=["numbers-continue", "numbers-jump"])
def test_a_restart_while_disconnected_or_slow_is_detected(slow, missed):
    """Engine A publishes seq 0..4 (blocks 1000..1004) and dies; B takes its endpoints and publishes ``missed``
    batches (blocks 2000..) that the subscriber never receives (it was disconnected), then more once it has
    reconnected. ``missed=5``: B's numbers continue A's (no gap); 7: they jump (a gap B's buffer would fill).
    ``slow``: the subscriber is stuck in the sink during the restart, with A's batches 3 and 4 still queued behind
    it (B's live batches come after them). In every case the sink is told to resync, then holds exactly
    B's blocks (the old code kept A's blocks and missed B's first ones, with no sign of it)."""
    ep, rep = f"tcp://127.0.0.1:{_free_port()}", f"tcp://127.0.0.1:{_free_port()}"
    sink = Sink(block_on=1002 if slow else None)
    engine_a = FakeEngine(ep, rep)
    engine_b = None
    sub = KvEventSubscriber(ep, replay_endpoint=rep, engine_id="e", sink=sink, replay_timeout_s=1.0,
                            replay_idle_s=0.2)
    try:
        sub.start()
        engine_a.wait_subscriptions(1)
        for seq in range(5):
            engine_a.send(seq, _payload(1000 + seq))
        if slow:
            assert sink.blocked.wait(10.0)
        else:
            assert sub.wait_for_seq(4, 10.0), sub.stats
        engine_a.close()
        engine_b = FakeEngine(ep, rep)
        for seq in range(missed):  # published while no subscriber was connected
            engine_b.store(seq, _payload(2000 + seq))
        if slow:
            # (a SUB socket re-sends its subscription only when its thread uses it again: B's batches can reach it
            # only after the release, behind A's 3 and 4)
            sink.release.set()
        else:
            engine_b.wait_subscriptions(1)  # the SUB has reconnected, to B
        last = _send_until_seen(engine_b, sub, missed, 2000)
        assert sink.held == set(range(2000, 2001 + last)), (sorted(sink.held), sub.stats)
        assert sink.calls.count("resync") == 1 and sub.stats.restarts == 1, (sink.calls, sub.stats)
        assert sub.stats.reconnects >= 1 and sub.stats.internal_errors == 0
    finally:
        sink.release.set()
        sub.close()
        engine_a.close()
        if engine_b is not None:
            engine_b.close()


def test_a_reconnect_without_a_replay_socket_is_a_resync():
    """No replay socket, nothing can tell a restarted engine from the same one: a new connection resyncs, even when
    the new numbers continue the old ones (the old code applied B's batch 5 on top of A's blocks)."""
    ep = f"tcp://127.0.0.1:{_free_port()}"
    sink = Sink()
    engine_a = FakeEngine(ep, f"tcp://127.0.0.1:{_free_port()}")
    engine_b = None
    sub = KvEventSubscriber(ep, engine_id="e", sink=sink)
    try:
        sub.start()
        engine_a.wait_subscriptions(1)
        for seq in range(5):
            engine_a.send(seq, _payload(1000 + seq))
        assert sub.wait_for_seq(4, 10.0), sub.stats
        engine_a.close()
        engine_b = FakeEngine(ep, f"tcp://127.0.0.1:{_free_port()}")
        engine_b.wait_subscriptions(1)
        last = _send_until_seen(engine_b, sub, 5, 2000)
        assert sink.calls.count("resync") == 1 and sink.held <= set(range(2005, 2001 + last)), sink.calls
        assert sub.stats.unverified == 1 and sub.stats.reconnects == 1, sub.stats
    finally:
        sub.close()
        engine_a.close()
        if engine_b is not None:
            engine_b.close()


def test_a_real_publisher_restart_and_a_quiet_start_up():
    """The real publisher: a subscriber that started on its replay (first connection checked against it) does not
    resync while the engine lives; a restart on the same endpoints is then one resync, and the sink ends with
    exactly the new engine's blocks."""
    ep, rep = f"tcp://127.0.0.1:{_free_port()}", f"tcp://127.0.0.1:{_free_port()}"
    sink = Sink()
    with KvEventPublisher(ep, replay_endpoint=rep) as pub:
        for seq in range(3):
            pub.publish(EventBatch(time.time(), (BlockStored((1000 + seq,), None, (seq,), 1),)))
        assert pub.flush()
        sub = KvEventSubscriber(ep, replay_endpoint=rep, engine_id="e", sink=sink, replay_timeout_s=1.0)
        try:
            sub.start()
            deadline = time.monotonic() + 10
            seq = 2
            while not sub.wait_for_seq(seq, 0.3):  # live batches until the slow joiner has joined
                seq += 1
                pub.publish(EventBatch(time.time(), (BlockStored((1000 + seq,), None, (seq,), 1),)))
                assert time.monotonic() < deadline, sub.stats
            assert sink.calls.count("resync") == 0 and sub.stats.restarts == 0 and sub.stats.unverified == 0
            assert sink.held == set(range(1000, 1001 + seq))
        except BaseException:
            sub.close()
            raise
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                pub2 = KvEventPublisher(ep, replay_endpoint=rep)
                break
            except zmq.ZMQError:
                assert time.monotonic() < deadline, "the endpoints were not released"
                time.sleep(0.02)
        with pub2:  # it numbers from 0 again: publish until the subscriber has applied one of its batches
            seq2 = 0
            pub2.publish(EventBatch(time.time(), (BlockStored((2000,), None, (0,), 1),)))
            deadline = time.monotonic() + 20
            while not _seen(sink, 2000 + seq2, 0.3):
                seq2 += 1
                pub2.publish(EventBatch(time.time(), (BlockStored((2000 + seq2,), None, (seq2,), 1),)))
                assert time.monotonic() < deadline, sub.stats
        assert sink.calls.count("resync") == 1 and sub.stats.restarts == 1, (sink.calls, sub.stats)
        assert sink.held == set(range(2000, 2001 + seq2)), sorted(sink.held)
    finally:
        sub.close()


# ---- L2: frames over the size limit are never received --------------------------------------------------------
def test_an_oversized_frame_is_not_received_and_the_stream_goes_on():
    """A frame larger than ``MAX_PAYLOAD_BYTES`` plus framing slack is refused by ZeroMQ from its size header (the
    old code received all of it, then refused it: ``malformed``). ZeroMQ drops that connection and would not
    reconnect after this protocol error; the subscriber connects a new socket, the batch published meanwhile shows
    as a gap, and the replay fills it (the same publisher: no resync). A frame of exactly ``MAX_PAYLOAD_BYTES`` is
    still received."""
    ep, rep = f"tcp://127.0.0.1:{_free_port()}", f"tcp://127.0.0.1:{_free_port()}"
    sink = Sink()
    engine = FakeEngine(ep, rep)
    sub = KvEventSubscriber(ep, replay_endpoint=rep, engine_id="e", sink=sink, replay_timeout_s=1.0,
                            replay_idle_s=0.2)
    try:
        sub.start()
        engine.wait_subscriptions(1)
        for seq in range(3):
            engine.send(seq, _payload(1000 + seq))
        assert sub.wait_for_seq(2, 10.0), sub.stats
        engine.send_raw([b"", (3).to_bytes(8, "big"), bytes(MAX_PAYLOAD_BYTES)])  # at the limit: received, refused
        engine.send(3, _payload(1003))
        assert sub.wait_for_seq(3, 10.0), sub.stats
        assert sub.stats.malformed == 1, sub.stats
        engine.send_raw([b"", (4).to_bytes(8, "big"), bytes(MAX_PAYLOAD_BYTES + (1 << 20))])
        engine.send(4, _payload(1004))  # lost with the dropped connection
        last = _send_until_seen(engine, sub, 5, 1000)
        assert sub.stats.malformed == 1, sub.stats  # the oversized frame never reached the subscriber
        assert engine.subscriptions >= 2 and sub.stats.reconnects >= 1 and sub.stats.gaps >= 1, sub.stats
        assert sink.held == set(range(1000, 1001 + last)), (sorted(sink.held), sub.stats)
        assert sub.stats.replayed >= 1 and sub.stats.resyncs == 0 and "resync" not in sink.calls, sub.stats
        assert sub.stats.internal_errors == 0
    finally:
        sub.close()
        engine.close()


def test_an_oversized_batch_in_the_replay_is_a_hole_and_the_stream_goes_on():
    """A numbered batch over the limit, also in the replay buffer: neither socket receives it (the replay answer is
    cut at it and ends by silence), so it is a hole: one resync, and the batches after it are applied."""
    ep, rep = f"tcp://127.0.0.1:{_free_port()}", f"tcp://127.0.0.1:{_free_port()}"
    sink = Sink()
    engine = FakeEngine(ep, rep)
    sub = KvEventSubscriber(ep, replay_endpoint=rep, engine_id="e", sink=sink, replay_timeout_s=0.5,
                            replay_idle_s=0.2)
    try:
        sub.start()
        engine.wait_subscriptions(1)
        for seq in range(3):
            engine.send(seq, _payload(1000 + seq))
        assert sub.wait_for_seq(2, 10.0), sub.stats
        engine.send(3, bytes(MAX_PAYLOAD_BYTES + (1 << 20)))
        last = _send_until_seen(engine, sub, 4, 1000)
        assert sub.stats.malformed == 0 and sub.stats.internal_errors == 0, sub.stats  # never received
        assert sink.calls.count("resync") == 1 and sub.stats.resyncs == 1, (sink.calls, sub.stats)
        assert sink.held and sink.held <= set(range(1004, 1001 + last)), sorted(sink.held)
        assert 1000 + last in sink.held
        # and the subscriber goes on
        engine.send(last + 1, _payload(1001 + last))
        assert sub.wait_for_seq(last + 1, 10.0), sub.stats
    finally:
        sub.close()
        engine.close()
