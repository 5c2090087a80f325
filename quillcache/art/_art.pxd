# C-level declarations of the arena-resident adaptive radix tree (one compilation unit: _art.pyx
# includes arena.pxi, nodes.pxi, search.pxi, walks.pxi, verify.pxi, persist.pxi, results.pxi,
# ops.pxi; see its docstring for the map).
#
# The on-arena layout (node structs, sizes from sizeof) is C, in include/qart_layout.h; CRC-32C
# in include/qart_crc32c.h; scan buffers and arena memory in include/qart_buffers.h.  Everything
# works on an ``Arena``: one contiguous byte region whose nodes and leaves refer to each other by
# 64-bit byte OFFSETS from the arena base (never raw pointers), so the bytes can be written out and
# re-attached as they are.

from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t, int64_t
from libc.string cimport memcpy, memmove, memset, memcmp

cdef extern from "qart_layout.h":
    enum:
        MAX_PREFIX "QART_MAX_PREFIX"              # prefix bytes stored in a node
        ARENA_HEADER_BYTES "QART_HEADER_BYTES"    # bytes 0..63: magic + format header (0 = null)
        FORMAT_VERSION_C "QART_FORMAT_VERSION"
        BYTE_ORDER_MARK_C "QART_BYTE_ORDER_MARK"
        NODE4 "QART_NODE4"
        NODE16 "QART_NODE16"
        NODE48 "QART_NODE48"
        NODE256 "QART_NODE256"
        NUM_CLASSES "QART_NUM_CLASSES"            # free-list size classes, one per multiple of 8
        MAX_OBJECT_BYTES "QART_MAX_OBJECT_BYTES"  # the largest node or leaf

    ctypedef struct Hdr "qart_hdr":
        uint8_t type
        uint8_t prefix_len
        uint16_t num_children
        uint32_t reserved
        uint8_t prefix[16]

    ctypedef struct Node4 "qart_node4":
        Hdr h
        uint8_t keys[4]
        uint8_t pad[4]
        uint64_t children[4]

    ctypedef struct Node16 "qart_node16":
        Hdr h
        uint8_t keys[16]
        uint64_t children[16]

    ctypedef struct Node48 "qart_node48":
        Hdr h
        uint8_t index[256]
        uint64_t children[48]

    ctypedef struct Node256 "qart_node256":
        Hdr h
        uint64_t children[256]

    const uint32_t QART_NODE_SIZE[5]
    const uint32_t QART_NODE_CAP[5]
    const uint32_t QART_NODE_MIN[5]
    int qart_find16(const uint8_t* keys, int n, uint8_t b) noexcept nogil
    void qart_prefetch(const void* p) noexcept nogil

cdef extern from "qart_crc32c.h":
    int qart_crc_hw_ok
    void qart_crc_init() noexcept nogil
    uint32_t qart_crc32c(uint32_t crc, const uint8_t* p, size_t n) noexcept nogil
    uint32_t qart_crc32c_impl(uint32_t crc, const uint8_t* p, size_t n, int impl) noexcept nogil

cdef extern from "qart_buffers.h":
    ctypedef struct qart_rows:
        uint8_t* data
        size_t n
        size_t width
    void qart_rows_init(qart_rows* r, size_t width) noexcept nogil
    void qart_rows_free(qart_rows* r) noexcept nogil
    int qart_rows_push(qart_rows* r, const uint8_t* row) noexcept nogil
    void* qart_arena_alloc(size_t cap) noexcept nogil
    void* qart_arena_move(void* old, size_t used, size_t cap) noexcept nogil
    ctypedef struct qart_offbuf:
        uint64_t* data
        size_t n
    void qart_buf_init(qart_offbuf* b) noexcept nogil
    void qart_buf_free(qart_offbuf* b) noexcept nogil
    int qart_push(qart_offbuf* b, uint64_t v) noexcept nogil

cdef enum:
    MAX_DEPTH = 260           # > longest possible root-to-leaf path (keys are <= 255 bytes)
    E_OK = 0
    E_CORRUPT = 1
    E_NOMEM = 2
    E_PREFIX = 3
    E_OOM = 4                 # malloc failed (E_NOMEM is the arena outrunning its reservation)
    E_CHECKSUM = 5            # a chunk failed its CRC-32C (Arena.bad_chunk); the arena is corrupt for good
    GATE_HEADER = 1           # Arena.gate: the header is still to be verified and checked
    GATE_CORRUPT = 2          # Arena.gate: a checksum (or the lazily checked header) failed
    MIN_CHUNK_SHIFT = 12      # chunk_bytes 4 KiB (>= MAX_OBJECT_BYTES: an object spans <= 2 chunks) ..
    MAX_CHUNK_SHIFT = 24      # .. 16 MiB

ctypedef struct Arena:
    uint8_t* base
    uint64_t used             # bump pointer: bytes [0, used) are header, live or free blocks
    uint64_t capacity         # bytes addressable at base (>= used)
    uint64_t root             # tagged offset of the root (0 = empty tree)
    uint64_t num_leaves
    uint64_t num_nodes[5]     # by node type (index NODE4..NODE256)
    uint64_t free_heads[NUM_CLASSES]  # by size class (bytes >> 3)
    uint64_t free_bytes
    uint64_t free_blocks
    uint32_t value_size
    int err                   # E_* of the last failed operation
    uint32_t conflict_len     # for E_PREFIX: length of the existing, conflicting key
    # lazy chunk verification; all zero/NULL when the tree was not attached with a table
    uint64_t lazy_end         # objects starting below this offset need verified chunks (0: none do)
    uint64_t table_end        # the attached used size: chunks tile [0, table_end)
    uint64_t* chunk_bits      # verified bitmap; the padding bits from num_chunks on are set
    uint32_t* chunk_crc       # expected CRC-32C per chunk
    uint64_t num_chunks
    uint64_t chunks_verified
    uint64_t bad_chunk        # the chunk that failed (when gate & GATE_CORRUPT and err was E_CHECKSUM)
    uint32_t chunk_shift
    int gate                  # GATE_* bits; every Python-facing operation checks it first

ctypedef struct Iter:         # in-order leaf iterator (search.pxi)
    int sp
    uint64_t pending          # subtree (tagged) to emit before resuming the stack
    uint64_t budget           # objects still allowed to be visited
    Hdr* node[MAX_DEPTH]
    uint8_t ntype[MAX_DEPTH]  # type each node was validated as (trusted over its header)
    int pos[MAX_DEPTH]

ctypedef struct PrefixHit:    # result of find_prefix (search.pxi)
    uint64_t target           # tagged subtree whose keys all start with the prefix (0 = none)
    uint64_t* ref             # slot holding target
    uint64_t* parent_ref      # slot holding the parent node (NULL if target is the root)
    Hdr* parent
    uint8_t byte              # parent's child byte leading to target
