"""Exact eviction orders of the study's online policies: lengthaware, tinylfu, belady, quillhd."""

from __future__ import annotations

import math

import pytest

from quillcache.policies.base import PolicyKeyError, UnknownKeyError
from quillcache.policies.belady import BeladyPolicy
from quillcache.policies.lengthaware import LengthAwarePolicy
from quillcache.policies.quillhd import QuillHdPolicy, age_bucket, bucket_mid
from quillcache.policies.tinylfu import TinyLfuPolicy

# ---------------------------------------------------------------- length-aware


def test_lengthaware_evicts_deeper_blocks_first_among_equal_frequency():
    p = LengthAwarePolicy()
    p.begin_request(["a", "b", "c"], 0, 1536)
    for k in "abc":
        p.insert(k, 1)
    assert p.victim() == "c"
    p.begin_request(["a", "b"], 2, 1024)
    p.touch("a")
    p.touch("b")
    assert [p.frequency(k) for k in "abc"] == [2, 2, 1]
    # (1, -2) c, then (2, -1) b, then (2, 0) a
    assert p.eviction_order() == ["c", "b", "a"]


def test_lengthaware_ties_by_recency_and_without_hints_is_lfu():
    p = LengthAwarePolicy()
    p.begin_request(["r", "s"], 0)
    p.insert("r", 1)
    p.insert("s", 1)
    p.begin_request(["r", "t"], 1)
    p.touch("r")
    p.insert("t", 1)
    assert p.eviction_order() == ["s", "t", "r"]  # s and t both (1, depth 1): older first
    q = LengthAwarePolicy()
    for k in "xyz":
        q.insert(k, 1)
    q.touch("x")
    assert q.victim(lambda k: k != "y") == "z"
    assert q.eviction_order() == ["y", "z", "x"]


# ---------------------------------------------------------------- belady


def test_belady_evicts_farthest_next_use_and_bypasses():
    nu = {"a": 5, "b": 9, "c": 7}
    p = BeladyPolicy(next_use_oracle=lambda k: nu[k], capacity_keys=3)
    for k in "abc":
        p.insert(k, 1)
    assert p.victim() == "b"
    nu["b"] = 4
    p.touch("b")
    assert p.next_use("b") == 4
    nu["d"] = 100
    assert p.admit("d", 1) is False  # MIN would evict the newcomer itself
    nu["d"] = 6
    assert p.admit("d", 1) is True
    assert p.victim(lambda k: k != "c") == "a"
    assert p.eviction_order() == ["c", "a", "b"]
    assert BeladyPolicy(next_use_oracle=lambda k: 1, bypass=False).admit("z", 1) is True


def test_belady_needs_an_oracle():
    with pytest.raises(TypeError, match="belady needs the future"):
        BeladyPolicy()


# ---------------------------------------------------------------- tinylfu


def test_tinylfu_window_candidate_loses_to_equal_frequency_victim():
    p = TinyLfuPolicy(capacity_keys=10, doorkeeper=False)
    assert (p.window_cap, p.main_cap, p.protected_cap, p.sample_size) == (1, 9, 7, 100)
    for k in range(10):
        p.insert(k, 1)
    assert all(p.segment_of(k) == "window" for k in range(10))
    v = p.victim()
    # k0..k8 move to probation (main had room); k9 duels k0 at frequency 1 vs 1 and loses
    assert v == 9
    assert [p.segment_of(k) for k in range(9)] == ["probation"] * 9
    p.evict(9)
    p.touch(0)
    assert p.segment_of(0) == "protected"
    # a key seen three times before beats probation's LRU key (seen once)
    for _ in range(2):
        p.insert(99, 1)
        p.evict(99)
    p.insert(99, 1)
    assert p.frequency(99) == 3 and p.frequency(1) == 1
    assert p.victim() == 1
    assert p.segment_of(99) == "probation"
    p.evict(1)
    assert len(p) == 9


