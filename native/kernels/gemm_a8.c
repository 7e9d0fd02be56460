/* W8 x A8 GEMM: 8-bit activations on AVX512-VNNI, each weight group of 32 k rotated.
 *
 * Per weight: a shmk_linear_t with `act8` set takes this kernel for every call, on every path
 * (shmk_linear_impl; the VNNI code from path vnni up, else the portable twin; every row count,
 * so a row's result never depends on its batch).  Such weights are packed from W' = W H / 32
 * (kernels.PackedLinear with act8: H the 32-point Walsh-Hadamard matrix on each group's
 * columns), so W' (H x) = W x.
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
 *     sx = 0; stored as u8 = vq + 128, because vpdpbusd's first operand is unsigned
 *   e[j][g] = 128 sum_{k in g} q[j][k]   (vpdpbusd of 128s with the weights, made per call:
 *                                          unit_sums, or inline for few rows)
 *   dot[i][j][g] = sum_{k in g} u8 * q - e[j][g] = sum_{k in g} vq * q        exact int32
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
static void quant_group_portable(const float *x, int64_t len, uint8_t *q, float *s) {
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
        memset(q, 128, GK);
        *s = 0.f;
        return;
    }
    const float inv = 127.f / amax;
    for (int t = 0; t < GK; t++) {
        /* |v| <= amax: |v * inv| <= 127 (1 + 2^-24)^2 rounds into [-127, 127] */
        const float r = nearbyintf(v[t] * inv);
        q[t] = (uint8_t)(128 + (r == r ? (int)r : 0));
    }
    *s = amax / 127.f;
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

INLINE VNNI_FN __m128i quant_half(__m512 v, __m512 inv) {
    const __m512 prod = _mm512_mul_ps(v, inv);
    /* cvtps2dq rounds half to even (default MXCSR) as nearbyintf does; NaN lanes -> 0 */
    const __mmask16 num = _mm512_cmp_ps_mask(prod, prod, _CMP_ORD_Q);
    const __m512i r = _mm512_maskz_cvtps_epi32(num, prod);
    return _mm512_cvtepi32_epi8(_mm512_add_epi32(r, _mm512_set1_epi32(128)));
}

VNNI_FN static void quant_group_vnni(const float *x, int64_t len, uint8_t *q, float *s) {
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
        memset(q, 128, GK);
        *s = 0.f;
        return;
    }
    const __m512 inv = _mm512_set1_ps(127.f / amax);
    _mm_storeu_si128((__m128i *)q, quant_half(lo, inv));
    _mm_storeu_si128((__m128i *)(q + 16), quant_half(hi, inv));
    *s = amax / 127.f;
}

static void quant_rows(int path, const float *x, int64_t i0, int64_t i1, int64_t k, uint8_t *xu,
                       float *sx) {
    const int64_t kp = shmk_padded_k(k), G = kp / GK;
    for (int64_t i = i0; i < i1; i++)
        for (int64_t g = 0; g < G; g++) {
            const int64_t k0 = g * GK, len = k - k0 < GK ? k - k0 : GK;
            const float *src = x + i * k + k0;
            if (path >= SHMK_VNNI)
                quant_group_vnni(src, len, xu + i * kp + k0, sx + i * G + g);
            else
                quant_group_portable(src, len, xu + i * kp + k0, sx + i * G + g);
        }
}

/* ------------------------------------------------------------------ GEMM */
typedef struct {
    int path;
    const uint8_t *xu; /* [m][kp] */
    const float *sx;   /* [m][G] */
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
    float v = acc * c->mult;
    if (c->bias) v = v + c->bias[j];
    float *o = c->y + i * c->n + j;
    *o = c->accumulate ? *o + v : v;
}

