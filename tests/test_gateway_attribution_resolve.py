"""Rules 3 and 4 of ``quillcache.gateway.residency``: an unattributed block is credited to the scope of a
descendant, and a block stored again under an engine hash attributed before is credited to that scope.

A system prompt several tenants share is ambiguous at its root while more than one of them is in flight on the
engine; each tenant's first private block is claimed by that tenant alone, so it is attributed, and the engine's
hash chain (the salt enters the root hash, every child hash is computed from its parent's) says the shared
blocks before it in that chain were stored under the same salt. These tests drive the real tracker, decider and
flat index with a fake clock, as ``tests/test_gateway_attribution.py`` does."""

from __future__ import annotations

import hashlib
import random

import pytest

from quillcache.gateway.decision import Decider
from quillcache.gateway.residency import EntryState, ResidencyTracker
from quillcache.hashing import hash_blocks
from quillcache.index import open_index
from test_gateway_attribution import BS, Clock, _ident  # tests/ is on sys.path (as for results_copy)

pytestmark = pytest.mark.timeout(60)

SYS = list(range(1, 2 * BS + 1))  # a 2-block system prompt that tenants S and T share
PS = SYS + list(range(100, 100 + 2 * BS + 1))  # S's question: 4 full blocks, the last two S's own
PT = SYS + list(range(300, 300 + 2 * BS + 1))  # T's question
PS2 = PS[: 4 * BS] + list(range(500, 500 + 2 * BS + 1))  # S's next turn: S's 4 blocks, then 2 new ones
HS, HT, HS2 = ([int(x) for x in hash_blocks(p, BS)] for p in (PS, PT, PS2))
S_ENGINE = [1000, 1001, 1002, 1003]  # the engine's hashes of S's blocks (S's salt in every one)
T_ENGINE = [2000, 2001, 2002, 2003]  # T's


def _stack(clock: Clock, **kw):
    index = open_index("flat")
    tr = ResidencyTracker(index, {"e0": "events"}, ttl_s=2.0, clock=clock, **kw)
    dec = Decider(index, ["e0"], tr, block_size_tokens=BS, seed=7)
    return index, tr, dec


def _entries(index, dec, tenant: str) -> set[int]:
    digest = dec.scope(_ident(tenant)).digest
    return {e.block_hash for e in index.entries_on_node("e0") if e.identity == digest}


def _confirmed(tr, dec, tenant: str) -> set[int]:
    digest = dec.scope(_ident(tenant)).digest
    return {r.h for r in tr._live["e0"].values() if r.state is EntryState.CONFIRMED and r.digest == digest}


def test_a_shared_system_prompt_is_credited_through_each_tenants_first_private_block():
    """S and T both in flight with the shared system prompt: its root is nobody's when stored, but S's private
    block names S as the owner of the chain before it, and T's names T; neither gets the other's blocks, and S's
    next turn finds its whole prompt cached."""
    clock = Clock()
    index, tr, dec = _stack(clock)
    d_s = dec.decide(_ident("s"), PS, 4)
    d_t = dec.decide(_ident("t"), PT, 4)
    assert tr.stored("e0", S_ENGINE, HS, None) == 2  # its own two blocks by the root rule: SYS was ambiguous
    assert tr.stats.ambiguous >= 1 and tr.stats.resolved == 2
    assert _confirmed(tr, dec, "s") == set(HS) and _entries(index, dec, "s") == set(HS)
    assert tr.stored("e0", T_ENGINE, HT, None) == 2  # T's system prompt: S's request still claims it
    assert _confirmed(tr, dec, "t") == set(HT) and tr.stats.resolved == 4
    tr.check()
    d_s.lease.release()
    d_t.lease.release()
    s2 = dec.decide(_ident("s"), PS2, 4)
    assert s2.cached_tokens == 4 * BS  # without rule 3: 0 (the chain's first two blocks were nobody's)
    s2.lease.release()
    # the resolved entries carry their engine hashes: the engine's removals delete exactly them
    assert tr.removed("e0", S_ENGINE[:2]) == 2
    assert _entries(index, dec, "s") == set(HS[2:]) | set(HS2[4:])  # and the next turn's speculation
    assert _entries(index, dec, "t") == set(HT)
    tr.check()


