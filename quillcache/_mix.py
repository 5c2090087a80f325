"""SplitMix64, the one 64-bit mixer of the package: scalar, NumPy and Numba versions (and ``_mix.pxd``).

Definition (Steele, Lea and Flood's SplitMix64 with Stafford's "mix13" finaliser)::

    mix13(z)      = z ^= z >> 30; z *= M1; z ^= z >> 27; z *= M2; z ^ (z >> 31)   (mod 2**64)
    splitmix64(z) = mix13(z + GOLDEN)

``splitmix64(state)`` is the generator's output for ``state`` and a bijection of 64-bit words;
``splitmix64_next(state)`` steps the generator: ``(state + GOLDEN, splitmix64(state))``, so the
outputs for seed 0 are ``0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, ...``.

Contract: every version computes exactly these bits. ``splitmix64`` / ``mix13`` take Python ints
(reduced mod 2**64); ``splitmix64_array`` / ``mix13_array`` take a uint64 array (any shape, not
modified) and return a new one; ``splitmix64_nb`` is the Numba ``@njit`` twin for kernels (built on
first access, so importing this module does not import Numba); the Cython ``cdef inline`` twin is
in ``quillcache/_mix.pxd``. ``tests/test_mix.py`` checks they all agree on random inputs.
"""

from __future__ import annotations

import numpy as np

__all__ = ["GOLDEN", "M1", "M2", "MASK64", "mix13", "mix13_array", "splitmix64", "splitmix64_array",
           "splitmix64_nb", "splitmix64_next"]

GOLDEN = 0x9E3779B97F4A7C15  # 2**64 / golden ratio, odd: the generator's increment
M1 = 0xBF58476D1CE4E5B9
M2 = 0x94D049BB133111EB
MASK64 = (1 << 64) - 1


def mix13(z: int) -> int:
    """Stafford's mix13 finaliser of a 64-bit word (a bijection)."""
    z &= MASK64
    z = ((z ^ (z >> 30)) * M1) & MASK64
    z = ((z ^ (z >> 27)) * M2) & MASK64
    return z ^ (z >> 31)


def splitmix64(z: int) -> int:
    """SplitMix64's output for state ``z``: ``mix13(z + GOLDEN)``."""
    return mix13(z + GOLDEN)


def splitmix64_next(state: int) -> tuple[int, int]:
    """One step of the generator: ``(new_state, output)``."""
    state = (state + GOLDEN) & MASK64
    return state, mix13(state)


def mix13_array(z: np.ndarray) -> np.ndarray:
    """:func:`mix13` of every element of a uint64 array (wrapping arithmetic)."""
    z = _as_u64(z)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(M1)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(M2)
        return z ^ (z >> np.uint64(31))


def splitmix64_array(z: np.ndarray) -> np.ndarray:
    """:func:`splitmix64` of every element of a uint64 array (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        return mix13_array(_as_u64(z) + np.uint64(GOLDEN))


def _as_u64(z: np.ndarray) -> np.ndarray:
    if not isinstance(z, np.ndarray) or z.dtype != np.uint64:
        raise TypeError(f"expected a uint64 array, got {type(z).__name__} {getattr(z, 'dtype', '')}".rstrip())
    return z


def _build_nb():
    from numba import njit

    golden, m1, m2 = np.uint64(GOLDEN), np.uint64(M1), np.uint64(M2)

    @njit(cache=True, nogil=True)
    def splitmix64_nb(z):
        """:func:`splitmix64` of one ``np.uint64`` inside a Numba kernel."""
        z = z + golden
        z = (z ^ (z >> np.uint64(30))) * m1
        z = (z ^ (z >> np.uint64(27))) * m2
        return z ^ (z >> np.uint64(31))

    return splitmix64_nb


def __getattr__(name: str):
    if name == "splitmix64_nb":
        fn = _build_nb()
        globals()[name] = fn
        return fn
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
