"""Review fixes in the kernels (rev-kernels findings 3, 4 and two cosmetic ones).

3. ``encode_block`` / ``check_layout`` / ``dequantize`` accept exactly the ``QuantizedKV`` values whose blocks
   ``decode_block`` accepts (one content check, ``codecs.content_problem``, on both sides): nothing is written
   that cannot be read back, and ``dequantize`` never returns inf/NaN for a value ``check_layout`` accepted.
4. Sketch snapshots carry a crc32c over header and body (format version 2 in the header); a damaged one, or one
   whose counters sum to more than its total in a row, is refused with a ValueError naming what failed; a
   version-1 snapshot still loads.
Cosmetic: ``hash_blocks(..., lora="\\ud800")`` names ``lora``; ``decode_block`` of something that is not a
contiguous bytes-like object raises ``KVBlockError`` naming ``buf``.
"""

from __future__ import annotations

import dataclasses
import struct
from unittest import mock

import crc32c
import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from quillcache.hashing import hash_blocks, local_hashes
from quillcache.kvquant import KVBlockError, KVQuantError, QuantizedKV, decode_block, encode_block, make_codec
from quillcache.kvquant.block import HEADER_BYTES
from quillcache.kvquant.reference import MAX_ZERO_POINT
from quillcache.sketch.countmin import CountMinSketch
from quillcache.sketch.reference import COUNTER_MAX

R = dataclasses.replace
OPTS = {"int8": {}, "fp8_e4m3": {}, "int4": {"group_size": 4}, "int2": {"group_size": 4}}


def _q(name: str, dtype=np.float32, window_tokens: int = 0, shape=(8, 2, 4), **extra) -> QuantizedKV:
    x = np.random.default_rng(0).standard_normal(shape).astype(dtype)
    return make_codec(name, window_tokens=window_tokens, **OPTS[name], **extra).quantize(x, kind="key")


def _field_of(e: KVQuantError) -> str:
    return e.field if isinstance(e, KVBlockError) else str(e).split(":", 1)[0]


def _written_unchecked(q: QuantizedKV) -> bytes:
    """The block ``encode_block`` would write for ``q`` if it did not check it first (what the old code wrote)."""
    with mock.patch.object(QuantizedKV, "check_layout", lambda self: None):
        return encode_block(q)


# ================================================================ 3. encode and decode accept one set


def _cases():
    q8, qf, q4, q2 = _q("int8"), _q("fp8_e4m3"), _q("int4"), _q("int2")
    fixed, q16, qw = _q("fp8_e4m3", scale=1.0), _q("int4", dtype=np.float16), _q("int8", window_tokens=4)
    q3 = make_codec("int4", group_size=1).quantize(np.ones((3, 1, 1), np.float32))  # 3 codes: 4 padding bits
    code_128 = q8.payload.copy()
    code_128[5] = 0x80
    nan_code = qf.payload.copy()
    nan_code[3] = 0xFF
    pad = q3.payload.copy()
    pad[-1] |= 0xF0
    window = qw.window.copy()
    window[1, 0, 2] = np.inf
    s = lambda q, v: np.full_like(q.scales, v)  # noqa: E731
    return [
        ("int8 scale NaN", R(q8, scales=s(q8, np.nan)), "scales"),
        ("int8 scale -1", R(q8, scales=s(q8, -1.0)), "scales"),
        ("int8 scale 0", R(q8, scales=s(q8, 0.0)), "scales"),
        ("int8 scale inf", R(q8, scales=s(q8, np.inf)), "scales"),
        ("int8 scale 3e38 overflows", R(q8, scales=s(q8, 3e38)), "scales"),
        ("fp8 scale 1e37 overflows", R(qf, scales=s(qf, 1e37)), "scales"),
        ("int4 scale 1e38 overflows", R(q4, scales=s(q4, 1e38)), "scales"),
        ("int2 one NaN scale", R(q2, scales=np.where(np.arange(q2.scales.size).reshape(q2.scales.shape) == 1,
                                                       np.float32(np.nan), q2.scales)), "scales"),
        ("int4 float16 beyond twice 65504", R(q16, scales=s(q16, 1e4)), "scales"),
        ("fp8 scale differs from the fixed scale", R(fixed, scales=s(fixed, 0.5)), "scales"),
        ("int8 code -128", R(q8, payload=code_128), "payload"),
        ("fp8 NaN code 0xFF", R(qf, payload=nan_code), "payload"),
        ("int4 padding bits", R(q3, payload=pad), "payload"),
        ("window inf", R(qw, window=window), "window"),
        ("int8 scale_option 1.0", R(q8, scale_option=1.0), "scale_option"),
        ("fp8 scale_option -1", R(qf, scale_option=-1.0), "scale_option"),
        ("fp8 scale_option inf", R(qf, scale_option=float("inf")), "scale_option"),
        ("fp8 scale_option underflows float32", R(qf, scale_option=1e-50), "scale_option"),
    ]