def test_a_later_store_resolves_the_blocks_an_earlier_store_left_unattributed():
    """The engine stored S's system prompt in one event (ambiguous: T in flight) and S's question later, as a
    child of the system prompt's last engine hash."""
    clock = Clock()
    index, tr, dec = _stack(clock)
    d_s = dec.decide(_ident("s"), PS, 4)
    d_t = dec.decide(_ident("t"), PT, 4)
    assert tr.stored("e0", S_ENGINE[:2], HS[:2], None) == 0 and _confirmed(tr, dec, "s") == set()
    assert tr.stored("e0", S_ENGINE[2:], HS[2:], S_ENGINE[1]) == 2
    assert _confirmed(tr, dec, "s") == set(HS) and tr.stats.resolved == 2
    assert _entries(index, dec, "t") == set(HT)  # T's own speculation, still pending; nothing of S's
    assert {r.h for r in tr._live["e0"].values() if r.state is EntryState.CONFIRMED} == set(HS)
    tr.check()
    d_s.lease.release()
    d_t.lease.release()


def test_a_descendant_credits_only_its_own_chain():
    """Two unattributed system-prompt chains on one engine (S's and T's engine hashes): S's private block
    resolves S's chain and leaves T's unattributed; T's stays nobody's until T's own private block."""
    clock = Clock()
    index, tr, dec = _stack(clock)
    d_s = dec.decide(_ident("s"), PS, 4)
    d_t = dec.decide(_ident("t"), PT, 4)
    assert tr.stored("e0", S_ENGINE[:2], HS[:2], None) == 0
    assert tr.stored("e0", T_ENGINE[:2], HT[:2], None) == 0
    assert tr.stored("e0", S_ENGINE[2:], HS[2:], S_ENGINE[1]) == 2
    assert _confirmed(tr, dec, "t") == set() and _confirmed(tr, dec, "s") == set(HS)
    assert sorted(tr._orphans["e0"]) == T_ENGINE[:2]
    assert tr.stored("e0", T_ENGINE[2:], HT[2:], T_ENGINE[1]) == 2 and _confirmed(tr, dec, "t") == set(HT)
    assert not tr._orphans["e0"]
    tr.check()
    d_s.lease.release()
    d_t.lease.release()


def test_an_inherited_child_also_resolves_its_unattributed_ancestors_only_through_an_attributed_block():
    """A block attributed by the parent rule already has an attributed parent: nothing to resolve. A child of
    an unattributed parent with no speculation of its own stays unattributed and credits nobody."""
    clock = Clock()
    index, tr, dec = _stack(clock)
    d_s = dec.decide(_ident("s"), PS, 4)
    d_t = dec.decide(_ident("t"), PT, 4)
    assert tr.stored("e0", S_ENGINE[:2], HS[:2], None) == 0
    # a continuation no request speculated (decode blocks, say), under the unattributed chain: nobody's
    assert tr.stored("e0", [1500], [123456789], S_ENGINE[1]) == 0 and tr.stats.resolved == 0
    assert _confirmed(tr, dec, "s") == set() and _confirmed(tr, dec, "t") == set()
    tr.check()
    d_s.lease.release()
    d_t.lease.release()


def test_an_ancestry_that_cannot_be_followed_refuses_while_another_scope_is_in_flight():
    """The engine evicted S's second system-prompt block before S's question was stored: the chain above S's
    question cannot be followed, so it could pass through the tail of T's request (in flight), whose decode
    blocks no claim names: S's question is refused too, and nothing is resolved. A block whose chain hash the
    subscriber could not compute breaks the chain the same way."""
    clock = Clock()
    index, tr, dec = _stack(clock)
    d_s = dec.decide(_ident("s"), PS, 4)
    d_t = dec.decide(_ident("t"), PT, 4)
    assert tr.stored("e0", S_ENGINE[:2], HS[:2], None) == 0
    assert tr.removed("e0", [S_ENGINE[1]]) == 0  # an unattributed block's removal: forgotten, nothing indexed
    assert tr.stored("e0", S_ENGINE[2:], HS[2:], S_ENGINE[1]) == 0 and tr.stats.resolved == 0
    assert _confirmed(tr, dec, "s") == set()
    tr.check()
    # T's question stored with an unknown chain hash in the middle: nothing of T's is credited while S is in flight
    assert tr.stored("e0", T_ENGINE, [HT[0], HT[1], None, HT[3]], None) == 0
    assert _confirmed(tr, dec, "t") == set() and tr.stats.resolved == 0
    tr.check()
    d_s.lease.release()
    d_t.lease.release()
    clock.t += 0.3
    tr.expire()  # the sweep sees both ended ...
    clock.t += 2.5
    tr.expire()  # ... and past their grace: an unknown ancestry blocks nobody now
    d_s2 = dec.decide(_ident("s"), PS2, 4)
    assert tr.stored("e0", [1504, 1505], HS2[4:], 1503) == 2  # S's next turn, under a parent never seen
    d_s2.lease.release()
    tr.check()
    d_s.lease.release()
    d_t.lease.release()


