"""Root-block attribution of engine stores is refused while another scope may have caused them.

A stored block without an attributed parent is credited to the scope whose speculation is pending for its
chain hash. A speculation leaves the pending set by TTL (its request may still be queued at the engine) and by
retraction (the client left, the engine may have prefilled already); each request's CLAIM on its chain hashes
stays while the request is in flight and, after it ended, for a grace period (``quillcache.gateway.residency``).
These tests drive the real tracker, decider and flat index with a fake clock, and two real peer links over
loopback ZeroMQ (polled with a deadline)."""

from __future__ import annotations

import asyncio
import contextlib
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
SYS = list(range(1, 2 * BS + 1))  # a 2-block system prompt shared by tenants S and T
P1 = SYS + list(range(100, 100 + 2 * BS + 1))  # S's first question
P2 = SYS + list(range(200, 200 + 2 * BS + 1))  # S's second question (private to S)
PT = SYS + list(range(300, 300 + 2 * BS + 1))  # T's question
H1, H2, HT = ([int(x) for x in hash_blocks(p, BS)] for p in (P1, P2, PT))
S2_ENGINE = [5000, 5001, 5002, 5003]  # S's R2 blocks (S's salt)


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


def test_refused_root_stores_are_counted_in_the_gateways_metrics():
    """``quillcache_gateway_residency_outcomes_total`` reads the tracker's counters at scrape time, so an
    operator sees the hit rate the safety rule gives up (ambiguous root stores) beside what it confirmed."""
    from quillcache.enginesim.process import parse_metrics
    from quillcache.gateway.metrics import GatewayMetrics

    clock = Clock()
    index, tr, dec = _stack(clock)
    metrics = GatewayMetrics(["e0"])
    metrics.attach_live(dict, dict, dict, lambda: 0, tr.stats.counts)

    def outcomes() -> dict[str, float]:
        m = parse_metrics(metrics.render().decode())
        pre = "quillcache_gateway_residency_outcomes_total{outcome=\""
        return {k[len(pre):-2]: v for k, v in m.items() if k.startswith(pre)}

    assert set(outcomes()) == set(tr.stats.counts()) and not any(outcomes().values())
    d_a = dec.decide(_ident("a"), TOKENS, 4)
    d_b = dec.decide(_ident("b"), TOKENS, 4)  # both scopes pending on the same chain: a store is nobody's
    assert tr.stored("e0", A_ENGINE, H, None) == 0
    got = outcomes()
    assert got["speculated"] == 8 and got["ambiguous"] == tr.stats.ambiguous >= 1 and got["confirmed"] == 0
    d_a.lease.release()
    d_b.lease.release()
    clock.t += 0.5
    tr.expire()  # both requests seen ended: their claims block for the grace period, then go
    clock.t += TTL_S + 1
    tr.expire()
    d_b2 = dec.decide(_ident("b"), TOKENS, 4)
    assert tr.stored("e0", B_ENGINE, H, None) == 4
    assert outcomes()["confirmed"] == 4
    d_b2.lease.release()


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


def test_a_request_reusing_pending_blocks_of_its_scope_claims_them():
    """R2 (scope S) reuses R1's still-pending speculation of the same prompt; R1 never reaches the engine (its
    client left) and its grace ends while R2 is queued; T routes the prompt. R2's store of S's blocks must not be
    credited to T: R2 claims the reused blocks that were not confirmed."""
    clock = Clock()
    index, tr, dec = _stack(clock)
    r1 = dec.decide(_ident("s"), TOKENS, 4)
    r2 = dec.decide(_ident("s"), TOKENS, 4)
    assert r2.cached_tokens == 4 * BS  # every block found: R1's pending entries
    r1.lease.release()
    dec.retract(r1)
    clock.t += 0.3
    tr.expire()  # the sweep sees R1 ended
    clock.t += TTL_S + 0.5
    tr.expire()  # R1's grace is over
    r_t = dec.decide(_ident("t"), TOKENS, 4)
    assert tr.stored("e0", A_ENGINE, H, None) == 0  # R2 (scope S) stores S's blocks
    assert _confirmed(tr, dec, "t") == 0
    tr.check()
    r2.lease.release()
    r_t.lease.release()


