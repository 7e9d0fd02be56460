/* W8 (group-32) x bf16 GEMM on AMX-BF16: the linear layers at M >= AMX_MIN_M on CPUs with AMX.
 *
 * Why a second numeric contract: `vpdpwssd` (int16 x int16) is the VNNI kernels' limit, ~32 MACs
 * a cycle; one AMX tile product (`tdpbf16ps`, 16 x 16 x 32) does 8192.  The weights enter
 * exactly (int8 values are exact in bf16) and each 32-k group is one tile product, so the
 * per-(channel, group) fp16 scales stay in fp32 as in gemm16.c; only the activations round to
 * bf16 (8-bit mantissa, round to nearest even).  Simulated on SmolLM2 that keeps teacher-forced
 * top-1 agreement with fp32 at 98.2% (int16: 98.2%; scaling the weights into bf16 instead: 97.6%).
 *   y[i][j] = mult * sum_g s[j][g] * (sum_{k in g} bf16(x[i][k]) * q[j][k])   (+ bias, + y)
 * with each group's inner sum in fp32 inside the tile unit (its order is the hardware's), then
 * one fp32 FMA per group in order.  Results differ from the int16 paths by bf16 rounding; they do
 * not depend on the thread count.
 *
 * Tiles: A = 16 rows x 32 bf16 of x (rows padded to 16 with zeros), B = the 16 pair-rows of one
 * packed block-group (16 channels x 2 k each, AMX-BF16's B layout: one vpermw splits each of
 * gemm16.c's quad rows into two, each int8 then widened to bf16), C = 16 x 16 fp32.  A task
 * takes a unit (two blocks, 32 channels) over a range of rows: the unit's weights are widened to
 * bf16 once into thread-local scratch, then for each block and 16 rows the groups run in order:
 * one tile product into a zeroed C tile, stored a group later, folded with the group's scale
 * into 16 zmm accumulators a group after that (block_rows; gemm_amx8.c's pipeline).
 * NOTE: against four products a group (32 rows x 2 blocks) folded into accumulators in memory:
 * prefill 512 +0.7-2.6 % (three alternated pairs); GEMM-only, the widening takes ~18 % of a hot
 * M = 512 gate_up and the next unit's prefetch ~5 %. */
#define _GNU_SOURCE
#include <immintrin.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "common.h"

#define AMX_FN __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16,f16c")))

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static void cpuid(unsigned leaf, unsigned sub, unsigned r[4]) {
    __asm__ volatile("cpuid" : "=a"(r[0]), "=b"(r[1]), "=c"(r[2]), "=d"(r[3]) : "a"(leaf), "c"(sub));
}

int shmk_amx_available(void) {
    static int cached = -1;
    if (cached >= 0) return cached;
    unsigned r7[4], r71[4];
    cpuid(0, 0, r7);
    if (r7[0] < 7) return cached = 0;
    cpuid(7, 0, r7);
    cpuid(7, 1, r71);
    const int amx_bf16 = (r7[3] >> 22) & 1, amx_tile = (r7[3] >> 24) & 1;
    const int amx_int8 = (r7[3] >> 25) & 1;
    const int avx512_bf16 = (r71[0] >> 5) & 1;
    if (!(amx_bf16 && amx_int8 && amx_tile && avx512_bf16)) return cached = 0;
    /* NOTE: Linux hands out the tile state only on request (once per process, before any
     * thread uses it); without this the first tile instruction faults. */
    return cached = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* NOTE: loaded at every task: other code on the same thread (oneDNN inside torch runs on the
 * caller's thread) may have replaced or released the configuration since our last task. */
__attribute__((target("amx-tile"))) void shmk_amx_config(const uint8_t rows[8],
                                                         const uint16_t colsb[8]) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.rows[t] = rows[t], cfg.colsb[t] = colsb[t];
    /* NOTE: GCC 12 does not see ldtilecfg read cfg and dropped the stores above as dead (the
     * tile state then faulted); the empty asm makes them visible first. */
    __asm__ volatile("" : : "m"(cfg) : "memory");
    _tile_loadconfig(&cfg);
}

typedef struct {
    const uint16_t *xb; /* bf16 [mp][kp], rows past m zero */
    int64_t m, kp, G, n, nb, nunits;
    shmk_split_plan plan;
    const int8_t *packed;
    const uint16_t *scales;
    float mult;
    const float *bias;
    float *y;
    int accumulate;
    const float *x; /* conversion stage */
    int64_t k, rows_per_ctask;
} amx_ctx;

/* 32 floats -> 32 bf16 (round to nearest even; what the tile unit is fed) */
AMX_FN static inline void to_bf16_32(uint16_t *dst, const float *src) {
    const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + 16), _mm512_loadu_ps(src));
    _mm512_storeu_si512((void *)dst, (__m512i)v);
}

