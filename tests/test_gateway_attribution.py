"""Root-block attribution of engine stores is refused while another scope may have caused them.

A stored block without an attributed parent is credited to the scope whose speculation is pending for its
chain hash. A speculation leaves the pending set by TTL (its request may still be queued at the engine) and by
retraction (the client left, the engine may have prefilled already); each request's CLAIM on its chain hashes
stays while the request is in flight and, after it ended, for a grace period (``quillcache.gateway.residency``).
These tests drive the real tracker, decider and flat index with a fake clock, and two real peer links over
loopback ZeroMQ (polled with a deadline)."""

from __future__ import annotations

import asyncio
import time

import msgpack
import numpy as np
import pytest

from quillcache.gateway.decision import Decider
from quillcache.gateway.peers import PeerLink
from quillcache.gateway.residency import EntryState, ResidencyTracker
from quillcache.hashing import hash_blocks
from quillcache.identity.scope import make_identity
from quillcache.index import open_index
from quillcache.types import KvLayout

pytestmark = pytest.mark.timeout(60)

BS = 4
TTL_S = 2.0
TOKENS = list(range(1, 4 * BS + 2))  # 4 full blocks
H = [int(x) for x in hash_blocks(TOKENS, BS)]
A_ENGINE = [1000, 1001, 1002, 1003]  # tenant A's blocks (the engine's hashes carry A's salt)
B_ENGINE = [2000, 2001, 2002, 2003]  # tenant B's


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _ident(tenant: str):
    return make_identity(model="m", tenant=tenant, layout=KvLayout(block_size_tokens=BS))


def _stack(clock: Clock):
    index = open_index("flat")
    tr = ResidencyTracker(index, {"e0": "events"}, ttl_s=TTL_S, clock=clock)
    dec = Decider(index, ["e0"], tr, block_size_tokens=BS, seed=7)
    return index, tr, dec


def _entries(index, dec, tenant: str) -> set[int]:
    digest = dec.scope(_ident(tenant)).digest
    return {e.block_hash for e in index.entries_on_node("e0") if e.identity == digest}


def _confirmed(tr, dec, tenant: str) -> int:
    digest = dec.scope(_ident(tenant)).digest
    return sum(1 for r in tr._live["e0"].values() if r.state is EntryState.CONFIRMED and r.digest == digest)


def test_a_store_after_the_owners_speculation_expired_is_not_credited_to_another_scope():
    clock = Clock()
    index, tr, dec = _stack(clock)
    d_a = dec.decide(_ident("a"), TOKENS, 4)  # A routed: its request is queued at the engine
    clock.t += TTL_S + 0.5
    assert tr.expire() == 4  # A's speculation ran out; A's request is still in flight (its lease is live)
    d_b = dec.decide(_ident("b"), TOKENS, 4)  # B routes the same prompt to the same engine
    assert tr.stored("e0", A_ENGINE, H, None) == 0  # A's store: B is pending, but A may have stored it
    assert _confirmed(tr, dec, "b") == 0 and tr.stats.ambiguous >= 1
    assert tr.stored("e0", B_ENGINE, H, None) == 0  # B's own store is just as ambiguous while A is in flight
    assert tr.removed("e0", A_ENGINE) == 0  # nothing of B's lives or dies with A's blocks
    tr.check()
    # A's request ends: its claim still blocks for the grace period (its events may be on the way) ...
    d_a.lease.release()
    tr.expire()
    d_b.lease.release()
    clock.t += 0.5
    d_b2 = dec.decide(_ident("b"), TOKENS, 4)
    assert tr.stored("e0", B_ENGINE, H, None) == 0
    # ... and no longer after it
    clock.t += TTL_S
    tr.expire()
    d_b2.lease.release()
    d_b3 = dec.decide(_ident("b"), TOKENS, 4)
    assert tr.stored("e0", B_ENGINE, H, None) == 4 and _entries(index, dec, "b") == set(H)
    d_b3.lease.release()
    tr.check()


def test_a_store_after_the_owner_retracted_is_not_credited_to_another_scope():
    """The client left before the first token; the engine had prefilled and stores A's blocks afterwards."""
    clock = Clock()
    index, tr, dec = _stack(clock)
    d_a = dec.decide(_ident("a"), TOKENS, 4)
    d_a.lease.release()  # the gateway's finish(): release, then retract (no output reached the client)
    dec.retract(d_a)
    assert _entries(index, dec, "a") == set()
    d_b = dec.decide(_ident("b"), TOKENS, 4)
    assert tr.stored("e0", A_ENGINE, H, None) == 0 and _confirmed(tr, dec, "b") == 0
    clock.t += TTL_S + 0.1  # past the grace: B's own (re)store is B's
    tr.expire()
    d_b.lease.release()
    d_b2 = dec.decide(_ident("b"), TOKENS, 4)
    assert tr.stored("e0", B_ENGINE, H, None) == 4
    d_b2.lease.release()
    tr.check()


