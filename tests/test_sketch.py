"""Count-min sketch: the Cython core against the plain-Python specification, and the guarantees.

The reference (``quillcache.sketch.reference``) is the specification: the compiled core must
produce the same counters, totals, aging clock and heavy-hitter heap on every stream. The
accuracy tests use seeded Zipf streams and exact counts from ``np.unique``/``Counter``.
"""

from __future__ import annotations

import struct

import threading
from collections import Counter

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from quillcache.sketch.countmin import CountMinSketch, SketchConfig
from quillcache.sketch.reference import (
    COUNTER_MAX,
    MASK64,
    ReferenceCountMinSketch,
    dimensions_for,
    mix64,
    row_columns,
    seed_key,
)

U64 = np.uint64
pytestmark = pytest.mark.timeout(180)  # a kernel that stops making progress fails instead of hanging

# ---- strategies (named after the domain) --------------------------------------------------

block_hashes = st.integers(min_value=0, max_value=MASK64)
# eps in [0.05, 0.9] gives 4..55 columns (collisions guaranteed); delta picks 1..7 rows, and
# (0.0068, 0.018] is the depth-5 band that has its own unrolled kernel.
eps_values = st.floats(min_value=0.05, max_value=0.9)
delta_values = st.one_of(st.floats(min_value=0.001, max_value=0.9), st.floats(min_value=0.0068, max_value=0.018))
seeds = st.one_of(st.just(0), st.integers(min_value=0, max_value=MASK64))
counts_values = st.one_of(
    st.integers(min_value=0, max_value=3), st.integers(min_value=COUNTER_MAX - 3, max_value=COUNTER_MAX)
)


@st.composite
def key_streams(draw, max_size: int = 200) -> list[int]:
    """A stream drawn from a small pool of block hashes, so keys repeat and counters collide."""
    pool = draw(st.lists(block_hashes, min_size=1, max_size=24, unique=True))
    return draw(st.lists(st.sampled_from(pool), max_size=max_size))


@st.composite
def sketch_configs(draw, **fixed) -> SketchConfig:
    kw = dict(
        eps=draw(eps_values),
        delta=draw(delta_values),
        conservative=draw(st.booleans()),
        seed=draw(seeds),
        aging_window=draw(st.one_of(st.none(), st.integers(min_value=1, max_value=400))),
        top_k=draw(st.integers(min_value=0, max_value=6)),
    )
    kw.update(fixed)
    return SketchConfig(**kw)


def reference_for(cfg: SketchConfig) -> ReferenceCountMinSketch:
    return ReferenceCountMinSketch(
        cfg.width,
        cfg.depth,
        conservative=cfg.conservative,
        seed=cfg.seed,
        aging_window=cfg.aging_window,
        top_k=cfg.top_k,
    )


def assert_same_state(sk: CountMinSketch, ref: ReferenceCountMinSketch) -> None:
    assert sk.counters().reshape(-1).tolist() == ref.counters()
    assert sk.total == ref.total
    assert sk.additions_since_aging == ref.since_aging
    assert sk._core.heavy_keys().tolist() == ref.heap_keys
    assert sk._core.heavy_stored().tolist() == ref.heap_est
    assert sk.heavy_hitters() == ref.heavy_hitters()


def zipf_stream(n: int, a: float, seed: int) -> np.ndarray:
    """Zipf ranks mixed into block-hash-looking uint64 keys (a bijection, so counts are preserved)."""
    ranks = np.random.default_rng(seed).zipf(a, n).astype(U64)
    return ranks * U64(0x9E3779B97F4A7C15) ^ U64(0xD1B54A32D192ED03)


