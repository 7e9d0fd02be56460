/* W8 x A8 GEMM: 8-bit activations on AVX512-VNNI, each weight group of 32 k rotated.
 *
 * Per weight: a shmk_linear_t with `act8` set takes this kernel for every call, on every path
 * (shmk_linear_impl; the VNNI code from path vnni up, else the portable twin; every row count,
 * so a row's result never depends on its batch).  Such weights are packed from W' = W H / 32
 * (kernels.PackedLinear with act8: H the 32-point Walsh-Hadamard matrix on each group's
 * columns), so W' (H x) = W x, and each byte is stored + 128 (u8: vpdpbusd's unsigned operand
 * is the weight, so the offset comes back as 128 x the row's own sum, one number a group).
 * `vpdpbusd` multiplies 64 u8 x s8 pairs an instruction against `vpdpwssd`'s 32 int16 pairs,
 * and reads the packed quad rows as they lie (lane c = channel c's 4 k: no widening, no
 * lane-pair sums).  The price is accuracy, which two things buy back: SmoothQuant factors
 * folded into the weights at load (model/smoothing.py) move channel outliers into the
 * weights, and the rotation (QuaRot) spreads what is left over its group before rounding.  A
 * scale per group, not per 16 k, means one fold per 8 vpdpbusd a row and block instead of 4
 * (docs/kernels.md, "8-bit activations").
 *
 * Math (portable and VNNI agree bit for bit):
 *   activations, per row i and group g of 32 consecutive k (zeros past k):
 *     v = H x_g, unnormalised, in butterfly stages h = 1, 2, 4, 8, 16 (v[j] = a + b,
 *     v[j + h] = a - b for a = v[j], b = v[j + h], j & h == 0: the same fp32 adds either way)
 *     sx[i][g] = max|v| / 127, vq = rint(v * (127 / max|v|)) in [-127, 127]; NaN elements
 *     are ignored by the max and quantise to 0; a group with max|v| < 2^-100 is zeros with
 *     sx = 0; vs[i][g] = sum_{k in g} vq
 *   weights stored u8 = q + 128 (q in [-127, 127])
 *   dot[i][j][g] = sum_{k in g} u8 * vq - 128 vs[i][g] = sum_{k in g} q * vq   exact int32
 *   acc = 0; for g in order: acc = fmaf((float)dot, fp16(s)[j][g] * sx[i][g], acc)
 *   y[i][j] = acc * scale_mult (+ bias[j]) (+ y[i][j] when accumulating) */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "common.h"
#include "vnni_tile.h"

#define VNNI_FN SHMK_VNNI_FN
#define INLINE static inline __attribute__((always_inline))
#define A8_MIN_AMAX 0x1p-100f /* gemm16.c's QUANT_MIN_AMAX, for the same reason */

/* ------------------------------------------------------------------ activation quantisation */
static void quant_group_portable(const float *x, int64_t len, int8_t *q, float *s,
                                 int32_t *qs) {
    float v[GK];
    for (int t = 0; t < GK; t++) v[t] = t < len ? x[t] : 0.f;
    for (int h = 1; h < GK; h *= 2)
        for (int j0 = 0; j0 < GK; j0 += 2 * h)
            for (int j = j0; j < j0 + h; j++) {
                const float a = v[j], b = v[j + h];
                v[j] = a + b, v[j + h] = a - b;
            }
    float amax = 0.f;
    for (int t = 0; t < GK; t++) amax = fmaxf(amax, fabsf(v[t]));
    if (!(amax >= A8_MIN_AMAX)) {
        memset(q, 0, GK);
        *s = 0.f, *qs = 0;
        return;
    }
    const float inv = 127.f / amax;
    int32_t sum = 0;
    for (int t = 0; t < GK; t++) {
        /* |v| <= amax: |v * inv| <= 127 (1 + 2^-24)^2 rounds into [-127, 127] */
        const float r = nearbyintf(v[t] * inv);
        q[t] = (int8_t)(r == r ? (int)r : 0);
        sum += q[t];
    }
    *s = amax / 127.f, *qs = sum;
}

/* one butterfly stage within 16 lanes: lane j takes lane j ^ h as its partner p; the lower
 * of a pair gets v + p (= a + b), the upper p - v (= a - b) */
INLINE VNNI_FN __m512 butterfly(__m512 v, int h) {
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i hv = _mm512_set1_epi32(h);
    const __m512 p = _mm512_permutexvar_ps(_mm512_xor_si512(lane, hv), v);
    const __mmask16 upper = _mm512_test_epi32_mask(lane, hv);
    return _mm512_mask_sub_ps(_mm512_add_ps(v, p), upper, p, v);
}