def test_tinylfu_protected_overflow_demotes_and_aging_halves():
    p = TinyLfuPolicy(capacity_keys=4, protected_ratio=0.5, doorkeeper=False)  # window 1, main 3, protected 1
    for k in (1, 2, 3, 4):
        p.insert(k, 1)
    assert p.victim() == 4  # 1,2,3 to probation; 4 (freq 1) loses to 1 (freq 1)
    p.evict(4)
    p.touch(1)
    p.touch(2)  # protected holds 1 key: 1 is demoted back to probation's MRU end
    assert [p.segment_of(k) for k in (1, 2, 3)] == ["probation", "protected", "probation"]
    p.insert(5, 1)
    assert p.victim() == 5  # freq(5) == freq(3) == 1: the window candidate loses ties
    a = TinyLfuPolicy(capacity_keys=10, sample_factor=1, doorkeeper=False)  # halve every 10 records
    a.insert(7, 1)
    for _ in range(4):
        a.touch(7)
    assert a.frequency(7) == 5
    for k in range(100, 105):
        a.insert(k, 1)
    assert a.frequency(7) == 2  # 5 >> 1


def test_tinylfu_doorkeeper_absorbs_first_access():
    p = TinyLfuPolicy(capacity_keys=16)
    p.insert(5, 1)
    assert p.sketch.estimate_one(5) == 0 and p.frequency(5) == 1
    p.touch(5)
    p.touch(5)
    assert p.sketch.estimate_one(5) == 2 and p.frequency(5) == 3


def test_tinylfu_predicate_and_errors():
    p = TinyLfuPolicy(capacity_keys=3)
    for k in "abc":
        p.insert(k, 1)
    assert p.victim(lambda k: k not in ("c", "a")) == "b"
    with pytest.raises(PolicyKeyError):
        p.insert("a", 1)
    with pytest.raises(UnknownKeyError):
        p.touch("zz")
    with pytest.raises(ValueError, match="window_ratio=1.5"):
        TinyLfuPolicy(window_ratio=1.5)


# ---------------------------------------------------------------- quillhd


def test_quillhd_age_buckets():
    assert [age_bucket(a) for a in (0, 15, 16, 17, 31, 32, 48, 64)] == [0, 15, 16, 16, 23, 24, 28, 32]
    assert bucket_mid(16) == 17.0 and bucket_mid(24) == 34.0


def test_quillhd_lru_rule_evicts_partial_tails_first():
    p = QuillHdPolicy(capacity_keys=100, mode="lru")
    p.begin_request(["a", "b", "c"], 0, 1300)  # 1300 tokens: c is a partial block
    for k in "abc":
        p.insert(k, 1)
    p.begin_request(["d", "e"], 0, 1024)
    p.insert("d", 1)
    p.insert("e", 1)
    assert [p.class_of(k) for k in "abcde"] == [1, 1, 0, 1, 1]
    p.begin_request(["a", "f"], 1, 1024)
    p.touch("a")
    p.insert("f", 1)
    assert p.class_of("a") == 5  # prefix hit, referenced twice
    assert p.eviction_order() == ["c", "b", "d", "e", "a", "f"]


def _learned(mode: str) -> QuillHdPolicy:
    """A is reused every 10 references four times; its classes learn hits at age 10."""
    p = QuillHdPolicy(capacity_keys=1000, mode=mode, period=16)
    p.insert("A", 1)
    fresh = 0
    for _ in range(4):
        for _ in range(9):
            p.insert(f"f{fresh}", 1)
            p.remove(f"f{fresh}")
            fresh += 1
        p.touch("A")
    return p


