from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from quillcache.hashing.blocks import hash_blocks
from quillcache.identity.naive_cache import NaiveContentCache

A, B = b"A" * 16, b"B" * 16


def test_content_only_key_shares_across_identities():
    c = NaiveContentCache(16)
    toks = list(range(64))
    h = c.hash_tokens(toks)
    assert list(h) == list(hash_blocks(toks, 16))  # no LoRA/namespace seed: content only
    assert c.lookup(h) == 0
    assert c.insert(h, A) == 4
    # another tenant/adapter sending the same tokens hits the first writer's blocks
    assert c.lookup(c.hash_tokens(toks)) == 4
    assert c.insert(h, B) == 0  # existing keys are not re-stored: the first writer wins
    assert c.writers(h) == [A] * 4


def test_lookup_is_a_prefix_hit():
    c = NaiveContentCache(16)
    c.insert([1, 2, 4], A)
    assert c.lookup([1, 2, 3, 4]) == 2
    assert c.lookup([9, 1, 2]) == 0
    assert c.writers([1, 2, 3], 2) == [A, A]
    with pytest.raises(KeyError, match="not cached"):
        c.writers([3])


def test_lru_eviction_order_is_exact():
    c = NaiveContentCache(16, capacity_blocks=3)
    c.insert([1, 2, 3], A)
    assert c.lookup([1]) == 1  # 1 becomes most recent
    c.insert([4], A)  # evicts 2 (least recently used)
    assert 2 not in c and all(x in c for x in (1, 3, 4))
    c.insert([5, 6], B)  # evicts 3 then 1
    assert sorted(c._blocks) == [4, 5, 6] and c.num_evictions == 3


@pytest.mark.parametrize(
    "call, exc",
    [
        (lambda c: c.insert([1], b"short"), TypeError),
        (lambda c: c.insert([-1], A), ValueError),
        (lambda c: c.lookup(["x"]), ValueError),
        (lambda c: c.lookup("abc"), TypeError),
        (lambda c: c.lookup(np.array([[1]], dtype=np.uint64)), TypeError),
        (lambda c: c.lookup(np.array([-1], dtype=np.int64)), ValueError),
    ],
)
def test_bad_input_is_refused(call, exc):
    with pytest.raises(exc):
        call(NaiveContentCache(16))


def test_bad_configuration_is_refused():
    with pytest.raises(ValueError):
        NaiveContentCache(0)
    with pytest.raises(ValueError):
        NaiveContentCache(16, capacity_blocks=0)
    with pytest.raises(TypeError):
        NaiveContentCache(16, capacity_blocks=2.5)


ops = st.lists(
    st.tuples(st.sampled_from(["insert", "lookup"]), st.lists(st.integers(0, 12), min_size=1, max_size=6),
              st.sampled_from([A, B])),
    max_size=60,
)


@given(ops=ops, cap=st.integers(1, 8))
def test_matches_a_plain_lru_reference(ops, cap):
    c = NaiveContentCache(16, capacity_blocks=cap)
    ref: OrderedDict[int, bytes] = OrderedDict()
    for op, hs, w in ops:
        if op == "lookup":
            n = 0
            for h in hs:
                if h not in ref:
                    break
                ref.move_to_end(h)
                n += 1
            assert c.lookup(hs) == n
        else:
            for h in hs:
                if h in ref:
                    ref.move_to_end(h)
                else:
                    ref[h] = w
            while len(ref) > cap:
                ref.popitem(last=False)
            c.insert(hs, w)
        assert list(c._blocks.items()) == list(ref.items())