/* bf16 rows of x, zero padded to kp columns; rows m .. mp-1 all zero */
AMX_FN static void convert_task(void *vctx, int64_t task, int tid) {
    (void)tid;
    const amx_ctx *c = vctx;
    const int64_t mp = shmk_cdiv(c->m, 16) * 16;
    int64_t i0 = task * c->rows_per_ctask, i1 = i0 + c->rows_per_ctask;
    if (i1 > mp) i1 = mp;
    uint16_t *xb = (uint16_t *)c->xb;
    for (int64_t i = i0; i < i1; i++) {
        uint16_t *dst = xb + i * c->kp;
        if (i >= c->m) {
            memset(dst, 0, (size_t)c->kp * sizeof(uint16_t));
            continue;
        }
        const float *src = c->x + i * c->k;
        int64_t kk = 0;
        for (; kk + 32 <= c->k; kk += 32) to_bf16_32(dst + kk, src + kk);
        if (kk < c->kp) { /* the tail through a zero-padded copy: same rounding as the rest */
            float tail[32] = {0};
            memcpy(tail, src + kk, (size_t)(c->k - kk) * sizeof(float));
            to_bf16_32(dst + kk, tail);
        }
    }
}

/* word permutation (vpermw index) of one 64-byte quad row, whose words are channel c's k pairs
 * at 2c and 2c + 1, into its two pair rows (AMX-BF16's B layout): words 0-15 = every channel's
 * first k pair, 16-31 = the second */
static const uint16_t QUAD_TO_PAIRS[32] __attribute__((aligned(64))) = {
    0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30,
    1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};

/* one pair row (channels 0-7 and 8-15 as int8 k pairs) -> 32 bf16 */
AMX_FN static inline void store_bf16_pair_row(uint16_t *dst, __m128i lo8, __m128i hi8) {
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo8));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi8));
    _mm512_storeu_si512((void *)dst, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

/* the unit's blocks (nblk = 1 or 2) widened to bf16: wb[b][g] = 16 pair-rows x 64 bytes (the
 * packed quad rows split into pair rows on the way) */
AMX_FN static void widen_unit(const amx_ctx *c, int64_t blk, int nblk, uint16_t *wb) {
    const __m512i pairs = _mm512_load_si512(QUAD_TO_PAIRS);
    for (int b = 0; b < nblk; b++)
        for (int64_t g = 0; g < c->G; g++) {
            const int8_t *src = c->packed + ((blk + b) * c->G + g) * GBYTES;
            uint16_t *dst = wb + ((int64_t)b * c->G + g) * GBYTES;
            for (int r = 0; r < 8; r++) { /* quad row r -> pair rows 2r, 2r + 1 */
                const __m512i q = _mm512_permutexvar_epi16(
                    pairs, _mm512_loadu_si512((const void *)(src + r * 64)));
                store_bf16_pair_row(dst + 2 * r * 32, _mm512_extracti32x4_epi32(q, 0),
                                    _mm512_extracti32x4_epi32(q, 1));
                store_bf16_pair_row(dst + (2 * r + 1) * 32, _mm512_extracti32x4_epi32(q, 2),
                                    _mm512_extracti32x4_epi32(q, 3));
            }
        }
}

/* y rows r0 .. r0+nrow-1 (< m) of block blk's 16 channels from acc[r][16] */
AMX_FN static void store_rows(const amx_ctx *c, int64_t blk, int64_t r0, int nrow,
                              const float *acc) {
    const __m512 mult = _mm512_set1_ps(c->mult);
    const int64_t j0 = blk * NB;
    const int64_t ncols = c->n - j0 < NB ? c->n - j0 : NB;
    const __mmask16 mask = (__mmask16)((1u << ncols) - 1u);
    const __m512 bias = c->bias ? _mm512_maskz_loadu_ps(mask, c->bias + j0) : _mm512_setzero_ps();
    for (int r = 0; r < nrow; r++) {
        float *y = c->y + (r0 + r) * c->n + j0;
        __m512 v = _mm512_add_ps(_mm512_mul_ps(_mm512_load_ps(acc + r * 16), mult), bias);
        if (c->accumulate) v = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, y), v);
        _mm512_mask_storeu_ps(y, mask, v);
    }
}

#define FOLD_ROW(r, a) a = _mm512_fmadd_ps(_mm512_load_ps(t + (r) * 16), s, a)

/* Rows r0 .. r0+nrow-1 (nrow <= 16) of one block over all groups, wbb its widened weights.
 * NOTE: the 16 x 16 accumulators are named zmm registers (folding into 32 x 32 in memory, four
 * tile products a group, made the fold's loads and stores the bound: ~2x the tile work), and
 * the groups are software-pipelined as in gemm_amx8.c: group g's product, group g-1's C tile
 * stored (its product done by now), group g-2's fold (its store done by now).  The tile numbers
 * are immediates, so they alternate with the group's parity: A 0 / 1, B 2 / 3, C 4 / 5. */
