/* W8 (group-32) x A8 (group-16) GEMM: 8-bit activations on AVX512-VNNI.
 *
 * Per weight: a shmk_linear_t with `act8` set takes this kernel for every call on path vnni
 * (shmk_linear_impl; every row count, so a row's result never depends on its batch); the rest
 * stays on gemm16.c.
 * `vpdpbusd` multiplies 64 u8 x s8 pairs an instruction against `vpdpwssd`'s 32 int16 pairs,
 * and reads the packed quad rows as they lie (lane c = channel c's 4 k: no widening, no
 * lane-pair sums).  The price is accuracy: on SmolLM2's unsmoothed weights the teacher-forced
 * KL to fp32 doubles; on weights smoothed at load (model/smoothing.py) it is about the
 * unsmoothed int16 kernel's, which is how the engine's opt-in activation_dtype="int8" runs it
 * (docs/kernels.md, "8-bit activations").
 *
 * Math (the weights are gemm16.c's, unchanged; portable and VNNI agree bit for bit):
 *   activations, per row i and span p of 16 consecutive k (zeros past k):
 *     sx[i][p] = max|x| / 127, xq = rint(x * (127 / max|x|)) in [-127, 127]; NaN elements are
 *     ignored by the max and quantise to 0; a span with max|x| < 2^-100 is zeros with sx = 0;
 *     stored as u8 = xq + 128, because vpdpbusd's first operand is unsigned
 *   e[j][p] = 128 sum_{k in p} q[j][k]   (vpdpbusd of 128s with the weights, made per call:
 *                                          unit_sums, or inline for few rows)
 *   dot[i][j][p] = sum_{k in p} u8 * q - e[j][p] = sum_{k in p} xq * q        exact int32
 *   acc = 0; for p in order: acc = fmaf((float)dot, fp16(s)[j][p / 2] * sx[i][p], acc)
 *   y[i][j] = acc * scale_mult (+ bias[j]) (+ y[i][j] when accumulating) */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "common.h"
#include "vnni_tile.h"

#define VNNI_FN SHMK_VNNI_FN
#define INLINE static inline __attribute__((always_inline))
#define SPAN 16               /* k per activation scale */
#define A8_MIN_AMAX 0x1p-100f /* gemm16.c's QUANT_MIN_AMAX, for the same reason */

/* ------------------------------------------------------------------ activation quantisation */
static void quant_span_portable(const float *x, int64_t len, uint8_t *q, float *s) {
    float amax = 0.f;
    for (int64_t t = 0; t < len; t++) amax = fmaxf(amax, fabsf(x[t]));
    if (!(amax >= A8_MIN_AMAX)) {
        memset(q, 128, SPAN);
        *s = 0.f;
        return;
    }
    const float inv = 127.f / amax;
    for (int64_t t = 0; t < SPAN; t++) {
        /* |x| <= amax: |x * inv| <= 127 (1 + 2^-24)^2 rounds into [-127, 127] */
        const float r = t < len ? nearbyintf(x[t] * inv) : 0.f;
        q[t] = (uint8_t)(128 + (r == r ? (int)r : 0));
    }
    *s = amax / 127.f;
}

VNNI_FN static void quant_span_vnni(const float *x, int64_t len, uint8_t *q, float *s) {
    const __mmask16 live = len >= SPAN ? 0xffff : (__mmask16)((1u << len) - 1u);
    const __m512 v = _mm512_maskz_loadu_ps(live, x);
    /* NOTE: maxps returns its SECOND operand when either is NaN, so a NaN lane gives 0 here and
     * never sets the max (fmaxf's rule in the portable loop) */
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v), _mm512_setzero_ps()));
    if (!(amax >= A8_MIN_AMAX)) {
        memset(q, 128, SPAN);
        *s = 0.f;
        return;
    }
    const __m512 prod = _mm512_mul_ps(v, _mm512_set1_ps(127.f / amax));
    /* cvtps2dq rounds half to even (default MXCSR) as nearbyintf does; NaN lanes -> 0 */
    const __mmask16 num = _mm512_cmp_ps_mask(prod, prod, _CMP_ORD_Q);
    const __m512i r = _mm512_maskz_cvtps_epi32(num, prod);
    _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(_mm512_add_epi32(r, _mm512_set1_epi32(128))));
    *s = amax / 127.f;
}

static void quant_rows(int path, const float *x, int64_t i0, int64_t i1, int64_t k, uint8_t *xu,
                       float *sx) {
    const int64_t kp = shmk_padded_k(k), P = kp / SPAN;
    for (int64_t i = i0; i < i1; i++)
        for (int64_t p = 0; p < P; p++) {
            const int64_t k0 = p * SPAN, len = k - k0 < 0 ? 0 : (k - k0 < SPAN ? k - k0 : SPAN);
            const float *src = x + i * k + (len ? k0 : 0);
            if (path >= SHMK_VNNI)
                quant_span_vnni(src, len, xu + i * kp + k0, sx + i * P + p);
            else
                quant_span_portable(src, len, xu + i * kp + k0, sx + i * P + p);
        }
}

