"""Eviction policies: exact eviction orders (the contract), registry errors, and a Hypothesis
test per policy against a tiny plain-Python model driven with the same calls."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from quillcache.policies import (
    POLICIES,
    EvictionPolicy,
    PolicyKeyError,
    S3FifoPolicy,
    UnknownKeyError,
    make_policy,
)

# ---------------------------------------------------------------- registry and bad input


# The four core policies this file models exactly; the trace-study policies (lengthaware, tinylfu,
# quillhd, belady) have their own exact tests in tests/test_policies_extra.py.
CORE = ("fifo", "lfu", "lru", "s3fifo")


def test_registry_lists_every_policy():
    assert set(POLICIES) == {*CORE, "lengthaware", "tinylfu", "quillhd", "belady", "sieve", "arc", "2q", "lhd", "lrb",
                             "quillchain", "lookahead"}
    for name, cls in POLICIES.items():
        if name in ("belady", "lookahead"):  # they need oracles of the future / the queue
            with pytest.raises(TypeError, match=name):
                make_policy(name)
            continue
        p = make_policy(name)
        assert isinstance(p, EvictionPolicy) and type(p) is cls and p.name == name


def test_unknown_policy_lists_registered_names():
    with pytest.raises(ValueError, match=r"unknown eviction policy 'clock'.*fifo.*lfu.*lru.*s3fifo"):
        make_policy("clock")
    with pytest.raises(TypeError, match="policy name must be str"):
        make_policy(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"policy 'lru' rejected options \['capacity_bytes'\]"):
        make_policy("lru", capacity_bytes=10)


def test_s3fifo_option_checks():
    with pytest.raises(ValueError, match="small_ratio=1.5"):
        make_policy("s3fifo", small_ratio=1.5)
    with pytest.raises(ValueError, match="move_to_main_threshold=0"):
        make_policy("s3fifo", move_to_main_threshold=0)
    with pytest.raises(ValueError, match="ghost_ratio=-1"):
        make_policy("s3fifo", ghost_ratio=-1)


@pytest.mark.parametrize("name", CORE)
def test_bad_calls_raise_typed_errors(name):
    p = make_policy(name)
    p.insert("a", 10)
    with pytest.raises(PolicyKeyError, match="'a' is already tracked"):
        p.insert("a", 10)
    for call in (p.touch, p.remove, p.evict):
        with pytest.raises(UnknownKeyError, match="'zz' is not tracked"):
            call("zz")
    with pytest.raises(ValueError, match="size_bytes=0 must be >= 1"):
        p.insert("b", 0)
    with pytest.raises(TypeError, match="size_bytes must be an integer, got float"):
        p.insert("b", 1.5)
    with pytest.raises(TypeError, match="got bool"):
        p.insert("b", True)
    assert "b" not in p and len(p) == 1 and p.tracked_bytes == 10
    assert p.admit("b", 5) is True
    assert p.victim(lambda k: False) is None
    assert p.victim() == "a"
    assert "a" in p  # victim never removes
    p.remove("a")
    assert len(p) == 0 and p.victim() is None and p.tracked_bytes == 0


# ---------------------------------------------------------------- exact eviction orders


def _filled(name: str, keys: str, **options) -> EvictionPolicy:
    p = make_policy(name, **options)
    for k in keys:
        p.insert(k, 1)
    return p


def test_lru_order():
    p = _filled("lru", "abcde")
    p.touch("b")
    p.touch("a")
    p.touch("d")
    # least recently used first: c, e, b, a, d; refused keys keep their place
    assert p.victim(lambda k: k != "c") == "e"
    assert p.eviction_order(lambda k: k != "b") == ["c", "e", "a", "d"]
    assert list(p) == ["b"]


def test_fifo_order_ignores_hits():
    p = _filled("fifo", "abcd")
    p.touch("a")
    p.touch("a")
    p.remove("b")
    p.insert("b", 1)
    assert p.eviction_order() == ["a", "c", "d", "b"]


def test_lfu_order_frequency_then_recency():
    p = _filled("lfu", "abcd")
    for k in "aaabcc":
        p.touch(k)
    # freqs: a=4, b=2, c=3, d=1
    p.insert("e", 1)  # freq 1, more recent than d
    p.touch("b")  # b=3, reached 3 after c did
    assert [p.frequency(k) for k in "abcde"] == [4, 3, 3, 1, 1]
    assert p.victim(lambda k: k not in "de") == "c"
    assert p.eviction_order() == ["d", "e", "c", "b", "a"]


def test_lfu_remove_keeps_buckets_consistent():
    p = _filled("lfu", "abc")
    p.touch("b")
    p.remove("b")  # its bucket (freq 2) empties and is unlinked
    p.touch("a")
    p.touch("a")
    assert p.frequency("a") == 3
    assert p.eviction_order() == ["c", "a"]


def test_s3fifo_order_small_main_ghost():
    p = S3FifoPolicy(capacity_bytes=10)
    for k in range(10):
        p.insert(k, 1)
    p.touch(0)
    p.touch(0)  # freq 2 >= threshold: moves to main when it reaches the tail of S
    p.touch(1)  # freq 1: still evicted from S
    assert p.victim() == 1 and p.queue_of(0) == "main" and p.frequency(0) == 0
    p.evict(1)
    assert p.ghost_keys() == [1]
    p.insert(1, 1)  # ghost hit: straight into main, ghost forgets it
    assert p.queue_of(1) == "main" and p.ghost_keys() == []
    # S holds 2..9 (8 bytes >= 10% of 10), so victims come from S's tail
    assert p.victim() == 2
    p.evict(2)
    p.touch(1)  # main: [0 (freq 0), 1 (freq 1)]
    assert p.victim(lambda k: k in (0, 1)) == 0
    p.evict(0)  # main keys do not enter the ghost
    assert p.ghost_keys() == [2]
    # once S is drained the main queue is scanned: 1 has freq 1, reinserted with 0, then evicted
    order = p.eviction_order()
    assert order == [3, 4, 5, 6, 7, 8, 9, 1]
    assert p.ghost_keys() == [2, 3, 4, 5, 6, 7, 8, 9]  # ghost_ratio 0.9 of 10 bytes keeps 9


def test_s3fifo_small_below_share_evicts_from_main():
    p = S3FifoPolicy(capacity_bytes=100)
    p.insert("m1", 40)
    p.evict(p.victim())  # m1 from S into the ghost
    p.insert("m1", 40)  # -> main
    p.insert("m2", 1)  # S holds 1 byte < 10% of 100: the main queue is scanned first
    assert p.victim() == "m1"
    p.evict("m1")
    assert "m2" in p and "m1" not in p and p.ghost_keys() == []


def test_s3fifo_refused_keys_rotate_and_victim_terminates():
    p = _filled("s3fifo", "abcd")
    for k in "abcd":
        p.touch(k)
    assert p.victim(lambda k: False) is None  # every key refused: bounded scan, no loop
    assert len(p) == 4 and p.tracked_bytes == 4
    assert p.victim(lambda k: k == "c") == "c"


# ---------------------------------------------------------------- models


class LruModel:
    def __init__(self):
        self.order, self.size = [], {}

    def insert(self, k, s):
        self.order.append(k)
        self.size[k] = s

    def touch(self, k):
        self.order.remove(k)
        self.order.append(k)

    def remove(self, k):
        self.order.remove(k)
        del self.size[k]

    evict = remove

    def victim(self, pred):
        return next((k for k in self.order if pred(k)), None)


class FifoModel(LruModel):
    def touch(self, k):
        pass


class LfuModel:
    def __init__(self):
        self.freq, self.stamp, self.size, self.t = {}, {}, {}, 0

    def _tick(self, k):
        self.t += 1
        self.stamp[k] = self.t

    def insert(self, k, s):
        self.freq[k], self.size[k] = 1, s
        self._tick(k)

    def touch(self, k):
        self.freq[k] += 1
        self._tick(k)

    def remove(self, k):
        del self.freq[k], self.stamp[k], self.size[k]

    evict = remove

    def victim(self, pred):
        cands = [k for k in self.freq if pred(k)]
        return min(cands, key=lambda k: (self.freq[k], self.stamp[k])) if cands else None


class S3FifoModel:
    """S3-FIFO with plain lists (index 0 = oldest), capacity given."""

    def __init__(self, cap):
        self.cap, self.S, self.M, self.G, self.freq, self.size = cap, [], [], [], {}, {}

    def insert(self, k, s):
        self.size[k], self.freq[k] = s, 0
        ghost = [g for g in self.G if g[0] == k]
        if ghost:
            self.G.remove(ghost[0])
            self.M.append(k)
        else:
            self.S.append(k)

    def touch(self, k):
        self.freq[k] = min(3, self.freq[k] + 1)

    def remove(self, k):
        (self.S if k in self.S else self.M).remove(k)
        del self.size[k], self.freq[k]

    def evict(self, k):
        in_small = k in self.S
        s = self.size[k]
        self.remove(k)
        if in_small:
            self.G.append((k, s))
            while self.G and sum(x[1] for x in self.G) > 0.9 * self.cap:
                self.G.pop(0)

    def _small(self, pred):
        for _ in range(len(self.S)):
            k = self.S[0]
            if self.freq[k] >= 2:
                self.S.pop(0)
                self.freq[k] = 0
                self.M.append(k)
            elif pred(k):
                return k
            else:
                self.S.append(self.S.pop(0))
        return None

    def _main(self, pred):
        for _ in range(4 * len(self.M)):
            k = self.M[0]
            if self.freq[k] > 0:
                self.freq[k] -= 1
                self.M.append(self.M.pop(0))
            elif pred(k):
                return k
            else:
                self.M.append(self.M.pop(0))
        return None

    def victim(self, pred):
        small_bytes = sum(self.size[k] for k in self.S)
        if self.S and small_bytes >= 0.1 * self.cap:
            k = self._small(pred)
            return k if k is not None else self._main(pred)
        k = self._main(pred)
        return k if k is not None else self._small(pred)


S3_CAP = 200
MODELS = {
    "lru": (lambda: make_policy("lru"), LruModel),
    "fifo": (lambda: make_policy("fifo"), FifoModel),
    "lfu": (lambda: make_policy("lfu"), LfuModel),
    "s3fifo": (lambda: make_policy("s3fifo", capacity_bytes=S3_CAP), lambda: S3FifoModel(S3_CAP)),
}
assert set(MODELS) == set(CORE)

keys = st.integers(0, 11)
ops = st.one_of(
    st.tuples(st.just("insert"), keys, st.integers(1, 40)),
    st.tuples(st.just("touch"), keys),
    st.tuples(st.just("remove"), keys),
    st.tuples(st.just("evict"), st.frozensets(keys, max_size=4)),  # refused keys
    st.tuples(st.just("victim"), st.frozensets(keys, max_size=12)),
)


@pytest.mark.parametrize("name", sorted(MODELS))
@given(script=st.lists(ops, max_size=80))
def test_policy_agrees_with_model(name, script):
    make, make_model = MODELS[name]
    p, m = make(), make_model()
    for op in script:
        kind, arg = op[0], op[1]
        if kind == "insert":
            if arg in p:
                with pytest.raises(PolicyKeyError):
                    p.insert(arg, op[2])
            else:
                p.insert(arg, op[2])
                m.insert(arg, op[2])
        elif kind in ("touch", "remove"):
            if arg in p:
                getattr(p, kind)(arg)
                getattr(m, kind)(arg)
            else:
                with pytest.raises(UnknownKeyError):
                    getattr(p, kind)(arg)
        else:
            refused = arg

            def pred(k, refused=refused):
                return k not in refused

            v = p.victim(pred)
            assert v == m.victim(pred)
            assert v is None or (v in p and pred(v))
            if v is None:
                assert all(k in refused for k in p)
            if kind == "evict" and v is not None:
                p.evict(v)
                m.evict(v)
        assert sorted(p) == sorted(m.size)
        assert len(p) == len(m.size) and p.tracked_bytes == sum(m.size.values())
    if name == "s3fifo":
        assert p.ghost_keys() == [g[0] for g in m.G]