def test_a_finished_request_whose_stores_all_arrived_blocks_nobody():
    """Sequential tenants sharing a prompt keep exact attribution: once every block A speculated was confirmed and
    A's request ended, none of A's stores is on the way, so B's store right after is B's (no grace wait)."""
    clock = Clock()
    index, tr, dec = _stack(clock)
    d_a = dec.decide(_ident("a"), TOKENS, 4)
    assert tr.stored("e0", A_ENGINE, H, None) == 4
    d_a.lease.release()
    d_b = dec.decide(_ident("b"), TOKENS, 4)
    assert tr.stored("e0", B_ENGINE, H, None) == 4 and _entries(index, dec, "b") == set(H)
    d_b.lease.release()
    # while a request is in flight, even a fully confirmed one blocks (the engine may recompute after preemption)
    d_c = dec.decide(_ident("c"), TOKENS, 4)
    assert tr.stored("e0", [3000, 3001, 3002, 3003], H, None) == 4
    d_a2 = dec.decide(_ident("a2"), TOKENS, 4)
    assert tr.stored("e0", [4000, 4001, 4002, 4003], H, None) == 0  # c is in flight
    d_c.lease.release()
    d_a2.lease.release()
    tr.check()


def test_a_capped_speculation_claims_every_new_block():
    """With ``speculative_max_blocks`` only the first blocks are speculated; the claim covers all new blocks, so
    a later block of A's store (its root unattributed) is not credited to B's pending speculation of it."""
    clock = Clock()
    index, tr, dec = _stack(clock)
    dec.speculative_max_blocks = 1
    d_a = dec.decide(_ident("a"), TOKENS, 4)
    clock.t += TTL_S + 0.5
    tr.expire()
    dec.speculative_max_blocks = 0
    d_b = dec.decide(_ident("b"), TOKENS, 4)
    assert tr.stored("e0", A_ENGINE, H, None) == 0 and _confirmed(tr, dec, "b") == 0
    d_a.lease.release()
    d_b.lease.release()


def test_ended_claims_are_unindexed():
    clock = Clock()
    index, tr, dec = _stack(clock)
    for i in range(50):
        tenant = "ab"[i % 2]
        d = dec.decide(_ident(tenant), [i + 1] + TOKENS, 4)
        if i % 3:
            tr.stored("e0", list(range(10 * i, 10 * i + 4)), [int(x) for x in hash_blocks([i + 1] + TOKENS, BS)], None)
        d.lease.release()
        if i % 5 == 0:
            dec.retract(d)
    assert tr._claimed and tr._claims["e0"]
    clock.t += 0.5
    tr.expire()  # sees every request ended; the retracted and the unconfirmed ones still block
    assert tr._claimed and tr._claims["e0"]
    clock.t += TTL_S + 0.1
    tr.expire()
    assert tr._claimed == [] and tr._claims["e0"] == {}


