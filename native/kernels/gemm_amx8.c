/* W8 (group-32) x A16 GEMM on AMX-INT8: exact, the same numbers as the VNNI kernels.
 *
 * Why: `vpdpwssd` does 32 MACs an instruction; an AMX int8 tile product does a 16 x 16 x 32
 * block (8192 MACs) in about one tile-unit slot (~18 cycles measured, whatever the row count).
 * The int16 activations of gemm16.c split into bytes, x = 256 hi + lo (hi signed, lo unsigned),
 * so each group's exact int32 dot is 256 (hi . q) + (lo . q): two tile products (`tdpbssd`,
 * `tdpbusd`) with K = 32, both results stored and combined in int32 (|256 hi.q| <= 2^27, no
 * overflow).  From there the math is gemm16.c's to the last bit:
 *   acc = fmaf((float)dot, s[j][g], acc) for g in order;  y = acc * (sx[i] * mult) (+ bias) (+ y)
 * so path "amx" gives path "vnni"'s results for these calls, and accuracy is not in question.
 *
 * Cost per 16 x 16 x 32 block: two products and two tile stores, ~18 and ~17 cycles each
 * whatever the row count, which the tile unit runs one after another, plus the fold on vector
 * units, which barely overlaps them (~80 TSC ticks a block measured, ~52 of them tile work).
 * That beats `vpdpwssd` 1.1-1.5x from 16 rows and, as 9 rows cost what 16 do while decode waits
 * on the weight stream anyway, from 9 rows in the model (common.h); unlike the bf16 kernel it
 * needs no int8 -> bf16 widening of the weights.
 *
 * Tiles: A_hi, A_lo = 16 rows x 32 bytes (one group of k; rows past m are zero), B = 8 rows x
 * 64 bytes (16 channels x 4 k, int8 AMX's layout, which is gemm16.c's packed layout: tiles load
 * straight from the weights), C = 16 x 16 int32.  A task takes units (two blocks, 32 channels)
 * over a range of rows: per block and 16 rows the groups run in order: two products each (B and
 * C tiles alternate between groups), stored a group later to one half of a double buffer,
 * folded into 16 zmm accumulators a group after that.
 * NOTE: at 16 rows the kernel waits on memory, not on the tile unit (~70 TSC ticks a group with
 * the weights in cache, ~150 streaming them with both cores): the weights were once rearranged
 * into scratch per unit (a vpermw per 64 bytes), and that copy, stalled on each unit's first
 * touch, cost 15-20% of a cold stream. */
#include <immintrin.h>
#include <string.h>

#include "common.h"

#define AMX8_FN __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl")))
#define MR 16 /* rows per tile pass */

typedef struct {
    const int8_t *ah;  /* [mp][kp] high bytes of the int16 activations (signed) */
    const uint8_t *al; /* [mp][kp] low bytes (unsigned) */
    const float *sx;   /* [m] row scales */
    int64_t m, k, kp, G, n, nb, nunits;
    shmk_split_plan plan;
    const int8_t *packed;
    const uint16_t *scales;
    float mult;
    const float *bias;
    float *y;
    int accumulate;
    /* quantisation stage */
    const float *x;
    int8_t *ah_w;
    uint8_t *al_w;
    float *sx_w;
    int64_t rows_per_qtask;
} amx8_ctx;

/* rows [i0, i1) of x -> int16 (gemm16.c's rounding) -> high and low bytes; rows >= m zero */
static void quant_task(void *vctx, int64_t task, int tid) {
    (void)tid;
    const amx8_ctx *c = vctx;
    const int64_t mp = shmk_cdiv(c->m, MR) * MR, kp = c->kp;
    int64_t i0 = task * c->rows_per_qtask, i1 = i0 + c->rows_per_qtask;
    if (i1 > mp) i1 = mp;
    int16_t *row = shmk_scratch(2, (size_t)kp * sizeof(int16_t));
    for (int64_t i = i0; i < i1; i++) {
        int8_t *hi = c->ah_w + i * kp;
        uint8_t *lo = c->al_w + i * kp;
        if (i >= c->m) {
            memset(hi, 0, (size_t)kp);
            memset(lo, 0, (size_t)kp);
            continue;
        }
        shmk_quant_row(c->x + i * c->k, c->k, kp, row, c->sx_w + i);
        for (int64_t j = 0; j < kp; j++) {
            hi[j] = (int8_t)(row[j] >> 8); /* arithmetic shift: floor(x / 256) */
            lo[j] = (uint8_t)(row[j] & 0xff);
        }
    }
}