@pytest.mark.parametrize("label,q,field", _cases(), ids=[c[0] for c in _cases()])
def test_contents_decode_block_refuses_are_refused_before_they_are_written_or_dequantized(label, q, field):
    """Was: check_layout, dequantize and encode_block accepted these; decode_block refused the block written,
    and dequantize returned inf/NaN for the NaN/inf/3e38 scales and the fp8 NaN code."""
    with pytest.raises(KVBlockError) as e:  # the block an unchecked encoder writes: decode_block's verdict
        decode_block(_written_unchecked(q))
    assert e.value.field == field
    with pytest.raises(KVQuantError, match=f"^{field}: "):
        q.check_layout()
    with pytest.raises(KVQuantError, match=f"^{field}: "):
        encode_block(q)
    with pytest.raises(KVQuantError, match=f"^{field}: "):
        q.dequantize()
    for backend in ("reference", "numba"):
        with pytest.raises(KVQuantError, match=f"^{field}: "):
            make_codec(q.codec, **OPTS[q.codec]).dequantize(q, backend=backend)  # q's own fields decide


_SPECIAL_F32 = [np.nan, np.inf, -np.inf, -1.0, 0.0, 2.0**-149, 1e-30, 1.0, 3e4, 1e33, 1e37, 3e38]


@settings(max_examples=200, deadline=None)
@given(name=st.sampled_from(sorted(OPTS)), dtype=st.sampled_from([np.float16, np.float32]), data=st.data())
def test_check_layout_accepts_exactly_what_decode_block_accepts(name, dtype, data):
    """Hand-built contents (scales, zero points, codes, window): either check_layout and decode_block of the
    unchecked block both refuse, naming the same field, or both accept, the block written reads back exactly,
    and every backend dequantizes to the same finite values."""
    q = _q(name, dtype=dtype, window_tokens=data.draw(st.sampled_from([0, 4])))
    scales, zeros, payload, window = q.scales.copy(), q.zeros.copy(), q.payload.copy(), q.window.copy()
    if data.draw(st.booleans()):
        i = data.draw(st.integers(0, scales.size - 1))
        scales.reshape(-1)[i] = np.float32(data.draw(st.sampled_from(_SPECIAL_F32)))
    if zeros.size and data.draw(st.booleans()):
        zeros.reshape(-1)[data.draw(st.integers(0, zeros.size - 1))] = data.draw(
            st.sampled_from([MAX_ZERO_POINT, -MAX_ZERO_POINT, MAX_ZERO_POINT + 1, -(2**31), 2**31 - 1]))
    if data.draw(st.booleans()):
        payload[data.draw(st.integers(0, payload.size - 1))] = data.draw(st.sampled_from([0x7F, 0x80, 0xFF, 0x81]))
    if window.size and data.draw(st.booleans()):
        window.reshape(-1)[0] = data.draw(st.sampled_from([np.nan, np.inf, 65504.0, -1.0]))
    hand = R(q, scales=scales, zeros=zeros, payload=payload, window=window)
    try:
        hand.check_layout()
    except KVQuantError as e:
        with pytest.raises(KVBlockError) as d:
            decode_block(_written_unchecked(hand))
        assert d.value.field == _field_of(e), (str(e), str(d.value))
        event(f"refused: {d.value.field}")
        return
    event("accepted")
    blob = encode_block(hand)
    back = decode_block(blob)  # was: KVBlockError for blocks encode_block had just written
    assert encode_block(back) == blob
    with np.errstate(all="ignore"):
        a, b = hand.dequantize("reference"), hand.dequantize("numba")
    assert np.isfinite(a).all()  # was: inf/NaN for NaN/inf/huge scales and the fp8 NaN code
    assert np.array_equal(a.view(np.uint8), b.view(np.uint8))