def test_a_shared_system_prompt_pending_for_a_scope_is_claimed_by_its_next_request():
    """The reviewer's r1b: S's R2 reuses R1's pending system prompt; after R1 ended and its grace ran out, T's
    request of the same system prompt must get neither S's system-prompt blocks nor (through the parent rule) S's
    private question blocks."""
    clock = Clock()
    index, tr, dec = _stack(clock)
    r1 = dec.decide(_ident("s"), P1, 4)
    r2 = dec.decide(_ident("s"), P2, 4)
    assert r2.cached_tokens == len(SYS)
    r1.lease.release()
    dec.retract(r1)
    clock.t += 0.3
    tr.expire()
    clock.t += TTL_S + 0.5
    tr.expire()
    r_t = dec.decide(_ident("t"), PT, 4)
    assert tr.stored("e0", S2_ENGINE, H2, None) == 0
    assert _confirmed(tr, dec, "t") == 0 and not (_entries(index, dec, "t") & set(H2[2:]))
    tr.check()
    r2.lease.release()
    r_t.lease.release()


def _after_s_stored_p1(clock: Clock, **tracker_kw):
    """A stack whose engine stored S's P1 (confirmed, engine hashes 7000-7003); S's request ended long ago."""
    index = open_index("flat")
    tr = ResidencyTracker(index, {"e0": "events"}, ttl_s=TTL_S, clock=clock, **tracker_kw)
    dec = Decider(index, ["e0"], tr, block_size_tokens=BS, seed=7)
    r1 = dec.decide(_ident("s"), P1, 4)
    assert tr.stored("e0", [7000, 7001, 7002, 7003], H1, None) == 4
    r1.lease.release()
    clock.t += TTL_S + 0.5
    tr.expire()
    return index, tr, dec


def test_confirmed_reused_blocks_stay_unclaimed():
    """S's R1 stored the system prompt (confirmed) and ended; S's R2 reuses it and is still in flight. T's store
    of the same system prompt is T's: R2 claims only its new blocks, so a shared prompt keeps its hit rate (an
    evicted and recomputed reused block is S's by rule 4, not by a claim)."""
    clock = Clock()
    index, tr, dec = _stack(clock)
    r1 = dec.decide(_ident("s"), P1, 4)
    assert tr.stored("e0", [7000, 7001, 7002, 7003], H1, None) == 4
    r1.lease.release()
    r2 = dec.decide(_ident("s"), P2, 4)
    assert r2.cached_tokens == len(SYS)
    r_t = dec.decide(_ident("t"), PT, 4)
    assert tr.stored("e0", [8000, 8001, 8002, 8003], HT, None) == 4 and _entries(index, dec, "t") == set(HT)
    tr.check()
    r2.lease.release()
    r_t.lease.release()


def test_a_reused_block_evicted_and_recomputed_is_not_credited_to_another_scope():
    """S's R2 reuses S's confirmed system prompt; the engine evicts it, then recomputes it for R2; meanwhile T
    routed the same prompt (T pending on the system prompt's chain hashes). R2's re-store carries S's salt: it
    must not be credited to T (it was, T being the only scope pending on those chain hashes: R2 does not claim
    its confirmed reused blocks). The tracker's memory of removed blocks' scopes (rule 4) makes it S's at once."""
    clock = Clock()
    index, tr, dec = _after_s_stored_p1(clock, max_known_blocks=1 << 10)
    r2 = dec.decide(_ident("s"), P2, 4)
    assert r2.cached_tokens == len(SYS)
    assert tr.removed("e0", [7000, 7001, 7002, 7003]) == 4  # evicted before R2 reached the engine
    r_t = dec.decide(_ident("t"), PT, 4)
    # S's salt, recomputed for R2: S's by its engine hashes (rule 4), or nobody's yet
    assert tr.stored("e0", [7000, 7001], H2[:2], None) == 2
    assert _confirmed(tr, dec, "t") == 0 and tr.stats.remembered == 1  # its child: rule 1
    assert tr.stored("e0", S2_ENGINE[2:], H2[2:], 7001) == 2  # R2's private blocks: S's, and so is the prompt
    assert _entries(index, dec, "s") == set(H2) and not (_entries(index, dec, "t") - set(HT))
    assert _confirmed(tr, dec, "t") == 0
    tr.check()
    r2.lease.release()
    r_t.lease.release()