static void tile_portable(const a8_ctx *c, int64_t blk, int64_t i0, int64_t i1) {
    const int8_t *wb = c->packed + blk * c->G * GBYTES;
    for (int64_t i = i0; i < i1; i++) {
        const uint8_t *x = c->xu + i * c->kp;
        float acc[NB] = {0};
        for (int64_t g = 0; g < c->G; g++) {
            const int8_t *w = wb + g * GBYTES;
            int32_t d[NB] = {0};
            for (int kk = 0; kk < GK; kk++)
                for (int ch = 0; ch < NB; ch++) {
                    const int32_t wq = w[(kk / 4) * 4 * NB + 4 * ch + (kk & 3)];
                    d[ch] += ((int32_t)x[g * GK + kk] - 128) * wq; /* the u8 offset back */
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

/* e[b][g][16] = 128 x the weight sums of group g for the unit's blocks (nr of them): what the
 * u8 activations' offset adds to every dot.  NOTE: made once per unit and task (each task's
 * row tiles reuse it) instead of stored at load: 1/8 byte a weight (13 MB for SmolLM2) had
 * pushed the loading process's peak RSS past 500 MB, and one extra pass over a unit per 24
 * rows costs ~4 % where a stored copy cost nothing. */
INLINE VNNI_FN void unit_sums(const a8_ctx *c, int64_t blk, int nr, int32_t *e) {
    const __m512i k128 = _mm512_set1_epi8((char)0x80);
    for (int b = 0; b < nr; b++) {
        const int8_t *wb = c->packed + (blk + b) * c->G * GBYTES;
        for (int64_t g = 0; g < c->G; g++) {
            const int8_t *w = wb + g * GBYTES;
            __m512i acc = _mm512_dpbusd_epi32(_mm512_setzero_si512(), k128, _mm512_loadu_si512(w));
            for (int q = 1; q < GK / 4; q++)
                acc = _mm512_dpbusd_epi32(acc, k128, _mm512_loadu_si512(w + q * 64));
            _mm512_storeu_si512((void *)(e + (b * c->G + g) * NB), acc);
        }
    }
}

/* pf_next: the first row tile of a unit (shmk_vnni_prefetch).
 * inl: take the u8 offset back with sums made here, one more vpdpbusd a quad row and block
 * (calls of few rows, which stream the weights from memory once); else from the unit's e
 * (unit_sums).  The same integers either way. */
INLINE VNNI_FN void vnni_kernel(const a8_ctx *c, int64_t blk, int64_t i0, const int mr,
                                const int nr, const int pf_next, const int inl,
                                const int32_t *e) {
    const int64_t G = c->G, kp = c->kp;
    const int8_t *wb0 = c->packed + blk * G * GBYTES, *wb1 = wb0 + G * GBYTES;
    const uint8_t *x = c->xu + i0 * kp;
    const float *sx = c->sx + i0 * G;
    const __m512i zero = _mm512_setzero_si512(), k128 = _mm512_set1_epi8((char)0x80);
    __m512 f[A8_MR][2];
    for (int r = 0; r < mr; r++) f[r][0] = f[r][1] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const int8_t *w0 = wb0 + g * GBYTES, *w1 = wb1 + g * GBYTES;
        /* NOTE: 0 - e, exact: |e| <= 128 x 32 x 127 */
        const __m512i c0 = inl ? zero : _mm512_sub_epi32(zero, _mm512_loadu_si512(e + g * NB));
        const __m512i c1 =
            inl || nr == 1 ? c0 : _mm512_sub_epi32(zero, _mm512_loadu_si512(e + (G + g) * NB));
        __m512i d[A8_MR][2], e0 = zero, e1 = zero; /* e: 128 x the group's weight sums */
        for (int r = 0; r < mr; r++) d[r][0] = c0, d[r][1] = c1;
#pragma GCC unroll 8
        for (int q = 0; q < GK / 4; q++) {
            shmk_vnni_prefetch(wb0, G, g, q, mr, nr, pf_next);
            const __m512i a = _mm512_loadu_si512(w0 + q * 64);
            const __m512i b = nr == 2 ? _mm512_loadu_si512(w1 + q * 64) : a;
            if (inl) {
                e0 = _mm512_dpbusd_epi32(e0, k128, a);
                if (nr == 2) e1 = _mm512_dpbusd_epi32(e1, k128, b);
            }
            for (int r = 0; r < mr; r++) {
                int32_t v; /* row r's 4 activations of quad row q, in every lane */
                memcpy(&v, x + r * kp + g * GK + 4 * q, 4);
                const __m512i xb = _mm512_set1_epi32(v);
                d[r][0] = _mm512_dpbusd_epi32(d[r][0], xb, a);
                if (nr == 2) d[r][1] = _mm512_dpbusd_epi32(d[r][1], xb, b);
            }
        }
        const __m512 s0 = _mm512_cvtph_ps(
            _mm256_loadu_si256((const __m256i *)(c->scales + (blk * G + g) * NB)));
        __m512 s1 = s0;
        if (nr == 2)
            s1 = _mm512_cvtph_ps(
                _mm256_loadu_si256((const __m256i *)(c->scales + ((blk + 1) * G + g) * NB)));
        for (int r = 0; r < mr; r++) {
            if (inl) {
                d[r][0] = _mm512_sub_epi32(d[r][0], e0);
                if (nr == 2) d[r][1] = _mm512_sub_epi32(d[r][1], e1);
            }
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

#define A8_ROWS(NR, INL)                                                                   \
    do {                                                                                   \
        int64_t i = i0;                                                                    \
        for (; i + A8_MR <= i1; i += A8_MR)                                                \
            vnni_kernel(c, blk, i, A8_MR, NR, i == i0, INL, e);                            \
        switch (i1 - i) {                                                                  \
        case 3: vnni_kernel(c, blk, i, 3, NR, i == i0, INL, e); break;                    \
        case 2: vnni_kernel(c, blk, i, 2, NR, 0, INL, e); break;                          \
        case 1: vnni_kernel(c, blk, i, 1, NR, 0, INL, e); break;                          \
        default: break;                                                                    \
        }                                                                                  \
    } while (0)

/* calls of up to this many rows make their weight sums inline (vnni_kernel's inl) */
#define A8_INLINE_SUMS_M 4

/* unit u = blocks 2u, 2u+1 (the last unit may hold one block) */
VNNI_FN static void a8_tile_vnni(const a8_ctx *c, int64_t u, int64_t i0, int64_t i1) {
    const int64_t blk = 2 * u;
    const int two = blk + 1 < c->nb, inl = c->m <= A8_INLINE_SUMS_M;
    int32_t *e = NULL;
    if (!inl) {
        e = shmk_scratch(4, (size_t)(2 * c->G * NB) * sizeof(int32_t));
        unit_sums(c, blk, two ? 2 : 1, e);
    }
    if (inl) {
        if (two)
            A8_ROWS(2, 1);
        else
            A8_ROWS(1, 1);
    } else {
        if (two)
            A8_ROWS(2, 0);
        else
            A8_ROWS(1, 0);
    }
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
    quant_rows(c->path, c->x, i0, i1, c->k, (uint8_t *)c->xu, (float *)c->sx);
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
    c.xu = shmk_scratch(0, (size_t)(m * c.kp));
    c.sx = shmk_scratch(1, (size_t)(m * c.G) * sizeof(float));
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

void shmk_quantize_rows_a8(const float *x, int64_t m, int64_t k, uint8_t *xu, float *scales) {
    quant_rows(shmk_path() >= SHMK_VNNI ? SHMK_VNNI : SHMK_PORTABLE, x, 0, m, k, xu, scales);
}