def test_what_decode_block_accepts_check_layout_accepts_and_reencodes_identically():
    """The other direction, on resealed blocks with random bytes changed: a decoded block passes check_layout."""
    rng = np.random.default_rng(11)
    blocks = [encode_block(_q(name, dtype=dtype, window_tokens=w)) for name in OPTS for dtype in (np.float16,
              np.float32) for w in (0, 4)]
    decoded = 0
    for _ in range(600):
        blob = bytearray(blocks[rng.integers(len(blocks))][:-4])
        for _ in range(rng.integers(1, 3)):
            i = int(rng.integers(HEADER_BYTES, len(blob)))
            blob[i] = int(rng.integers(256))
        blob += struct.pack("<I", crc32c.crc32c(bytes(blob)))
        try:
            q = decode_block(bytes(blob))
        except KVBlockError:
            continue
        q.check_layout()
        assert encode_block(q) == bytes(blob)
        decoded += 1
    assert decoded > 100


def test_the_store_path_still_round_trips_quantize_output():
    for name in OPTS:
        for dtype in (np.float16, np.float32):
            x = np.random.default_rng(3).standard_normal((32, 2, 16)).astype(dtype) * 50
            for kind in ("key", "value"):
                q = make_codec(name, **OPTS[name]).quantize(x, kind=kind)
                back = decode_block(encode_block(q))
                assert np.array_equal(back.dequantize().view(np.uint8), q.dequantize().view(np.uint8))


# ================================================================ 4. sketch snapshots: crc32c, version 2

# a version-1 snapshot written by the code before the crc32c (CountMinSketch(0.9, 0.2, top_k=2,
# aging_window=1000, seed=7) after adding [1, 2, 2, 3, 3, 3, 9, 9, 9, 9])
V1_SNAPSHOT = bytes.fromhex(
    "5143434d53007631cdccccccccccec3f9a9999999999c93f040000000200000007000000000000000100000002000000e8030000"
    "000000000a000000000000000a000000000000000200000007000000030000000000000000000000000000000000000007000000"
    "00000000020000000000000009000000000000000300000007000000")
HEADER = struct.Struct("<8sddIIQ?3xIQQQI")


def _sketch() -> CountMinSketch:
    sk = CountMinSketch(0.3, 0.2, top_k=4, aging_window=100, seed=5)
    sk.add(np.random.default_rng(5).integers(0, 30, size=90).astype(np.uint64))
    return sk


def _reseal(blob: bytes) -> bytes:
    return blob[:-4] + struct.pack("<I", crc32c.crc32c(blob[:-4]))


def test_a_snapshot_is_version_2_with_a_crc32c_over_header_and_body():
    blob = _sketch().to_bytes()
    assert blob[:8] == b"QCCMS\x00v2"
    assert struct.unpack("<I", blob[-4:])[0] == crc32c.crc32c(blob[:-4])


def test_every_flipped_bit_of_a_snapshot_is_refused():
    """Was: 1,324 of 3,000 random corruptions (counters, total, heap keys) loaded silently."""
    blob = _sketch().to_bytes()
    for i in range(len(blob)):
        for bit in range(8):
            bad = bytearray(blob)
            bad[i] ^= 1 << bit
            with pytest.raises(ValueError):
                CountMinSketch.from_bytes(bytes(bad))
    bad = bytearray(blob)
    bad[HEADER.size + 5] ^= 0x10  # a counter
    with pytest.raises(ValueError, match="crc32c"):
        CountMinSketch.from_bytes(bytes(bad))
    with pytest.raises(ValueError, match="bytes; expected"):
        CountMinSketch.from_bytes(blob[:-4])  # a version-2 snapshot without its crc32c


def test_a_version_1_snapshot_still_loads():
    sk = CountMinSketch.from_bytes(V1_SNAPSHOT)
    assert (sk.width, sk.depth, sk.total, sk.additions_since_aging) == (4, 2, 10, 10)
    assert sk.counters().tolist() == [[7, 3, 0, 0], [0, 0, 7, 0]]
    assert sk.heavy_hitters() == [(9, 7), (2, 3)]
    again = CountMinSketch.from_bytes(sk.to_bytes())  # rewritten as version 2
    assert np.array_equal(again.counters(), sk.counters()) and again.heavy_hitters() == sk.heavy_hitters()


