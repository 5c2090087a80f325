"""Block hashing: Numba XXH3-64 and the Dynamo chain are bit-identical to the ``xxhash`` package.

The reference is always the ``xxhash`` package driven from plain Python (a per-block loop);
the fast side is batched so the whole file stays well under a minute.
"""

from __future__ import annotations

import hashlib
import struct
import subprocess
import sys

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from quillcache.hashing import blocks as hashing
from quillcache.hashing import _xxh3 as k

U64_MAX = 2**64 - 1
BLOCK_SIZES = (16, 64, 256, 512)
SEED_CONFIGS = ((None, None), ("llama-lora-a", None), (None, "tenant-ns"), ("adapter-β", "ns-2"))


def _loop_local(tokens, bs: int, seed: int) -> list[int]:
    """The natural per-block loop over the ``xxhash`` package (independent of the module)."""
    arr = np.asarray(tokens, dtype=np.uint64)
    return [
        xxhash.xxh3_64_intdigest(arr[a : a + bs].astype("<u4").tobytes(), seed=seed)
        for a in range(0, len(arr) - bs + 1, bs)
    ]


def _loop_chain(locals_: list[int], seed: int) -> list[int]:
    out: list[int] = []
    for h in locals_:
        out.append(h if not out else xxhash.xxh3_64_intdigest(struct.pack("<QQ", out[-1], h), seed=seed))
    return out


def _seed(lora, namespace) -> int:
    s = 1337
    if lora:
        s += xxhash.xxh3_64_intdigest(lora.encode(), seed=0)
    if namespace:
        s += xxhash.xxh3_64_intdigest(namespace.encode(), seed=1)
    return s % 2**64