/* One row of a group's fold: a += s * (256 hi + lo), the int32 sum exact (see above). */
#define FOLD_ROW(r, a)                                                                         \
    a = _mm512_fmadd_ps(                                                                       \
        _mm512_cvtepi32_ps(_mm512_add_epi32(                                                   \
            _mm512_slli_epi32(_mm512_load_si512(hi + (r) * 16), 8),                            \
            _mm512_load_si512(lo + (r) * 16))),                                                \
        s, a)
#define FOLD16()                                                                               \
    do {                                                                                       \
        FOLD_ROW(0, a0), FOLD_ROW(1, a1), FOLD_ROW(2, a2), FOLD_ROW(3, a3);                    \
        FOLD_ROW(4, a4), FOLD_ROW(5, a5), FOLD_ROW(6, a6), FOLD_ROW(7, a7);                    \
        FOLD_ROW(8, a8), FOLD_ROW(9, a9), FOLD_ROW(10, a10), FOLD_ROW(11, a11);                \
        FOLD_ROW(12, a12), FOLD_ROW(13, a13), FOLD_ROW(14, a14), FOLD_ROW(15, a15);            \
    } while (0)

/* y rows r0 .. r0+nrow-1 of block blk from the accumulators acc[r][16] */
AMX8_FN static void store_rows(const amx8_ctx *c, int64_t blk, int64_t r0, int nrow,
                               const float *acc) {
    const int64_t j0 = blk * NB;
    const int64_t ncols = c->n - j0 < NB ? c->n - j0 : NB;
    const __mmask16 mask = (__mmask16)((1u << ncols) - 1u);
    const __m512 bias =
        c->bias ? _mm512_maskz_loadu_ps(mask, c->bias + j0) : _mm512_setzero_ps();
    for (int r = 0; r < nrow; r++) {
        float *y = c->y + (r0 + r) * c->n + j0;
        /* gemm16.c's epilogue order: acc * (sx * mult), then + bias, then + y */
        const __m512 sx = _mm512_set1_ps(c->sx[r0 + r] * c->mult);
        __m512 v = _mm512_mul_ps(_mm512_load_ps(acc + r * 16), sx);
        if (c->bias) v = _mm512_add_ps(v, bias);
        if (c->accumulate) v = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, y), v);
        _mm512_mask_storeu_ps(y, mask, v);
    }
}

/* Rows r0 .. r0+nrow-1 (nrow <= 16) of one block (16 channels) over all groups.
 * Accumulators are 16 named zmm (an array would live on the stack).
 * NOTE: the tile numbers are immediates: A_hi 0, A_lo 1, B 2 / 3 and C 4-5 / 6-7 (hi, lo) for
 * even / odd groups. */
