/* BLAKE2b (RFC 7693), unkeyed, one-shot: qc_blake2b(out, outlen, data, n).
 *
 * Written from the RFC's description of the algorithm (section 3: G, F, the message schedule
 * SIGMA, the initialization vector and parameter block word). Invariants:
 * - outlen is 1..64; the result equals hashlib.blake2b(data, digest_size=outlen).digest();
 * - words are read and written little-endian byte by byte, so the result does not depend on the
 *   host's byte order;
 * - the last block (the only one when n <= 128, an all-zero one when n == 0) is compressed with
 *   the final flag and the total byte count; a message of an exact multiple of 128 bytes has no
 *   extra empty block.
 */
#ifndef QC_BLAKE2B_H
#define QC_BLAKE2B_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

static const uint64_t qc_b2b_iv[8] = {
    0x6A09E667F3BCC908ULL, 0xBB67AE8584CAA73BULL, 0x3C6EF372FE94F82BULL, 0xA54FF53A5F1D36F1ULL,
    0x510E527FADE682D1ULL, 0x9B05688C2B3E6C1FULL, 0x1F83D9ABFB41BD6BULL, 0x5BE0CD19137E2179ULL};

static const uint8_t qc_b2b_sigma[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3}};

static inline uint64_t qc_b2b_load64(const uint8_t *p) {
    return (uint64_t)p[0] | ((uint64_t)p[1] << 8) | ((uint64_t)p[2] << 16) | ((uint64_t)p[3] << 24) |
           ((uint64_t)p[4] << 32) | ((uint64_t)p[5] << 40) | ((uint64_t)p[6] << 48) | ((uint64_t)p[7] << 56);
}

static inline uint64_t qc_b2b_rotr(uint64_t x, unsigned r) { return (x >> r) | (x << (64 - r)); }

#define QC_B2B_G(a, b, c, d, x, y)                  \
    do {                                            \
        v[a] = v[a] + v[b] + (x);                   \
        v[d] = qc_b2b_rotr(v[d] ^ v[a], 32);        \
        v[c] = v[c] + v[d];                         \
        v[b] = qc_b2b_rotr(v[b] ^ v[c], 24);        \
        v[a] = v[a] + v[b] + (y);                   \
        v[d] = qc_b2b_rotr(v[d] ^ v[a], 16);        \
        v[c] = v[c] + v[d];                         \
        v[b] = qc_b2b_rotr(v[b] ^ v[c], 63);        \
    } while (0)

/* F: compress one 128-byte block into h; t = bytes hashed so far including this block. */
static void qc_b2b_compress(uint64_t h[8], const uint8_t block[128], uint64_t t, int last) {
    uint64_t v[16], m[16];
    int i;
    for (i = 0; i < 16; i++) m[i] = qc_b2b_load64(block + 8 * i);
    for (i = 0; i < 8; i++) {
        v[i] = h[i];
        v[i + 8] = qc_b2b_iv[i];
    }
    v[12] ^= t; /* the high word of the 128-bit counter stays 0: messages are < 2**64 bytes */
    if (last) v[14] = ~v[14];
    for (i = 0; i < 12; i++) {
        const uint8_t *s = qc_b2b_sigma[i];
        QC_B2B_G(0, 4, 8, 12, m[s[0]], m[s[1]]);
        QC_B2B_G(1, 5, 9, 13, m[s[2]], m[s[3]]);
        QC_B2B_G(2, 6, 10, 14, m[s[4]], m[s[5]]);
        QC_B2B_G(3, 7, 11, 15, m[s[6]], m[s[7]]);
        QC_B2B_G(0, 5, 10, 15, m[s[8]], m[s[9]]);
        QC_B2B_G(1, 6, 11, 12, m[s[10]], m[s[11]]);
        QC_B2B_G(2, 7, 8, 13, m[s[12]], m[s[13]]);
        QC_B2B_G(3, 4, 9, 14, m[s[14]], m[s[15]]);
    }
    for (i = 0; i < 8; i++) h[i] ^= v[i] ^ v[i + 8];
}

static void qc_blake2b(uint8_t *out, size_t outlen, const uint8_t *data, size_t n) {
    uint64_t h[8];
    uint8_t last[128];
    size_t done = 0, i;
    for (i = 0; i < 8; i++) h[i] = qc_b2b_iv[i];
    h[0] ^= 0x01010000ULL ^ (uint64_t)outlen; /* depth 1, fanout 1, no key, digest length */
    while (n - done > 128) {
        qc_b2b_compress(h, data + done, (uint64_t)(done + 128), 0);
        done += 128;
    }
    memset(last, 0, sizeof last);
    if (n > done) memcpy(last, data + done, n - done);
    qc_b2b_compress(h, last, (uint64_t)n, 1);
    for (i = 0; i < outlen; i++) out[i] = (uint8_t)(h[i >> 3] >> (8 * (i & 7)));
}

#endif /* QC_BLAKE2B_H */
