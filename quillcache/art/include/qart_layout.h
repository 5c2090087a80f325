/* On-arena layout of the adaptive radix tree (quillcache.art._art).

   These structs ARE the persistent format: an arena written out by one build is attached by
   another, so every size and offset below is pinned by a static assertion and the arena header
   carries a format version.  Little-endian, natural alignment; all node fields are at fixed
   offsets, children are 64-bit tagged offsets from the arena base (bit 0 set = leaf, 0 = null).

     header    u8 type | u8 prefix_len | u16 num_children | u32 reserved | u8 prefix[16]
     Node4     header | u8 keys[4]  | u8 pad[4] | u64 children[4]      (keys sorted)
     Node16    header | u8 keys[16] | u64 children[16]                  (keys sorted)
     Node48    header | u8 index[256] (slot + 1, 0 = none) | u64 children[48]
     Node256   header | u64 children[256]
     leaf      u8 key_len | key | value, rounded up to 8 bytes
     free block  u64 offset of the next free block of the same size (0 ends the list)

   Node sizes are taken from sizeof() (QART_NODE_SIZE); the free-list size classes, one per
   multiple of 8 bytes, reach the largest node exactly. */
#ifndef QART_LAYOUT_H
#define QART_LAYOUT_H

#include <stddef.h>
#include <stdint.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define QART_MAX_PREFIX 16        /* prefix bytes stored in a node; longer paths are optimistic */
#define QART_HEADER_BYTES 64      /* arena bytes 0..63: magic + format header, so 0 means null */
#define QART_FORMAT_VERSION 1
#define QART_BYTE_ORDER_MARK 0x01020304u
#define QART_MAX_KEY_BYTES 255
#define QART_MAX_VALUE_BYTES 255
enum { QART_NODE4 = 1, QART_NODE16 = 2, QART_NODE48 = 3, QART_NODE256 = 4 };

typedef struct {
    uint8_t type;
    uint8_t prefix_len;           /* FULL compressed path length; only the first 16 bytes stored */
    uint16_t num_children;
    uint32_t reserved;
    uint8_t prefix[QART_MAX_PREFIX];
} qart_hdr;

typedef struct { qart_hdr h; uint8_t keys[4]; uint8_t pad[4]; uint64_t children[4]; } qart_node4;
typedef struct { qart_hdr h; uint8_t keys[16]; uint64_t children[16]; } qart_node16;
typedef struct { qart_hdr h; uint8_t index[256]; uint64_t children[48]; } qart_node48;
typedef struct { qart_hdr h; uint64_t children[256]; } qart_node256;

/* The persistent format: changing any of these needs a new QART_FORMAT_VERSION. */
_Static_assert(sizeof(qart_hdr) == 24, "qart_hdr layout changed");
_Static_assert(offsetof(qart_node4, children) == 32 && sizeof(qart_node4) == 64, "Node4 layout changed");
_Static_assert(offsetof(qart_node16, children) == 40 && sizeof(qart_node16) == 168, "Node16 layout changed");
_Static_assert(offsetof(qart_node48, children) == 280 && sizeof(qart_node48) == 664, "Node48 layout changed");
_Static_assert(offsetof(qart_node256, children) == 24 && sizeof(qart_node256) == 2072, "Node256 layout changed");

/* Largest leaf: key_len byte + 255-byte key + 255-byte value, rounded up to 8. */
#define QART_MAX_LEAF_BYTES ((1 + QART_MAX_KEY_BYTES + QART_MAX_VALUE_BYTES + 7) & ~7)
/* Free-list size classes: one per multiple of 8 up to the largest object (the Node256). */
#define QART_NUM_CLASSES (sizeof(qart_node256) / 8 + 1)
#define QART_MAX_OBJECT_BYTES sizeof(qart_node256)
_Static_assert(QART_MAX_LEAF_BYTES <= sizeof(qart_node256), "a leaf outgrows the size classes");
_Static_assert(sizeof(qart_node256) % 8 == 0 && sizeof(qart_node48) % 8 == 0
               && sizeof(qart_node16) % 8 == 0 && sizeof(qart_node4) % 8 == 0,
               "node sizes must be multiples of the 8-byte alignment");

/* By node type (index QART_NODE4..QART_NODE256). */
static const uint32_t QART_NODE_SIZE[5] = {
    0, sizeof(qart_node4), sizeof(qart_node16), sizeof(qart_node48), sizeof(qart_node256)};
static const uint32_t QART_NODE_CAP[5] = {0, 4, 16, 48, 256};
/* Fewest children a node of each type keeps (below it shrinks or merges; verify() checks it). */
static const uint32_t QART_NODE_MIN[5] = {0, 2, 4, 13, 38};

#if defined(__GNUC__) || defined(__clang__)
#define qart_prefetch(p) __builtin_prefetch((const void *)(p))
#else
#define qart_prefetch(p) ((void)0)
#endif

/* Index of byte b among the first n (<= 16) keys, or -1. */
static inline int qart_find16(const uint8_t *keys, int n, uint8_t b) {
#if defined(__SSE2__) && (defined(__GNUC__) || defined(__clang__)) && !defined(QART_SCALAR_FIND16)
    __m128i k = _mm_loadu_si128((const __m128i *)keys);
    __m128i c = _mm_cmpeq_epi8(k, _mm_set1_epi8((char)b));
    unsigned m = (unsigned)_mm_movemask_epi8(c) & ((1u << n) - 1u);
    return m ? __builtin_ctz(m) : -1;
#else
    for (int i = 0; i < n; i++) if (keys[i] == b) return i;
    return -1;
#endif
}

#endif /* QART_LAYOUT_H */
