"""The Cython twin of ``quillcache/_mix.py``: SplitMix64 as ``cdef inline`` functions.

``splitmix64(z) = mix13(z + GOLDEN)`` in wrapping uint64 arithmetic, bit for bit the Python,
NumPy and Numba versions; ``splitmix64_next(&state)`` steps the generator (advances ``state`` by
GOLDEN and returns ``splitmix64`` of the old state). cimported by ``alloc/_alloc.pyx`` and
``sketch/_sketch.pxd``; tested through ``quillcache.sketch._sketch.splitmix64_array``.
"""

from libc.stdint cimport uint64_t


cdef inline uint64_t splitmix64(uint64_t z) noexcept nogil:
    z = z + 0x9E3779B97F4A7C15ULL
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL
    return z ^ (z >> 31)


cdef inline uint64_t splitmix64_next(uint64_t* state) noexcept nogil:
    cdef uint64_t out = splitmix64(state[0])
    state[0] += 0x9E3779B97F4A7C15ULL
    return out