def test_quillhd_hd_rule_uses_learned_density():
    p = _learned("hd")
    # updates at t=16 and t=32: classes 1, 5, 6 have one hit at age 10 each; class 7 none yet
    assert p.hit_density(1, 2) == pytest.approx(1 / 8)
    assert p.hit_density(7, 1) == 0.0
    p.insert("B", 1)  # t=42, class 1
    p.insert("C", 1)  # t=43, class 1
    p.touch("A")  # t=44, A stays class 7
    # at t=45: B (class 1, age 3) has density 1/7, A (class 7, age 1) has 0 -> A goes first
    assert p.victim() == "A"
    assert p.eviction_order() == ["A", "B", "C"]
    q = _learned("lru")
    q.insert("B", 1)
    q.insert("C", 1)
    q.touch("A")
    assert q.eviction_order() == ["B", "C", "A"]


def test_quillhd_options_and_remove():
    with pytest.raises(ValueError, match="mode='x'"):
        QuillHdPolicy(mode="x")
    with pytest.raises(ValueError, match="decay=0"):
        QuillHdPolicy(decay=0)
    with pytest.raises(ValueError, match="period=0"):
        QuillHdPolicy(period=0)
    p = QuillHdPolicy()
    p.insert("k", 1)
    p.remove("k")
    assert "k" not in p and p.victim() is None
    with pytest.raises(UnknownKeyError):
        p.evict("k")
    with pytest.raises(ValueError, match="num_hit=5"):
        p.begin_request(["a"], 5)


# ---------------------------------------------------------------- sieve, arc, 2q, lhd, lrb, quillchain


def test_sieve_hand_skips_visited_keys_without_moving_them():
    from quillcache.policies.sieve import SievePolicy

    p = SievePolicy()
    for k in "abc":
        p.insert(k, 1)
    p.touch("a")
    assert p.victim() == "b" and not p.visited("a")  # the hand cleared a's bit on the way
    p.evict("b")
    assert p.hand == "c"
    p.insert("d", 1)
    p.touch("c")
    assert p.victim() == "d"  # c was visited: cleared, d is next
    p.evict("d")
    assert p.hand is None  # d was the newest: the next scan starts at the oldest
    p.insert("e", 1)
    assert p.victim(lambda k: k != "a") == "c"  # a refused: passed over
    assert p.hand == "c"
    assert p.eviction_order() == ["c", "e", "a"]  # from the hand on, wrapping to the oldest


def test_arc_adapts_its_target_on_ghost_hits():
    from quillcache.policies.arc import ArcPolicy

    p = ArcPolicy(capacity_keys=2)
    for k in "ab":
        assert p.admit(k, 1)
        p.insert(k, 1)
    p.touch("a")  # a -> T2
    assert p.admit("c", 1) and p.victim() == "b"  # |T1| = 1 > p = 0
    p.evict("b")
    p.insert("c", 1)
    assert p.list_of("b") == "b1"
    assert p.admit("b", 1) and p.p == 1.0  # ghost hit in B1 grows T1's target
    assert p.victim() == "a"  # |T1| = 1 is not > p: T2's LRU
    p.evict("a")
    p.insert("b", 1)
    assert (p.list_of("a"), p.list_of("b"), p.list_of("c")) == ("b2", "t2", "t1")
    assert p.admit("a", 1) and p.p == 0.0  # ghost hit in B2 shrinks it
    assert p.victim() == "c"


def test_twoq_ghost_hits_go_to_am_and_a1in_drains_first():
    from quillcache.policies.twoq import TwoQPolicy

    p = TwoQPolicy(capacity_keys=4)
    for k in "abcd":
        p.insert(k, 1)
    assert p.victim() == "a"  # |A1in| = 4 > kin = 1
    p.evict("a")
    p.insert("e", 1)
    p.evict(p.victim())  # b
    p.insert("a", 1)  # remembered in A1out
    assert p.queue_of("a") == "am" and p.queue_of("e") == "a1in"
    p.touch("e")  # a hit in A1in changes nothing
    p.evict(p.victim())  # c goes to A1out, which keeps kout = 2 keys
    p.insert("f", 1)
    assert p.eviction_order() == ["d", "e", "a", "f"]


