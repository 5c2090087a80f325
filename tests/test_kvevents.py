"""quillcache.kvevents: the vLLM wire codec, the publisher/subscriber protocol over real ZeroMQ sockets, and the
stand-in engine's events end to end."""

from __future__ import annotations

import hashlib
import random
import threading
import time
import urllib.request

import msgpack
import pytest
import zmq

from quillcache.enginesim import EngineSimProcess, engine_block_digests
from quillcache.hashing import hash_blocks, local_hashes
from quillcache.kvevents import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KvEventDecodeError,
    KvEventPublisher,
    KvEventSubscriber,
    decode_batch,
    encode_batch,
    normalize_hash,
)

U64 = (1 << 64) - 1


# ---- codec ----------------------------------------------------------------------------------------
def _batch(rng: random.Random, bs: int = 4) -> EventBatch:
    hashes = tuple(rng.getrandbits(64) for _ in range(3))
    stored = BlockStored(hashes, rng.getrandbits(64), tuple(rng.randrange(1 << 32) for _ in range(3 * bs)), bs,
                         7, "GPU", "adapter-x")
    return EventBatch(1234.5, (stored, BlockRemoved(hashes[:2], "GPU"), AllBlocksCleared(),
                               BlockStored((1 << 63,), None, tuple(range(bs)), bs, None, None, None)), 0)


@pytest.mark.parametrize("encoding", ["tagged", "positional"])
@pytest.mark.parametrize("form", ["u64", "i64", "bytes"])
def test_codec_round_trip_every_encoding_and_hash_form(encoding, form):
    batch = _batch(random.Random(1))
    assert decode_batch(encode_batch(batch, encoding=encoding, hash_form=form)) == batch


def test_hash_forms_agree():
    digest = hashlib.sha256(b"block").digest()
    as_u64 = int.from_bytes(digest, "big") & U64  # vLLM's own digest -> int conversion
    assert normalize_hash(digest) == as_u64
    assert normalize_hash(as_u64 - (1 << 64) if as_u64 >= 1 << 63 else as_u64) == as_u64
    ev = BlockRemoved((digest,), "GPU")  # the encoder keeps a digest whole in the bytes form
    for form in ("u64", "i64", "bytes"):
        assert decode_batch(encode_batch(EventBatch(0.0, (ev,)), hash_form=form)).events[0].block_hashes == (as_u64,)
    wire = msgpack.unpackb(encode_batch(EventBatch(0.0, (BlockRemoved((U64,), None),)), hash_form="i64"))
    assert wire["events"][0]["block_hashes"] == [-1]


def test_decodes_payloads_shaped_like_each_vllm_generation():
    # older vLLM: array_like structs, no medium / lora_name, no data_parallel_rank
    old = msgpack.packb([1.0, [["BlockStored", [-5, 6], None, [1, 2, 3, 4], 2, None],
                               ["BlockRemoved", [-5]], ["AllBlocksCleared"]]])
    b = decode_batch(old)
    assert b.events[0] == BlockStored(((1 << 64) - 5, 6), None, (1, 2, 3, 4), 2, None, None, None)
    assert b.events[1] == BlockRemoved(((1 << 64) - 5,), None) and b.data_parallel_rank is None
    # current vLLM: maps with a "type" tag, bytes hashes, extra fields (extra_keys, group_idx...), a future event
    d1, d2 = hashlib.sha256(b"1").digest(), hashlib.sha256(b"2").digest()
    new = msgpack.packb({"ts": 2.5, "data_parallel_rank": 1, "events": [
        {"type": "BlockStored", "block_hashes": [d2], "parent_block_hash": d1, "token_ids": [9, 9], "block_size": 2,
         "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": [["salt"]], "group_idx": 0,
         "kv_cache_spec_kind": "full_attention"},
        {"type": "SomeFutureEvent", "x": 1}]}, use_bin_type=True)
    b = decode_batch(new)
    assert b.events == (BlockStored((normalize_hash(d2),), normalize_hash(d1), (9, 9), 2, None, "GPU", None),)
    assert b.unknown_events == 1 and b.data_parallel_rank == 1 and b.ts == 2.5


