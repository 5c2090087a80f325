#ifndef QART_CRC32C_H
#define QART_CRC32C_H

/* CRC-32C (Castagnoli, reflected polynomial 0x82F63B78, initial value and final xor ~0: the
   function of the crc32c package). qart_crc32c(crc, p, n) continues a CRC: start from 0, and
   qart_crc32c(qart_crc32c(0, a), b) is the CRC of a || b.
   Two implementations, chosen at run time: SSE4.2's crc32 instruction (only the function that
   uses it is compiled for SSE4.2, so the module runs on any x86-64), three independent streams
   combined with "append N zero bytes" operator tables; and a portable slicing-by-8 loop. */
#include <stdint.h>
#include <stddef.h>
#include <string.h>
#define QART_CRC_POLY 0x82F63B78u
static uint32_t qart_crc_tab[8][256];   /* slicing-by-8: tab[k][b] = byte b then k zero bytes */
static int qart_crc_hw_ok = 0;

static uint32_t qart_crc32c_sw(uint32_t crc, const uint8_t *p, size_t n) {
    uint32_t c = ~crc, lo, hi;
    while (n && ((uintptr_t)p & 7)) { c = qart_crc_tab[0][(c ^ *p++) & 0xff] ^ (c >> 8); n--; }
    while (n >= 8) {
        lo = ((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24) ^ c;
        hi = (uint32_t)p[4] | (uint32_t)p[5] << 8 | (uint32_t)p[6] << 16 | (uint32_t)p[7] << 24;
        c = qart_crc_tab[7][lo & 0xff] ^ qart_crc_tab[6][(lo >> 8) & 0xff]
          ^ qart_crc_tab[5][(lo >> 16) & 0xff] ^ qart_crc_tab[4][lo >> 24]
          ^ qart_crc_tab[3][hi & 0xff] ^ qart_crc_tab[2][(hi >> 8) & 0xff]
          ^ qart_crc_tab[1][(hi >> 16) & 0xff] ^ qart_crc_tab[0][hi >> 24];
        p += 8;
        n -= 8;
    }
    while (n) { c = qart_crc_tab[0][(c ^ *p++) & 0xff] ^ (c >> 8); n--; }
    return ~c;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <nmmintrin.h>
#define QART_CRC_HW 1
#define QART_CRC_LONG 8192   /* bytes per stream in a long 3-stream block (power of two) */
#define QART_CRC_SHORT 256   /* ... in a short one */
static uint32_t qart_crc_long[4][256];   /* operator: append QART_CRC_LONG zero bytes */
static uint32_t qart_crc_short[4][256];

static inline uint32_t qart_crc_shift(uint32_t z[4][256], uint32_t c) {
    return z[0][c & 0xff] ^ z[1][(c >> 8) & 0xff] ^ z[2][(c >> 16) & 0xff] ^ z[3][c >> 24];
}

__attribute__((target("sse4.2")))
static uint32_t qart_crc32c_hw(uint32_t crc, const uint8_t *p, size_t n) {
    uint64_t c0 = (uint32_t)~crc, c1, c2, w0, w1, w2;
    const uint8_t *end;
    while (n && ((uintptr_t)p & 7)) { c0 = _mm_crc32_u8((uint32_t)c0, *p++); n--; }
    /* The instruction has a latency of ~3 cycles and a throughput of 1: three independent
       streams over consecutive blocks keep it busy; the register state of a stream that
       started at 0 is combined as crc(A || B) = shift_|B|(crc(A)) ^ crc0(B) (linearity). */
    while (n >= 3 * QART_CRC_LONG) {
        c1 = 0; c2 = 0; end = p + QART_CRC_LONG;
        do {
            memcpy(&w0, p, 8); memcpy(&w1, p + QART_CRC_LONG, 8); memcpy(&w2, p + 2 * QART_CRC_LONG, 8);
            c0 = _mm_crc32_u64(c0, w0); c1 = _mm_crc32_u64(c1, w1); c2 = _mm_crc32_u64(c2, w2);
            p += 8;
        } while (p < end);
        c0 = qart_crc_shift(qart_crc_long, (uint32_t)c0) ^ (uint32_t)c1;
        c0 = qart_crc_shift(qart_crc_long, (uint32_t)c0) ^ (uint32_t)c2;
        p += 2 * QART_CRC_LONG;
        n -= 3 * QART_CRC_LONG;
    }
    while (n >= 3 * QART_CRC_SHORT) {
        c1 = 0; c2 = 0; end = p + QART_CRC_SHORT;
        do {
            memcpy(&w0, p, 8); memcpy(&w1, p + QART_CRC_SHORT, 8); memcpy(&w2, p + 2 * QART_CRC_SHORT, 8);
            c0 = _mm_crc32_u64(c0, w0); c1 = _mm_crc32_u64(c1, w1); c2 = _mm_crc32_u64(c2, w2);
            p += 8;
        } while (p < end);
        c0 = qart_crc_shift(qart_crc_short, (uint32_t)c0) ^ (uint32_t)c1;
        c0 = qart_crc_shift(qart_crc_short, (uint32_t)c0) ^ (uint32_t)c2;
        p += 2 * QART_CRC_SHORT;
        n -= 3 * QART_CRC_SHORT;
    }
    while (n >= 8) { memcpy(&w0, p, 8); c0 = _mm_crc32_u64(c0, w0); p += 8; n -= 8; }
    while (n) { c0 = _mm_crc32_u8((uint32_t)c0, *p++); n--; }
    return ~(uint32_t)c0;
}
#else
#define QART_CRC_HW 0
#endif

/* GF(2) 32x32 matrices as 32 column words (column k = image of bit k). */
static uint32_t qart_gf2_times(const uint32_t *mat, uint32_t vec) {
    uint32_t sum = 0;
    while (vec) { if (vec & 1) sum ^= *mat; vec >>= 1; mat++; }
    return sum;
}
static void qart_crc_zeros(uint32_t z[4][256], size_t len_bytes) {
    /* Operator "feed len_bytes (a power of two) zero bytes" on the raw CRC register, as four
       byte-indexed tables: start from one zero bit and square 3 + log2(len_bytes) times. */
    uint32_t op[32], sq[32];
    size_t bits = len_bytes * 8;
    int k, b;
    op[0] = QART_CRC_POLY;
    for (k = 1; k < 32; k++) op[k] = 1u << (k - 1);
    while (bits > 1) {
        for (k = 0; k < 32; k++) sq[k] = qart_gf2_times(op, op[k]);
        memcpy(op, sq, sizeof(op));
        bits >>= 1;
    }
    for (b = 0; b < 256; b++)
        for (k = 0; k < 4; k++) z[k][b] = qart_gf2_times(op, (uint32_t)b << (8 * k));
}

static void qart_crc_init(void) {
    uint32_t c;
    int b, k;
    for (b = 0; b < 256; b++) {
        c = (uint32_t)b;
        for (k = 0; k < 8; k++) c = (c & 1) ? (c >> 1) ^ QART_CRC_POLY : c >> 1;
        qart_crc_tab[0][b] = c;
    }
    for (b = 0; b < 256; b++)
        for (k = 1; k < 8; k++)
            qart_crc_tab[k][b] = (qart_crc_tab[k - 1][b] >> 8) ^ qart_crc_tab[0][qart_crc_tab[k - 1][b] & 0xff];
#if QART_CRC_HW
    qart_crc_zeros(qart_crc_long, QART_CRC_LONG);
    qart_crc_zeros(qart_crc_short, QART_CRC_SHORT);
    __builtin_cpu_init();
    qart_crc_hw_ok = __builtin_cpu_supports("sse4.2") ? 1 : 0;
#endif
}

/* impl: 0 = best available, 1 = SSE4.2 (caller checked qart_crc_hw_ok), 2 = portable. */
static uint32_t qart_crc32c_impl(uint32_t crc, const uint8_t *p, size_t n, int impl) {
#if QART_CRC_HW
    if (impl != 2 && qart_crc_hw_ok) return qart_crc32c_hw(crc, p, n);
#endif
    return qart_crc32c_sw(crc, p, n);
}
static uint32_t qart_crc32c(uint32_t crc, const uint8_t *p, size_t n) {
    return qart_crc32c_impl(crc, p, n, 0);
}

#endif /* QART_CRC32C_H */