/* 16 rounded lanes of v * inv (int32) */
INLINE VNNI_FN __m512i quant_half(__m512 v, __m512 inv) {
    const __m512 prod = _mm512_mul_ps(v, inv);
    /* cvtps2dq rounds half to even (default MXCSR) as nearbyintf does; NaN lanes -> 0 */
    const __mmask16 num = _mm512_cmp_ps_mask(prod, prod, _CMP_ORD_Q);
    return _mm512_maskz_cvtps_epi32(num, prod);
}

VNNI_FN static void quant_group_vnni(const float *x, int64_t len, int8_t *q, float *s,
                                     int32_t *qs) {
    const __mmask16 m0 = len >= 16 ? 0xffff : (__mmask16)((1u << len) - 1u);
    const __mmask16 m1 = len >= GK ? 0xffff : len <= 16 ? 0 : (__mmask16)((1u << (len - 16)) - 1u);
    __m512 lo = _mm512_maskz_loadu_ps(m0, x), hi = _mm512_maskz_loadu_ps(m1, x + 16);
    for (int h = 1; h < 16; h *= 2) lo = butterfly(lo, h), hi = butterfly(hi, h);
    const __m512 a = lo, b = hi;
    lo = _mm512_add_ps(a, b), hi = _mm512_sub_ps(a, b); /* stage h = 16 */
    /* NOTE: maxps returns its SECOND operand when either is NaN, so a NaN lane gives 0 here and
     * never sets the max (fmaxf's rule in the portable loop) */
    const __m512 z = _mm512_setzero_ps();
    const float amax = _mm512_reduce_max_ps(
        _mm512_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), z), _mm512_max_ps(_mm512_abs_ps(hi), z)));
    if (!(amax >= A8_MIN_AMAX)) {
        memset(q, 0, GK);
        *s = 0.f, *qs = 0;
        return;
    }
    const __m512 inv = _mm512_set1_ps(127.f / amax);
    const __m512i r0 = quant_half(lo, inv), r1 = quant_half(hi, inv);
    _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(r0));
    _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtepi32_epi8(r1));
    *s = amax / 127.f, *qs = _mm512_reduce_add_epi32(_mm512_add_epi32(r0, r1));
}

/* rows i0 .. i1 - 1: xq[i][kp], sx[i][G], vs[i][G] (the group sums; vs may be NULL) */
static void quant_rows(int path, const float *x, int64_t i0, int64_t i1, int64_t k, int8_t *xq,
                       float *sx, int32_t *vs) {
    const int64_t kp = shmk_padded_k(k), G = kp / GK;
    for (int64_t i = i0; i < i1; i++)
        for (int64_t g = 0; g < G; g++) {
            const int64_t k0 = g * GK, len = k - k0 < GK ? k - k0 : GK;
            const float *src = x + i * k + k0;
            int32_t sum;
            if (path >= SHMK_VNNI)
                quant_group_vnni(src, len, xq + i * kp + k0, sx + i * G + g, &sum);
            else
                quant_group_portable(src, len, xq + i * kp + k0, sx + i * G + g, &sum);
            if (vs) vs[i * G + g] = sum;
        }
}

/* ------------------------------------------------------------------ GEMM */
typedef struct {
    int path;
    const int8_t *xq;  /* [m][kp] */
    const float *sx;   /* [m][G] */
    const int32_t *vs; /* [m][G]: each group's sum of xq */
    const float *x;    /* quantisation stage */
    int64_t m, k, kp, G, n, nb;
    const int8_t *packed;
    const uint16_t *scales;
    float mult;
    const float *bias;
    float *y;
    int accumulate;
    shmk_split_plan plan;
    int64_t rows_per_qtask;
} a8_ctx;

static inline void store_one(const a8_ctx *c, int64_t i, int64_t j, float acc) {
    shmk_store_one(c->y, c->n, c->bias, c->accumulate, i, j, acc * c->mult);
}

