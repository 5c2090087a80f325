"""Page-aligned byte buffers for everything that moves KV bytes through the kernel.

``aligned_empty(n_bytes)`` / ``aligned_zeros(n_bytes)`` return a 1-D ``uint8`` NumPy array of
``n_bytes`` whose first byte sits on an ``alignment_bytes`` boundary (default: one page, 4096).

Why: NumPy (like ``malloc``) places a large array 16 bytes into its first page, so every block slot at
an aligned *offset* of such a buffer sits 16 bytes past a cache line. On the CPUs this project is
measured on (AMD EPYC), a copy is markedly slower when its source and destination differ in their
offset within a cache line: the kernel's socket copies behind ``recv_into`` / ``send`` (the bytes of
a TCP stream sit at their stream offset, so the transfer protocol keeps payloads on 64-byte stream
offsets) and ``memcpy`` alike. Page-aligned buffers on both sides keep every aligned block copy on
the fast path; the transfer study's "region off the cache line" subjects measure the difference in
every run. A buffer of the caller's that is not aligned pays it on every copy into or out of these.

Invariants: ``result.ctypes.data % alignment_bytes == 0`` when ``n_bytes > 0`` (an empty array has
no first byte; NumPy reports its base's address); ``result.nbytes == n_bytes``; the result
is a view of a private array at most ``alignment_bytes - 1`` bytes longer, which it keeps alive
(``result.base``); ``aligned_zeros`` costs address space, not RAM, until pages are written (NumPy's
``zeros`` maps zero pages), and ``pretouch=True`` faults in now every page the buffer spans (its last
one included, when ``alignment_bytes`` is less than a page and the buffer does not start on one) by
writing a zero to the buffer's first byte and to the first byte of each later page
(``_touch_offsets``; so ``aligned_zeros`` stays all zero), so that the first transfers do not pay the
page faults.
"""

from __future__ import annotations

import numpy as np

from quillcache._checks import check_int

__all__ = ["PAGE_BYTES", "aligned_empty", "aligned_zeros"]

PAGE_BYTES = 4096


def _touch_offsets(address: int, n_bytes: int) -> np.ndarray:
    """Offsets into ``n_bytes`` bytes at ``address`` with one in every page they span: 0 (the first page's
    byte, wherever the buffer starts in it), then the first byte of each later page; ascending, each in
    ``[0, n_bytes)``; none when ``n_bytes`` is 0."""
    if n_bytes <= 0:
        return np.empty(0, dtype=np.intp)
    next_page = -address % PAGE_BYTES  # offset of the first page boundary at or after the buffer's start
    later = np.arange(next_page if next_page else PAGE_BYTES, n_bytes, PAGE_BYTES, dtype=np.intp)
    return np.concatenate((np.zeros(1, dtype=np.intp), later))


def _aligned(make, n_bytes: int, alignment_bytes: int, pretouch: bool) -> np.ndarray:
    n_bytes = check_int("n_bytes", n_bytes, 0)
    alignment_bytes = check_int("alignment_bytes", alignment_bytes, 1, 1 << 30)
    if alignment_bytes & (alignment_bytes - 1):
        raise ValueError(f"alignment_bytes must be a power of two, got {alignment_bytes}")
    raw = make(n_bytes + alignment_bytes - 1, dtype=np.uint8)
    start = -raw.ctypes.data % alignment_bytes
    out = raw[start:start + n_bytes]
    if pretouch and n_bytes:
        out[_touch_offsets(out.ctypes.data, n_bytes)] = 0  # one write per page: faulted in now, not in transfers
    return out


def aligned_empty(n_bytes: int, alignment_bytes: int = PAGE_BYTES, *, pretouch: bool = False) -> np.ndarray:
    """``n_bytes`` uninitialised bytes starting on an ``alignment_bytes`` boundary (module docstring)."""
    return _aligned(np.empty, n_bytes, alignment_bytes, pretouch)


def aligned_zeros(n_bytes: int, alignment_bytes: int = PAGE_BYTES, *, pretouch: bool = False) -> np.ndarray:
    """``n_bytes`` zero bytes starting on an ``alignment_bytes`` boundary (module docstring)."""
    return _aligned(np.zeros, n_bytes, alignment_bytes, pretouch)