/* ------------------------------------------------------------------ GEMM */
typedef struct {
    int path;
    const uint8_t *xu; /* [m][kp] */
    const float *sx;   /* [m][kp / 16] */
    const float *x;    /* quantisation stage */
    int64_t m, k, kp, G, P, n, nb;
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
        for (int64_t p = 0; p < c->P; p++) {
            const int64_t g = p / 2;
            const int8_t *w = wb + g * GBYTES;
            int32_t d[NB] = {0};
            for (int kk = (int)(p % 2) * SPAN; kk < (int)(p % 2) * SPAN + SPAN; kk++)
                for (int ch = 0; ch < NB; ch++) {
                    const int32_t wq = w[(kk / 4) * 4 * NB + 4 * ch + (kk & 3)];
                    d[ch] += ((int32_t)x[g * GK + kk] - 128) * wq; /* the u8 offset back */
                }
            const uint16_t *s = c->scales + (blk * c->G + g) * NB;
            const float sxp = c->sx[i * c->P + p];
            for (int ch = 0; ch < NB; ch++)
                acc[ch] = fmaf((float)d[ch], shmk_h2f(s[ch]) * sxp, acc[ch]);
        }
        for (int64_t ch = 0; ch < NB && blk * NB + ch < c->n; ch++)
            store_one(c, i, blk * NB + ch, acc[ch]);
    }
}

/* --- VNNI: MR rows x 2 blocks, one zmm accumulator each per span, folded into fp32 ones --- */
#define A8_MR 4

INLINE VNNI_FN void vnni_store(const a8_ctx *c, int64_t blk, int64_t i, __m512 f) {
    const __m512 v = _mm512_mul_ps(f, _mm512_set1_ps(c->mult));
    shmk_vnni_store(c->y + i * c->n, c->bias, c->n, blk, v, c->accumulate);
}

/* e[b][p][16] = 128 x the weight sums of span p for the unit's blocks (nr of them): what the
 * u8 activations' offset adds to every dot.  NOTE: made once per unit and task (each task's
 * row tiles reuse it) instead of stored at load: 1/8 byte a weight (13 MB for SmolLM2) had
 * pushed the loading process's peak RSS past 500 MB, and one extra pass over a unit per 24
 * rows costs ~4 % where a stored copy cost nothing. */
INLINE VNNI_FN void unit_sums(const a8_ctx *c, int64_t blk, int nr, int32_t *e) {
    const __m512i k128 = _mm512_set1_epi8((char)0x80);
    for (int b = 0; b < nr; b++) {
        const int8_t *wb = c->packed + (blk + b) * c->G * GBYTES;
        for (int64_t p = 0; p < c->P; p++) {
            const int8_t *w = wb + (p / 2) * GBYTES + (p % 2) * 4 * 64;
            __m512i acc = _mm512_dpbusd_epi32(_mm512_setzero_si512(), k128, _mm512_loadu_si512(w));
            for (int q = 1; q < 4; q++)
                acc = _mm512_dpbusd_epi32(acc, k128, _mm512_loadu_si512(w + q * 64));
            _mm512_storeu_si512((void *)(e + (b * c->P + p) * NB), acc);
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
    const int64_t G = c->G, kp = c->kp, P = c->P;
    const int8_t *wb0 = c->packed + blk * G * GBYTES, *wb1 = wb0 + G * GBYTES;
    const uint8_t *x = c->xu + i0 * kp;
    const float *sx = c->sx + i0 * P;
    __m512 f[A8_MR][2];
    for (int r = 0; r < mr; r++) f[r][0] = f[r][1] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const int8_t *w0 = wb0 + g * GBYTES, *w1 = wb1 + g * GBYTES;
        const __m512 s0 = _mm512_cvtph_ps(
            _mm256_loadu_si256((const __m256i *)(c->scales + (blk * G + g) * NB)));
        __m512 s1 = s0;
        if (nr == 2)
            s1 = _mm512_cvtph_ps(
                _mm256_loadu_si256((const __m256i *)(c->scales + ((blk + 1) * G + g) * NB)));
        for (int h = 0; h < GK / SPAN; h++) {
            const int64_t p = 2 * g + h;
            const __m512i zero = _mm512_setzero_si512(), k128 = _mm512_set1_epi8((char)0x80);
            /* NOTE: 0 - e, exact: |e| <= 128 x 16 x 127 */
            const __m512i c0 =
                inl ? zero : _mm512_sub_epi32(zero, _mm512_loadu_si512(e + p * NB));
            const __m512i c1 = inl || nr == 1
                                   ? c0
                                   : _mm512_sub_epi32(zero, _mm512_loadu_si512(e + (P + p) * NB));
            __m512i d[A8_MR][2], e0 = zero, e1 = zero; /* e: 128 x the span's weight sums */
            for (int r = 0; r < mr; r++) d[r][0] = c0, d[r][1] = c1;
#pragma GCC unroll 4
            for (int q = 4 * h; q < 4 * h + 4; q++) {
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
            for (int r = 0; r < mr; r++) {
                if (inl) {
                    d[r][0] = _mm512_sub_epi32(d[r][0], e0);
                    if (nr == 2) d[r][1] = _mm512_sub_epi32(d[r][1], e1);
                }
                const __m512 sxr = _mm512_set1_ps(sx[r * P + p]);
                f[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d[r][0]), _mm512_mul_ps(s0, sxr),
                                          f[r][0]);
                if (nr == 2)
                    f[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d[r][1]),
                                              _mm512_mul_ps(s1, sxr), f[r][1]);
            }
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
        e = shmk_scratch(4, (size_t)(2 * c->P * NB) * sizeof(int32_t));
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
    c.m = m, c.k = w->k, c.kp = shmk_padded_k(w->k), c.G = c.kp / GK, c.P = c.kp / SPAN;
    c.n = w->n, c.nb = shmk_cdiv(w->n, NB);
    c.packed = w->packed, c.scales = w->scales, c.mult = w->scale_mult;
    c.bias = w->bias, c.y = y, c.accumulate = accumulate, c.x = x;
    c.xu = shmk_scratch(0, (size_t)(m * c.kp));
    c.sx = shmk_scratch(1, (size_t)(m * c.P) * sizeof(float));
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
