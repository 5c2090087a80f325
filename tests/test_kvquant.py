"""kvquant codecs and block format: round trips, error bounds, the self-describing block (every
flipped bit and every truncation refused), and bad input refused with typed errors naming the value."""

from __future__ import annotations

import struct

import crc32c
import numpy as np
import pytest

import quillcache.kvquant as kq
from quillcache.kvquant import (CODECS, KVBlockError, KVQuantDtypeError, KVQuantError, KVQuantShapeError,
                                NonFiniteError, OutOfRangeError, decode_block, encode_block, make_codec)
from quillcache.kvquant.block import HEADER_BYTES
from quillcache.registry import UnknownNameError

CASES = [("int8", {}), ("int8", {"granularity": "tensor"}), ("fp8_e4m3", {}), ("fp8_e4m3", {"granularity": "tensor"}),
         ("fp8_e4m3", {"scale": 1.0}), ("int4", {}), ("int4", {"axis": "token"}), ("int2", {}),
         ("int2", {"window_tokens": 32}), ("int8", {"window_tokens": 5})]


def _kv(dtype=np.float16, shape=(96, 4, 64), seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape)
    x[:, :, [0, shape[2] - 1]] *= 10  # outlier channels
    return x.astype(dtype)


def _rel_mse(a, b) -> float:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return float(((a - b) ** 2).sum() / (b**2).sum())


def test_registry_names_the_codecs():
    assert CODECS.names() == ["int8", "fp8_e4m3", "int4", "int2"]
    assert kq.KERNELS.names() == ["reference", "numba", "cuda"]


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("kind", ["key", "value"])
@pytest.mark.parametrize("name,opts", CASES)
def test_round_trip_through_a_block(name, opts, kind, dtype):
    x = _kv(dtype)
    before = x.copy()
    codec = make_codec(name, **opts)
    q = codec.quantize(x, kind=kind)
    assert np.array_equal(x, before)  # input untouched
    blob = encode_block(q)
    q2 = decode_block(blob)
    assert encode_block(q2) == blob
    y = kq.dequantize(q2)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert np.array_equal(y, codec.dequantize(q, backend="reference"))
    w = codec.window_tokens
    if w:
        assert np.array_equal(y[-w:], x[-w:])  # the window is exact
    bound = {"int8": 5e-3 if opts.get("granularity") == "tensor" else 5e-4, "fp8_e4m3": 1.5e-3, "int4": 1.5e-2,
             "int2": 0.2}[name]
    assert _rel_mse(y, x) < bound


def test_per_element_error_bounds():
    x = _kv(np.float32, (64, 2, 32))
    q = make_codec("int8").quantize(x)
    err = np.abs(q.dequantize() - x)
    assert (err <= q.scales[:, :, None] * (0.5 + 1e-6)).all()  # half a step
    for bits in (4, 2):
        for kind, axis in (("key", "channel"), ("value", "token")):
            q = make_codec(f"int{bits}").quantize(x, kind=kind)
            s = q.scales
            s_full = np.repeat(s, 32, axis=0) if axis == "channel" else np.repeat(s, 32, axis=2)
            assert (np.abs(q.dequantize() - x) <= s_full * (1 + 1e-6)).all()  # at most one step (edge clipping)


def test_constant_zero_and_tiny_groups_decode_exactly_or_to_within_a_step():
    x = np.zeros((32, 1, 32), np.float32)
    for name in ("int8", "fp8_e4m3", "int4", "int2"):
        assert np.array_equal(kq.quantize(x, name).dequantize(), x)
    c = np.full((32, 1, 32), 3.14159, np.float32)  # a constant group: the scale floor keeps it exact
    for name in ("int4", "int2"):
        assert np.array_equal(kq.quantize(c, name).dequantize(), c)
    big = np.full((32, 1, 32), 2.0**127, np.float32) * np.where(np.arange(32) % 2, 1, -1).astype(np.float32)
    for name in ("int8", "fp8_e4m3", "int4", "int2"):
        assert np.isfinite(kq.quantize(big, name).dequantize()).all()


def test_bytes_per_element():
    shape = (4096, 8, 128)
    assert make_codec("int8").bytes_per_element((32, 8, 128)) == 1 + 4 / 128
    assert make_codec("fp8_e4m3").bytes_per_element((32, 8, 128)) == 1 + 8 * 4 / (32 * 8 * 128)
    assert make_codec("int4").bytes_per_element((64, 2, 64)) == 0.5 + 8 / 32  # f32 scale + i32 zero per 32
    assert make_codec("int2").bytes_per_element((64, 2, 64), kind="value") == 0.25 + 8 / 32
    assert make_codec("int4").bytes_per_element(shape) == 0.5 + 8 / 32  # the study's 4,096 x 8 x 128 tensors