def test_lhd_classes_by_reuse_distance_and_ignores_prefix_hints():
    from quillcache.policies.lhd import LhdPolicy
    from quillcache.policies.quillhd import reuse_class

    assert [reuse_class(g) for g in (0, 1, 63, 64, 255, 256, 1023, 1024, 1 << 14, 1 << 16, 1 << 30)] == \
        [0, 1, 1, 1, 2, 2, 3, 3, 5, 6, 7]
    p = LhdPolicy(capacity_keys=8)
    p.begin_request(["a", "b"], 0, 700)  # b is a partial tail: LHD does not know it
    p.insert("a", 1)
    p.insert("b", 1)
    assert p.class_of("a") == p.class_of("b") == 0
    p.begin_request(["a"], 1, 512)
    p.touch("a")
    assert p.class_of("a") == 1  # gap 2


def test_lrb_learns_a_regular_gap_and_samples_reproducibly():

    from quillcache._mix import splitmix64
    from quillcache.policies.lrb import LrbPolicy

    p = LrbPolicy(capacity_keys=100)
    keys = list(range(5))
    for k in keys:
        p.insert(k, 1)
    for i in range(3000):
        p.touch(keys[i % 5])
    k = keys[-1]
    predicted_gap = p.predicted_next(k) - (5 + 3000)
    assert abs(math.log2(predicted_gap) - 3) < 0.3, predicted_gap  # bit_length(5) = 3
    q = LrbPolicy(capacity_keys=3, sample_size=1, seed=7)
    for k in "xyz":
        q.insert(k, 1)
    assert q.victim() == "xyz"[splitmix64(7) % 3]


def test_quillchain_evicts_a_chain_leaf_first_and_counts_turns():
    from quillcache.policies.quillchain import QuillChainPolicy

    p = QuillChainPolicy(capacity_keys=16)
    p.begin_request(["s", "a1", "a2", "t1"], 0, 3 * 512 + 10)  # t1: partial tail
    for k in ("s", "a1", "a2", "t1"):
        p.insert(k, 1)
    assert p.class_of("t1") == 0 and p.class_of("a2") == 6  # turn 0 on this chain, first seen
    p.begin_request(["s", "a1", "a2", "a3", "t2"], 3, 4 * 512 + 10)  # the next turn
    for k in ("s", "a1", "a2"):
        p.touch(k)
    for k in ("a3", "t2"):
        p.insert(k, 1)
    assert p.class_of("a3") == 8  # first seen, one earlier turn ended on this chain (turn class 2)
    assert p.class_of("a1") == p.class_of("s") == 1  # prefix hits seen twice
    order = p.eviction_order()
    assert order[0] == "t1"  # nothing learned yet: the oldest class head goes first
    chain = [k for k in order if k in ("s", "a1", "a2")]
    assert chain == ["a2", "a1", "s"]  # within a class, leaves before their ancestors


def _drive_hinted(p, keys, block_tokens=512):
    """One hinted request of whole ``block_tokens``-token blocks (no partial tail) through a policy
    as the replay drives it: (its prefix hits, evicted keys, stored keys, refused keys)."""
    k = 0
    for key in keys:
        if key not in p:
            break
        k += 1
    p.begin_request(keys, k, len(keys) * block_tokens)
    evicted, stored, refused = [], [], []
    for key in keys:
        if key in p:
            p.touch(key)
        elif p.admit(key, 1):
            if len(p) >= p.capacity_keys:
                evicted.append(p.victim())
                p.evict(evicted[-1])
            p.insert(key, 1)
            stored.append(key)
        else:
            refused.append(key)
    return k, evicted, stored, refused