@pytest.mark.parametrize("ended_first", [False, True])
def test_a_held_block_evicted_and_recomputed_keeps_its_scope_after_the_memory_forgot_it(ended_first):
    """As above, with rule 4's bounded memory off (``max_known_blocks=0``: what happens once it forgot the
    block). R2 holds its confirmed reused blocks WEAKLY: while it does, the tracker keeps the engine hash and
    scope of a held entry that leaves, so the recompute is S's (it was credited to T, the only scope pending),
    also when R2's events come after R2 ended (within the grace). T's own store of the same chain hashes, under
    T's engine hashes, is T's: a hold blocks nobody (a first version refused it: the review's F4)."""
    clock = Clock()
    index, tr, dec = _after_s_stored_p1(clock, max_known_blocks=0)
    r2 = dec.decide(_ident("s"), P2, 4)
    assert r2.cached_tokens == len(SYS)
    r_t = dec.decide(_ident("t"), PT, 4)
    assert tr.removed("e0", [7000, 7001]) == 2  # evicted before R2 reached the engine
    if ended_first:  # R2's events arrive after R2 ended, within the grace
        r2.lease.release()
        clock.t += TTL_S / 2
        tr.expire()
    remembered = tr.stats.remembered
    assert tr.stored("e0", [7000, 7001], H2[:2], None) == 2  # S's salt, recomputed for R2
    assert _confirmed(tr, dec, "t") == 0 and tr.stats.remembered == remembered + 1  # the child by rule 1
    assert tr.stored("e0", S2_ENGINE[2:], H2[2:], 7001) == 2
    assert _entries(index, dec, "s") == set(H1) | set(H2)
    assert tr.stored("e0", [8000, 8001], HT[:2], None) == 2  # T's own copy of the system prompt
    assert _confirmed(tr, dec, "t") == 2 and tr.stats.ambiguous == 0
    tr.check()
    r2.lease.release()
    r_t.lease.release()
    for _ in range(2):
        clock.t += TTL_S + 0.5
        tr.expire()
    assert tr._weak["e0"] == tr._weak_gone["e0"] == {}  # the held record ends with the last hold


def test_blocks_computed_again_while_still_cached_keep_their_scope():
    """S's R2 reuses S's whole confirmed prompt; the engine evicts only its first block, so its prefix match is
    empty and it computes the whole prompt again, storing the blocks it still holds under the same engine
    hashes. U, pending on the same chain hashes, is credited with none of them: all are S's by their engine
    hashes (rule 4: the first from the held record, the next still cached, the rest by rule 1)."""
    clock = Clock()
    index, tr, dec = _after_s_stored_p1(clock, max_known_blocks=0)
    r2 = dec.decide(_ident("s"), P1, 4)
    assert r2.cached_tokens == 4 * BS
    r_u = dec.decide(_ident("u"), P1, 4)
    assert _entries(index, dec, "u") == set(H1)  # pending
    assert tr.removed("e0", [7000]) == 1
    remembered = tr.stats.remembered
    assert tr.stored("e0", [7000, 7001, 7002, 7003], H1, None) == 4
    assert tr.stats.remembered == remembered + 1 and tr.stats.ambiguous == 0  # the rest by rule 1
    assert _confirmed(tr, dec, "u") == 0 and _confirmed(tr, dec, "s") == 4
    tr.check()
    r2.lease.release()
    r_u.lease.release()


def test_swept_claims_keep_nothing_a_confirmed_entry_would_retain():
    """Each turn of a conversation reuses the whole conversation so far: its claim holds every earlier block
    weakly. A confirmed entry keeps a reference to the claim of the request that speculated it, so a claim that
    kept its holds after the sweep would retain memory quadratic in the conversation's length (the review's
    F-MEM: 1,200 turns retained 1.4M weak entries); swept claims hold nothing."""
    clock = Clock()
    index, tr, dec = _stack(clock)
    toks, stored, claims = [], 0, []
    for turn in range(40):
        toks = toks + list(range(10_000 + 2 * BS * turn, 10_000 + 2 * BS * (turn + 1)))
        d = dec.decide(_ident("s"), toks + [7], 4)
        claims.append(tr._claimed[-1])
        hs = [int(h) for h in hash_blocks(toks + [7], BS)]
        tr.stored("e0", list(range(1 << 40 | stored, 1 << 40 | len(hs))), hs[stored:],
                  (1 << 40 | stored - 1) if stored else None)
        stored = len(hs)
        d.lease.release()
        clock.t += 0.5
        tr.expire()
    for _ in range(2):
        clock.t += TTL_S + 0.5
        tr.expire()
    assert all(r.claim is None for r in tr._live["e0"].values())  # confirmed: the claim is not kept
    assert tr._claimed == [] and tr._weak["e0"] == {} and sum(len(c.weak or ()) for c in claims) == 0
    assert all(c.hashes == [] for c in claims)  # what a peer link still keeps holds nothing either
    tr.check()