def test_non_contiguous_input_is_accepted():
    x = _kv(np.float32, (64, 4, 64))
    view = x[:, ::2, :]
    assert np.array_equal(kq.quantize(view, "int4").dequantize(), kq.quantize(view.copy(), "int4").dequantize())


# ----------------------------------------------------------------------------- the block


def _block(name="int4", **opts) -> bytes:
    return encode_block(make_codec(name, **opts).quantize(_kv(np.float16, (32, 2, 32)), kind="key"))


def test_every_flipped_bit_is_refused():
    blob = bytearray(_block("int2", window_tokens=0))
    for i in range(len(blob) * 8):
        bad = bytearray(blob)
        bad[i // 8] ^= 1 << (i % 8)
        with pytest.raises(KVBlockError):
            decode_block(bytes(bad))


def test_every_truncation_and_extension_is_refused():
    blob = _block("fp8_e4m3", window_tokens=4)
    for n in range(len(blob)):
        with pytest.raises(KVBlockError, match="length|crc32c"):
            decode_block(blob[:n])
    with pytest.raises(KVBlockError, match="length"):
        decode_block(blob + b"\0")


def _reseal(body: bytes) -> bytes:
    return body + struct.pack("<I", crc32c.crc32c(body))


def _patch(blob: bytes, offset: int, fmt: str, value) -> bytes:
    body = bytearray(blob[:-4])
    struct.pack_into(fmt, body, offset, value)
    return _reseal(bytes(body))


@pytest.mark.parametrize("offset,fmt,value,field", [
    (0, "<4s", b"QKVX", "magic"), (4, "<H", 2, "version"), (6, "<H", 57, "header_bytes"), (8, "<B", 9, "codec"),
    (9, "<B", 2, "kind"), (10, "<B", 1, "layout"), (11, "<B", 7, "dtype"), (12, "<B", 0, "granularity"),
    (13, "<B", 8, "bits"), (14, "<H", 5, "group_size"), (20, "<I", 0, "shape"), (24, "<I", 3, "scales_bytes"),
])
def test_a_resealed_block_with_a_bad_header_field_names_it(offset, fmt, value, field):
    blob = _block("int4")
    with pytest.raises(KVBlockError) as e:
        decode_block(_patch(blob, offset, fmt, value))
    assert e.value.field == field, str(e.value)


def test_resealed_blocks_with_impossible_contents_are_refused():
    q = make_codec("int8").quantize(_kv(np.float32, (8, 2, 16)))
    blob = bytearray(encode_block(q)[:-4])
    blob[HEADER_BYTES + q.scales.nbytes] = 0x80  # int8 code -128
    with pytest.raises(KVBlockError, match="-128"):
        decode_block(_reseal(bytes(blob)))
    blob = bytearray(encode_block(q)[:-4])
    blob[HEADER_BYTES:HEADER_BYTES + 4] = struct.pack("<f", -1.0)  # a negative scale
    with pytest.raises(KVBlockError, match="scale"):
        decode_block(_reseal(bytes(blob)))
    q = make_codec("fp8_e4m3").quantize(_kv(np.float32, (8, 2, 16)))
    blob = bytearray(encode_block(q)[:-4])
    blob[HEADER_BYTES + q.scales.nbytes] = 0xFF  # fp8 NaN
    with pytest.raises(KVBlockError, match="NaN"):
        decode_block(_reseal(bytes(blob)))
    x = _kv(np.float32, (3, 1, 1))
    q = make_codec("int4", group_size=1).quantize(x, kind="key")  # 3 codes in 2 bytes: 4 padding bits
    blob = bytearray(encode_block(q)[:-4])
    blob[-1] |= 0xF0
    with pytest.raises(KVBlockError, match="padding"):
        decode_block(_reseal(bytes(blob)))


def test_tiny_constant_groups_are_written_in_blocks_that_decode():
    """A group far below float32's normal range gets a scale whose zero point stays within the bound
    (a subnormal scale floor rounded down once made blocks that decode_block refused)."""
    for v in (1e-37, -1e-37, 5e-38, 1.2573e-40, -3 * 2.0**-149, 2.0**-126):
        x = np.full((32, 2, 8), v, np.float32)
        for name in ("int4", "int2"):
            for backend in ("reference", "numba"):
                q = kq.quantize(x, name, kind="key", backend=backend)
                assert np.abs(q.zeros).max() <= 2**20
                y = decode_block(encode_block(q)).dequantize(backend)
                assert np.array_equal(y, q.dequantize(backend))
                assert np.abs(y.astype(np.float64) - v).max() <= max(abs(v) * 1e-6, 2.0**-150), (v, name, backend)
    key = _kv(np.float32, (64, 2, 64))
    key[:, 1, 5] = np.float32(1e-37)  # one tiny constant channel in a realistic key tensor
    q = kq.quantize(key, "int2", kind="key")
    assert np.array_equal(decode_block(encode_block(q)).dequantize(), q.dequantize())


@pytest.mark.parametrize("name,opts", [("int4", {}), ("int2", {}), ("fp8_e4m3", {"scale": 150.0}), ("int8", {}),
                                       ("fp8_e4m3", {})])
def test_float16_values_near_its_maximum_never_dequantize_to_inf(name, opts):
    x = np.full((32, 1, 32), 65504.0, np.float16)
    x[::2] = -65504.0
    x[1::4] = 50000.0
    for backend in ("reference", "numba"):
        q = make_codec(name, **opts).quantize(x, kind="key", backend=backend)
        y = q.dequantize(backend)
        assert np.isfinite(y).all(), (name, backend)
        y2 = decode_block(encode_block(q)).dequantize(backend)
        assert np.array_equal(y, y2)
        step = float(q.scales.max()) * (448 / 8 if name == "fp8_e4m3" else 1)
        assert np.abs(y.astype(np.float64) - x.astype(np.float64)).max() <= step


def test_encoded_blocks_of_every_codec_always_decode_to_the_same_tensor():
    rng = np.random.default_rng(3)
    for exp in (-40, -30, -10, 0, 10, 30, 37):
        x = (rng.standard_normal((64, 2, 32)) * 10.0**exp).astype(np.float32)
        x[:, :, 3] = np.float32(10.0**exp)  # a constant channel
        for name, opts in CASES:
            for kind in ("key", "value"):
                q = make_codec(name, **opts).quantize(x, kind=kind)
                assert np.array_equal(decode_block(encode_block(q)).dequantize(), q.dequantize()), (name, opts, exp)


def _resealed(q, edit) -> bytes:
    body = bytearray(encode_block(q)[:-4])
    edit(body)
    return _reseal(bytes(body))


@pytest.mark.parametrize("name,opts,dtype,scale", [
    ("int8", {}, np.float32, 3e38), ("int8", {}, np.float16, 1e4), ("fp8_e4m3", {}, np.float32, 3e38),
    ("fp8_e4m3", {}, np.float16, 1e4), ("int4", {}, np.float32, 3e38), ("int2", {}, np.float16, 1e5),
])
def test_a_resealed_scale_no_encoder_writes_is_refused(name, opts, dtype, scale):
    """crc32c catches accidents, not edits: a block whose codes would decode past its dtype's range is refused."""
    q = make_codec(name, **opts).quantize(_kv(dtype, (32, 2, 32)), kind="key")
    blob = _resealed(q, lambda b: struct.pack_into("<f", b, HEADER_BYTES, scale))
    with pytest.raises(KVBlockError) as e:
        decode_block(blob)
    assert e.value.field == "scales" and "beyond" in str(e.value)


def test_resealed_blocks_with_inconsistent_fields_are_refused_naming_them():
    x = _kv(np.float32, (32, 2, 32))
    fixed = make_codec("fp8_e4m3", scale=1.0).quantize(x)
    with pytest.raises(KVBlockError, match="fixed fp8 scale_option"):  # header says 1.0, scales say 0.5
        decode_block(_resealed(fixed, lambda b: struct.pack_into("<f", b, HEADER_BYTES, 0.5)))
    q8 = make_codec("int8").quantize(x)
    with pytest.raises(KVBlockError) as e:  # only fp8 has a fixed scale
        decode_block(_resealed(q8, lambda b: struct.pack_into("<f", b, 64, 1.0)))
    assert e.value.field == "scale_option"
    q4 = make_codec("int4").quantize(x, kind="key")
    with pytest.raises(KVBlockError) as e:
        decode_block(_resealed(q4, lambda b: struct.pack_into("<i", b, HEADER_BYTES + q4.scales.nbytes, 2**20 + 1)))
    assert e.value.field == "zeros"
    qw = make_codec("int8", window_tokens=4).quantize(x)
    end = HEADER_BYTES + qw.scales.nbytes + qw.zeros.nbytes + qw.payload.nbytes
    with pytest.raises(KVBlockError) as e:
        decode_block(_resealed(qw, lambda b: struct.pack_into("<f", b, end, float("inf"))))
    assert e.value.field == "window"
    with pytest.raises(KVBlockError) as e:  # window_tokens == tokens
        decode_block(_resealed(qw, lambda b: struct.pack_into("<I", b, 28, 32)))
    assert e.value.field == "shape"
    for offset, field in ((40, "zeros_bytes"), (56, "window_bytes")):
        with pytest.raises(KVBlockError) as e:  # a section size the shape does not imply (total length kept)
            decode_block(_resealed(qw, lambda b, o=offset: struct.pack_into("<Q", b, o, 4)))
        assert e.value.field in ("length", field)
    with pytest.raises(KVBlockError) as e:
        decode_block(_resealed(q4, lambda b: (struct.pack_into("<Q", b, 40, q4.zeros.nbytes - 4),
                                              struct.pack_into("<Q", b, 48, q4.payload.nbytes + 4))))
    assert e.value.field == "zeros_bytes"


def test_a_hand_built_quantized_tensor_that_does_not_fit_its_fields_is_refused():
    import dataclasses

    q = make_codec("int4").quantize(_kv(np.float32, (32, 2, 32)), kind="key")
    for field, bad in (("scales", q.scales[:, :1]), ("zeros", q.zeros.astype(np.int64)), ("payload", q.payload[:-1]),
                       ("window", np.zeros((1, 2, 32), np.float32)), ("scales", q.scales.astype(np.float64))):
        broken = dataclasses.replace(q, **{field: bad})
        for backend in ("reference", "numba"):
            with pytest.raises(KVQuantError, match=field):
                broken.dequantize(backend)


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("bad,error,match", [
    (np.zeros((4, 2, 8), np.float64), KVQuantDtypeError, "float64"),
    (np.zeros((4, 2, 8), np.int32), KVQuantDtypeError, "int32"),
    ([[[0.0]]], KVQuantDtypeError, "list"),
    (np.zeros((4, 8), np.float32), KVQuantShapeError, r"\(4, 8\)"),
    (np.zeros((0, 2, 8), np.float32), KVQuantShapeError, r"\(0, 2, 8\)"),
])
def test_wrong_dtype_or_shape_is_named(bad, error, match):
    with pytest.raises(error, match=match):
        kq.quantize(bad, "int8")


def test_non_finite_and_out_of_range_values_are_refused_naming_the_first():
    for backend in ("reference", "numba"):
        for v in (np.nan, np.inf, -np.inf):
            x = np.zeros((4, 2, 8), np.float32)
            x[2, 1, 5] = v
            with pytest.raises(NonFiniteError, match=r"x\[2, 1, 5\]"):
                kq.quantize(x, "fp8_e4m3", backend=backend)
        x = np.zeros((4, 2, 8), np.float32)
        x[3, 0, 7] = 2.0**127 * 1.5
        with pytest.raises(OutOfRangeError, match=r"x\[3, 0, 7\]"):
            kq.quantize(x, "int8", backend=backend)


def test_group_sizes_that_do_not_divide_are_named():
    x = np.zeros((40, 2, 64), np.float32)
    with pytest.raises(KVQuantShapeError, match="40 - 0 = 40 is not divisible by group_size=32"):
        kq.quantize(x, "int4", kind="key")
    with pytest.raises(KVQuantShapeError, match="head_dim=60 is not divisible by group_size=32"):
        kq.quantize(np.zeros((32, 2, 60), np.float32), "int2", kind="value")
    assert kq.quantize(x, "int4", kind="key", window_tokens=8).window.shape == (8, 2, 64)
    with pytest.raises(KVQuantShapeError, match="window_tokens=40 must be < tokens=40"):
        kq.quantize(x, "int8", window_tokens=40)


def test_bad_options_are_named():
    with pytest.raises(UnknownNameError, match="int3"):
        make_codec("int3")
    with pytest.raises(KVQuantError, match="rejected options"):
        make_codec("int8", group_size=32)
    with pytest.raises(KVQuantError, match="granularity"):
        make_codec("int8", granularity="channel")
    with pytest.raises(KVQuantError, match="scale"):
        make_codec("fp8_e4m3", scale=0.0)
    with pytest.raises(KVQuantError, match="group_size"):
        make_codec("int4", group_size=0)
    with pytest.raises(KVQuantError, match="window_tokens"):
        make_codec("int4", window_tokens=-1)
    with pytest.raises(KVQuantError, match="kind"):
        kq.quantize(np.zeros((32, 1, 32), np.float32), "int4", kind="query")
    with pytest.raises(KVQuantError, match="gpu"):
        kq.quantize(np.zeros((32, 1, 32), np.float32), "int4", backend="gpu")
    q = kq.quantize(np.zeros((32, 1, 32), np.float32), "int4")
    with pytest.raises(KVQuantError, match="cannot be dequantized"):
        make_codec("int8").dequantize(q)


@pytest.mark.parametrize("q", [None, "int8", b"\x00" * 64, {"codec": "int8"}])
def test_dequantize_refuses_what_is_not_a_quantized_tensor_naming_it(q):
    """It raised AttributeError ('... has no attribute codec_object') before."""
    from quillcache.kvquant import KVQuantError, dequantize

    with pytest.raises(KVQuantError, match=f"q must be a QuantizedKV .*got {type(q).__name__}"):
        dequantize(q)
