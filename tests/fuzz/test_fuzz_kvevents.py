"""Fuzz targets for the vLLM KV-event intake (``quillcache.kvevents``).

- ``decode_batch`` on random bytes, on msgpack of random structures shaped like batches and events, and on valid
  payloads with bytes flipped, cut or appended: it raises only ``KvEventDecodeError``, or returns a batch whose
  events satisfy the documented invariants (u64 hashes, ``len(token_ids) == blocks x block_size``, ...).
- ``KvEventSubscriber`` over a real ZeroMQ socket: a valid event stream interleaved with garbage messages (wrong
  frame counts, wrong sequence frames, payloads that do not decode) never stops the subscriber, counts every garbage
  message as malformed, and leaves the sink's state exactly what the valid stream alone produces.

``make fuzz`` runs these with a large budget (the socket target is capped: each example opens sockets).
"""

from __future__ import annotations

import random
import time

import msgpack
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quillcache.kvevents import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KvEventDecodeError,
    KvEventSubscriber,
    decode_batch,
    encode_batch,
)

_SUPPRESS = [HealthCheck.too_slow, HealthCheck.data_too_large]
U64 = (1 << 64) - 1


def _check_batch(b: EventBatch) -> None:
    assert isinstance(b.ts, float) and b.unknown_events >= 0
    for ev in b.events:
        if isinstance(ev, BlockStored):
            assert ev.block_size >= 1 and len(ev.token_ids) == len(ev.block_hashes) * ev.block_size
            assert all(0 <= t < 1 << 32 for t in ev.token_ids)
            assert ev.parent_block_hash is None or 0 <= ev.parent_block_hash <= U64
        else:
            assert isinstance(ev, (BlockRemoved, AllBlocksCleared))
        for h in getattr(ev, "block_hashes", ()):
            assert 0 <= h <= U64


def _decode_or_refuse(payload: bytes) -> None:
    try:
        b = decode_batch(payload)
    except KvEventDecodeError:
        return
    _check_batch(b)


@settings(suppress_health_check=_SUPPRESS)
@given(st.binary(max_size=512))
def test_decode_random_bytes(payload):
    _decode_or_refuse(payload)


_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 63), U64), st.floats(allow_nan=True),
                     st.binary(max_size=40), st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared",
                                                              "GPU", "type", ""]))
_keys = st.sampled_from(["type", "ts", "events", "data_parallel_rank", "block_hashes", "parent_block_hash",
                         "token_ids", "block_size", "lora_id", "medium", "lora_name", "x"])
_trees = st.recursive(_scalars, lambda kids: st.one_of(st.lists(kids, max_size=8),
                                                       st.dictionaries(_keys, kids, max_size=8)), max_leaves=60)


@settings(suppress_health_check=_SUPPRESS)
@given(_trees)
def test_decode_random_structures(obj):
    _decode_or_refuse(msgpack.packb(obj, use_bin_type=True))


def _valid_payload(rng: random.Random) -> bytes:
    bs = rng.randrange(1, 5)
    n = rng.randrange(0, 4)
    events = [BlockStored(tuple(rng.getrandbits(64) for _ in range(n)), rng.choice([None, rng.getrandbits(64)]),
                          tuple(rng.randrange(1 << 32) for _ in range(n * bs)), bs, None, "GPU", None),
              BlockRemoved(tuple(rng.getrandbits(64) for _ in range(n)), "GPU"), AllBlocksCleared()]
    rng.shuffle(events)
    return encode_batch(EventBatch(rng.random(), tuple(events), 0), encoding=rng.choice(["tagged", "positional"]),
                        hash_form=rng.choice(["u64", "i64", "bytes"]))


@settings(suppress_health_check=_SUPPRESS)
@given(st.integers(0, 2**32), st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=6),
       st.integers(0, 600), st.binary(max_size=16))