def test_quillchain_refuses_a_block_worth_less_than_its_victim_and_the_rest_of_its_request():
    """Admission by hit density: a shared two-block prompt comes back in every request, each
    request's own blocks never do. Once learned, a full cache refuses the new blocks (and every
    later new block of the same request) instead of evicting the prompt; ``admit=False`` stores
    them. A refused key is still counted as a reference and tracks nothing."""
    from quillcache.policies.quillchain import QuillChainPolicy

    def drive(p, r):
        k, _, _, refused = _drive_hinted(p, ["s", "h", f"u{r}a", f"u{r}b", f"u{r}c"])
        return k, refused

    # the real cache on the hit-density rule from the start (admission acts under that rule only)
    on = QuillChainPolicy(capacity_keys=4, period=8, start_rule="hd")
    off = QuillChainPolicy(capacity_keys=4, period=8, admit=False, start_rule="hd")
    results = [(r, drive(on, r), drive(off, r)) for r in range(60)]
    assert all(refused == [] for _, _, (_, refused) in results)  # without admission nothing is refused
    late = [(r, k, refused) for r, (k, refused), _ in results[30:]]
    assert all(k == 2 for _, k, _ in late)  # once learned, the prompt is never displaced
    assert any(refused == [f"u{r}a", f"u{r}b", f"u{r}c"] for r, _, refused in late)
    for r, _, refused in late:  # a refused block's later new blocks are refused with it
        names = [f"u{r}a", f"u{r}b", f"u{r}c"]
        assert refused == names[len(names) - len(refused):]
        assert not any(key in on for key in refused)
    assert on._refs["u58a"] == 1 and "u58a" not in on  # a refused reference is still learned from
    assert len(on) == 4


def test_quillchain_values_a_shared_prefix_by_its_own_rate():
    """Shared-prefix rate: a request that branches off its known prefix where no earlier request
    ended (a new conversation on a shared prompt, not the next turn of one) counts a fork on every
    block of that prefix. A forked-from block with at least ``RATE_MIN_REFS`` references is worth
    at least its own rate while in use, discounted by its silence: before anything is learned
    (every density 0) that alone keeps the shared prompt over an unshared block that is younger."""
    from quillcache.policies.quillchain import QuillChainPolicy
    from quillcache.policies.quillhd import RATE_MIN_REFS, RATE_SILENCE_GAPS

    def drive(p, keys):
        return _drive_hinted(p, keys)[1]

    runs = {}
    for shared in (True, False):
        p = QuillChainPolicy(capacity_keys=5, period=10**6, shared_rate=shared, second_chance=False, start_rule="hd")
        for branch in "abcd":  # t = 1..8: "s" then each request's own block
            drive(p, ["s", branch])
        runs[shared] = (p, [v for new in "efgh" for v in drive(p, [new])])
    on, off = runs[True][0], runs[False][0]
    assert on._fork == {"s": 3} and off._fork == {}  # requests 2-4 branched off "s"; no request ended there
    assert on._refs["s"] == RATE_MIN_REFS
    assert runs[False][1] == ["a", "b", "c", "s"]  # every density is 0: the oldest block goes
    assert runs[True][1] == ["a", "b", "c", "d"]  # "s" is worth its rate, the others nothing
    r = (4 - 1) / (7 - 1)  # references 1, 3, 5, 7
    t = on._t + 1
    assert on._value(on.class_of("s"), "s", t) == r * math.exp(-((t - 7) * r) / RATE_SILENCE_GAPS) > 0.0
    assert on._value(on.class_of("h"), "h", t) == 0.0
    # the next turn of a conversation extends the chain where its previous request ended: no fork
    p = QuillChainPolicy(capacity_keys=8, period=10**6)
    drive(p, ["s", "a"])
    drive(p, ["s", "a", "a2"])
    assert p._fork == {}
    drive(p, ["s", "b"])  # a new conversation on the same prompt
    assert p._fork == {"s": 1}
    with pytest.raises(ValueError, match="shared_rate needs classes='chain'"):
        QuillHdPolicy(shared_rate=True)
    with pytest.raises(TypeError, match="shared_rate must be bool"):
        QuillChainPolicy(shared_rate=1)