# ---------------------------------------------------------------------------------------------- peers
def test_a_peers_store_is_not_credited_to_another_scope_after_the_peers_speculation_expired():
    """Replica 1 routes A, replica 2 routes B, the same prompt to the same engine. A's speculation expires on both
    (A still queued); A's store reaches both: neither credits it to B. After A ends (its "e" reaches replica 2)
    and the grace period, B's own store is B's on replica 2."""

    async def wait_for(pred, what: str) -> None:
        deadline = time.monotonic() + 15
        while not pred():
            assert time.monotonic() < deadline, what
            await asyncio.sleep(0.005)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        clock = Clock()
        (i1, t1, d1), (i2, t2, d2) = _stack(clock), _stack(clock)
        l1 = PeerLink(t1, loop, bind="tcp://127.0.0.1:0")
        l2 = PeerLink(t2, loop, bind="tcp://127.0.0.1:0")
        l1.peers, l2.peers = (l2.endpoint,), (l1.endpoint,)
        d1.peers, d2.peers = l1, l2
        l1.start(), l2.start()
        try:
            for src, dst in ((d1, l2), (d2, l1)):  # a SUB gets nothing sent before it connected: warm up
                k = 0
                deadline = time.monotonic() + 15
                while dst.stats.received == 0:
                    assert time.monotonic() < deadline, "the peer link never connected"
                    src.decide(_ident("warm"), [9000 + k] + TOKENS, 1).lease.release()
                    k += 1
                    await asyncio.sleep(0.02)
            d_a = d1.decide(_ident("a"), TOKENS, 4)
            await wait_for(lambda: _entries(i2, d2, "a") == set(H), "A's claim never reached replica 2")
            clock.t += TTL_S + 0.5
            t1.expire(), t2.expire()  # A's speculation (and the warm-ups') ran out on both; A is still in flight
            assert _entries(i1, d1, "a") == set() == _entries(i2, d2, "a")
            d_b = d2.decide(_ident("b"), TOKENS, 4)
            await wait_for(lambda: _entries(i1, d1, "b") == set(H), "B's claim never reached replica 1")
            for tr, dec in ((t1, d1), (t2, d2)):
                assert tr.stored("e0", A_ENGINE, H, None) == 0
                assert _confirmed(tr, dec, "b") == 0
                tr.check()
            d_a.lease.release()  # A ends on replica 1: its next sweep tells replica 2
            clock.t += 0.3
            t1.expire()
            digest_a = d2.scope(_ident("a")).digest
            await wait_for(lambda: all(c.digest != digest_a for c, _ in l2._remote.values()),
                           "A's end never reached replica 2")
            assert t2.stored("e0", B_ENGINE, H, None) == 0  # within the grace period
            clock.t += TTL_S + 0.1
            d_b.lease.release()
            t2.expire()
            d_b2 = d2.decide(_ident("b"), TOKENS, 4)
            assert t2.stored("e0", B_ENGINE, H, None) == 4 and _entries(i2, d2, "b") == set(H)
            d_b2.lease.release()
        finally:
            l1.close()
            l2.close()

    asyncio.run(main())


def test_peer_link_applies_claims_and_refuses_garbage():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    clock = Clock()
    index, tr, dec = _stack(clock)
    loop = asyncio.new_event_loop()
    link = PeerLink(tr, loop, bind="inproc://gateway-attribution-peer-test")
    try:
        d_a = dec.scope(_ident("a")).digest
        origin = b"\x01" * 8
        hashes = np.array(H, dtype="<u8").tobytes()
        good = msgpack.packb(["c", origin, "e0", d_a, hashes, 7, 2, False])
        link._apply(*link._decode([good]))
        assert _entries(index, dec, "a") == set(H[:2])  # speculated the first two, claimed all four
        link._apply(*link._decode([msgpack.packb(["r", origin, "e0", d_a, b"", 7, 0, True])]))
        assert _entries(index, dec, "a") == set()
        d_b = dec.decide(_ident("b"), TOKENS, 4)
        assert tr.stored("e0", A_ENGINE, H, None) == 0  # the retracted peer claim still blocks
        link._apply(*link._decode([msgpack.packb(["e", origin, "e0", d_a, b"", 7, 0, True])]))
        clock.t += TTL_S + 0.1
        tr.expire()
        d_b.lease.release()
        d_b2 = dec.decide(_ident("b"), TOKENS, 4)
        assert tr.stored("e0", B_ENGINE, H, None) == 4
        d_b2.lease.release()
        for bad in ([good, good], [b"\xc1"], [msgpack.packb(["c", origin, "e9", d_a, b"", 1, 0, True])],
                    [msgpack.packb(["c", origin, "e0", b"short", b"", 1, 0, True])],
                    [msgpack.packb(["x", origin, "e0", d_a, b"", 1, 0, True])],
                    [msgpack.packb(["c", origin, "e0", d_a, b"1234567", 1, 0, True])],
                    [msgpack.packb(["c", origin, "e0", d_a, hashes, 1, 5, True])],  # speculates past its hashes
                    [msgpack.packb(["c", origin, "e0", d_a, hashes, -1, 0, True])],
                    [msgpack.packb(["c", b"short", "e0", d_a, hashes, 1, 0, True])],
                    [msgpack.packb(["c", origin, "e0", d_a, hashes, 1, 0, 1])],
                    [msgpack.packb(["s", "e0", d_a, hashes])], [msgpack.packb({"s": 1})]):
            assert link._decode(bad) is None, bad

        @settings(max_examples=300, deadline=None)
        @given(st.binary(max_size=200))
        def never_crashes(data):
            m = link._decode([data])
            if m is not None:
                link._apply(*m)
            tr.check()

        never_crashes()
    finally:
        link.close()
        loop.close()
