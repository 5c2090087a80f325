"""SplitMix64 (``quillcache._mix``): known outputs, and the Python, NumPy, Numba and Cython twins agree.

The Cython generator (``splitmix64_next`` in ``_mix.pxd``) is also bound to the Python one by
``tests/test_alloc.py::test_churn_identical_in_both_and_deterministic`` (same seed, same layout).
"""

from __future__ import annotations

import numpy as np
import pytest

from quillcache import _mix
from quillcache._mix import (
    GOLDEN,
    MASK64,
    mix13,
    mix13_array,
    splitmix64,
    splitmix64_array,
    splitmix64_next,
)


def _random_words(seed: int, n: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    edges = np.array([0, 1, GOLDEN, MASK64, MASK64 - GOLDEN, MASK64 - GOLDEN + 1, 1 << 63], dtype=np.uint64)
    return np.concatenate([edges, rng.integers(0, MASK64, n, dtype=np.uint64, endpoint=True)])


def test_known_generator_outputs():
    # SplitMix64's first outputs for seed 0 (the canonical generator)
    state, out = splitmix64_next(0)
    assert (state, out) == (GOLDEN, 0xE220A8397B1DCDAF)
    state, out = splitmix64_next(state)
    assert (state, out) == ((2 * GOLDEN) & MASK64, 0x6E789E6AA1B965F4)
    assert splitmix64(0) == 0xE220A8397B1DCDAF and splitmix64(GOLDEN) == 0x6E789E6AA1B965F4
    assert splitmix64(MASK64) == mix13(GOLDEN - 1)  # wraps mod 2**64
    assert mix13(0) == 0


def test_is_a_bijection_on_a_sample():
    z = _random_words(1, 20_000)
    assert np.unique(splitmix64_array(np.unique(z))).size == np.unique(z).size


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_numpy_matches_python(seed):
    z = _random_words(seed, 2000)
    before = z.copy()
    got = splitmix64_array(z)
    assert got.dtype == np.uint64 and np.array_equal(z, before)  # input untouched
    assert [int(v) for v in got] == [splitmix64(int(v)) for v in z]
    assert [int(v) for v in mix13_array(z)] == [mix13(int(v)) for v in z]
    grid = z[:100].reshape(10, 10)
    assert np.array_equal(splitmix64_array(grid), got[:100].reshape(10, 10))  # any shape


def test_numpy_refuses_other_dtypes():
    with pytest.raises(TypeError, match="uint64 array"):
        splitmix64_array(np.arange(4, dtype=np.int64))
    with pytest.raises(TypeError, match="uint64 array"):
        splitmix64_array([1, 2])  # type: ignore[arg-type]


def test_numba_matches_python():
    from numba import njit

    nb = _mix.splitmix64_nb

    @njit
    def run(z):
        out = np.empty_like(z)
        for i in range(z.shape[0]):
            out[i] = nb(z[i])
        return out

    z = _random_words(3, 2000)
    assert [int(v) for v in run(z)] == [splitmix64(int(v)) for v in z]
    assert int(nb(np.uint64(0))) == 0xE220A8397B1DCDAF


def test_cython_matches_python():
    sk = pytest.importorskip("quillcache.sketch._sketch")
    z = _random_words(4, 2000)
    got = sk.splitmix64_array(z)
    assert got.dtype == np.uint64 and [int(v) for v in got] == [splitmix64(int(v)) for v in z]


def test_unknown_attribute():
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _mix.nope  # noqa: B018