@pytest.mark.parametrize("obj, match", [
    ({"events": []}, r"batch map is missing \['ts'\]"),
    ([1.0], "batch array has 1 element"),
    ("x", "batch must be a map or an array, got str"),
    ([1.0, {}], "batch events must be an array"),
    ([1.0, [["BlockStored", [1], None, [1, 2, 3], 2]]], r"events\[0\]: 3 token_ids for 1 block\(s\) of 2 tokens"),
    ([1.0, [["BlockStored", [1], None]]], r"events\[0\] \(BlockStored\): 2 field\(s\), needs at least 4"),
    ([1.0, [{"type": "BlockRemoved"}]], r"events\[0\] \(BlockRemoved\): missing field\(s\) \['block_hashes'\]"),
    ([1.0, [["BlockRemoved", [1.5]]]], r"events\[0\]\.block_hashes\[0\] must be an int or bytes, got float"),
    ([1.0, [["BlockRemoved", [b""]]]], r"block_hashes\[0\] has 0 bytes; a digest has 1\.\.64"),
    ([1.0, [["BlockRemoved", ["abc"]]]], r"block_hashes\[0\] must be an int or bytes, got str"),
    ([1.0, [["BlockStored", [1], None, [1 << 32], 1]]], r"token_ids\[0\]=4294967296 is not a token id"),
    ([1.0, [["BlockStored", [1], None, [1], 0]]], r"block_size must be an int >= 1, got 0"),
    ([1.0, [["BlockStored", [1], None, [1], 1, "x"]]], r"lora_id must be an int or nil, got str"),
    ([1.0, [7]], r"events\[0\]: an event must be a map or an array, got int"),
    ([1.0, [[3]]], "must start with its type tag"),
    (["now", []], "batch ts must be a number"),
])
def test_decode_errors_name_the_problem(obj, match):
    with pytest.raises(KvEventDecodeError, match=match):
        decode_batch(msgpack.packb(obj))


def test_normalize_hash_range():
    assert normalize_hash(-(1 << 63)) == 1 << 63
    with pytest.raises(ValueError, match="outside the i64/u64 range"):
        normalize_hash(1 << 64)
    with pytest.raises(ValueError, match="outside the i64/u64 range"):
        normalize_hash(-(1 << 63) - 1)
    with pytest.raises(ValueError, match="got bool"):
        normalize_hash(True)


def test_decode_refuses_non_msgpack_and_non_bytes():
    with pytest.raises(KvEventDecodeError, match="payload is not msgpack"):
        decode_batch(b"\xc1")
    with pytest.raises(KvEventDecodeError, match="payload is not msgpack"):
        decode_batch(msgpack.packb([1.0, []]) + b"\x00")  # trailing bytes
    with pytest.raises(KvEventDecodeError, match="payload must be bytes"):
        decode_batch("text")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown KV-event encoding 'json'"):
        encode_batch(EventBatch(0.0, ()), encoding="json")  # type: ignore[arg-type]


# ---- subscriber over real sockets ----------------------------------------------------------------------
class RecordingSink:
    """The sink model: engine hash -> chain hash of what the engine holds, plus a log of every call."""

    def __init__(self) -> None:
        self.blocks: dict[int, int | None] = {}
        self.calls: list[tuple] = []
        self.lock = threading.Lock()

    def on_stored(self, engine_id, stored):
        with self.lock:
            self.calls.append(("stored", engine_id, stored))
            self.blocks.update(zip(stored.block_hashes, stored.chain_hashes))

    def on_removed(self, engine_id, removed):
        with self.lock:
            self.calls.append(("removed", engine_id, removed))
            for h in removed:
                self.blocks.pop(h, None)

    def on_cleared(self, engine_id):
        with self.lock:
            self.calls.append(("cleared", engine_id))
            self.blocks.clear()

    def on_resync(self, engine_id):
        with self.lock:
            self.calls.append(("resync", engine_id))
            self.blocks.clear()

    def kinds(self) -> list[str]:
        return [c[0] for c in self.calls]