def test_quillchain_admits_a_returning_shared_prefix_by_its_own_rate():
    """Admission values the incoming block the way the victim choice values a cached one: a
    forked-from prompt with at least ``RATE_MIN_REFS`` references that comes back after an eviction
    is worth its own rate ``(refs - 1) / (t - first)``, not the density at age 0 of the class a
    block missing from a request's prefix falls into; without ``shared_rate`` it is refused."""
    from quillcache.policies.quillchain import QuillChainPolicy
    from quillcache.policies.quillhd import RATE_MIN_REFS

    def drive(p, keys):
        return _drive_hinted(p, keys)[2]

    outcome = {}
    for shared in (True, False):
        p = QuillChainPolicy(capacity_keys=4, period=10**6, shared_rate=shared, start_rule="hd")
        for branch in "abc":  # t = 1..6: "s" at 1, 3, 5; requests 2 and 3 fork off it
            drive(p, ["s", branch])
        p.evict("s")  # metadata stays: the prompt is only out of the cache
        drive(p, ["x"])  # t = 7; the cache is full again (a, b, c, x)
        # nothing learned yet (period): every density is 0.01, but 0.001 for a block at age 0,
        # so a block valued by its class alone is worth less than any victim
        p._hd = [[0.001] + [0.01] * (len(row) - 1) for row in p._hd]
        outcome[shared] = (p, drive(p, ["s", "e"]))  # t = 8: "s" comes back on a new branch
    on, stored = outcome[True]
    assert on._refs["s"] == RATE_MIN_REFS and on._fork["s"] == 3
    assert on._incoming_value(on.class_of("s"), "s", 4, 8) == (4 - 1) / (8 - 1) > 0.01
    assert on._incoming_value(on.class_of("x"), "x", 1, 8) == 0.001  # no fork: its class's density
    assert stored == ["s"]  # "s" displaces a victim worth 0.01; "e" (worth 0.001) is then refused
    assert outcome[False][1] == []  # without shared_rate "s" is worth 0.001 and refused, and "e" with it


def test_quillchain_period_is_a_span_of_prompt_tokens():
    """``period`` counts references of 512-token blocks: with smaller blocks the policy (and its
    kernel runner, through the same ``period_refs``) waits proportionally more references, so a
    learning period covers the same prompt tokens whatever the engine's block size."""
    import numpy as np

    from quillcache.hitrate import kernels, simulate
    from quillcache.hitrate.arrays import arrays_from_lists
    from quillcache.policies.quillchain import QuillChainPolicy, period_refs

    assert period_refs(2048, 512) == 2048 and period_refs(2048, 16) == 65536 and period_refs(3, 1024) == 2
    assert period_refs(1, 4096) == 1  # never below one reference
    for bad in ((0, 16), (2048, 0)):
        with pytest.raises(ValueError):
            period_refs(*bad)
    assert QuillChainPolicy(period=2048, block_tokens=16).period == 65536
    assert QuillChainPolicy(period=2048).period == 2048
    # the kernel runner converts the same way: QuillChain at 16-token blocks with period P equals
    # the same kernel given P * 32 references directly (the online class is checked against the
    # kernel with both block sizes in tests/test_hitrate.py)
    rng = np.random.default_rng(5)
    lists = [list(range(c * 50, c * 50 + int(rng.integers(1, 40)))) for c in rng.integers(0, 30, 300)]
    arrs = arrays_from_lists(lists, input_tokens=[16 * len(x) - 3 for x in lists])
    a = simulate(arrs, "quillchain", 120, block_tokens=16, period=4).hits_per_request
    c = simulate(arrs, "quillchain", 120, block_tokens=16, period=128).hits_per_request
    assert not np.array_equal(a, c)  # the period matters on this trace, so the check below can fail
    hits = np.zeros(arrs.num_requests, np.int32)
    kernels.quillhd(arrs.req_offsets, arrs.blocks, arrs.num_unique, 120, hits, arrs.input_tokens, 16, 128, 0.9,
                    kernels.NUM_BUCKETS, 0.95, 1.0, 3, kernels.CLS_CHAIN, True, True, True, True, True, True)
    assert np.array_equal(a, hits)