def test_clear_and_the_bound_forget_unattributed_blocks():
    clock = Clock()
    index, tr, dec = _stack(clock, max_unattributed_blocks=1)
    d_s = dec.decide(_ident("s"), PS, 4)
    d_t = dec.decide(_ident("t"), PT, 4)
    assert tr.stored("e0", S_ENGINE[:2], HS[:2], None) == 0
    assert list(tr._orphans["e0"]) == [S_ENGINE[1]]  # the bound: the oldest is forgotten
    # above the remembered block the chain is lost: it may pass through T's tail (T in flight), so refused
    assert tr.stored("e0", S_ENGINE[2:], HS[2:], S_ENGINE[1]) == 0 and tr.stats.resolved == 0
    assert tr.stored("e0", T_ENGINE[:2], HT[:2], None) == 0 and tr._orphans["e0"]
    tr.cleared("e0")
    assert not tr._orphans["e0"]
    assert tr.stored("e0", T_ENGINE[2:], HT[2:], T_ENGINE[1]) == 0  # T's speculation went with the clear
    tr.check()
    d_s.lease.release()
    d_t.lease.release()
    with pytest.raises(ValueError, match="max_unattributed_blocks"):
        ResidencyTracker(open_index("flat"), {"e0": "events"}, max_unattributed_blocks=-1)
    with pytest.raises(ValueError, match="max_unattributed_blocks"):
        ResidencyTracker(open_index("flat"), {"e0": "events"}, max_unattributed_blocks=True)


def test_with_the_memory_off_nothing_is_resolved():
    """Without the memory of unattributed blocks the chain above S's question cannot be followed: with T in flight
    (its decode blocks could continue anywhere up there) S's question is refused too."""
    clock = Clock()
    index, tr, dec = _stack(clock, max_unattributed_blocks=0)
    d_s = dec.decide(_ident("s"), PS, 4)
    d_t = dec.decide(_ident("t"), PT, 4)
    assert tr.stored("e0", S_ENGINE, HS, None) == 0 and _confirmed(tr, dec, "s") == set()
    assert tr.stats.resolved == 0 and not tr._orphans["e0"]
    d_s.lease.release()
    d_t.lease.release()


def test_a_clear_remembers_the_scopes_of_what_it_drops():
    """The review's d23cc8a finding: S reuses its confirmed prompt (not claimed), the engine's cache is cleared (or
    the subscriber resyncs, or the engine restarts) and the engine recomputes S's prompt for S's request while T
    is pending on the same chain hashes: rule 4 must know S's engine hashes from the clear, as from a removal."""
    clock = Clock()
    index, tr, dec = _stack(clock)
    d_s = dec.decide(_ident("s"), PS, 4)
    assert tr.stored("e0", S_ENGINE, HS, None) == 4
    d_s.lease.release()
    d_s2 = dec.decide(_ident("s"), PS2, 4)  # reuses S's 4 confirmed blocks: claims only its new ones
    tr.cleared("e0")
    d_t = dec.decide(_ident("t"), PT, 4)  # T pending on the shared system prompt
    assert tr.stored("e0", S_ENGINE[:2], HS[:2], None) == 2 and tr.stats.remembered == 1
    assert _confirmed(tr, dec, "t") == set() and _confirmed(tr, dec, "s") == set(HS[:2])
    tr.check()
    d_s2.lease.release()
    d_t.lease.release()


def test_another_tenants_decode_block_is_not_credited_to_a_scope_that_guessed_its_output():
    """The review's F1: T's prompt P is in flight; S sends P followed by a guess O of T's output. The engine stores
    T's prompt blocks (ambiguous: S and T both claim them) and then T's first DECODE block (P's tail and T's
    generated tokens), whose chain hash only S is pending on: no claim can name a decode block. It must not be
    credited to S (and, by rule 3, neither T's prompt blocks above it): S's later probe of P + O would otherwise
    learn whether T generated O. T's claim has P's last block as its tail, and the decode block's ancestry passes
    through it."""
    clock = Clock()
    index, tr, dec = _stack(clock)
    p = list(range(1, 2 * BS + 2))  # 2 full blocks and one token
    o = [900, 901, 902]  # T's generated tokens: they fill T's block 2
    h = [int(x) for x in hash_blocks(p + o, BS)]
    t_engine = [7000, 7001, 7002]
    d_t = dec.decide(_ident("t"), p, 4)
    d_s = dec.decide(_ident("s"), p + o + [555], 4)
    assert tr.stored("e0", t_engine[:2], h[:2], None) == 0  # ambiguous roots
    assert tr.stored("e0", t_engine[2:], h[2:], t_engine[1]) == 0  # T's decode block: nobody's
    assert _confirmed(tr, dec, "s") == set() and tr.stats.resolved == 0
    dec.retract(d_s)
    d_s.lease.release()
    d_t.lease.release()
    clock.t += 10
    tr.expire()
    probe = dec.decide(_ident("s"), p + o + [1, 2, 3, 4, 5], 4)
    assert probe.cached_tokens == 0
    probe.lease.release()
    tr.check()