def truth(batches: list[EventBatch]) -> set[int]:
    held: set[int] = set()
    for b in batches:
        for ev in b.events:
            if isinstance(ev, BlockStored):
                held.update(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                held.difference_update(ev.block_hashes)
            else:
                held.clear()
    return held


class Chain:
    """A random engine-like history: prompts share prefixes, blocks get stored and evicted (capacity-bounded)."""

    def __init__(self, seed: int, bs: int = 4, capacity: int = 40) -> None:
        self.rng, self.bs, self.capacity = random.Random(seed), bs, capacity
        self.held: dict[int, None] = {}
        self.prefixes = [[self.rng.randrange(1000) for _ in range(bs * 6)] for _ in range(4)]

    def next_batch(self) -> EventBatch:
        rng, bs = self.rng, self.bs
        tokens = rng.choice(self.prefixes)[: bs * rng.randrange(1, 7)] + [rng.randrange(1000) for _ in range(bs * 3)]
        digests = [int.from_bytes(d[-8:], "big") for d in engine_block_digests(tokens, bs)]
        start = 0
        while start < len(digests) and digests[start] in self.held:
            start += 1
        new = digests[start:]
        events: list = []
        evict = max(0, len(self.held) + len(new) - self.capacity)
        if evict:
            gone = list(self.held)[:evict]
            for h in gone:
                del self.held[h]
            events.append(BlockRemoved(tuple(gone), "GPU"))
        if new:
            events.append(BlockStored(tuple(new), digests[start - 1] if start else None,
                                      tuple(tokens[start * bs:len(digests) * bs]), bs, None, "GPU", None))
            self.held.update(dict.fromkeys(new))
        return EventBatch(time.time(), tuple(events), 0)


def _wait(pred, timeout_s: float = 5.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def test_chain_hashes_match_the_gateway_hash_and_map_removals():
    bs = 4
    tokens = list(range(100, 100 + 5 * bs))
    d = [int.from_bytes(x[-8:], "big") for x in engine_block_digests(tokens, bs)]
    sink = RecordingSink()
    # published before the subscriber starts, so its start-up replay delivers them in order: a batch published
    # while a new SUB's subscription is still on its way would be dropped by the PUB socket, and with no later
    # batch nothing would show the gap (ZeroMQ's slow joiner; the live path is covered by the other tests)
    with KvEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0") as pub:
        pub.publish(EventBatch(1.0, (BlockStored(tuple(d[:2]), None, tuple(tokens[:2 * bs]), bs, 3, "GPU", "lora-a"),)))
        # a later event continues the chain from a parent stored earlier: the subscriber's map supplies it
        pub.publish(EventBatch(2.0, (BlockStored(tuple(d[2:]), d[1], tuple(tokens[2 * bs:]), bs, 3, "GPU", "lora-a"),
                                     BlockRemoved((d[4], 999), "GPU"))))
        pub.publish(EventBatch(3.0, (BlockStored((77,), 12345, tuple(range(bs)), bs, None, "GPU", None),)))
        pub.publish(EventBatch(4.0, (AllBlocksCleared(),)))
        assert pub.flush()
        with KvEventSubscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint, engine_id="e0", sink=sink):
            _wait(lambda: len(sink.calls) == 5, what="5 sink calls")
    expect = [int(h) for h in hash_blocks(tokens, bs)]  # what the gateway's planner computes (no LoRA, no namespace)
    s1, s2 = sink.calls[0][2], sink.calls[1][2]
    assert list(s1.chain_hashes) + list(s2.chain_hashes) == expect
    assert list(s1.local_hashes) == [int(h) for h in local_hashes(tokens[:2 * bs], bs)]
    assert s1.lora_name == "lora-a" and s1.lora_id == 3 and s1.medium == "GPU"
    removed = sink.calls[2][2]
    assert list(removed) == [d[4], 999] and removed.chain_hashes == (expect[4], None)
    orphan = sink.calls[3][2]  # its parent was never seen: chain unknown
    assert orphan.chain_hashes == (None,)
    assert sink.kinds() == ["stored", "stored", "removed", "stored", "cleared"]


@pytest.mark.parametrize("encoding, form", [("tagged", "bytes"), ("positional", "i64")])
def test_late_join_and_lost_batches_are_replayed(encoding, form):
    """A real gap: batches published before the subscriber connects, then batches the publisher's fault knob drops
    from the PUB socket (seeded); the replay socket fills both and the sink ends equal to the engine's truth."""
    seed = 11
    chain, sink, sent = Chain(seed), RecordingSink(), []
    with KvEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", encoding=encoding,
                          hash_form=form, drop_rate=0.3, seed=seed) as pub:
        for _ in range(5):
            sent.append(chain.next_batch())
            pub.publish(sent[-1])
        assert pub.flush()
        with KvEventSubscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint, engine_id="e", sink=sink) as sub:
            assert sub.wait_for_seq(4, 5.0)  # the start-up replay brought the history before it connected
            for _ in range(200):
                sent.append(chain.next_batch())
                pub.publish(sent[-1])
            sent.append(EventBatch(0.0, ()))  # a last batch that is surely sent: drop_rate applies to it too,
            while True:                       # so keep publishing empties until one arrives
                pub.publish(EventBatch(0.0, ()))
                assert pub.flush()
                if sub.wait_for_seq(pub.next_seq - 1, 0.5):
                    break
        assert pub.stats.dropped_by_fault > 10, f"seed {seed}: the fault knob should have dropped batches"
    assert sub.stats.gaps >= 1 and sub.stats.replayed >= pub.stats.dropped_by_fault + 5 - 1
    assert sub.stats.resyncs == 0 and sub.stats.malformed == 0
    assert set(sink.blocks) == truth(sent) == set(chain.held)
    # every chain hash that is known equals the gateway's hash of the block's prefix
    assert all(c is not None for c in sink.blocks.values())