static void tile_portable(const a8_ctx *c, int64_t blk, int64_t i0, int64_t i1) {
    const int8_t *wb = c->packed + blk * c->G * GBYTES;
    for (int64_t i = i0; i < i1; i++) {
        const int8_t *x = c->xq + i * c->kp;
        float acc[NB] = {0};
        for (int64_t g = 0; g < c->G; g++) {
            const int8_t *w = wb + g * GBYTES;
            int32_t d[NB];
            for (int ch = 0; ch < NB; ch++) d[ch] = -128 * c->vs[i * c->G + g]; /* the offset */
            for (int kk = 0; kk < GK; kk++)
                for (int ch = 0; ch < NB; ch++) {
                    const int32_t wu = (uint8_t)w[(kk / 4) * 4 * NB + 4 * ch + (kk & 3)];
                    d[ch] += (int32_t)x[g * GK + kk] * wu;
                }
            const uint16_t *s = c->scales + (blk * c->G + g) * NB;
            const float sxp = c->sx[i * c->G + g];
            for (int ch = 0; ch < NB; ch++)
                acc[ch] = fmaf((float)d[ch], shmk_h2f(s[ch]) * sxp, acc[ch]);
        }
        for (int64_t ch = 0; ch < NB && blk * NB + ch < c->n; ch++)
            store_one(c, i, blk * NB + ch, acc[ch]);
    }
}

/* --- VNNI: MR rows x 2 blocks, one zmm accumulator each per group, folded into fp32 ones --- */
#define A8_MR 4

INLINE VNNI_FN void vnni_store(const a8_ctx *c, int64_t blk, int64_t i, __m512 f) {
    const __m512 v = _mm512_mul_ps(f, _mm512_set1_ps(c->mult));
    shmk_vnni_store(c->y + i * c->n, c->bias, c->n, blk, v, c->accumulate);
}

/* pf_next: the first row tile of a unit (shmk_vnni_prefetch) */
INLINE VNNI_FN void vnni_kernel(const a8_ctx *c, int64_t blk, int64_t i0, const int mr,
                                const int nr, const int pf_next) {
    const int64_t G = c->G, kp = c->kp;
    const int8_t *wb0 = c->packed + blk * G * GBYTES, *wb1 = wb0 + G * GBYTES;
    const int8_t *x = c->xq + i0 * kp;
    const float *sx = c->sx + i0 * G;
    const int32_t *vs = c->vs + i0 * G;
    __m512 f[A8_MR][2];
    for (int r = 0; r < mr; r++) f[r][0] = f[r][1] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const int8_t *w0 = wb0 + g * GBYTES, *w1 = wb1 + g * GBYTES;
        __m512i d[A8_MR][2];
        /* NOTE: the weights' + 128 taken back, exact: |.| <= 128 x 32 x 127 */
        for (int r = 0; r < mr; r++) d[r][0] = d[r][1] = _mm512_set1_epi32(-128 * vs[r * G + g]);
#pragma GCC unroll 8
        for (int q = 0; q < GK / 4; q++) {
            shmk_vnni_prefetch(wb0, G, GBYTES, g, q, mr, nr, pf_next);
            const __m512i a = _mm512_loadu_si512(w0 + q * 64);
            const __m512i b = nr == 2 ? _mm512_loadu_si512(w1 + q * 64) : a;
            for (int r = 0; r < mr; r++) {
                int32_t v; /* row r's 4 activations of quad row q, in every lane */
                memcpy(&v, x + r * kp + g * GK + 4 * q, 4);
                const __m512i xb = _mm512_set1_epi32(v);
                d[r][0] = _mm512_dpbusd_epi32(d[r][0], a, xb); /* u8 weights x s8 activations */
                if (nr == 2) d[r][1] = _mm512_dpbusd_epi32(d[r][1], b, xb);
            }
        }
        const __m512 s0 = _mm512_cvtph_ps(
            _mm256_loadu_si256((const __m256i *)(c->scales + (blk * G + g) * NB)));
        __m512 s1 = s0;
        if (nr == 2)
            s1 = _mm512_cvtph_ps(
                _mm256_loadu_si256((const __m256i *)(c->scales + ((blk + 1) * G + g) * NB)));
        for (int r = 0; r < mr; r++) {
            const __m512 sxr = _mm512_set1_ps(sx[r * G + g]);
            f[r][0] =
                _mm512_fmadd_ps(_mm512_cvtepi32_ps(d[r][0]), _mm512_mul_ps(s0, sxr), f[r][0]);
            if (nr == 2)
                f[r][1] =
                    _mm512_fmadd_ps(_mm512_cvtepi32_ps(d[r][1]), _mm512_mul_ps(s1, sxr), f[r][1]);
        }
    }
    for (int r = 0; r < mr; r++) {
        vnni_store(c, blk, i0 + r, f[r][0]);
        if (nr == 2) vnni_store(c, blk + 1, i0 + r, f[r][1]);
    }
}

