"""The kvquant kernels: NumPy reference (the specification) vs Numba CPU vs ``numba.cuda`` under the
CUDA simulator, bit for bit, on Hypothesis inputs (odd head dims, extreme ranges, subnormals,
zeros, float32 max) and on the e4m3fn code boundaries.

The CUDA kernels run through Numba's simulator, which must be enabled before ``numba.cuda`` is
imported: ``test_cuda_kernels_match_the_reference_in_the_simulator`` reruns this file's
``cudasim`` tests in a subprocess with ``NUMBA_ENABLE_CUDASIM=1`` (in the parent process they skip).
NaN / inf never reach a kernel: the codecs refuse them (``tests/test_kvquant.py``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from quillcache.kvquant import _cpu, reference
from quillcache.kvquant.fp8 import E4M3_TABLE, e4m3_encode

IN_SIM = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
cudasim = pytest.mark.skipif(not IN_SIM, reason="runs in the NUMBA_ENABLE_CUDASIM=1 subprocess")
ROOT = Path(__file__).resolve().parents[1]
MAX_ABS = 2.0**127  # the codecs refuse larger magnitudes (they could not be dequantized without overflow)


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


@st.composite
def kv_tensors(draw, max_tokens: int = 12, max_heads: int = 3, max_dim: int = 19):
    """float32 (tokens, heads, head_dim): scaled Gaussians over 1e-44..1e38, raw float32s, or mixtures with
    zeros, the largest accepted magnitude (2**127) and outlier channels."""
    t = draw(st.integers(1, max_tokens))
    h = draw(st.integers(1, max_heads))
    d = draw(st.integers(1, max_dim))
    shape = (t, h, d)
    how = draw(st.sampled_from(["gaussian", "raw", "mixed"]))
    if how == "raw":
        return draw(hnp.arrays(np.float32, shape, elements=st.floats(-MAX_ABS, MAX_ABS, width=32,
                                                                     allow_subnormal=True)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    exp = draw(st.integers(-44, 36))
    x = (rng.standard_normal(shape) * 10.0**exp).astype(np.float32)
    if how == "mixed":
        x[rng.random(shape) < 0.2] = 0.0
        x[:, :, rng.integers(0, d)] *= np.float32(10.0)
        if draw(st.booleans()):
            x.reshape(-1)[rng.integers(0, x.size)] = np.float32(MAX_ABS) * rng.choice([-1, 1])
    return np.ascontiguousarray(x)


def _same(a, b) -> None:
    """Bit-identical arrays (NaN patterns, -0.0 and dtype included)."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
    assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), (a, b)


def _check_backend(k, x: np.ndarray, gt: int, gd: int, bits: int) -> None:
    """Every kernel of backend ``k`` against the reference on ``x``, encode and decode."""
    for per_tensor in (False, True):
        rq, rs = reference.int8_quantize(x, per_tensor)
        q, s = k.int8_quantize(x, per_tensor)
        _same(rq, q), _same(rs, s)
        _same(reference.int8_dequantize(rq, rs), k.int8_dequantize(rq, rs))
    for per_head, scale in ((True, None), (False, None), (False, 0.25)):
        rc, rs = reference.fp8_quantize(x, per_head, scale)
        c, s = k.fp8_quantize(x, per_head, scale)
        _same(rc, c), _same(rs, s)
        _same(reference.fp8_dequantize(rc, rs), k.fp8_dequantize(rc, rs))
    rq, rs, rz = reference.asym_quantize(x, bits, gt, gd)
    q, s, z = k.asym_quantize(x, bits, gt, gd)
    _same(rq, q), _same(rs, s), _same(rz, z)
    _same(reference.asym_dequantize(rq, rs, rz, gt, gd), k.asym_dequantize(rq, rs, rz, gt, gd))
    packed = reference.pack_bits(rq, bits)
    _same(packed, k.pack_bits(rq, bits))
    _same(rq.reshape(-1), k.unpack_bits(packed, bits, rq.size))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(x=kv_tensors(), data=st.data())
def test_numba_cpu_kernels_are_bit_identical_to_the_reference(x, data):
    t, _, d = x.shape
    gt = data.draw(st.sampled_from(_divisors(t)))
    gd = data.draw(st.sampled_from(_divisors(d)))
    _check_backend(_cpu, x, gt, gd, data.draw(st.sampled_from([2, 4])))


def _tiny_constant_groups() -> np.ndarray:
    """Constant groups whose scale floor ``amax * 2**-20`` is subnormal and inexact: where the floor is raised by
    one 2**-149 step, so a kernel that rounds the raise differently (an FMA) writes other scale bits."""
    exps = np.arange(-149, -100)
    mant = np.float32(1.0) + np.arange(8, dtype=np.float32) / np.float32(8.0)
    v = (mant[None, :] * np.exp2(exps[:, None]).astype(np.float32)).astype(np.float32).reshape(-1)
    v = v[v > 0]
    signs = np.where(np.arange(v.size) % 2 == 0, np.float32(1.0), np.float32(-1.0))
    return np.repeat(v * signs, 4).reshape(-1, 1, 4)  # one constant group of 4 per token (gt=1, gd=4)