AMX_FN static void block_rows(const amx_ctx *c, int64_t blk, const uint16_t *wbb, int64_t r0,
                              int nrow, float *cbuf) {
    const int64_t G = c->G, stride = c->kp * (int64_t)sizeof(uint16_t);
    const uint16_t *scales = c->scales + blk * G * NB;
    SHMK_ACC16_ZERO();
    for (int64_t g = 0; g < G + 2; g++) {
        if (g < G) {
            const uint16_t *a = c->xb + r0 * c->kp + g * GK;
            if (g & 1) {
                _tile_loadd(1, a, stride);
                _tile_loadd(3, wbb + g * GBYTES, 64);
                _tile_zero(5);
                _tile_dpbf16ps(5, 1, 3);
            } else {
                _tile_loadd(0, a, stride);
                _tile_loadd(2, wbb + g * GBYTES, 64);
                _tile_zero(4);
                _tile_dpbf16ps(4, 0, 2);
            }
        }
        if (g >= 1 && g <= G) {
            if ((g - 1) & 1)
                _tile_stored(5, cbuf + 256, 64);
            else
                _tile_stored(4, cbuf, 64);
        }
        if (g >= 2) {
            const float *t = cbuf + ((g - 2) & 1) * 256;
            const __m512 s = _mm512_cvtph_ps(
                _mm256_loadu_si256((const __m256i *)(scales + (g - 2) * NB)));
            FOLD_ROW(0, a0), FOLD_ROW(1, a1), FOLD_ROW(2, a2), FOLD_ROW(3, a3);
            FOLD_ROW(4, a4), FOLD_ROW(5, a5), FOLD_ROW(6, a6), FOLD_ROW(7, a7);
            FOLD_ROW(8, a8), FOLD_ROW(9, a9), FOLD_ROW(10, a10), FOLD_ROW(11, a11);
            FOLD_ROW(12, a12), FOLD_ROW(13, a13), FOLD_ROW(14, a14), FOLD_ROW(15, a15);
        }
    }
    float acc[16 * 16] __attribute__((aligned(64)));
    SHMK_ACC16_STORE(acc);
    store_rows(c, blk, r0, nrow, acc);
}

AMX_FN static void amx_task(void *vctx, int64_t task, int tid) {
    (void)tid;
    const amx_ctx *c = vctx;
    int64_t u0, u1, i0, i1;
    shmk_split_task(&c->plan, task, &u0, &u1, &i0, &i1);
    uint16_t *wb = shmk_scratch(6, (size_t)(2 * c->G * GBYTES) * sizeof(uint16_t));
    float *cbuf = shmk_scratch(7, 2 * 256 * sizeof(float)); /* two C tiles, 64-byte aligned */
    static const uint8_t rows[8] = {16, 16, 16, 16, 16, 16, 16, 16};
    static const uint16_t colsb[8] = {64, 64, 64, 64, 64, 64, 64, 64};
    shmk_amx_config(rows, colsb);
    for (int64_t u = u0; u < u1; u++) {
        const int64_t blk = 2 * u;
        const int nblk = blk + 1 < c->nb ? 2 : 1;
        /* NOTE: the next unit's weights and scales come into L2 while this one is computed
         * (past the last unit the prefetches are dropped, never a fault); with the model's cold
         * weights the widening would otherwise wait on memory every unit. */
        const char *next = (const char *)(c->packed + (blk + 2) * c->G * GBYTES);
        for (int64_t off = 0; off < 2 * c->G * GBYTES; off += 64)
            _mm_prefetch(next + off, _MM_HINT_T1);
        const char *next_s = (const char *)(c->scales + (blk + 2) * c->G * NB);
        for (int64_t off = 0; off < 2 * c->G * NB * 2; off += 64)
            _mm_prefetch(next_s + off, _MM_HINT_T1);
        widen_unit(c, blk, nblk, wb);
        for (int b = 0; b < nblk; b++)
            for (int64_t r0 = i0; r0 < i1; r0 += 16)
                block_rows(c, blk + b, wb + b * c->G * GBYTES, r0,
                           (int)(i1 - r0 < 16 ? i1 - r0 : 16), cbuf);
    }
    _tile_release();
}

void shmk_linear_amx(const shmk_linear_t *w, const float *x, int64_t m, float *y,
                     int accumulate) {
    amx_ctx c;
    memset(&c, 0, sizeof c);
    c.m = m, c.k = w->k, c.kp = shmk_cdiv(w->k, GK) * GK, c.G = c.kp / GK, c.n = w->n;
    c.nb = shmk_cdiv(c.n, NB), c.nunits = shmk_cdiv(c.nb, 2);
    c.packed = w->packed, c.scales = w->scales, c.mult = w->scale_mult, c.bias = w->bias;
    c.y = y, c.accumulate = accumulate, c.x = x;
    const int64_t mp = shmk_cdiv(m, 16) * 16;
    const int nth = shmk_threads();
    /* NOTE: the caller's scratch slot 0 holds the bf16 rows; tasks only read it. */
    c.xb = shmk_scratch(0, (size_t)(mp * c.kp) * sizeof(uint16_t));
    c.rows_per_ctask = shmk_cdiv(mp, 4 * nth);
    shmk_parallel(convert_task, &c, shmk_cdiv(mp, c.rows_per_ctask));
    c.plan = shmk_split_units(m, c.nunits, nth);
    shmk_parallel(amx_task, &c, c.plan.ntasks);
}