def test_replay_buffer_too_small_signals_resync():
    chain, sink = Chain(5), RecordingSink()
    with KvEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", buffer_steps=3) as pub:
        sent = [chain.next_batch() for _ in range(10)]
        for b in sent:
            pub.publish(b)
        assert pub.flush()
        with KvEventSubscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint, engine_id="e", sink=sink) as sub:
            while not sub.wait_for_seq(pub.next_seq - 1, 0.3):  # keep sending until the slow joiner has joined
                sent.append(chain.next_batch())
                pub.publish(sent[-1])
    # the buffer no longer reached back to seq 0, but nothing had reached the sink yet: nothing to forget
    assert sub.stats.resyncs == 0 and sub.stats.resyncs_skipped == 1 and "resync" not in sink.kinds()
    # the sink holds only what the replayed and later batches stored, all of it still held by the engine
    assert sink.blocks and set(sink.blocks) <= truth(sent)
    # now lose batches in the middle, beyond the buffer: this time the sink is told to forget
    with KvEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", buffer_steps=2,
                          drop_rate=0.9, seed=2) as pub:
        sink2 = RecordingSink()
        with KvEventSubscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint, engine_id="e", sink=sink2) as sub2:
            deadline = time.monotonic() + 10
            while sub2.stats.resyncs == 0:
                pub.publish(chain.next_batch())
                time.sleep(0.002)
                assert time.monotonic() < deadline, sub2.stats
    assert sink2.kinds().count("resync") == sub2.stats.resyncs >= 1


def test_gap_without_replay_socket_and_publisher_restart_resync():
    sink = RecordingSink()
    with KvEventPublisher("tcp://127.0.0.1:0") as pub:
        endpoint = pub.endpoint
        for _ in range(3):  # published before anyone listens: lost, so the first batch the subscriber sees is a gap
            pub.publish(EventBatch(0.0, (BlockStored((1,), None, (5,), 1),)))
        assert pub.flush()
        with KvEventSubscriber(endpoint, engine_id="e", sink=sink) as sub:
            deadline = time.monotonic() + 10
            while not sub.wait_for_seq(pub.next_seq, 0.2):
                pub.publish(EventBatch(0.0, (BlockStored((1,), None, (5,), 1),)))
                assert time.monotonic() < deadline
            # a gap before anything reached the sink: no replay socket, but nothing to forget either
            assert sub.stats.gaps == 1 and sub.stats.resyncs == 0 and sub.stats.resyncs_skipped == 1
            assert sink.kinds()[0] == "stored"
            pub.close()
            # a restarted engine numbers from 0 again on the same endpoint (the old listener closes asynchronously)
            deadline = time.monotonic() + 10
            while True:
                try:
                    pub2 = KvEventPublisher(endpoint)
                    break
                except Exception:
                    assert time.monotonic() < deadline, "the endpoint was not released"
                    time.sleep(0.05)
            with pub2:
                # seen as a restart (seq <= last) or, if the SUB reconnects late, as a gap: a resync either way
                while sub.stats.resyncs < 1:
                    pub2.publish(EventBatch(0.0, (BlockStored((2,), None, (6,), 1),)))
                    time.sleep(0.02)
                    assert time.monotonic() < deadline, "the restart was not seen"
                assert sub.stats.restarts + sub.stats.gaps >= 2 and sink.kinds().count("resync") == 1