def test_quillchain_period_is_at_most_the_capacity():
    """With ``cap_period`` (QuillChain's default) a learning / challenger period lasts ``period``
    references but at most the capacity in blocks, and at least ``PERIOD_MIN_REFS``: the kernel
    with it equals the kernel without it given that shorter period, the online class agrees with
    the kernel where the cap binds, and a class without a known capacity caps its periods by the
    largest occupancy seen so far."""
    import numpy as np

    from quillcache.hitrate import simulate
    from quillcache.hitrate.arrays import arrays_from_lists
    from quillcache.hitrate.reference import replay
    from quillcache.policies.quillchain import QuillChainPolicy
    from quillcache.policies.quillhd import PERIOD_MIN_REFS, learning_period

    assert PERIOD_MIN_REFS == 512
    assert learning_period(2048, 1000) == 1000 and learning_period(2048, 100) == 512
    assert learning_period(2048, 10**6) == 2048 and learning_period(300, 100) == 300
    for bad in ((0, 10), (10, 0)):
        with pytest.raises(ValueError):
            learning_period(*bad)
    rng = np.random.default_rng(11)
    lists = [list(range(c * 40, c * 40 + int(rng.integers(1, 30)))) for c in rng.integers(0, 120, 1500)]
    arrs = arrays_from_lists(lists, input_tokens=[512 * len(x) - 7 for x in lists])
    assert arrs.num_refs > 8 * 2048  # several periods of either length
    capped = simulate(arrs, "quillchain", 700).hits_per_request
    assert np.array_equal(capped, simulate(arrs, "quillchain", 700, period=700, cap_period=False).hits_per_request)
    assert not np.array_equal(capped, simulate(arrs, "quillchain", 700, cap_period=False).hits_per_request)
    assert np.array_equal(capped, replay(arrs, "quillchain", 700))  # the class, where the cap binds
    # below PERIOD_MIN_REFS blocks of capacity the period is PERIOD_MIN_REFS references
    assert np.array_equal(simulate(arrs, "quillchain", 100).hits_per_request,
                          simulate(arrs, "quillchain", 100, period=512, cap_period=False).hits_per_request)
    p = QuillChainPolicy()  # no capacity: the largest occupancy so far stands for it
    assert p._plen == PERIOD_MIN_REFS
    for i in range(1500):  # updates at references 512 (512 keys held) and 1024 (1024 held)
        p.insert(i, 1)
    assert p._plen == 1024 and p._next_upd == 2048
    assert QuillChainPolicy(cap_period=False)._plen == 2048