@pytest.mark.parametrize("t_first", [False, True])
def test_the_decode_of_a_prompt_with_no_full_block_is_not_credited_to_a_scope_that_guessed_it(t_first):
    """T's prompt p has no full block, so its decode blocks are ROOTS. S sends p followed by a guess o of T's
    output (S's first block is p + o's start): S alone is pending on the chain hashes T's decode stores. T's
    short claim claims every root another scope speculates whose first block begins with p (routed before or
    after T), and holds it as a tail: neither decode block is credited to S, during T's request or its grace.
    A root of another prefix is S's as before."""
    clock = Clock()
    index, tr, dec = _stack(clock)
    p = [11, 12]
    o = [900, 901, 902, 903, 904, 905]
    h = [int(x) for x in hash_blocks(p + o, BS)]
    t_engine = [7000, 7001]
    other = [int(x) for x in hash_blocks([13, 12, 900, 901, 5], BS)]
    if t_first:
        d_t = dec.decide(_ident("t"), p, 4)
    d_s = dec.decide(_ident("s"), p + o + [555], 4)
    d_other = dec.decide(_ident("s"), [13, 12, 900, 901, 5], 4)
    if not t_first:
        d_t = dec.decide(_ident("t"), p, 4)
    assert tr.stored("e0", t_engine[:1], h[:1], None) == 0  # T's first decode block: nobody's
    d_t.lease.release()  # T's next decode block arrives after T ended, within the grace
    clock.t += tr.claim_grace_s / 2
    tr.expire()
    assert tr.stored("e0", t_engine[1:], h[1:2], t_engine[0]) == 0
    assert _confirmed(tr, dec, "s") == set() and tr.stats.resolved == 0
    assert tr.stored("e0", [8000], other[:1], None) == 1 and _confirmed(tr, dec, "s") == set(other[:1])
    dec.retract(d_s)
    d_s.lease.release()
    d_other.lease.release()
    for _ in range(2):  # the first sweep sees them ended, the next one after the grace unindexes them
        clock.t += 10
        tr.expire()
    assert tr._shorts["e0"] == [] and tr._tails["e0"] == {} and tr._claims["e0"] == {}
    probe = dec.decide(_ident("s"), p + o + [1, 2, 3, 4, 5], 4)
    assert probe.cached_tokens == 0
    probe.lease.release()
    tr.check()


def _engine_hash(tenant: str, tokens: list[int]) -> int:
    """The fake engine's salted hash of a block: the tenant and every token up to the block's end."""
    return int.from_bytes(hashlib.blake2b(repr((tenant, tokens)).encode(), digest_size=7).digest(), "little")


def test_a_block_stored_again_is_credited_to_the_scope_its_engine_hash_had():
    """S's prompt was stored and attributed, then evicted. T routes the shared system prompt (pending on its chain
    hashes) and S's next request recomputes S's system prompt: the engine hash says it is S's (rule 4), so it goes
    to S even though T is the only scope pending on those chain hashes. The memory is bounded and survives a
    clear; with it off, the same store goes by the claims (here: refused as ambiguous)."""
    for known in (1 << 10, 1, 0):
        clock = Clock()
        index, tr, dec = _stack(clock, max_known_blocks=known)
        d_s = dec.decide(_ident("s"), PS, 4)
        assert tr.stored("e0", S_ENGINE, HS, None) == 4
        d_s.lease.release()
        assert tr.removed("e0", S_ENGINE) == 4 and _entries(index, dec, "s") == set()
        assert len(tr._known["e0"]) == min(known, 4)
        tr.cleared("e0")  # the relation engine hash -> scope is the hash's, not the cache's: kept
        assert len(tr._known["e0"]) == min(known, 4)
        d_t = dec.decide(_ident("t"), PT, 4)
        d_s2 = dec.decide(_ident("s"), PS2, 4)
        got = tr.stored("e0", S_ENGINE[:2], HS[:2], None)
        if known >= 4:
            assert got == 2 and _confirmed(tr, dec, "s") == set(HS[:2]) and tr.stats.remembered == 1
        else:  # forgotten (the bound kept only the last removal) or off: T pending, S claims: nobody's
            assert got == 0 and tr.stats.remembered == 0
        assert _confirmed(tr, dec, "t") == set()
        tr.check()
        d_t.lease.release()
        d_s2.lease.release()
    with pytest.raises(ValueError, match="max_known_blocks"):
        ResidencyTracker(open_index("flat"), {"e0": "events"}, max_known_blocks=-1)


