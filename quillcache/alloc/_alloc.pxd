# Declarations of the compiled offset allocator's C state (see _alloc.pyx and
# quillcache/alloc/reference.py for the algorithm). Types and constants only, so other Cython
# modules can size and inspect a Core; the functions stay private to _alloc.pyx.

from libc.stdint cimport uint8_t, uint32_t

cdef extern from *:
    """
    #if defined(__GNUC__) || defined(__clang__)
    static inline unsigned int qc_ctz32(unsigned int x) { return (unsigned int)__builtin_ctz(x); }
    static inline unsigned int qc_clz32(unsigned int x) { return (unsigned int)__builtin_clz(x); }
    #else
    static inline unsigned int qc_ctz32(unsigned int x) { unsigned int n = 0; while (!(x & 1u)) { x >>= 1; n++; } return n; }
    static inline unsigned int qc_clz32(unsigned int x) { unsigned int n = 0; while (!(x & 0x80000000u)) { x <<= 1; n++; } return n; }
    #endif
    #define QC_UNUSED 0xFFFFFFFFu
    #define QC_ERR_NO_SPACE 0xFFFFFFFFu
    #define QC_ERR_NO_NODES 0xFFFFFFFEu
    """
    # both undefined for x == 0: callers check first
    uint32_t qc_ctz32(uint32_t x) noexcept nogil
    uint32_t qc_clz32(uint32_t x) noexcept nogil
    # "no node" in every link field, and the two failure results of _alloc_units
    # (node indices are < 2**28, so they never collide)
    const uint32_t UNUSED "QC_UNUSED"
    const uint32_t ERR_NO_SPACE "QC_ERR_NO_SPACE"
    const uint32_t ERR_NO_NODES "QC_ERR_NO_NODES"

cdef enum:
    MANTISSA_BITS = 3
    MANTISSA_VALUE = 8
    MANTISSA_MASK = 7
    NUM_TOP_BINS = 32
    TOP_SHIFT = 3
    LEAF_MASK = 7
    NUM_LEAF_BINS = 256
    ST_POOLED = 0
    ST_FREE = 1
    ST_USED = 2
    ST_PENDING = 3

# One node of the pool: a live allocation (ST_USED), a free region filed in a bin (ST_FREE) or
# an idle node on the free-node stack (ST_POOLED). 29 bytes of fields, 32 with padding.
ctypedef struct Node:
    uint32_t offset
    uint32_t size
    uint32_t bin_prev
    uint32_t bin_next
    uint32_t nb_prev
    uint32_t nb_next
    uint32_t gen
    uint8_t state

ctypedef struct Core:
    Node* nodes
    uint32_t* free_nodes
    uint32_t num_free_nodes
    uint32_t max_allocs
    uint32_t capacity_units
    uint32_t free_units
    uint32_t num_live
    uint32_t used_bins_top
    uint32_t used_bins[NUM_TOP_BINS]
    uint32_t bin_heads[NUM_LEAF_BINS]
