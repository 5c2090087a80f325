"""Review fixes in ``quillcache.kvquant`` (rev-kvquant findings 3 and 4).

3. ``QuantizedKV.window`` is the codec's own copy of the full-precision tokens: changing the caller's tensor
   after ``quantize`` changes neither ``dequantize()`` nor a block encoded later.
4. ``QuantizedKV.check_layout`` refuses, naming the field, what no encoder writes (a dtype, kind or
   granularity outside the codec's, a zero point beyond ``MAX_ZERO_POINT``); ``encode_block`` checks first;
   on everything accepted the backends agree bit for bit.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache.kvquant import KVQuantError, decode_block, encode_block, make_codec
from quillcache.kvquant.reference import MAX_ZERO_POINT

R = dataclasses.replace


def _x(dtype=np.float32, shape=(8, 2, 4), seed=0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


# ================================================================ 3. the window is a copy


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("name,opts", [("int8", {}), ("fp8_e4m3", {}), ("int4", {"group_size": 2}),
                                       ("int2", {"group_size": 2})])
def test_changing_the_input_after_quantize_changes_nothing_quantized(name, opts, dtype):
    x = _x(dtype)
    codec = make_codec(name, window_tokens=4, **opts)
    q = codec.quantize(x)
    before_y, before_block = q.dequantize().copy(), encode_block(q)
    x[:] = 7  # was: x[4:] was q.window itself, so the window tokens followed the caller's tensor
    assert np.array_equal(q.dequantize(), before_y)
    assert encode_block(q) == before_block
    assert not np.shares_memory(q.window, x)


# ================================================================ 4. check_layout refuses what no encoder writes


def _q(name="int4", **opts):
    return make_codec(name, **({"group_size": 4} if name in ("int4", "int2") else {}), **opts).quantize(_x())


def _bad_cases():
    q8, q4, qf = _q("int8"), _q("int4"), _q("fp8_e4m3")
    big = np.full_like(q4.zeros, MAX_ZERO_POINT + 1)
    return [
        ("dtype int8", R(q8, dtype="int8", window=np.zeros((0, 2, 4), np.int8)), "dtype='int8'"),
        ("dtype float64", R(q8, dtype="float64", window=np.zeros((0, 2, 4))), "dtype='float64'"),
        ("kind query", R(q8, kind="query"), "kind='query'"),
        ("int8 granularity head", R(q8, granularity="head"), "granularity='head'"),
        ("fp8 granularity token_head", R(qf, granularity="token_head"), "granularity='token_head'"),
        ("int4 granularity tensor", R(q4, granularity="tensor"), "granularity='tensor'"),
        ("codec", R(q8, codec="int16"), "codec='int16'"),
        ("int8 group_size", R(q8, group_size=3), "group_size=3"),
        ("zeros just past the bound", R(q4, zeros=big), "zeros"),
        ("zeros negative past the bound", R(q4, zeros=-big), "zeros"),
        ("zeros near int32's minimum", R(q4, zeros=np.full_like(q4.zeros, -(2**31) + 1)), "zeros"),
        ("scales a list", R(q8, scales=q8.scales.tolist()), "scales is a list"),
        ("shape of floats", R(q8, shape=(8.0, 2, 4)), "shape="),
    ]


@pytest.mark.parametrize("label,q,match", _bad_cases(), ids=[c[0] for c in _bad_cases()])
def test_a_hand_built_tensor_no_encoder_writes_is_refused_naming_the_field(label, q, match):
    with pytest.raises(KVQuantError, match=match.replace("(", r"\(")):
        q.check_layout()
    with pytest.raises(KVQuantError, match=match.replace("(", r"\(")):
        q.dequantize()  # was: dtype="int8" dequantized [1.7, -2.6, 100.2] to int8 [1, -2, 100]
    with pytest.raises(KVQuantError, match=match.replace("(", r"\(")):
        encode_block(q)  # was: "ValueError: tuple.index(x): x not in tuple" or a block decode_block refuses
    if q.codec in ("int8", "fp8_e4m3", "int4", "int2"):
        codec = make_codec(q.codec, **({"group_size": 4} if q.codec in ("int4", "int2") else {}))
        for backend in ("reference", "numba"):
            with pytest.raises(KVQuantError, match=match.replace("(", r"\(")):
                codec.dequantize(q, backend=backend)


@pytest.mark.parametrize("z", [MAX_ZERO_POINT, -MAX_ZERO_POINT])
@pytest.mark.parametrize("name", ["int4", "int2"])
def test_zero_points_at_the_bound_are_accepted_and_decode_alike_everywhere(name, z):
    q = R(_q(name), zeros=np.full_like(_q(name).zeros, z))
    codec = make_codec(name, group_size=4)
    a, b = codec.dequantize(q, backend="reference"), codec.dequantize(q, backend="numba")
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    assert np.isfinite(a).all() and np.abs(a).max() > 1e5  # |q - z| near 2**20 steps
    back = decode_block(encode_block(q))  # the block format takes exactly what check_layout takes
    assert np.array_equal(back.zeros, q.zeros)


@settings(max_examples=60, deadline=None)
@given(bits=st.sampled_from([2, 4]), seed=st.integers(0, 2**32 - 1), lo=st.integers(-MAX_ZERO_POINT, MAX_ZERO_POINT),
       hi=st.integers(-MAX_ZERO_POINT, MAX_ZERO_POINT), exp=st.integers(-149, 100))
def test_every_accepted_hand_built_kivi_tensor_decodes_bit_identically_on_every_cpu_backend(bits, seed, lo, hi, exp):
    rng = np.random.default_rng(seed)
    q = _q(f"int{bits}")
    zeros = rng.integers(min(lo, hi), max(lo, hi) + 1, q.zeros.shape).astype(np.int32)
    scales = (rng.random(q.scales.shape) * 2.0**exp).astype(np.float32)
    payload = rng.integers(0, 256, q.payload.shape).astype(np.uint8)
    used = q.num_elements * bits % 8
    if used:
        payload[-1] &= (1 << used) - 1
    hand = R(q, zeros=zeros, scales=scales, payload=payload)
    try:
        hand.check_layout()
    except KVQuantError as e:  # a zero scale, or one that decodes past float32: decode_block refuses its block too
        assert str(e).startswith("scales: ")
        return
    codec = make_codec(f"int{bits}", group_size=4)
    a, b = codec.dequantize(hand, backend="reference"), codec.dequantize(hand, backend="numba")
    assert np.isfinite(a).all()
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