def test_the_scale_floor_of_tiny_groups_is_bit_identical_on_every_backend():
    from quillcache.kvquant import _scalar

    x = np.ascontiguousarray(_tiny_constant_groups())
    for bits in (2, 4):
        rq, rs, rz = reference.asym_quantize(x, bits, 1, 4)
        q, s, z = _cpu.asym_quantize(x, bits, 1, 4)
        _same(rq, q), _same(rs, s), _same(rz, z)
        qmaxf = np.float32((1 << bits) - 1)
        plain = np.array([_scalar.asym_scale(np.float32(g.min()), np.float32(g.max()), qmaxf) for g in x[:, 0, :]],
                         np.float32)  # the Python the simulator runs
        _same(rs.reshape(-1), plain)
    assert (rs.view(np.uint32) < 0x00800000).any()  # subnormal scales were exercised


def test_numba_cpu_kernels_on_a_study_sized_tensor():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((256, 8, 128)).astype(np.float32)
    x[:, :, [3, 40, 77, 120]] *= 10
    _check_backend(_cpu, x, 32, 1, 4)
    _check_backend(_cpu, x, 1, 32, 2)


def _boundary_values() -> np.ndarray:
    """Every finite e4m3 value, the midpoints between neighbours, one float32 ulp either side, and beyond 448."""
    v = np.unique(E4M3_TABLE[~np.isnan(E4M3_TABLE)].astype(np.float64))
    v = v[v >= 0]
    mids = (v[:-1] + v[1:]) / 2
    base = np.concatenate([v, mids, [448.0, 464.0, 480.0, 1e6, 2.0**-10, 2.0**-11]]).astype(np.float32)
    near = np.concatenate([base, np.nextafter(base, np.float32(np.inf)), np.nextafter(base, np.float32(0))])
    return np.concatenate([near, -near]).astype(np.float32)


def _nearest_even(v: np.ndarray) -> np.ndarray:
    """Brute force: the finite code nearest to clamp(v, ±448), ties to the even code (even mantissa)."""
    codes = np.array([c for c in range(256) if not np.isnan(E4M3_TABLE[c]) and c != 0x80])
    vals = E4M3_TABLE[codes].astype(np.float64)
    w = np.clip(v.astype(np.float64), -448, 448)
    dist = np.abs(w[:, None] - vals[None, :])
    best = dist.min(axis=1, keepdims=True)
    tie = dist == best
    pick = np.where(tie & (codes[None, :] % 2 == 0), 0, 1) + np.where(tie, 0, 2)  # prefer tied even codes
    out = codes[np.argmin(pick, axis=1)].astype(np.uint8)
    neg = (v < 0) & (out == 0)  # a negative value that rounds to zero keeps its sign
    out[neg] = 0x80
    return out


def test_e4m3_encode_is_round_to_nearest_even_with_saturation():
    v = _boundary_values()
    want = _nearest_even(v)
    _same(want, e4m3_encode(v))
    got = np.empty(v.size, np.uint8)
    _cpu._fp8_encode(v.reshape(-1, 1, 1), np.ones((1, 1), np.float32), got.reshape(-1, 1, 1))
    _same(want, got)
    assert E4M3_TABLE[0x7E] == 448.0 and np.isnan(E4M3_TABLE[0x7F]) and np.isnan(E4M3_TABLE[0xFF])
    assert E4M3_TABLE[0x01] == 2.0**-9 and E4M3_TABLE[0x08] == 2.0**-6
    finite = [c for c in range(256) if not np.isnan(E4M3_TABLE[c]) and c != 0x80]
    _same(np.array(finite, np.uint8), e4m3_encode(E4M3_TABLE[finite]))  # every code round-trips


# ----------------------------------------------------------------------------- numba.cuda in the simulator


@cudasim
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(x=kv_tensors(max_tokens=4, max_heads=2, max_dim=9), data=st.data())
def test_cudasim_kernels_are_bit_identical_to_the_reference(x, data):
    from quillcache.kvquant import _cuda

    t, _, d = x.shape
    gt = data.draw(st.sampled_from(_divisors(t)))
    gd = data.draw(st.sampled_from(_divisors(d)))
    _check_backend(_cuda, x, gt, gd, data.draw(st.sampled_from([2, 4])))


@cudasim
def test_cudasim_fp8_boundaries_and_codec_round_trip():
    from quillcache.kvquant import _cuda, make_codec

    v = np.ascontiguousarray(_boundary_values()[::3][:96])
    c, _ = _cuda.fp8_quantize(v.reshape(-1, 1, 1), False, 1.0)
    _same(_nearest_even(v), c.reshape(-1))
    x = np.random.default_rng(3).standard_normal((8, 2, 4)).astype(np.float16)
    for name, opts in (("int8", {}), ("fp8_e4m3", {}), ("int4", {"group_size": 3}), ("int2", {"group_size": 2})):
        codec = make_codec(name, window_tokens=2, **opts)
        q = codec.quantize(x, kind="key", backend="cuda")
        _same(codec.quantize(x, kind="key", backend="reference").payload, q.payload)
        _same(codec.dequantize(q, backend="reference"), codec.dequantize(q, backend="cuda"))


def test_cuda_kernels_match_the_reference_in_the_simulator():
    if IN_SIM:
        pytest.skip("already in the simulator")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONFAULTHANDLER="1")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "cudasim",
                          str(Path(__file__).resolve())], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "2 passed" in out.stdout, out.stdout[-2000:]