def test_a_huge_sequence_jump_costs_nothing():
    """A first batch numbered 2**62 (an engine that published for months, no replay): handled at once, no resync
    (nothing reached the sink before), the batch applied."""
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sink = RecordingSink()
    try:
        with KvEventSubscriber(f"tcp://127.0.0.1:{port}", engine_id="e", sink=sink) as sub:
            assert pub.poll(5000)
            pub.recv()
            pub.send_multipart([b"", (1 << 62).to_bytes(8, "big"),
                                encode_batch(EventBatch(0.0, (BlockStored((5,), None, (1,), 1),)))])
            assert sub.wait_for_seq(1 << 62, 5.0)
        assert set(sink.blocks) == {5}
        assert sub.stats.gaps == 1 and sub.stats.resyncs_skipped == 1 and sub.stats.resyncs == 0
    finally:
        pub.close(0)


def test_sink_errors_do_not_stop_the_subscriber():
    class Exploding(RecordingSink):
        def on_stored(self, engine_id, stored):
            super().on_stored(engine_id, stored)
            raise RuntimeError("sink bug")

    sink = Exploding()
    with KvEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0") as pub:
        for i in range(3):  # before the subscriber: its start-up replay delivers them (no slow-joiner loss)
            pub.publish(EventBatch(0.0, (BlockStored((i,), None, (i,), 1),)))
        assert pub.flush()
        with KvEventSubscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint, engine_id="e", sink=sink) as sub:
            assert sub.wait_for_seq(2, 5.0)
    assert sub.stats.sink_errors == 3 and set(sink.blocks) == {0, 1, 2}


# ---- the stand-in engine's events, end to end -------------------------------------------------------------
def test_engine_sim_events_end_to_end():
    """Real engine-sim process (positional encoding, i64 hashes, seeded lost batches) -> subscriber: the sink holds
    exactly the engine's cached blocks, each mapped to the gateway's chain hash of its prompt prefix."""
    import openai

    sink = RecordingSink()
    with EngineSimProcess(fixed_ttft_ms=1, decode_ms_per_token=0, gpu_blocks=24, kv_events="tcp://127.0.0.1:0",
                          kv_events_replay="tcp://127.0.0.1:0", kv_events_encoding="positional",
                          hash_signedness="i64", kv_events_drop_rate=0.2, fault_seed=3) as sim:
        with KvEventSubscriber(sim.info["kv_events"], replay_endpoint=sim.info["kv_events_replay"], engine_id="sim",
                               sink=sink) as sub:
            c = openai.OpenAI(base_url=sim.url + "/v1", api_key="x", max_retries=0)

            def settle() -> None:
                """A lost LAST batch shows no gap until another one comes: send fresh prompts until the subscriber
                has handled every batch the engine published."""
                for i in range(100):
                    n = sim.metrics()["quillcache_sim_kv_event_batches_total"]
                    if sub.wait_for_seq(int(n) - 1, 0.5):
                        return
                    c.completions.create(model="quillcache-sim", prompt=f"settle {i:03d} " + "q" * 32, max_tokens=1)
                raise AssertionError("the subscriber never caught up")

            rng = random.Random(9)
            prompts = ["".join(rng.choice("abc") for _ in range(rng.randrange(40, 120))) for _ in range(12)]
            for p in prompts:
                c.completions.create(model="quillcache-sim", prompt=p, max_tokens=3)
            urllib.request.urlopen(urllib.request.Request(sim.url + "/reset_prefix_cache", method="POST"), timeout=5)
            settle()
            assert "cleared" in sink.kinds()
            for p in prompts[:4]:
                c.completions.create(model="quillcache-sim", prompt=p, max_tokens=3)
            settle()
            assert len(sink.blocks) == sim.metrics()["quillcache_sim_cached_blocks"]
            assert sum(k == "removed" for k in sink.kinds()) > 0  # 24 blocks of capacity: evictions happened
        assert sub.stats.malformed == 0 and sub.stats.resyncs == 0
    # each block's chain hash is the gateway's hash of its prompt prefix (byte tokenizer, block 16)
    expected: dict[int, int] = {}
    for p in prompts[:4]:
        toks = list(p.encode())
        for d, ch in zip(engine_block_digests(toks, 16), hash_blocks(toks, 16)):
            expected[int.from_bytes(d[-8:], "big")] = int(ch)
    assert any(h in sink.blocks for h in expected)
    assert all(sink.blocks[h] == ch for h, ch in expected.items() if h in sink.blocks)
    assert sub.stats.gaps > 0 and sub.stats.replayed > 0  # the seeded drops were real gaps, filled by replay


