/* Pieces shared by the AVX512-VNNI GEMM tiles: gemm16.c's int16 ones, gemm_a8.c's 8-bit one
 * and gemm_w4a8.c's.  They walk a unit (blocks blk, blk+1 of the packed layout) a quad or
 * nibble row (64 bytes) at a time and leave 16 fp32 results per row and block. */
#ifndef SHMK_VNNI_TILE_H
#define SHMK_VNNI_TILE_H
#include <immintrin.h>

#include "common.h"

#define SHMK_VNNI_FN __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
#define SHMK_PF_DIST 1024 /* software prefetch distance in a block stream (bytes) */

/* KERNEL(mr) for a slab of `rows` rows (1 .. 8; more take 8): the row count a compile-time
 * constant in each call, so a slab's sums stay in registers (gemm_w4a8.c, gemm16.c's W4) */
#define SHMK_SLAB_SWITCH(rows, KERNEL)   \
    switch ((rows) < 8 ? (rows) : 8) {   \
    case 1: KERNEL(1); break;            \
    case 2: KERNEL(2); break;            \
    case 3: KERNEL(3); break;            \
    case 4: KERNEL(4); break;            \
    case 5: KERNEL(5); break;            \
    case 6: KERNEL(6); break;            \
    case 7: KERNEL(7); break;            \
    default: KERNEL(8); break;           \
    }

/* Prefetch for row q (64 bytes) of group g of a unit starting at wb0 (G groups a block of gb
 * bytes each: GBYTES, or GBYTES / 2 for W4 nibbles, nr blocks).
 * Tiles of few rows (mr <= 2) stream the weights from memory: look SHMK_PF_DIST ahead in both
 * blocks.  Wide tiles reuse a unit from cache for every row tile after the first, so the memory
 * stream would stall the first and idle for the rest: pf_next (set on the first row tile of a
 * unit) brings the next unit (blocks blk+2, blk+3) into L2 while this one is computed. */
static inline __attribute__((always_inline)) SHMK_VNNI_FN void shmk_vnni_prefetch(
    const int8_t *wb0, int64_t G, int64_t gb, int64_t g, int q, int mr, int nr, int pf_next) {
    const int8_t *w0 = wb0 + g * gb, *w1 = w0 + G * gb;
    if (mr <= 2) {
        /* NOTE: near the end of the unit, w0's look-ahead would land in block blk+1 (w1's,
         * already streaming); skip it to blk+3, the next unit's second block.  w1's look-ahead
         * runs on into blk+2, the next unit's first. */
        const int64_t o = g * gb + q * 64 + SHMK_PF_DIST;
        _mm_prefetch((const char *)wb0 + o + (o >= G * gb ? 2 * G * gb : 0), _MM_HINT_T0);
        if (nr == 2) _mm_prefetch((const char *)w1 + q * 64 + SHMK_PF_DIST, _MM_HINT_T0);
    } else if (pf_next) {
        /* NOTE: past the last unit these addresses leave the weights; prefetches of unmapped
         * memory are dropped, never fault. */
        _mm_prefetch((const char *)w0 + 2 * G * gb + q * 64, _MM_HINT_T1);
        _mm_prefetch((const char *)w1 + 2 * G * gb + q * 64, _MM_HINT_T1);
    }
}

/* y[j0 .. j0 + 16) of one row (j0 = 16 blk, masked at n) = v (+ bias[j]) (+ y[j] when
 * accumulating) */
static inline __attribute__((always_inline)) SHMK_VNNI_FN void shmk_vnni_store(
    float *yrow, const float *bias, int64_t n, int64_t blk, __m512 v, int accumulate) {
    const int64_t j0 = blk * NB;
    const int64_t ncols = n - j0 < NB ? n - j0 : NB;
    const __mmask16 mask = (__mmask16)((1u << ncols) - 1u);
    if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias + j0));
    float *y = yrow + j0;
    if (accumulate) v = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, y), v);
    _mm512_mask_storeu_ps(y, mask, v);
}

#endif