def exact_counts(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    uniq, cnt = np.unique(keys, return_counts=True)
    return uniq, cnt


# ---- the hash specification -----------------------------------------------------------------


def test_dimensions_follow_eps_delta():
    assert dimensions_for(0.001, 0.01) == (2719, 5)
    sk = CountMinSketch(0.001, 0.01)
    assert (sk.width, sk.depth) == (2719, 5)
    assert sk.counters().shape == (5, 2719) and sk.counters().dtype == np.uint32
    assert sk.nbytes >= 2719 * 5 * 4


def test_mix64_is_splitmix64():
    # splitmix64 outputs for state 0 (first two draws of the canonical generator)
    assert mix64(0) == 0xE220A8397B1DCDAF
    assert mix64(0x9E3779B97F4A7C15) == 0x6E789E6AA1B965F4


@given(block_hashes, seeds, st.integers(1, 5000), st.integers(1, 32))
def test_row_columns_in_range(key, seed, width, depth):
    cols = row_columns(key, seed_key(seed), width, depth)
    assert len(cols) == depth and all(0 <= c < width for c in cols)


# ---- Cython == reference --------------------------------------------------------------------


@given(sketch_configs(), key_streams(max_size=300), st.data())
def test_core_matches_reference(cfg, stream, data):
    sk, ref = CountMinSketch.from_config(cfg), reference_for(cfg)
    use_counts = data.draw(st.booleans())
    counts = data.draw(st.lists(counts_values, min_size=len(stream), max_size=len(stream))) if use_counts else None
    arr = np.array(stream, dtype=U64)
    sk.add(arr, None if counts is None else np.array(counts, dtype=np.uint32))
    ref.add(stream, counts)
    assert_same_state(sk, ref)
    probe = np.array(stream[:50] + [0, MASK64], dtype=U64)
    assert sk.estimate(probe).tolist() == ref.estimate(probe.tolist())


@given(sketch_configs(), key_streams(max_size=60))
def test_add_one_equals_batch(cfg, stream):
    a, b = CountMinSketch.from_config(cfg), CountMinSketch.from_config(cfg)
    a.add(np.array(stream, dtype=U64))
    for k in stream:
        b.add_one(k)
    assert np.array_equal(a.counters(), b.counters())
    assert a.total == b.total and a.heavy_hitters() == b.heavy_hitters()


# ---- guarantees -----------------------------------------------------------------------------


@given(
    sketch_configs(aging_window=None),
    key_streams(),
    key_streams(),
    st.booleans(),
)
def test_never_undercounts(cfg, s1, s2, merge):
    truth = Counter(s1) + Counter(s2)
    a = CountMinSketch.from_config(cfg)
    a.add(np.array(s1, dtype=U64))
    if merge:
        b = CountMinSketch.from_config(cfg)
        b.add(np.array(s2, dtype=U64))
        a.merge(b)
    else:
        a.add(np.array(s2, dtype=U64))
    keys = sorted(truth)
    if keys:
        est = a.estimate(np.array(keys, dtype=U64))
        assert all(int(e) >= truth[k] for k, e in zip(keys, est))
    assert a.total == len(s1) + len(s2)
    for k, e in a.heavy_hitters():
        assert e >= truth[k]


@given(sketch_configs(aging_window=None, top_k=0, conservative=True), key_streams())
def test_conservative_never_above_standard(cfg, stream):
    cu = CountMinSketch.from_config(cfg)
    std = CountMinSketch(cfg.eps, cfg.delta, conservative=False, seed=cfg.seed)
    arr = np.array(stream, dtype=U64)
    cu.add(arr)
    std.add(arr)
    probe = np.unique(np.concatenate([arr, np.arange(20, dtype=U64)]))
    assert np.all(cu.estimate(probe) <= std.estimate(probe))
    assert np.all(cu.counters() <= std.counters())


@pytest.mark.parametrize("conservative", [True, False])
def test_zipf_error_within_eps_n(conservative):
    eps, delta = 0.001, 0.01
    keys = zipf_stream(200_000, 1.1, seed=7)
    sk = CountMinSketch(eps, delta, conservative=conservative, seed=3)
    sk.add(keys)
    uniq, cnt = exact_counts(keys)
    over = sk.estimate(uniq).astype(np.int64) - cnt
    assert over.min() >= 0
    within = np.mean(over <= eps * sk.total)
    assert within >= 1 - delta, f"only {within:.4f} of {uniq.size} keys within eps*N"


def test_conservative_error_smaller_on_zipf():
    keys = zipf_stream(200_000, 1.1, seed=11)
    uniq, cnt = exact_counts(keys)
    err = {}
    for cons in (True, False):
        sk = CountMinSketch(0.001, 0.01, conservative=cons)
        sk.add(keys)
        err[cons] = int((sk.estimate(uniq).astype(np.int64) - cnt).sum())
    assert err[True] <= err[False]


@pytest.mark.parametrize("conservative", [True, False])
def test_top_k_finds_true_heavy_hitters(conservative):
    keys = zipf_stream(200_000, 1.1, seed=5)
    k = 10
    truth = Counter(keys.tolist()).most_common(k + 1)
    assert truth[k - 1][1] > truth[k][1]  # the true top-k set is unambiguous
    sk = CountMinSketch(0.001, 0.01, conservative=conservative, top_k=k)
    sk.add(keys)
    hh = sk.heavy_hitters()
    assert len(hh) == k
    assert {key for key, _ in hh} == {key for key, _ in truth[:k]}
    assert [e for _, e in hh] == sorted((e for _, e in hh), reverse=True)
    exact = dict(truth)
    assert all(e >= exact[key] for key, e in hh)


# ---- aging, halving, saturation -------------------------------------------------------------


@given(sketch_configs(aging_window=None), key_streams())
def test_halve_shifts_counters_and_total(cfg, stream):
    sk = CountMinSketch.from_config(cfg)
    sk.add(np.array(stream, dtype=U64))
    before, total = sk.counters(), sk.total
    sk.halve()
    assert np.array_equal(sk.counters(), before >> 1)
    assert sk.total == total >> 1


def test_aging_window_halves_after_w_additions():
    w = 1000
    keys = zipf_stream(w, 1.2, seed=1)
    aged = CountMinSketch(0.01, 0.01, aging_window=w)
    plain = CountMinSketch(0.01, 0.01)
    aged.add(keys[:-1])
    plain.add(keys[:-1])
    assert np.array_equal(aged.counters(), plain.counters()) and aged.additions_since_aging == w - 1
    aged.add_one(int(keys[-1]))
    plain.add_one(int(keys[-1]))
    assert np.array_equal(aged.counters(), plain.counters() >> 1)
    assert aged.total == w // 2 and aged.additions_since_aging == 0
    # counts weigh on the clock: one addition of count w halves again
    aged.add_one(123, count=w)
    assert aged.additions_since_aging == 0 and aged.total == (w // 2 + w) // 2


@pytest.mark.parametrize("conservative", [True, False])
def test_counters_saturate_not_wrap(conservative):
    sk = CountMinSketch(0.5, 0.5, conservative=conservative)
    sk.add_one(42, COUNTER_MAX - 1)
    sk.add(np.array([42, 42, 42], dtype=U64), np.array([COUNTER_MAX, 5, 1], dtype=np.uint32))
    assert sk.estimate_one(42) == COUNTER_MAX
    assert int(sk.counters().max()) == COUNTER_MAX
    assert sk.total == 2 * COUNTER_MAX + 5


# ---- merge ----------------------------------------------------------------------------------


@given(sketch_configs(aging_window=None, conservative=False), key_streams(), key_streams())
def test_standard_merge_equals_concatenated_stream(cfg, s1, s2):
    a, b, whole = (CountMinSketch.from_config(cfg) for _ in range(3))
    a.add(np.array(s1, dtype=U64))
    b.add(np.array(s2, dtype=U64))
    whole.add(np.array(s1 + s2, dtype=U64))
    a.merge(b)
    assert np.array_equal(a.counters(), whole.counters())
    assert a.total == whole.total


@given(sketch_configs(), key_streams(), key_streams())
def test_merge_matches_reference(cfg, s1, s2):
    a, b = CountMinSketch.from_config(cfg), CountMinSketch.from_config(cfg)
    ra, rb = reference_for(cfg), reference_for(cfg)
    a.add(np.array(s1, dtype=U64))
    b.add(np.array(s2, dtype=U64))
    ra.add(s1)
    rb.add(s2)
    a.merge(b)
    ra.merge(rb)
    assert_same_state(a, ra)


@pytest.mark.parametrize(
    "other_kwargs, name",
    [
        (dict(eps=0.01, delta=0.01), "width"),
        (dict(eps=0.001, delta=0.1), "depth"),
        (dict(eps=0.001, delta=0.01, seed=9), "seed"),
        (dict(eps=0.001, delta=0.01, conservative=False), "conservative"),
    ],
)
def test_merge_mismatch_names_the_field(other_kwargs, name):
    sk = CountMinSketch(0.001, 0.01)
    other = CountMinSketch(**other_kwargs)
    with pytest.raises(ValueError, match=name):
        sk.merge(other)


# ---- serialization --------------------------------------------------------------------------


@given(sketch_configs(), key_streams())
def test_bytes_round_trip(cfg, stream):
    sk = CountMinSketch.from_config(cfg)
    sk.add(np.array(stream, dtype=U64))
    back = CountMinSketch.from_bytes(sk.to_bytes())
    assert back.config == sk.config
    assert np.array_equal(back.counters(), sk.counters())
    assert (back.total, back.additions_since_aging) == (sk.total, sk.additions_since_aging)
    assert back.heavy_hitters() == sk.heavy_hitters()
    more = np.array(stream[::-1], dtype=U64)
    sk.add(more)
    back.add(more)
    assert back.to_bytes() == sk.to_bytes()


def test_pickle_round_trip():
    import pickle

    sk = CountMinSketch(0.01, 0.01, top_k=3, aging_window=500)
    sk.add(zipf_stream(2000, 1.2, seed=4))
    back = pickle.loads(pickle.dumps(sk))
    assert back.to_bytes() == sk.to_bytes()


@given(key_streams(max_size=30), st.data())
def test_corrupt_snapshot_never_crashes(stream, data):
    sk = CountMinSketch(0.3, 0.1, top_k=4, aging_window=50)
    sk.add(np.array(stream, dtype=U64))
    raw = bytearray(sk.to_bytes())
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    blob = bytes(raw[:cut]) if data.draw(st.booleans()) else bytes(raw)
    try:
        back = CountMinSketch.from_bytes(blob)
    except ValueError:
        return
    back.add(np.array(stream, dtype=U64))  # a snapshot that loads is a usable sketch
    back.heavy_hitters()


# ---- input validation -----------------------------------------------------------------------

BAD_CONFIGS = [
    (dict(eps=0, delta=0.1), ValueError, "eps=0"),
    (dict(eps=-0.5, delta=0.1), ValueError, "eps=-0.5"),
    (dict(eps=1.0, delta=0.1), ValueError, "eps=1.0"),
    (dict(eps=float("nan"), delta=0.1), ValueError, "eps=nan"),
    (dict(eps=0.1, delta=0.0), ValueError, "delta=0.0"),
    (dict(eps=0.1, delta=1.5), ValueError, "delta=1.5"),
    (dict(eps="0.1", delta=0.1), TypeError, "eps"),
    (dict(eps=True, delta=0.1), TypeError, "eps"),
    (dict(eps=1e-12, delta=0.1), ValueError, "eps=1e-12"),
    (dict(eps=0.1, delta=1e-30), ValueError, "delta=1e-30"),
    (dict(eps=1e-8, delta=0.01), ValueError, "eps=1e-08"),
    (dict(eps=5e-324, delta=0.1), ValueError, "eps=5e-324"),  # e/eps is infinite: no OverflowError
    (dict(eps=1e-309, delta=0.1), ValueError, "eps=1e-309"),
    (dict(eps=0.1, delta=5e-324), ValueError, "delta=5e-324"),
    (dict(eps=0.1, delta=0.1, seed=-1), ValueError, "seed=-1"),
    (dict(eps=0.1, delta=0.1, seed=2**64), ValueError, "seed=18446744073709551616"),
    (dict(eps=0.1, delta=0.1, aging_window=0), ValueError, "aging_window=0"),
    (dict(eps=0.1, delta=0.1, aging_window=2.5), TypeError, "aging_window"),
    (dict(eps=0.1, delta=0.1, top_k=-3), ValueError, "top_k=-3"),
    (dict(eps=0.1, delta=0.1, conservative=1), TypeError, "conservative"),
]


@pytest.mark.parametrize("kwargs, exc, needle", BAD_CONFIGS)
def test_bad_config_is_refused_with_value_named(kwargs, exc, needle):
    with pytest.raises(exc, match=needle.replace("(", r"\(").replace(".", r"\.")):
        CountMinSketch(**kwargs)


BAD_KEYS = [
    (np.zeros(4, dtype=np.float64), TypeError, "float64"),
    (np.array([1, -2, 3], dtype=np.int64), TypeError, "int64"),
    (np.zeros(4, dtype=np.uint32), TypeError, "uint32"),
    (np.zeros(4, dtype=">u8"), TypeError, ">u8"),
    (np.zeros((2, 3), dtype=U64), ValueError, r"shape \(2, 3\)"),
    (np.array(5, dtype=U64), ValueError, r"shape \(\)"),
    (np.zeros(10, dtype=U64)[::2], ValueError, "C-contiguous"),
    (-1, ValueError, "key -1"),
    (2**64, ValueError, "key 18446744073709551616"),
    (1.5, TypeError, "float"),
    (True, TypeError, "bool"),
    ([1, 2], TypeError, "list"),
    (None, TypeError, "NoneType"),
]


@pytest.mark.parametrize("keys, exc, needle", BAD_KEYS)
def test_bad_keys_are_refused_with_value_named(keys, exc, needle):
    sk = CountMinSketch(0.1, 0.1)
    with pytest.raises(exc, match=needle):
        sk.add(keys)
    with pytest.raises(exc, match=needle):
        sk.estimate(keys)
    assert sk.total == 0


@pytest.mark.parametrize(
    "counts, exc, needle",
    [
        (np.array([1, -2, 3]), ValueError, r"counts\[1\]=-2"),
        (np.array([1, 2**32, 3], dtype=np.int64), ValueError, r"counts\[1\]=4294967296"),
        (np.array([1.0, 2.0, 3.0]), TypeError, "float64"),
        (np.array([1, 2]), ValueError, "3 keys but 2 counts"),
        (np.ones((3, 1), dtype=np.uint32), ValueError, "1-D"),
        (np.ones(6, dtype=np.uint32)[::2], ValueError, "C-contiguous"),
        (-1, ValueError, "count=-1"),
        (2**32, ValueError, "count=4294967296"),
        ("1", TypeError, "str"),
    ],
)
def test_bad_counts_are_refused(counts, exc, needle):
    sk = CountMinSketch(0.1, 0.1)
    with pytest.raises(exc, match=needle):
        sk.add(np.arange(3, dtype=U64), counts)
    assert sk.total == 0


def test_single_key_calls_validate():
    sk = CountMinSketch(0.1, 0.1)
    for bad, exc in [(-5, ValueError), (2**64, ValueError), (3.0, TypeError), (False, TypeError)]:
        with pytest.raises(exc):
            sk.add_one(bad)
        with pytest.raises(exc):
            sk.estimate_one(bad)
    with pytest.raises(ValueError, match="count=-1"):
        sk.add_one(1, -1)
    with pytest.raises(TypeError, match="merge a CountMinSketch"):
        sk.merge(object())
    with pytest.raises(ValueError, match="magic"):
        CountMinSketch.from_bytes(b"x" * 200)
    with pytest.raises(TypeError):
        CountMinSketch.from_bytes("not bytes")
    blob = bytearray(CountMinSketch(eps=0.1, delta=0.1).to_bytes())
    for offset, value in ((8, 5e-324), (16, 5e-324)):  # eps, then delta, patched to a subnormal
        bad = bytearray(blob)
        struct.pack_into("<d", bad, offset, value)
        with pytest.raises(ValueError, match="5e-324"):
            CountMinSketch.from_bytes(bytes(bad))


def test_accepted_input_forms():
    sk = CountMinSketch(0.1, 0.1)
    sk.add(np.empty(0, dtype=U64))
    sk.add(np.uint64(7))
    sk.add(7, counts=2)
    ro = np.array([7, 8], dtype=U64)
    ro.flags.writeable = False
    sk.add(ro, np.array([0, 1], dtype=np.int8))  # count 0 is a no-op
    sk.add_one(np.int64(8))
    assert sk.estimate_one(7) >= 3 and sk.estimate_one(8) >= 2
    assert sk.total == 1 + 2 + 1 + 1
    assert sk.estimate(np.empty(0, dtype=U64)).shape == (0,)


def test_concurrent_mutation_is_refused_not_raced():
    sk = CountMinSketch(0.001, 0.01, top_k=8)
    keys = zipf_stream(400_000, 1.1, seed=2)
    outcomes: list[str] = []

    def worker() -> None:
        try:
            sk.add(keys)
            outcomes.append("ok")
        except RuntimeError:
            outcomes.append("refused")

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sk.total == keys.size * outcomes.count("ok")
    assert outcomes.count("ok") >= 1


# ---- stateful: the core against the reference, operation by operation -----------------------


class SketchMachine(RuleBasedStateMachine):
    """Drive ``CountMinSketch`` and ``ReferenceCountMinSketch`` with the same operations."""

    @initialize(cfg=sketch_configs(), pool=st.lists(block_hashes, min_size=1, max_size=12, unique=True))
    def setup(self, cfg, pool):
        self.cfg = cfg
        self.pool = pool
        self.sk = CountMinSketch.from_config(cfg)
        self.ref = reference_for(cfg)

    @rule(data=st.data())
    def add_batch(self, data):
        keys = data.draw(st.lists(st.sampled_from(self.pool), max_size=80))
        counts = data.draw(st.one_of(st.none(), st.lists(counts_values, min_size=len(keys), max_size=len(keys))))
        self.sk.add(np.array(keys, dtype=U64), None if counts is None else np.array(counts, dtype=np.int64))
        self.ref.add(keys, counts)

    @rule(data=st.data(), count=counts_values)
    def add_one(self, data, count):
        key = data.draw(st.sampled_from(self.pool))
        self.sk.add_one(key, count)
        self.ref.add_one(key, count)

    @rule()
    def halve(self):
        self.sk.halve()
        self.ref.halve()

    @rule(data=st.data())
    def merge(self, data):
        keys = data.draw(st.lists(st.sampled_from(self.pool), max_size=40))
        top_k = data.draw(st.integers(0, 5))
        other = CountMinSketch(
            self.cfg.eps, self.cfg.delta, conservative=self.cfg.conservative, seed=self.cfg.seed, top_k=top_k
        )
        other_ref = ReferenceCountMinSketch(
            self.cfg.width, self.cfg.depth, conservative=self.cfg.conservative, seed=self.cfg.seed, top_k=top_k
        )
        other.add(np.array(keys, dtype=U64))
        other_ref.add(keys)
        self.sk.merge(other)
        self.ref.merge(other_ref)

    @rule()
    def clear(self):
        self.sk.clear()
        self.ref.clear()

    @rule()
    def round_trip(self):
        self.sk = CountMinSketch.from_bytes(self.sk.to_bytes())

    @invariant()
    def same_state(self):
        assert_same_state(self.sk, self.ref)
        probe = np.array(self.pool, dtype=U64)
        assert self.sk.estimate(probe).tolist() == self.ref.estimate(self.pool)


TestSketchMachine = SketchMachine.TestCase


def test_block_boundaries_match_reference():
    """Streams longer than one 64-key block, every depth that has its own code path."""
    rng = np.random.default_rng(0)
    for delta in (0.5, 0.01, 1e-6):
        for cons in (True, False):
            cfg = SketchConfig(eps=0.2, delta=delta, conservative=cons, top_k=3, aging_window=97)
            keys = rng.integers(0, 50, 1000).astype(U64) * U64(0x9E3779B97F4A7C15)
            counts = rng.integers(0, 4, 1000).astype(np.uint32)
            sk, ref = CountMinSketch.from_config(cfg), reference_for(cfg)
            sk.add(keys[:131])
            ref.add(keys[:131].tolist())
            sk.add(keys[131:], counts[131:])
            ref.add(keys[131:].tolist(), counts[131:].tolist())
            assert_same_state(sk, ref)
            plain = CountMinSketch(0.2, delta, conservative=cons)
            rplain = ReferenceCountMinSketch(cfg.width, cfg.depth, conservative=cons)
            plain.add(keys, counts)
            rplain.add(keys.tolist(), counts.tolist())
            assert_same_state(plain, rplain)


def test_hash_spreads_keys_evenly():
    """Columns of sequential keys are near-uniform per row (chi-square well below a broken hash)."""
    width, depth = 101, 4
    skey = seed_key(0)
    hist = np.zeros((depth, width))
    for k in range(20_000):
        for row, col in enumerate(row_columns(k, skey, width, depth)):
            hist[row, col] += 1
    expected = 20_000 / width
    chi2 = ((hist - expected) ** 2 / expected).sum(axis=1)
    # 100 degrees of freedom: mean 100, p=0.999 quantile ~149
    assert np.all(chi2 < 160), chi2
