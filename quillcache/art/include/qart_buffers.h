/* Growable C buffers used while scanning, and the arena's own memory (quillcache.art._art).

   Contracts: qart_offbuf starts in its own inline storage (no malloc for small scans) and must
   be released with qart_buf_free; qart_rows holds fixed-width byte rows and is released with
   qart_rows_free (or its data handed over); push functions return -1 (buffer unchanged) when
   memory runs out.  Arena memory comes from qart_arena_alloc / qart_arena_move and is released
   with free(). */
#ifndef QART_BUFFERS_H
#define QART_BUFFERS_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
/* Growable list of leaf offsets; starts in its own inline storage (no malloc for small scans). */
typedef struct { uint64_t *data; size_t n; size_t cap; int heap; uint64_t local[64]; } qart_offbuf;
static void qart_buf_init(qart_offbuf *b) { b->data = b->local; b->n = 0; b->cap = 64; b->heap = 0; }
static void qart_buf_free(qart_offbuf *b) { if (b->heap) free(b->data); qart_buf_init(b); }
static int qart_push(qart_offbuf *b, uint64_t v) {
    if (b->n == b->cap) {
        size_t cap = 2 * b->cap;
        uint64_t *d = b->heap ? (uint64_t *)realloc(b->data, cap * sizeof(uint64_t))
                              : (uint64_t *)malloc(cap * sizeof(uint64_t));
        if (!d) return -1;
        if (!b->heap) memcpy(d, b->local, b->n * sizeof(uint64_t));
        b->data = d; b->cap = cap; b->heap = 1;
    }
    b->data[b->n++] = v;
    return 0;
}

/* Arena memory: 2 MiB-aligned and marked for transparent huge pages when large (random
   descents through a big arena are TLB-bound otherwise). Released with free(). */
#if defined(__linux__)
#include <sys/mman.h>
#endif
static void *qart_arena_alloc(size_t cap) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (cap >= ((size_t)2 << 20)) {
        void *p = NULL;
        if (posix_memalign(&p, (size_t)2 << 20, cap) != 0) return NULL;
        madvise(p, cap, MADV_HUGEPAGE);
        return p;
    }
#endif
    return malloc(cap);
}
static void *qart_arena_move(void *old, size_t used, size_t cap) {
    void *p = qart_arena_alloc(cap);
    if (p) { memcpy(p, old, used); free(old); }
    return p;
}
/* Growable matrix of fixed-width byte rows (CSR scan output). */
typedef struct { uint8_t *data; size_t n; size_t cap; size_t width; } qart_rows;
static void qart_rows_init(qart_rows *r, size_t width) { r->data = NULL; r->n = 0; r->cap = 0; r->width = width; }
static void qart_rows_free(qart_rows *r) { free(r->data); r->data = NULL; r->n = 0; r->cap = 0; }
static int qart_rows_push(qart_rows *r, const uint8_t *row) {
    if (r->n == r->cap) {
        size_t cap = r->cap ? 2 * r->cap : 1024, w = r->width ? r->width : 1;
        uint8_t *d = (uint8_t *)qart_arena_alloc(cap * w);   /* huge pages when large */
        if (!d) return -1;
        if (r->n) memcpy(d, r->data, r->n * w);
        free(r->data);
        r->data = d; r->cap = cap;
    }
    if (r->width) memcpy(r->data + r->n * r->width, row, r->width);
    r->n++;
    return 0;
}

#endif /* QART_BUFFERS_H */