#define A8_ROWS(NR)                                                                        \
    do {                                                                                   \
        int64_t i = i0;                                                                    \
        for (; i + A8_MR <= i1; i += A8_MR) vnni_kernel(c, blk, i, A8_MR, NR, i == i0);    \
        switch (i1 - i) {                                                                  \
        case 3: vnni_kernel(c, blk, i, 3, NR, i == i0); break;                            \
        case 2: vnni_kernel(c, blk, i, 2, NR, 0); break;                                  \
        case 1: vnni_kernel(c, blk, i, 1, NR, 0); break;                                  \
        default: break;                                                                    \
        }                                                                                  \
    } while (0)

/* unit u = blocks 2u, 2u+1 (the last unit may hold one block) */
VNNI_FN static void a8_tile_vnni(const a8_ctx *c, int64_t u, int64_t i0, int64_t i1) {
    const int64_t blk = 2 * u;
    if (blk + 1 < c->nb)
        A8_ROWS(2);
    else
        A8_ROWS(1);
}

static void gemm_task(void *vctx, int64_t task, int tid) {
    (void)tid;
    const a8_ctx *c = vctx;
    int64_t u0, u1, i0, i1;
    shmk_split_task(&c->plan, task, &u0, &u1, &i0, &i1);
    for (int64_t u = u0; u < u1; u++) {
        if (c->path >= SHMK_VNNI) {
            a8_tile_vnni(c, u, i0, i1);
            continue;
        }
        for (int64_t b = 2 * u; b < 2 * u + 2 && b < c->nb; b++) tile_portable(c, b, i0, i1);
    }
}

static void quant_task(void *vctx, int64_t task, int tid) {
    (void)tid;
    const a8_ctx *c = vctx;
    const int64_t i0 = task * c->rows_per_qtask;
    const int64_t i1 = i0 + c->rows_per_qtask < c->m ? i0 + c->rows_per_qtask : c->m;
    quant_rows(c->path, c->x, i0, i1, c->k, (int8_t *)c->xq, (float *)c->sx, (int32_t *)c->vs);
}

/* NOTE: gemm16.c's row tile; at 4 rows a kernel call, 6 calls reuse a unit from L1 */
#define A8_MTILE 24

/* y (+)= x W^T on 8-bit activations, on the VNNI kernel where the path has it (AMX machines
 * too), else the portable one: the same bits either way. */
static void linear_a8(int path, const shmk_linear_t *w, const float *x, int64_t m, float *y,
                      int accumulate) {
    if (m <= 0 || w->n <= 0) return;
    a8_ctx c;
    memset(&c, 0, sizeof c);
    c.path = path >= SHMK_VNNI ? SHMK_VNNI : SHMK_PORTABLE;
    c.m = m, c.k = w->k, c.kp = shmk_padded_k(w->k), c.G = c.kp / GK;
    c.n = w->n, c.nb = shmk_cdiv(w->n, NB);
    c.packed = w->packed, c.scales = w->scales, c.mult = w->scale_mult;
    c.bias = w->bias, c.y = y, c.accumulate = accumulate, c.x = x;
    c.xq = shmk_scratch(0, (size_t)(m * c.kp));
    c.sx = shmk_scratch(1, (size_t)(m * c.G) * sizeof(float));
    c.vs = shmk_scratch(4, (size_t)(m * c.G) * sizeof(int32_t));
    c.rows_per_qtask = m <= 8 ? m : shmk_cdiv(m, 4 * shmk_threads());
    shmk_parallel(quant_task, &c, shmk_cdiv(m, c.rows_per_qtask));
    c.plan = shmk_split_tiles(m, shmk_cdiv(c.nb, 2), shmk_threads(), A8_MTILE);
    shmk_parallel(gemm_task, &c, c.plan.ntasks);
}

void shmk_linear_a8_impl(const shmk_linear_t *w, const float *x, int64_t m, float *y,
                         int accumulate) {
    linear_a8(shmk_path(), w, x, m, y, accumulate);
}

void shmk_linear_a8(const float *x, int64_t m, const shmk_linear_t *w, float *y) {
    linear_a8(shmk_path(), w, x, m, y, 0);
}

void shmk_quantize_rows_a8(const float *x, int64_t m, int64_t k, int8_t *xq, float *scales) {
    quant_rows(shmk_path() >= SHMK_VNNI ? SHMK_VNNI : SHMK_PORTABLE, x, 0, m, k, xq, scales, NULL);
}