@pytest.mark.parametrize("seed", range(20))
def test_random_interleavings_never_credit_a_block_to_a_scope_whose_salt_it_does_not_carry(seed):
    """Tenants with a shared system prompt and private questions (or prompts with no full block, whose decode
    block is a root), in random order and overlap, their stores
    split into random events, random evictions and expiries. A request's engine also stores its first DECODE
    block (its prompt's tail and output tokens), which no claim names; some prompts of one tenant are another
    tenant's prompt followed by that tenant's output (a guess of it), so a decode block can be the only pending
    chain hash of another scope. The fake engine gives each (tenant, block) its own engine hash, so the salt each
    stored block carries is known: every confirmed entry must belong to the tenant whose engine hash confirmed
    it, and the index must equal the tracker. Rule 4's memory may be off: a confirmed reused block the engine
    evicts and recomputes is covered by the request's weak hold on it (module doc), rule 4 only credits it."""
    rng = random.Random(seed)
    clock = Clock()
    index, tr, dec = _stack(clock, max_unattributed_blocks=rng.choice([0, 3, 1 << 20]),
                            max_known_blocks=rng.choice([0, 2, 1 << 20]))
    tenants = ["s", "t", "u"]
    digests = {dec.scope(_ident(x)).digest: x for x in tenants}
    owner_of_engine_hash: dict[int, str] = {}
    stored: dict[str, set[int]] = {x: set() for x in tenants}  # engine hashes live in the fake engine

    def question(x: str, q: int) -> list[int]:
        return SYS + [1000 * (tenants.index(x) + 1) + 10 * q + i for i in range(2 * BS + 1)]

    def output(x: str, q: int) -> list[int]:  # what x's request q generates
        return [5000 + 100 * tenants.index(x) + 10 * q + i for i in range(2 * BS)]

    def short(x: str, q: int) -> list[int]:  # a prompt with no full block: its decode blocks are roots
        return [8000 + 100 * tenants.index(x) + 10 * q + i for i in range(1 + q % (BS - 1))]

    inflight = []
    for step in range(40):
        x = rng.choice(tenants)
        q = rng.randrange(3)
        ask = short if rng.random() < 0.2 else question
        prompt = ask(x, q)
        if rng.random() < 0.3:  # x guesses another tenant's output and asks about it
            y = rng.choice([t for t in tenants if t != x])
            qy = rng.randrange(3)
            prompt = rng.choice([question, short])(y, qy) + output(y, qy) + [7]
        full = prompt + output(x, q) if prompt == ask(x, q) else prompt + [9] * BS
        hashes = [int(h) for h in hash_blocks(full, BS)]
        n_prompt = len(prompt) // BS
        n_stored = min(len(hashes), n_prompt + 1)  # the prompt's full blocks and the first decode block
        ehs = [_engine_hash(x, full[: (j + 1) * BS]) for j in range(n_stored)]
        for e in ehs:
            owner_of_engine_hash[e] = x
        d = dec.decide(_ident(x), prompt, 4)
        inflight.append((d, x, hashes[:n_stored], ehs))
        if rng.random() < 0.6 and inflight:  # a request's blocks reach the engine, in one or two events
            d, x, hashes, ehs = inflight.pop(rng.randrange(len(inflight)))
            new = [j for j in range(len(ehs)) if ehs[j] not in stored[x]]
            if new:
                cut = rng.randrange(new[0], len(ehs) + 1)
                parts = [(new[0], cut), (cut, len(ehs))]
                for a, b in parts:
                    if a < b:
                        tr.stored("e0", ehs[a:b], hashes[a:b], ehs[a - 1] if a else None)
                        stored[x].update(ehs[a:b])
            d.lease.release()
        if rng.random() < 0.2:  # the engine evicts a random stored block
            pool = [(x, e) for x, es in stored.items() for e in es]
            if pool:
                x, e = rng.choice(pool)
                stored[x].discard(e)
                tr.removed("e0", [e])
        clock.t += rng.choice([0.0, 0.3, 1.0, 2.5])
        tr.expire()
        for rec in tr._live["e0"].values():
            if rec.state is EntryState.CONFIRMED:
                assert owner_of_engine_hash[rec.engine_hash] == digests[rec.digest], (step, rec.h)
        tr.check()
    for d, *_ in inflight:
        d.lease.release()