class CatchUpSink(RecordingSink):
    def on_caught_up(self, engine_id):
        with self.lock:
            self.calls.append(("caught_up", engine_id, set(self.blocks)))


def test_caught_up_comes_after_the_whole_replayed_history():
    """A gateway is ready only once the engine's history is applied: ``on_caught_up`` is called once, after every
    call of the start-up replay, and at that moment the sink already holds the engine's truth; ``caught_up`` is set.
    Without a replay socket there is nothing to wait for: the signal comes at once."""
    chain, sink, sent = Chain(5), CatchUpSink(), []
    with KvEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0") as pub:
        for _ in range(40):
            sent.append(chain.next_batch())
            pub.publish(sent[-1])
        assert pub.flush()
        with KvEventSubscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint, engine_id="e", sink=sink) as sub:
            assert sub.caught_up.wait(5.0)
            _wait(lambda: "caught_up" in sink.kinds(), what="on_caught_up")
            deadline = time.monotonic() + 5.0
            while not sub.wait_for_seq(40, 0.3):  # live batches after the catch-up, until the slow joiner has joined
                assert time.monotonic() < deadline, sub.stats
                pub.publish(chain.next_batch())
                assert pub.flush()
    kinds = sink.kinds()
    assert kinds.count("caught_up") == 1
    at = kinds.index("caught_up")
    assert at >= 1 and all(k != "caught_up" for k in kinds[:at])
    assert sink.calls[at][2] == truth(sent)  # the whole history was applied before the signal
    assert kinds[at + 1:], "the live batch came after the signal"
    plain = CatchUpSink()
    with KvEventPublisher("tcp://127.0.0.1:0") as pub2, \
            KvEventSubscriber(pub2.endpoint, engine_id="p", sink=plain) as sub2:
        assert sub2.caught_up.wait(5.0)
        _wait(lambda: plain.kinds() == ["caught_up"], what="on_caught_up without replay")


def test_a_replay_larger_than_the_routers_high_water_mark_is_read_in_pages():
    """vLLM's publisher answers a replay request with its whole buffer in one loop through a ROUTER, which drops
    silently what does not fit the peer's pipe (a stretch of batches, often the end marker). The subscriber asks
    again from the first batch it is missing until it has the whole history: the start-up catch-up applies all of
    it, with no resync; the same holds for a gap in the live stream that only a long replay fills."""
    chain, sink, sent = Chain(3, bs=256, capacity=400), RecordingSink(), []
    with KvEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", replay_hwm=20) as pub:
        for _ in range(600):
            sent.append(chain.next_batch())
            pub.publish(sent[-1])
        assert pub.flush()
        with KvEventSubscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint, engine_id="e", sink=sink) as sub:
            assert sub.caught_up.wait(60.0)
            assert sub.last_seq == 599 and sub.stats.replayed == 600, sub.stats
            assert sub.stats.replay_pages >= 2, "the answer should not have fit the ROUTER's pipe in one page"
            assert sub.stats.resyncs == 0 and sub.stats.resyncs_skipped == 0
            assert set(sink.blocks) == truth(sent)
        # a long replay of a middle range (what a gap fill asks for), read in pages too, by a subscriber of its own
        # (ZeroMQ sockets belong to one thread)
        probe = KvEventSubscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint, engine_id="p", sink=sink)
        try:
            assert sorted(probe._collect_replay(100, 550)) == list(range(100, 550))
            assert probe.stats.replay_pages >= 2
        finally:
            if probe._replay is not None:
                probe._replay.close(0)