def test_decode_mutated_valid_payloads(seed, flips, cut, tail):
    data = bytearray(_valid_payload(random.Random(seed)))
    for pos, byte in flips:
        if data:
            data[pos % len(data)] = byte
    _decode_or_refuse(bytes(data[: max(0, len(data) - cut % (len(data) + 1))]) + tail)


# ---- the subscriber, over a real socket ------------------------------------------------------------------------
class _Sink:
    def __init__(self) -> None:
        self.blocks: set[int] = set()
        self.resyncs = 0

    def on_stored(self, engine_id, stored):
        self.blocks.update(stored.block_hashes)

    def on_removed(self, engine_id, removed):
        self.blocks.difference_update(removed)

    def on_cleared(self, engine_id):
        self.blocks.clear()

    def on_resync(self, engine_id):
        self.resyncs += 1
        self.blocks.clear()


def _garbage(data: st.DataObject) -> list[bytes]:
    kind = data.draw(st.sampled_from(["frames", "seq", "payload"]))
    if kind == "frames":
        n = data.draw(st.sampled_from([1, 2, 4, 5]))
        return [data.draw(st.binary(max_size=24)) for _ in range(n)]
    if kind == "seq":  # a valid payload behind a sequence frame of the wrong size
        seq = data.draw(st.binary(max_size=12).filter(lambda b: len(b) != 8))
        return [b"", seq, _valid_payload(random.Random(data.draw(st.integers(0, 1000))))]
    payload = data.draw(st.one_of(st.binary(max_size=200), _trees.map(lambda o: msgpack.packb(o, use_bin_type=True))))
    try:
        decode_batch(payload)
        payload = b"\xc1" + payload  # it decoded: make it garbage (0xc1 is never valid msgpack)
    except KvEventDecodeError:
        pass
    return [b"", data.draw(st.binary(min_size=8, max_size=8)), payload]


@settings(max_examples=min(settings.default.max_examples, 60), deadline=None, suppress_health_check=_SUPPRESS)
@given(st.data())
def test_subscriber_survives_garbage_and_keeps_exact_state(data):
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.XPUB)  # an XPUB tells us when the subscriber has joined: nothing is lost to a slow join
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sink = _Sink()
    rng = random.Random(data.draw(st.integers(0, 2**32), label="seed"))
    held: set[int] = set()
    n_garbage = 0
    try:
        with KvEventSubscriber(f"tcp://127.0.0.1:{port}", engine_id="e", sink=sink) as sub:
            assert pub.poll(5000), "the subscriber never subscribed"
            pub.recv()
            seq = 0
            for _ in range(data.draw(st.integers(1, 12), label="steps")):
                if data.draw(st.booleans(), label="garbage?"):
                    pub.send_multipart(_garbage(data))
                    n_garbage += 1
                    continue
                hashes = tuple(rng.getrandbits(64) for _ in range(rng.randrange(1, 4)))
                gone = tuple(rng.sample(sorted(held), min(len(held), rng.randrange(0, 3))))
                batch = EventBatch(0.0, (BlockRemoved(gone), BlockStored(hashes, None, tuple(range(len(hashes))), 1)))
                held.difference_update(gone)
                held.update(hashes)
                pub.send_multipart([b"", seq.to_bytes(8, "big"), encode_batch(batch)])
                seq += 1
            pub.send_multipart([b"", seq.to_bytes(8, "big"), encode_batch(EventBatch(0.0, ()))])
            assert sub.wait_for_seq(seq, 30.0), f"subscriber stalled; stats {sub.stats}"
            deadline = time.monotonic() + 5
            while sub.stats.malformed < n_garbage:  # garbage after the last valid batch may still be in flight
                assert time.monotonic() < deadline, sub.stats
                time.sleep(0.001)
            assert sub._thread is not None and sub._thread.is_alive()
        assert sub.stats.malformed == n_garbage and sub.stats.internal_errors == 0
        assert sink.resyncs == 0 and sink.blocks == held
    finally:
        pub.close(0)
