"""O(1) offset allocator for DRAM segments and SSD slabs (public API).

``OffsetAllocator(capacity_bytes, max_allocs, *, alignment=1)`` does the bookkeeping of byte
ranges in a segment it does not own. It is Sebastian Aaltonen's OffsetAllocator (TLSF family;
REFERENCE §6) compiled with Cython (``_alloc.pyx``); ``PyOffsetAllocator`` (``reference.py``) is
the plain-Python specification: same API, same decisions, and the benchmark baseline. What both
share (result records, errors, handle format, argument checks) lives in the leaf module
``_contract.py``; the full contract is stated there.

Import graph (no cycle): ``_contract`` <- ``reference``, ``_contract`` <- ``_alloc``, and this
module imports all three.
"""

from quillcache.alloc._alloc import OffsetAllocator, float_to_uint, uint_to_float_round_down, uint_to_float_round_up
from quillcache.alloc._contract import (
    Allocation,
    AllocatorError,
    AllocatorTypeError,
    InvalidHandleError,
    MAX_NODES,
    MAX_UNITS,
    OutOfSpaceError,
    StorageReport,
)
from quillcache.alloc.reference import PyOffsetAllocator

__all__ = [
    "Allocation",
    "AllocatorError",
    "AllocatorTypeError",
    "InvalidHandleError",
    "MAX_NODES",
    "MAX_UNITS",
    "OffsetAllocator",
    "OutOfSpaceError",
    "PyOffsetAllocator",
    "StorageReport",
    "float_to_uint",
    "uint_to_float_round_down",
    "uint_to_float_round_up",
]