def test_a_retraction_reaches_the_peers_after_part_of_the_speculation_was_confirmed():
    """The engine stored the request's first block, then its client left: the rest of the speculation is
    retracted here and on the peers, although the confirmed entry no longer references the claim (the
    review's W1: the peer was not told)."""

    class Frames:
        def __init__(self) -> None:
            self.sent: list[str] = []

        def claimed(self, c, *args) -> None:
            self.sent.append("p")

        def retracted(self, c) -> None:
            self.sent.append("r")

    clock = Clock()
    index, tr, dec = _stack(clock)
    dec.peers = Frames()
    d = dec.decide(_ident("a"), TOKENS, 4)
    assert tr.stored("e0", A_ENGINE[:1], H[:1], None) == 1
    dec.retract(d)
    assert dec.peers.sent == ["p", "r"] and _entries(index, dec, "a") == set(H[:1])
    d.lease.release()
    tr.check()


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
    assert tr._tails["e0"] == tr._weak["e0"] == tr._weak_gone["e0"] == {} and tr._shorts["e0"] == []


# ---------------------------------------------------------------------------------------------- peers
async def _wait_for(pred, what: str) -> None:
    deadline = time.monotonic() + 15
    while not pred():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.005)


@contextlib.asynccontextmanager
async def _linked(clock: Clock):
    """Two replicas (index, tracker, decider, link) over one engine, linked as peers over loopback ZeroMQ."""
    loop = asyncio.get_running_loop()
    (i1, t1, d1), (i2, t2, d2) = _stack(clock), _stack(clock)
    l1 = PeerLink(t1, loop, bind="tcp://127.0.0.1:0")
    l2 = PeerLink(t2, loop, bind="tcp://127.0.0.1:0")
    l1.peers, l2.peers = (l2.endpoint,), (l1.endpoint,)
    d1.peers, d2.peers = l1, l2
    try:
        l1.start(), l2.start()
        for src, dst in ((d1, l2), (d2, l1)):  # a SUB gets nothing sent before it connected: warm up
            k = 0
            deadline = time.monotonic() + 15
            while dst.stats.received == 0:
                assert time.monotonic() < deadline, "the peer link never connected"
                src.decide(_ident("warm"), [9000 + k] + TOKENS, 1).lease.release()
                k += 1
                await asyncio.sleep(0.02)
        yield (i1, t1, d1, l1), (i2, t2, d2, l2)
    finally:
        l1.close()
        l2.close()


def test_a_peers_store_is_not_credited_to_another_scope_after_the_peers_speculation_expired():
    """Replica 1 routes A, replica 2 routes B, the same prompt to the same engine. A's speculation expires on both
    (A still queued); A's store reaches both: neither credits it to B. After A ends (its "e" reaches replica 2)
    and the grace period, B's own store is B's on replica 2."""

    async def main() -> None:
        clock = Clock()
        async with _linked(clock) as ((i1, t1, d1, l1), (i2, t2, d2, l2)):
            d_a = d1.decide(_ident("a"), TOKENS, 4)
            await _wait_for(lambda: _entries(i2, d2, "a") == set(H), "A's claim never reached replica 2")
            clock.t += TTL_S + 0.5
            t1.expire(), t2.expire()  # A's speculation (and the warm-ups') ran out on both; A is still in flight
            assert _entries(i1, d1, "a") == set() == _entries(i2, d2, "a")
            d_b = d2.decide(_ident("b"), TOKENS, 4)
            await _wait_for(lambda: _entries(i1, d1, "b") == set(H), "B's claim never reached replica 1")
            for tr, dec in ((t1, d1), (t2, d2)):
                assert tr.stored("e0", A_ENGINE, H, None) == 0
                assert _confirmed(tr, dec, "b") == 0
                tr.check()
            d_a.lease.release()  # A ends on replica 1: its next sweep tells replica 2
            clock.t += 0.3
            t1.expire()
            digest_a = d2.scope(_ident("a")).digest
            await _wait_for(lambda: all(c.digest != digest_a for c, _, _ in l2._remote.values()),
                            "A's end never reached replica 2")
            assert t2.stored("e0", B_ENGINE, H, None) == 0  # within the grace period
            clock.t += TTL_S + 0.1
            d_b.lease.release()
            t2.expire()
            d_b2 = d2.decide(_ident("b"), TOKENS, 4)
            assert t2.stored("e0", B_ENGINE, H, None) == 4 and _entries(i2, d2, "b") == set(H)
            d_b2.lease.release()

    asyncio.run(main())