# --------------------------------------------------------------------------- XXH3 kernel
def _ranges_vs_xxhash(buf: np.ndarray, starts, lengths, seeds) -> None:
    starts = np.asarray(starts, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    seeds = np.asarray(seeds, dtype=np.uint64)
    out = np.empty(len(starts), dtype=np.uint64)
    k.xxh3_64_ranges(buf, starts, lengths, seeds, out)
    raw = buf.tobytes()
    for s, n, seed, got in zip(starts.tolist(), lengths.tolist(), seeds.tolist(), out.tolist()):
        want = xxhash.xxh3_64_intdigest(raw[s : s + n], seed=seed)
        assert got == want, f"length {n} at offset {s}, seed {seed}: {got} != {want}"


def test_xxh3_every_length_0_to_2100_random_seeds_and_offsets():
    rng = np.random.default_rng(11)
    buf = rng.integers(0, 256, size=2100 + 64, dtype=np.uint8)
    lengths = np.arange(2101)
    starts = rng.integers(0, 64, size=lengths.shape[0])  # unaligned starts too
    seeds = rng.integers(0, 2**64, size=lengths.shape[0], dtype=np.uint64)
    seeds[::7] = 0
    seeds[3::7] = 1337
    seeds[5::7] = U64_MAX
    _ranges_vs_xxhash(buf, starts, lengths, seeds)


def test_xxh3_long_inputs_and_block_boundaries():
    rng = np.random.default_rng(12)
    buf = rng.integers(0, 256, size=20_000, dtype=np.uint8)
    lengths = [1023, 1024, 1025, 2047, 2048, 2049, 3071, 3072, 3073, 4095, 4096, 4097, 5000, 8191, 8192, 8193,
               12_345, 19_999]  # fmt: skip
    seeds = [int(x) for x in rng.integers(0, 2**64, size=len(lengths), dtype=np.uint64)]
    _ranges_vs_xxhash(buf, [0] * len(lengths), lengths, seeds)
    _ranges_vs_xxhash(buf, [1] * len(lengths), [n - 1 for n in lengths], [0] * len(lengths))


def test_xxh3_public_wrapper_and_dynamo_known_answer():
    # Dynamo's own router test: compute_block_hash(b"test data") == LocalBlockHash(13226331709069118873)
    assert hashing.xxh3_64(b"test data", 1337) == 13226331709069118873
    assert hashing.xxh3_64(b"", 0) == xxhash.xxh3_64_intdigest(b"")
    arr = np.arange(300, dtype=np.uint32)
    assert hashing.xxh3_64(arr, 7) == xxhash.xxh3_64_intdigest(arr.tobytes(), seed=7)
    assert hashing.xxh3_64(arr[::3], 7) == xxhash.xxh3_64_intdigest(arr[::3].tobytes(), seed=7)


def test_custom_secret_kernel_matches_python_reference():
    assert k.reference_custom_secret(0) == k.KSECRET.tobytes()
    sec_bytes = np.empty(k.SECRET_SIZE, dtype=np.uint8)
    sec64 = np.empty(k.SECRET_TABLE_LEN, dtype=np.uint64)
    for seed in (0, 1, 1337, 0x0123456789ABCDEF, U64_MAX):
        k._custom_secret_table(np.uint64(seed), sec_bytes, sec64)
        want = k.reference_custom_secret(seed)
        assert sec_bytes.tobytes() == want
        assert sec64.tolist() == [int.from_bytes(want[i : i + 8], "little") for i in range(k.SECRET_TABLE_LEN)]


@given(data=st.binary(max_size=700), seed=st.integers(0, U64_MAX))
def test_xxh3_hypothesis_matches_xxhash(data, seed):
    assert hashing.xxh3_64(data, seed) == xxhash.xxh3_64_intdigest(data, seed=seed)


# --------------------------------------------------------------------------- Dynamo chain
@pytest.mark.parametrize("bs", BLOCK_SIZES)
def test_bit_identity_2500_random_prompts_per_block_size(bs):
    """4 block sizes x 2,500 prompts = 10,000 random prompts, every seed config, every API form."""
    rng = np.random.default_rng(1000 + bs)
    n_prompts = 2500
    max_tokens = 6 * bs + bs - 1  # up to 6 full blocks plus a partial one
    lengths = rng.integers(0, max_tokens, size=n_prompts, endpoint=True)
    flat = rng.integers(0, 2**32, size=int(lengths.sum()), dtype=np.uint64).astype(np.uint32)
    offsets = np.zeros(n_prompts + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    prompts = [flat[offsets[j] : offsets[j + 1]] for j in range(n_prompts)]
    # each prompt gets one of the seed configs; the fast side is one batched call per config
    cfg_of = rng.integers(0, len(SEED_CONFIGS), size=n_prompts)
    for c, (lora, ns) in enumerate(SEED_CONFIGS):
        seed = _seed(lora, ns)
        assert hashing.hash_seed(lora, ns) == seed
        idx = np.flatnonzero(cfg_of == c)
        sub = [prompts[j] for j in idx]
        seq, bo = hashing.hash_blocks_batch(sub, bs, lora=lora, namespace=ns)
        loc, bo2 = hashing.hash_blocks_batch(
            [p.astype(np.int64) for p in sub], bs, lora=lora, namespace=ns, chained=False
        )
        assert np.array_equal(bo, bo2)
        sub_flat = np.concatenate(sub) if sub else np.empty(0, np.uint32)
        sub_off = np.concatenate([[0], np.cumsum([len(p) for p in sub])]).astype(np.int64)
        seq_csr, bo3 = hashing.hash_blocks_batch((sub_flat, sub_off), bs, lora=lora, namespace=ns)
        assert np.array_equal(seq_csr, seq) and np.array_equal(bo3, bo)
        for i, p in enumerate(sub):
            want_local = _loop_local(p, bs, seed)
            want_seq = _loop_chain(want_local, 1337)
            assert loc[bo[i] : bo[i + 1]].tolist() == want_local
            assert seq[bo[i] : bo[i + 1]].tolist() == want_seq
        # the single-prompt API on a sample (it is the same kernel)
        for i in range(0, len(sub), 97):
            p = sub[i]
            want_local = _loop_local(p, bs, seed)
            assert hashing.local_hashes(p, bs, lora, ns).tolist() == want_local
            assert hashing.hash_blocks(p.tolist(), bs, lora=lora, namespace=ns).tolist() == _loop_chain(
                want_local, 1337
            )


def test_reference_module_matches_loop():
    toks = list(range(1000, 1100))
    for bs in (1, 3, 16):
        assert k.reference_local_hashes(toks, bs, 99) == _loop_local(toks, bs, 99)
        # the chain step is seeded with 1337 whatever the local seed (REFERENCE section 1), unless told otherwise
        assert k.reference_hash_blocks(toks, bs, 99) == _loop_chain(_loop_local(toks, bs, 99), 1337)
        assert k.reference_hash_blocks(toks, bs, 99, chain_seed=99) == _loop_chain(_loop_local(toks, bs, 99), 99)


def test_known_answer_fixed_prompt():
    toks = list(range(32))
    assert hashing.hash_blocks(toks, 16).tolist() == [15310707395893867146, 13769157705258532664]
    assert hashing.local_hashes(toks, 16).tolist()[0] == 15310707395893867146
    assert hashing.hash_seed() == 1337 == hashing.hash_seed("", "") == hashing.hash_seed(None, "")
    assert hashing.hash_seed("a", "b") == 9207261918427575928 == _seed("a", "b")
    assert hashing.hash_seed("a") != hashing.hash_seed(None, "a")  # seeds 0 and 1 keep them apart


def test_lora_and_namespace_change_every_hash():
    toks = np.arange(64)
    base = hashing.hash_blocks(toks, 16)
    for lora, ns in SEED_CONFIGS[1:]:
        other = hashing.hash_blocks(toks, 16, lora=lora, namespace=ns)
        assert not np.intersect1d(base, other).size


def test_partial_trailing_blocks_and_prefix_property():
    rng = np.random.default_rng(3)
    toks = rng.integers(0, 2**32, size=100, dtype=np.uint64)
    assert hashing.hash_blocks(toks[:10], 16).shape == (0,)
    assert hashing.local_hashes(toks[:15], 16).dtype == np.uint64
    full = hashing.hash_blocks(toks, 16)
    assert full.shape == (6,)
    for n in range(0, 101):
        assert np.array_equal(hashing.hash_blocks(toks[:n], 16), full[: n // 16])


def test_empty_inputs():
    for empty in ([], (), np.array([], dtype=np.uint32), np.array([], dtype=np.int64)):
        assert hashing.hash_blocks(empty, 16).shape == (0,)
        assert hashing.local_hashes(empty, 1).dtype == np.uint64
    h, bo = hashing.hash_blocks_batch([], 16)
    assert h.shape == (0,) and bo.tolist() == [0]
    h, bo = hashing.hash_blocks_batch([[], [1, 2], []], 1)
    assert bo.tolist() == [0, 0, 2, 2] and h.tolist() == _loop_chain(_loop_local([1, 2], 1, 1337), 1337)
    h, bo = hashing.hash_blocks_batch((np.array([], np.uint32), [0]), 16)
    assert h.shape == (0,) and bo.tolist() == [0]
    assert hashing.salted_hash_blocks([], 4, b"k" * 16).shape == (0,)


def test_non_contiguous_and_foreign_layouts_are_copied_not_refused():
    rng = np.random.default_rng(4)
    base = rng.integers(0, 2**32, size=(64, 2), dtype=np.uint64)
    col = base[:, 1]  # strided view
    assert not col.flags.c_contiguous
    want = hashing.hash_blocks(np.ascontiguousarray(col), 8)
    assert np.array_equal(hashing.hash_blocks(col, 8), want)
    assert np.array_equal(hashing.hash_blocks(col.astype(">u4"), 8), want)  # big-endian dtype
    assert np.array_equal(hashing.hash_blocks(col[::-1][::-1], 8), want)
    before = base.copy()
    hashing.hash_blocks_batch([col, col[:20]], 8)
    assert np.array_equal(base, before)  # inputs are never modified


def test_batch_mixed_dtypes_and_lists():
    rng = np.random.default_rng(5)
    ps = [
        rng.integers(0, 2**32, size=40, dtype=np.uint64),
        rng.integers(0, 2**31, size=33, dtype=np.int32),
        rng.integers(0, 2**16, size=50, dtype=np.uint16),
        [int(x) for x in rng.integers(0, 2**32, size=17, dtype=np.uint64)],
        np.array([2**32 - 1] * 16, dtype=object),
    ]
    h, bo = hashing.hash_blocks_batch(ps, 8)
    for j, p in enumerate(ps):
        want = _loop_chain(_loop_local(np.asarray(p, dtype=np.uint64), 8, 1337), 1337)
        assert h[bo[j] : bo[j + 1]].tolist() == want


token_lists = st.lists(st.integers(0, 2**32 - 1), max_size=200)
names = st.one_of(st.none(), st.text(max_size=6))


@given(toks=token_lists, bs=st.integers(1, 40), lora=names, ns=names)
def test_hypothesis_single_prompt_matches_reference(toks, bs, lora, ns):
    seed = _seed(lora, ns)
    assert hashing.hash_seed(lora, ns) == seed
    want_local = _loop_local(toks, bs, seed)
    assert hashing.local_hashes(toks, bs, lora, ns).tolist() == want_local
    assert hashing.hash_blocks(np.array(toks, dtype=np.int64), bs, lora, ns).tolist() == _loop_chain(
        want_local, 1337
    )


@given(prompts=st.lists(token_lists, max_size=8), bs=st.integers(1, 20), as_csr=st.booleans())
def test_hypothesis_batch_equals_per_prompt(prompts, bs, as_csr):
    if as_csr:
        flat = [t for p in prompts for t in p]
        offs = np.concatenate([[0], np.cumsum([len(p) for p in prompts], dtype=np.int64)])
        h, bo = hashing.hash_blocks_batch((flat, offs), bs)
    else:
        h, bo = hashing.hash_blocks_batch(prompts, bs)
    assert bo.dtype == np.int64 and bo.shape == (len(prompts) + 1,)
    for j, p in enumerate(prompts):
        assert h[bo[j] : bo[j + 1]].tolist() == hashing.hash_blocks(p, bs).tolist()


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "tokens, exc, match",
    [
        (np.array([1.0, 2.0]), TypeError, "float64"),
        ([1.5, 2.0], TypeError, "float64"),
        (np.array([True, False]), TypeError, "bool"),
        (["a", "b"], TypeError, "<U1"),
        ("abc", TypeError, "str"),
        (b"\x01\x02", TypeError, "bytes"),
        ([-1, 2], ValueError, r"tokens\[0\]=-1"),
        (np.array([3, -7], dtype=np.int8), ValueError, r"tokens\[1\]=-7"),
        ([0, 2**32], ValueError, r"tokens\[1\]=4294967296"),
        (np.array([5, 2**40], dtype=np.uint64), ValueError, "1099511627776"),
        ([1, 2**70], ValueError, str(2**70)),
        ([1, None], TypeError, "None"),
        (np.zeros((2, 3), dtype=np.int64), ValueError, r"shape \(2, 3\)"),
        (np.int64(5), ValueError, r"shape \(\)"),
        ([[1], [2, 3]], ValueError, "1-D"),
    ],
)
def test_bad_tokens_raise_naming_the_value(tokens, exc, match):
    with pytest.raises(exc, match=match):
        hashing.hash_blocks(tokens, 16)
    with pytest.raises(exc, match=match):
        hashing.local_hashes(tokens, 16)
    with pytest.raises(exc, match=match):
        hashing.salted_hash_blocks(tokens, 16, b"k" * 16)


@pytest.mark.parametrize(
    "bs, exc, match",
    [
        (0, ValueError, "block_size=0"),
        (-1, ValueError, "block_size=-1"),
        (70000, ValueError, "block_size=70000"),
        (65537, ValueError, "block_size=65537"),
        (16.0, TypeError, "float 16.0"),
        ("16", TypeError, "str '16'"),
        (True, TypeError, "bool True"),
        (None, TypeError, "NoneType"),
    ],
)
def test_bad_block_size_raises_naming_the_value(bs, exc, match):
    with pytest.raises(exc, match=match):
        hashing.hash_blocks([1, 2, 3], bs)
    with pytest.raises(exc, match=match):
        hashing.hash_blocks_batch([[1, 2, 3]], bs)
    with pytest.raises(exc, match=match):
        hashing.salted_hash_blocks([1, 2, 3], bs, b"k" * 16)


def test_block_size_limits_accepted():
    assert hashing.hash_blocks(list(range(3)), 1).shape == (3,)
    assert hashing.hash_blocks(np.zeros(65536, np.uint32), 65536).shape == (1,)
    assert hashing.hash_blocks([1, 2], np.int32(2)).shape == (1,)


@pytest.mark.parametrize(
    "prompts, exc, match",
    [
        ([[1, 2], [3, -4]], ValueError, r"prompts\[1\]\[1\]=-4"),
        ([np.array([1, 2]), np.array([0.5])], TypeError, r"prompts\[1\].*float64"),
        ([np.zeros((2, 2), np.int64)], ValueError, r"prompts\[0\].*shape \(2, 2\)"),
        ([np.arange(5), np.array([1, 2**33])], ValueError, r"prompts\[1\]\[1\]=8589934592"),
        (([1, 2, 3], [0, 4]), ValueError, r"offsets\[-1\]=4"),
        (([1, 2, 3], [1, 3]), ValueError, r"offsets\[0\]=1"),
        (([1, 2, 3], [0, 2, 1, 3]), ValueError, r"offsets\[2\]=1"),
        (([1, 2, 3], []), ValueError, "offsets is empty"),
        (([1, 2, 3], [0.0, 3.0]), TypeError, "float64"),
        (([1, 2, 3], [[0, 3]]), ValueError, "1-D"),
        (([1, 2, -3], [0, 3]), ValueError, r"flat_tokens\[2\]=-3"),
        (([1, 2], [0, 1], [0]), TypeError, "tuple of 3 items"),
        (np.zeros(4, np.uint32), TypeError, "numpy array"),
        ("abc", TypeError, "str"),
        (7, TypeError, "int"),
    ],
)
def test_bad_batch_input_raises_naming_the_value(prompts, exc, match):
    with pytest.raises(exc, match=match):
        hashing.hash_blocks_batch(prompts, 2)


def test_bad_seed_names_and_flags():
    with pytest.raises(TypeError, match="lora must be str or None, got int 5"):
        hashing.hash_blocks([1], 1, lora=5)
    with pytest.raises(TypeError, match="namespace must be str or None, got bytes"):
        hashing.hash_blocks([1], 1, namespace=b"ns")
    with pytest.raises(TypeError, match="chained must be a bool"):
        hashing.hash_blocks_batch([[1]], 1, chained="yes")
    with pytest.raises(ValueError, match=f"seed={2**64}"):
        hashing.xxh3_64(b"x", 2**64)
    with pytest.raises(ValueError, match="seed=-1"):
        hashing.xxh3_64(b"x", -1)
    with pytest.raises(TypeError, match="data must be bytes-like"):
        hashing.xxh3_64("text")


any_array = hnp.arrays(
    dtype=st.one_of(hnp.scalar_dtypes(), hnp.byte_string_dtypes(), hnp.unicode_string_dtypes()),
    shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=6),
)
any_block_size = st.one_of(
    st.integers(-3, 70_000), st.floats(allow_nan=True), st.none(), st.text(max_size=3), st.booleans()
)


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(tokens=st.one_of(any_array, st.lists(st.one_of(st.integers(), st.floats(), st.none()), max_size=8)),
       bs=any_block_size)  # fmt: skip
def test_hypothesis_arbitrary_input_raises_cleanly_or_matches_reference(tokens, bs):
    try:
        got = hashing.hash_blocks(tokens, bs)
    except (TypeError, ValueError):
        return
    seq = np.asarray(tokens).astype(np.uint64)  # accepted: must be valid 1-D ids
    assert got.tolist() == _loop_chain(_loop_local(seq, int(bs), 1337), 1337)


any_offsets = st.one_of(
    st.lists(st.integers(-3, 14), max_size=6), hnp.arrays(hnp.integer_dtypes(), st.integers(0, 5))
)


@given(flat=st.lists(st.integers(-2, 2**32), max_size=12), offsets=any_offsets, bs=st.integers(1, 4))
def test_hypothesis_arbitrary_csr_raises_cleanly_or_matches(flat, offsets, bs):
    try:
        h, bo = hashing.hash_blocks_batch((flat, offsets), bs)
    except (TypeError, ValueError):
        return
    offs = [int(o) for o in offsets]
    for j in range(len(offs) - 1):
        want = _loop_chain(_loop_local(flat[offs[j] : offs[j + 1]], bs, 1337), 1337)
        assert h[bo[j] : bo[j + 1]].tolist() == want


# --------------------------------------------------------------------------- keyed BLAKE2b chain
KEY_A = bytes(range(32))
KEY_B = bytes(range(1, 33))


def _blake_reference(toks, bs: int, key: bytes, salt: bytes = b"") -> list[bytes]:
    parent = hashlib.blake2b(
        struct.pack("<II", bs, len(salt)) + salt, key=key, digest_size=32, person=b"qc-salt-root"
    ).digest()
    out = []
    arr = np.asarray(toks, dtype="<u4")
    for a in range(0, len(arr) - bs + 1, bs):
        block = arr[a : a + bs].tobytes()
        parent = hashlib.blake2b(parent + block, key=key, digest_size=32, person=b"qc-salt-block").digest()
        out.append(parent)
    return out


def test_salted_chain_matches_spec_and_u64_is_digest_prefix():
    toks = list(range(50))
    digests = hashing.salted_block_digests(toks, 8, KEY_A, salt=b"tenant-7")
    want = _blake_reference(toks, 8, KEY_A, b"tenant-7")
    assert digests.shape == (6, 32) and digests.dtype == np.uint8
    assert [bytes(d) for d in digests] == want
    u64 = hashing.salted_hash_blocks(toks, 8, KEY_A, salt=b"tenant-7")
    assert u64.dtype == np.uint64
    assert u64.tolist() == [int.from_bytes(d[:8], "little") for d in want]


def test_salted_chain_key_salt_and_prefix_semantics():
    toks = np.arange(64, dtype=np.uint32)
    a = hashing.salted_hash_blocks(toks, 16, KEY_A)
    assert np.array_equal(a, hashing.salted_hash_blocks(toks.astype(np.int64), 16, bytearray(KEY_A)))
    b = hashing.salted_hash_blocks(toks, 16, KEY_B)
    assert not np.intersect1d(a, b).size  # same prefix, different key: unrelated chain
    c = hashing.salted_hash_blocks(toks, 16, KEY_A, salt=b"x")
    assert not np.intersect1d(a, c).size
    assert not np.intersect1d(a, hashing.hash_blocks(toks, 16)).size
    assert np.array_equal(hashing.salted_hash_blocks(toks[:40], 16, KEY_A), a[:2])  # prefix property
    changed = toks.copy()
    changed[20] += 1  # block 1 changes: block 0 same, all later blocks differ
    d = hashing.salted_hash_blocks(changed, 16, KEY_A)
    assert d[0] == a[0] and (d[1:] != a[1:]).all()


def test_salted_chain_is_deterministic_across_processes():
    code = (
        "from quillcache.hashing.blocks import salted_hash_blocks;"
        f"print(list(map(int, salted_hash_blocks(list(range(48)), 16, {KEY_A!r}, salt=b's'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(hashing.salted_hash_blocks(list(range(48)), 16, KEY_A, salt=b"s").tolist())


@pytest.mark.parametrize(
    "key, salt, exc, match",
    [
        (b"short", b"", ValueError, "key is 5 bytes; expected 16..64"),
        (b"k" * 15, b"", ValueError, "key is 15 bytes"),
        (b"k" * 65, b"", ValueError, "key is 65 bytes"),
        (b"", b"", ValueError, "key is 0 bytes"),
        ("a" * 32, b"", TypeError, "key must be bytes, got str"),
        (None, b"", TypeError, "key must be bytes, got NoneType"),
        (b"k" * 16, "salt", TypeError, "salt must be bytes, got str"),
        (b"k" * 16, b"s" * 1025, ValueError, "salt is 1025 bytes"),
    ],
)
def test_bad_salted_key_or_salt(key, salt, exc, match):
    with pytest.raises(exc, match=match):
        hashing.salted_hash_blocks([1, 2, 3, 4], 2, key, salt=salt)
    with pytest.raises(exc, match=match):
        hashing.salted_block_digests([1, 2, 3, 4], 2, key, salt=salt)


def test_salted_key_never_echoed():
    secret = b"super-secret-key-material-0123456789"[:12]
    with pytest.raises(ValueError) as info:
        hashing.salted_hash_blocks([1, 2], 1, secret)
    assert "super" not in str(info.value)