@pytest.mark.parametrize("version", [1, 2])
def test_counters_summing_to_more_than_the_total_are_refused(version):
    """Was: a snapshot with total=0 and counters summing to 62 loaded."""
    blob = _sketch().to_bytes()
    head = list(HEADER.unpack_from(blob))
    head[10] = 0  # total
    if version == 1:
        head[0] = b"QCCMS\x00v1"
        bad = HEADER.pack(*head) + blob[HEADER.size:-4]
    else:
        bad = _reseal(HEADER.pack(*head) + blob[HEADER.size:])
    with pytest.raises(ValueError, match=r"row 0 sum to \d+ > total=0"):
        CountMinSketch.from_bytes(bad)


@settings(max_examples=80, deadline=None)
@given(conservative=st.booleans(), aging=st.sampled_from([None, 1, 7, 50]), seed=st.integers(0, 2**64 - 1),
       ops=st.lists(st.tuples(st.sampled_from(["add", "heavy", "halve", "merge", "snap"]), st.integers(0, 2**32 - 1)),
                    max_size=25))
def test_no_reachable_sketch_state_breaks_the_row_sum_check(conservative, aging, seed, ops):
    """Every row sums to at most ``total`` through additions, saturating counts, aging, halve and merge, so a
    snapshot of any state loads (the check refuses only damage)."""
    rng = np.random.default_rng(seed % 2**32)
    mk = lambda: CountMinSketch(0.5, 0.3, conservative=conservative, aging_window=aging, top_k=3)  # noqa: E731
    sk = mk()
    for op, n in ops:
        if op == "add":
            sk.add(rng.integers(0, 20, size=1 + n % 40).astype(np.uint64),
                   rng.integers(0, 1 + n % 1000, size=1 + n % 40).astype(np.uint32))
        elif op == "heavy":
            sk.add_one(n % 5, COUNTER_MAX if n % 2 else n)  # saturates counters
        elif op == "halve":
            sk.halve()
        elif op == "merge":
            other = mk()
            other.add(rng.integers(0, 20, size=30).astype(np.uint64), n % COUNTER_MAX)
            sk.merge(other)
        else:
            sk = CountMinSketch.from_bytes(sk.to_bytes())
        assert (sk.counters().sum(axis=1, dtype=np.uint64) <= sk.total).all()
    back = CountMinSketch.from_bytes(sk.to_bytes())
    assert back.to_bytes() == sk.to_bytes()


# ================================================================ cosmetic


@pytest.mark.parametrize("param", ["lora", "namespace"])
def test_a_name_utf_8_cannot_encode_is_refused_naming_it(param):
    """Was: a bare UnicodeEncodeError ("'utf-8' codec can't encode character") that named neither."""
    tokens = np.arange(32, dtype=np.uint32)
    for fn in (hash_blocks, local_hashes):
        with pytest.raises(ValueError, match=f"^{param}=") as e:
            fn(tokens, 16, **{param: "ab\ud800"})
        assert not isinstance(e.value, UnicodeError)


@pytest.mark.parametrize("buf", ["str", 5, None, memoryview(b"x" * 200)[::2]], ids=["str", "int", "None", "strided"])
def test_decode_block_of_something_not_a_contiguous_buffer_names_buf(buf):
    """Was: Python's own TypeError from memoryview(), naming nothing."""
    with pytest.raises(KVBlockError) as e:
        decode_block(buf)
    assert e.value.field == "buf"


def test_a_fixed_fp8_scale_the_codec_accepts_is_one_every_check_accepts():
    """``3.4028235e38`` rounds to float32's largest finite value: the codec took it while the content checks, reading
    the float64, refused what it then quantized (re-review of 2026-11-29, /tmp/s35/rr_data L1)."""
    from quillcache.kvquant.codecs import scale_option_problem

    x = np.random.default_rng(2).standard_normal((4, 2, 8)).astype(np.float32)
    for scale in (3.4028235e38, 1e-45, 0.25):
        codec = make_codec("fp8_e4m3", scale=scale)
        q = codec.quantize(x, kind="key")
        assert scale_option_problem("fp8_e4m3", q.scale_option) is None
        back = decode_block(encode_block(q))
        assert np.array_equal(codec.dequantize(back), codec.dequantize(q))
    for scale in (3.5e38, 1e-46):
        with pytest.raises(KVQuantError, match="positive finite float32"):
            make_codec("fp8_e4m3", scale=scale)
        assert scale_option_problem("fp8_e4m3", scale) is not None