def test_a_peer_claim_carries_the_reused_blocks_that_were_pending():
    """The shared-system-prompt sequence across replicas: S's R1 and R2 are routed on replica 1 (R2 reuses R1's
    pending system prompt), T on replica 2. R2's claim on replica 2 must cover the system prompt too, so R2's
    store reaching replica 2 after R1 ended is not credited to T there."""

    async def main() -> None:
        clock = Clock()
        async with _linked(clock) as ((i1, t1, d1, l1), (i2, t2, d2, l2)):
            d_s = d2.scope(_ident("s")).digest
            n_s = lambda: sum(c.digest == d_s for c, _, _ in l2._remote.values())  # noqa: E731
            r1 = d1.decide(_ident("s"), P1, 4)
            r2 = d1.decide(_ident("s"), P2, 4)
            assert r2.cached_tokens == len(SYS)
            await _wait_for(lambda: n_s() == 2, "S's claims never reached replica 2")
            r1.lease.release()  # R1's client left before the engine ran it
            d1.retract(r1)
            clock.t += 0.3
            t1.expire()
            await _wait_for(lambda: n_s() == 1, "R1's end never reached replica 2")
            clock.t += TTL_S + 0.5  # R1's grace is over on both; R2 is still queued at the engine
            t1.expire(), t2.expire()
            r_t = d2.decide(_ident("t"), PT, 4)
            assert t2.stored("e0", S2_ENGINE, H2, None) == 0
            assert _confirmed(t2, d2, "t") == 0
            t2.check()
            r2.lease.release()
            r_t.lease.release()

    asyncio.run(main())


def test_a_replica_that_missed_the_stores_claims_the_reused_blocks_it_does_not_see_confirmed():
    """Replica 2 missed S's stores of the system prompt (a replay gap it resynced over), replica 1 has them
    confirmed. S's R2 routed on replica 1 reuses them, so replica 1 does not claim them; the engine evicts them
    and recomputes them for R2 under S's salt, while T (routed on replica 2) is pending on the same chain
    hashes there. Each replica decides the claim from its own view of the whole prompt: replica 2 claims the
    reused blocks it never saw confirmed, so the re-store is refused there, not credited to T (it was when the
    link carried only the blocks replica 1 claimed)."""

    async def main() -> None:
        clock = Clock()
        async with _linked(clock) as ((i1, t1, d1, l1), (i2, t2, d2, l2)):
            d_s = d2.scope(_ident("s")).digest
            n_s = lambda: sum(c is not None and c.digest == d_s for c, _, _ in l2._remote.values())  # noqa: E731
            r1 = d1.decide(_ident("s"), P1, 4)
            await _wait_for(lambda: n_s() == 1, "R1's claim never reached replica 2")
            assert t1.stored("e0", [7000, 7001, 7002, 7003], H1, None) == 4  # replica 2 misses these events
            r1.lease.release()
            clock.t += 0.3
            t1.expire()
            await _wait_for(lambda: n_s() == 0, "R1's end never reached replica 2")
            clock.t += TTL_S + 0.5
            t1.expire(), t2.expire()
            t2.cleared("e0")  # its resync after the gap: it holds nothing of S
            r2 = d1.decide(_ident("s"), P2, 4)
            assert r2.cached_tokens == len(SYS)
            await _wait_for(lambda: n_s() == 1, "R2's claim never reached replica 2")
            assert set(t1._claims["e0"]).isdisjoint(H2[:2])  # confirmed on replica 1: not claimed there
            assert set(H2) <= set(t2._claims["e0"])  # never seen confirmed on replica 2: claimed there
            r_t = d2.decide(_ident("t"), PT, 4)
            for tr in (t1, t2):
                tr.removed("e0", [7000, 7001])  # evicted before R2 reached the engine
            for tr in (t1, t2):
                tr.stored("e0", [7000, 7001], H2[:2], None)  # recomputed for R2 under S's salt
                tr.check()
            assert _confirmed(t2, d2, "t") == 0 and _confirmed(t1, d1, "t") == 0
            assert _entries(i1, d1, "s") >= set(H2[:2])  # replica 1 remembers the evicted blocks were S's
            r2.lease.release()
            r_t.lease.release()

    asyncio.run(main())