AMX8_FN static void block_rows(const amx8_ctx *c, int64_t blk, int64_t r0, int nrow, int prefetch,
                               int32_t *cbuf) {
    const int64_t G = c->G, kp = c->kp;
    const int8_t *bq = c->packed + blk * G * GBYTES; /* each group one B tile (gemm16.c) */
    const uint16_t *scales = c->scales + blk * G * NB;
    /* NOTE: the weights of the block after next come to L2 a group at a time during the first
     * row pass (all at once, the prefetches stalled on full miss queues: 12% of the samples). */
    const char *next = (const char *)(c->packed + (blk + 2) * G * GBYTES);
    const char *next_s = (const char *)(c->scales + (blk + 2) * G * NB);
    SHMK_ACC16_ZERO();
    /* NOTE: software-pipelined over groups (tile numbers alternate by group parity, as they are
     * immediates): group g's products, then group g-1's C tiles stored (their products done by
     * now), then group g-2's fold from memory (its stores done by now).  Storing a group's C
     * tiles right after its products stalled on them. */
    for (int64_t g = 0; g < G + 2; g++) {
        if (g < G) {
            _tile_loadd(0, c->ah + r0 * kp + g * GK, kp);
            _tile_loadd(1, c->al + r0 * kp + g * GK, kp);
            if (g & 1) {
                _tile_loadd(3, bq + g * GBYTES, 64);
                _tile_zero(6);
                _tile_zero(7);
                _tile_dpbssd(6, 0, 3);
                _tile_dpbusd(7, 1, 3);
            } else {
                _tile_loadd(2, bq + g * GBYTES, 64);
                _tile_zero(4);
                _tile_zero(5);
                _tile_dpbssd(4, 0, 2);
                _tile_dpbusd(5, 1, 2);
            }
            if (prefetch) {
                for (int64_t off = 0; off < GBYTES; off += 64)
                    _mm_prefetch(next + g * GBYTES + off, _MM_HINT_T1);
                if (g % 2 == 0) _mm_prefetch(next_s + g * 32, _MM_HINT_T1);
            }
        }
        if (g >= 1 && g <= G) {
            int32_t *cb = cbuf + ((g - 1) & 1) * 512;
            if ((g - 1) & 1) {
                _tile_stored(6, cb, 64);
                _tile_stored(7, cb + 256, 64);
            } else {
                _tile_stored(4, cb, 64);
                _tile_stored(5, cb + 256, 64);
            }
        }
        if (g >= 2) {
            const int32_t *hi = cbuf + ((g - 2) & 1) * 512, *lo = hi + 256;
            const __m512 s = _mm512_cvtph_ps(
                _mm256_loadu_si256((const __m256i *)(scales + (g - 2) * NB)));
            FOLD16();
        }
    }
    float acc[16 * 16] __attribute__((aligned(64)));
    SHMK_ACC16_STORE(acc);
    store_rows(c, blk, r0, nrow, acc);
}

AMX8_FN static void amx8_task(void *vctx, int64_t task, int tid) {
    (void)tid;
    const amx8_ctx *c = vctx;
    int64_t u0, u1, i0, i1;
    shmk_split_task(&c->plan, task, &u0, &u1, &i0, &i1);
    int32_t *cbuf = shmk_scratch(7, 2 * 512 * sizeof(int32_t));
    /* A_hi, A_lo: 16 x 32 bytes; B: 8 x 64 bytes; C: 16 x 16 int32 */
    static const uint8_t rows[8] = {MR, MR, GK / 4, GK / 4, MR, MR, MR, MR};
    static const uint16_t colsb[8] = {GK, GK, 64, 64, 64, 64, 64, 64};
    shmk_amx_config(rows, colsb);
    for (int64_t u = u0; u < u1; u++) {
        const int64_t blk = 2 * u;
        const int nblk = blk + 1 < c->nb ? 2 : 1;
        for (int b = 0; b < nblk; b++)
            for (int64_t r0 = i0; r0 < i1; r0 += MR) {
                const int64_t rows = i1 - r0 < MR ? i1 - r0 : MR;
                block_rows(c, blk + b, r0, (int)rows, r0 == i0, cbuf);
            }
    }
    _tile_release();
}

void shmk_linear_amx8(const shmk_linear_t *w, const float *x, int64_t m, float *y,
                      int accumulate) {
    amx8_ctx c;
    memset(&c, 0, sizeof c);
    c.m = m, c.k = w->k, c.kp = shmk_padded_k(w->k), c.G = c.kp / GK, c.n = w->n;
    c.nb = shmk_cdiv(c.n, NB), c.nunits = shmk_cdiv(c.nb, 2);
    c.packed = w->packed, c.scales = w->scales, c.mult = w->scale_mult, c.bias = w->bias;
    c.y = y, c.accumulate = accumulate, c.x = x;
    const int64_t mp = shmk_cdiv(m, MR) * MR;
    const int nth = shmk_threads();
    /* NOTE: the caller's scratch slots 0 and 1 hold the activation bytes and row scales;
     * tasks only read them. */
    int8_t *bytes = shmk_scratch(0, (size_t)(2 * mp * c.kp));
    c.ah = c.ah_w = bytes;
    c.al = c.al_w = (uint8_t *)(bytes + mp * c.kp);
    c.sx = c.sx_w = shmk_scratch(1, (size_t)m * sizeof(float));
    c.rows_per_qtask = shmk_cdiv(mp, 4 * nth);
    shmk_parallel(quant_task, &c, shmk_cdiv(mp, c.rows_per_qtask));
    c.plan = shmk_split_units(m, c.nunits, nth);
    shmk_parallel(amx8_task, &c, c.plan.ntasks);
}