def test_quillchain_starts_on_the_lru_rule_until_the_hit_density_rule_beats_it():
    """``start_rule="lru"`` (QuillChain's default): the real cache runs the LRU rule and the
    challenger shadow the HD rule until a period in which the shadow had more prefix hits, after
    which they swap; ``start_rule="hd"`` starts the other way round. On a trace where the two
    rules part before the first comparison, each start follows its rule alone at least until that
    comparison and departs from it later; the online class starts the same way as the kernel."""
    import numpy as np

    from quillcache.hitrate import simulate
    from quillcache.hitrate.arrays import arrays_from_lists
    from quillcache.hitrate.reference import replay
    from quillcache.policies.quillchain import QuillChainPolicy
    from quillcache.policies.quillhd import QuillHdPolicy, learning_period

    assert QuillChainPolicy().rule == "lru" and QuillChainPolicy(start_rule="hd").rule == "hd"
    assert QuillHdPolicy().rule == "hd" and QuillHdPolicy(mode="challenger", start_rule="lru").rule == "lru"
    assert QuillHdPolicy(mode="hd", start_rule="lru").rule == "hd"  # a fixed mode keeps its rule
    with pytest.raises(ValueError, match="start_rule"):
        QuillChainPolicy(start_rule="belady")
    rng = np.random.default_rng(3)
    lists = [list(range(c * 40, c * 40 + int(rng.integers(1, 30)))) for c in rng.integers(0, 200, 1500)]
    arrs = arrays_from_lists(lists, input_tokens=[512 * len(x) - 7 for x in lists])
    cap = 200  # the first comparison of the two rules is at reference learning_period(2048, 200) = 512
    first_cmp = learning_period(2048, cap)
    lru_start = simulate(arrs, "quillchain", cap).hits_per_request
    hd_start = simulate(arrs, "quillchain", cap, start_rule="hd").hits_per_request
    lru_only = simulate(arrs, "quillchain", cap, mode="lru").hits_per_request
    hd_only = simulate(arrs, "quillchain", cap, mode="hd").hits_per_request

    def first_diff(a, b):  # the reference at which the first request with different hits begins
        assert (a != b).any()
        return int(arrs.req_offsets[int(np.argmax(a != b))])

    assert first_diff(lru_only, hd_only) < first_cmp  # the rules part before any swap: a wrong start shows
    assert first_diff(lru_start, lru_only) >= first_cmp  # the LRU start is the LRU rule until a swap ...
    assert first_diff(hd_start, hd_only) >= first_cmp  # ... the HD start the HD rule; both swap later
    assert np.array_equal(lru_start, replay(arrs, "quillchain", cap))  # the online class starts the same way


def test_quillchain_second_chance_is_bounded_by_a_span_of_prompt_tokens():
    """Second chance (the LRU rule): a shared prefix touched again while cached is marked; a marked
    victim is unmarked and re-queued at the tail of its class instead, at most
    ``second_chance_max(block_tokens) = SECOND_CHANCE_TOKENS // block_tokens`` times per eviction,
    after which the victim goes even if marked. The bound is a span of prompt tokens, so 16-token
    blocks get 32 times as many second chances as 512-token blocks (the same prompt is 32 times as
    many blocks)."""
    from quillcache.policies.quillchain import QuillChainPolicy
    from quillcache.policies.quillhd import SECOND_CHANCE_TOKENS, second_chance_max

    assert SECOND_CHANCE_TOKENS == 64 * 512
    assert second_chance_max(512) == 64 and second_chance_max(16) == 2048 and second_chance_max(10**6) == 1
    with pytest.raises(ValueError, match="block_tokens"):
        second_chance_max(0)

    def drive(p, keys):
        return _drive_hinted(p, keys, p.block_tokens)[1]  # mode="lru": nothing is refused

    outcome = {}
    for block_tokens, second in ((512, True), (16384, True), (32768, True), (512, False)):
        p = QuillChainPolicy(capacity_keys=6, period=10**6, mode="lru", block_tokens=block_tokens,
                             second_chance=second)
        drive(p, ["s1", "s2", "s3", "a"])
        drive(p, ["s1", "s2", "s3", "b"])  # a new branch of s1-s3: a fork, and each is touched while cached
        marked = set(p._real.marked)
        evicted = [v for x in "cde" for v in drive(p, [x])]
        outcome[(block_tokens, second)] = (p._second_max, marked, evicted, set(p._real.marked))
    # s1-s3 share one class, queued deepest first (leaf_first): s3 is the oldest there, a the oldest of all
    assert outcome[(512, False)] == (64, set(), ["a", "s3"], set())
    # a budget of 64 re-queues all three (clearing their marks) and comes back to s3, now unmarked
    assert outcome[(512, True)] == (64, {"s1", "s2", "s3"}, ["a", "s3"], set())
    assert outcome[(16384, True)] == (2, {"s1", "s2", "s3"}, ["a", "s1"], set())  # s3, s2 spared; s1 goes marked
    # a budget of 1: s3 is spared, s2 goes marked, s1 keeps its mark
    assert outcome[(32768, True)] == (1, {"s1", "s2", "s3"}, ["a", "s2"], {"s1"})