def test_a_peers_prompt_with_no_full_block_claims_the_roots_its_decode_may_store():
    """T's prompt with no full block is routed on replica 1; S's guess of T's output (S's first block begins with
    T's prompt) on replica 2. The link carries T's prompt tokens (a short claim) and S's first block's tokens:
    neither replica credits T's first decode block, a root, to S."""

    async def main() -> None:
        clock = Clock()
        async with _linked(clock) as ((i1, t1, d1, l1), (i2, t2, d2, l2)):
            p, o = [11, 12], [900, 901, 902, 903, 904, 905]
            h = [int(x) for x in hash_blocks(p + o, BS)]
            d_t = d1.decide(_ident("t"), p, 4)
            await _wait_for(lambda: t2._shorts["e0"], "T's short claim never reached replica 2")
            d_s = d2.decide(_ident("s"), p + o + [555], 4)
            await _wait_for(lambda: h[0] in t1._claims["e0"], "S's root never reached replica 1")
            for tr, dec in ((t1, d1), (t2, d2)):
                assert h[0] in tr._claims["e0"] and h[0] in tr._tails["e0"]  # claimed by T's short claim
                assert tr.stored("e0", [7000], h[:1], None) == 0
                assert tr.stored("e0", [7001], h[1:2], 7000) == 0
                assert _confirmed(tr, dec, "s") == 0
                tr.check()
            d_t.lease.release()
            d_s.lease.release()

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
        good = msgpack.packb(["p", origin, "e0", d_a, hashes, 7, 0, 2, b""])
        link._apply(*link._decode([good]))
        assert _entries(index, dec, "a") == set(H[:2])  # speculated the first two, claimed all four
        link._apply(*link._decode([msgpack.packb(["r", origin, "e0", d_a, b"", 7, 0, 0, b""])]))
        assert _entries(index, dec, "a") == set()
        d_b = dec.decide(_ident("b"), TOKENS, 4)
        assert tr.stored("e0", A_ENGINE, H, None) == 0  # the retracted peer claim still blocks
        link._apply(*link._decode([msgpack.packb(["e", origin, "e0", d_a, b"", 7, 0, 0, b""])]))
        clock.t += TTL_S + 0.1
        tr.expire()
        d_b.lease.release()
        d_b2 = dec.decide(_ident("b"), TOKENS, 4)
        assert tr.stored("e0", B_ENGINE, H, None) == 4
        d_b2.lease.release()
        for bad in ([good, good], [b"\xc1"], [msgpack.packb(["p", origin, "e9", d_a, b"", 1, 0, 0, b""])],
                    [msgpack.packb(["p", origin, "e0", b"short", b"", 1, 0, 0, b""])],
                    [msgpack.packb(["x", origin, "e0", d_a, b"", 1, 0, 0, True])],
                    [msgpack.packb(["p", origin, "e0", d_a, b"1234567", 1, 0, 0, b""])],
                    [msgpack.packb(["p", origin, "e0", d_a, hashes, 1, 0, 5, b""])],  # speculates past its hashes
                    [msgpack.packb(["p", origin, "e0", d_a, hashes, 1, 2, 3, b""])],  # skip + speculate past them
                    [msgpack.packb(["p", origin, "e0", d_a, hashes, 1, -1, 2, b""])],
                    [msgpack.packb(["p", origin, "e0", d_a, hashes, -1, 0, 0, b""])],
                    [msgpack.packb(["p", b"short", "e0", d_a, hashes, 1, 0, 0, b""])],
                    [msgpack.packb(["p", origin, "e0", d_a, hashes, 1, 0, 0, True])],
                    [msgpack.packb(["p", origin, "e0", d_a, hashes, 1, 0, 0, b"1234567"])],
                    [msgpack.packb(["p", origin, "e0", d_a, hashes, 1, 0, 0, b"\0" * (8 * 4097)])],  # first too long
                    [msgpack.packb(["p", origin, "e0", d_a, hashes, 1, 0, 0])],  # an earlier format: no first tokens
                    [msgpack.packb(["c", origin, "e0", d_a, hashes, 1, 0, 0, True])],  # the 9-field format before it
                    [msgpack.packb(["c", origin, "e0", d_a, hashes, 1, 0, 0, b""])],  # its kind in today's layout
                    [msgpack.packb(["c", origin, "e0", d_a, hashes, 1, 0, False])],  # the 8-field format before that
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


def test_a_peer_claim_with_repeated_hashes_keeps_the_claim_sweep_working():
    """A peer's claim may repeat a chain hash (the wire allows it); one of them (7) shared with nobody, another
    (H[0]) with a local in-flight claim. After it ended and the grace passed, every sweep completes: the claim is
    unindexed, the local claim keeps its hashes, and later ended claims are unindexed as well."""
    clock = Clock()
    index, tr, dec = _stack(clock)
    loop = asyncio.new_event_loop()
    link = PeerLink(tr, loop, bind="inproc://gateway-attribution-repeated-hashes")
    try:
        origin, d_a = b"\x02" * 8, dec.scope(_ident("a")).digest
        local = dec.decide(_ident("b"), TOKENS, 4)  # in flight: claims H
        rep = np.array([7, 7, H[0], 7], dtype="<u8").tobytes()
        link._apply(*link._decode([msgpack.packb(["p", origin, "e0", d_a, rep, 1, 0, 4, b""])]))
        link._apply(*link._decode([msgpack.packb(["e", origin, "e0", d_a, b"", 1, 0, 0, b""])]))
        ended = [dec.decide(_ident("c"), [50 + i] + TOKENS, 4) for i in range(20)]
        for d in ended:
            d.lease.release()
        for _ in range(3):
            clock.t += TTL_S + 0.5
            tr.expire()
        assert len(tr._claimed) == 1 and tr._claimed[0].lease is local.lease
        assert set(tr._claims["e0"]) == set(H)
        local.lease.release()
        for _ in range(2):  # the first sweep sees it ended (its speculation expired: it blocks for the grace)
            clock.t += TTL_S + 0.5
            tr.expire()
        assert tr._claimed == [] and tr._claims["e0"] == {}
        assert tr._tails["e0"] == tr._weak["e0"] == tr._weak_gone["e0"] == {} and tr._shorts["e0"] == []
        tr.check()
    finally:
        link.close()
        loop.close()


def test_peer_claims_fuzzed_with_repeated_hashes_are_all_unindexed_after_the_grace():
    """Random sequences of peer claims (repeated and shared chain hashes, skipped and speculated counts, valid or
    not), retractions, ends, local requests, engine stores and sweeps, on an events and an approximate engine:
    nothing raises, the index matches the tracker, what the link keeps for peers stays within its bound, and
    once every request ended and the longest claim lifetime plus the grace passed, every claim is unindexed."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from quillcache.gateway import peers

    pool = H + [7, 8, 9]
    @st.composite
    def peer_op(draw):
        hs = draw(st.lists(st.sampled_from(pool), max_size=8))
        n_skip = draw(st.integers(0, len(hs)))
        n_spec = draw(st.integers(0, len(hs) - n_skip + 1))  # one past the hashes: a frame refused
        first = draw(st.lists(st.integers(0, 3), max_size=3))  # with no hashes: a short claim
        return ("peer", draw(st.sampled_from("ppre")), draw(st.integers(0, 3)), hs, n_skip, n_spec,
                draw(st.sampled_from("ab")), draw(st.sampled_from(["e0", "e0", "a0"])), first)

    local_op = st.tuples(st.just("local"), st.sampled_from("ab"), st.integers(0, 3))
    store_op = st.tuples(st.just("store"), st.lists(st.sampled_from(pool), min_size=1, max_size=4))
    tick_op = st.tuples(st.just("tick"), st.floats(0.0, 3.0))
    runs = iter(range(10**6))

    @settings(max_examples=200, deadline=None, derandomize=True)
    @given(st.lists(st.one_of(peer_op(), local_op, store_op, tick_op), max_size=30))
    def sequence(ops):
        clock = Clock()
        index = open_index("flat")
        tr = ResidencyTracker(index, {"e0": "events", "a0": "approximate"}, ttl_s=TTL_S, clock=clock,
                              approx_capacity_blocks={"a0": 16})
        dec = Decider(index, ["e0", "a0"], tr, block_size_tokens=BS, seed=7)
        loop = asyncio.new_event_loop()
        link = PeerLink(tr, loop, bind=f"inproc://gateway-attribution-fuzz-{next(runs)}")
        leases, engine_hash = [], 10**6
        try:
            for op in ops:
                if op[0] == "peer":
                    _, kind, cid, hs, n_skip, n_spec, tenant, engine, first = op
                    frame = [kind, b"\x03" * 8, engine, dec.scope(_ident(tenant)).digest,
                             np.array(hs, dtype="<u8").tobytes(), cid, n_skip, n_spec,
                             np.array(first, dtype="<u8").tobytes()]
                    m = link._decode([msgpack.packb(frame)])
                    assert (m is None) == (n_skip + n_spec > len(hs))
                    if m is not None:
                        link._apply(*m)
                elif op[0] == "local":
                    leases.append(dec.decide(_ident(op[1]), TOKENS[: (op[2] + 1) * BS + 1], 4).lease)  # H[:k]
                elif op[0] == "store":
                    tr.stored("e0", list(range(engine_hash, engine_hash + len(op[1]))), op[1], None)
                    engine_hash += len(op[1])
                else:
                    clock.t += op[1]
                    tr.expire()
                tr.check()
                assert link._remote_size == sum(size for _, _, size in link._remote.values())
                assert link._remote_size <= peers._MAX_REMOTE_HASHES
            for lease in leases:
                lease.release()
            clock.t += link.claim_max_s + 1.0  # every peer claim's lifetime is over, ended or not
            tr.expire()
            clock.t += tr.claim_grace_s + 1.0
            tr.expire()
            assert tr._claimed == [] and tr._claims["e0"] == {}
            assert tr._tails["e0"] == tr._weak["e0"] == tr._weak_gone["e0"] == {} and tr._shorts["e0"] == []
            tr.check()
        finally:
            link.close()
            loop.close()

    sequence()


def test_peer_claims_on_an_approximate_engine_do_not_accumulate(monkeypatch):
    """No "e" ever comes for a claim on an approximate engine (nothing is attributed there): the link keeps only
    its entries (for a retraction), and what it keeps for peers is bounded by hashes, not by claims. Events
    engines' claims whose end was lost count too; one forgotten here stays open in the tracker (the safe side)."""
    from quillcache.gateway import peers

    monkeypatch.setattr(peers, "_MAX_REMOTE_HASHES", 1000)
    clock = Clock()
    index = open_index("flat")
    tr = ResidencyTracker(index, {"e0": "events", "a0": "approximate"}, ttl_s=TTL_S, clock=clock,
                          approx_capacity_blocks={"a0": 64})
    loop = asyncio.new_event_loop()
    link = PeerLink(tr, loop, bind="inproc://gateway-attribution-approximate")
    rng = np.random.default_rng(5)
    try:
        origin, digest = b"\x04" * 8, b"d" * 16
        for cid in range(200):  # 32 blocks each: 1 + 32 kept per claim
            hs = rng.integers(1, 2**63, 32, dtype=np.uint64).astype("<u8").tobytes()
            link._apply(*link._decode([msgpack.packb(["p", origin, "a0", digest, hs, cid, 0, 32, b""])]))
        assert len(link._remote) == 1000 // 33 and tr._claimed == []
        assert all(c is None for c, _, _ in link._remote.values())  # no claim kept for an approximate engine
        link._apply(*link._decode([msgpack.packb(["r", origin, "a0", digest, b"", 199, 0, 0, b""])]))
        assert tr.count("a0") == 64 - 32  # the latest claim's entries are retracted
        for cid in range(1000, 1100):  # events claims whose "e" is lost: 1 + 2 * 16 each
            hs = rng.integers(1, 2**63, 16, dtype=np.uint64).astype("<u8").tobytes()
            link._apply(*link._decode([msgpack.packb(["p", origin, "e0", digest, hs, cid, 0, 16, b""])]))
        assert len(link._remote) == 1000 // 33 and len(tr._claimed) == 100
        tr.check()
    finally:
        link.close()
        loop.close()
