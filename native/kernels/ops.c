/* RMSNorm, RoPE and SiLU*mul (fp32).
 * Each op has a portable C version and an AVX2+FMA version; the AVX512 paths use the AVX2 code,
 * except SiLU*mul's zmm loop. */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "avx2_math.h"
#include "common.h"

/* ------------------------------------------------------------------ RMSNorm */
static void rmsnorm_row_portable(float *x, const float *res, const float *w, int64_t h, float eps,
                                 float *out) {
    float ss = 0.f;
    for (int64_t i = 0; i < h; i++) {
        if (res) x[i] += res[i];
        ss += x[i] * x[i];
    }
    float r = 1.f / sqrtf(ss / (float)h + eps);
    for (int64_t i = 0; i < h; i++) out[i] = w[i] * (x[i] * r);
}

AVX2_FN static void rmsnorm_row_avx2(float *x, const float *res, const float *w, int64_t h,
                                     float eps, float *out) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= h; i += 16) {
        __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
        if (res) {
            v0 = _mm256_add_ps(v0, _mm256_loadu_ps(res + i));
            v1 = _mm256_add_ps(v1, _mm256_loadu_ps(res + i + 8));
            _mm256_storeu_ps(x + i, v0);
            _mm256_storeu_ps(x + i + 8, v1);
        }
        a0 = _mm256_fmadd_ps(v0, v0, a0);
        a1 = _mm256_fmadd_ps(v1, v1, a1);
    }
    float ss = hsum256(_mm256_add_ps(a0, a1));
    for (; i < h; i++) {
        if (res) x[i] += res[i];
        ss += x[i] * x[i];
    }
    float r = 1.f / sqrtf(ss / (float)h + eps);
    __m256 vr = _mm256_set1_ps(r);
    for (i = 0; i + 8 <= h; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(w + i),
                                                _mm256_mul_ps(_mm256_loadu_ps(x + i), vr)));
    for (; i < h; i++) out[i] = w[i] * (x[i] * r);
}

/* Row-wise ops split over the pool from this many elements: a prefill's 512 x 576 RMSNorm took
 * ~115 us on one thread (~10 % of a prefill step went to the row-wise ops), while batch-16
 * decode's 16 x 576 is a few us, less than a hand-off to the pool is worth. */
#define ROWS_SPLIT_ELEMS 16384

/* rows of a row-wise op per task, or 0 to run it on the caller only */
static int64_t rows_per_task(int64_t m, int64_t row_elems) {
    if (m * row_elems < ROWS_SPLIT_ELEMS || shmk_threads() == 1) return 0;
    return shmk_cdiv(m, 4 * shmk_threads());
}

typedef struct {
    float *x;
    const float *res, *w;
    int64_t m, h, rows;
    float eps;
    float *out;
    int avx2;
} norm_ctx;

static void norm_rows(const norm_ctx *c, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
        const float *res = c->res ? c->res + r * c->h : NULL;
        if (c->avx2)
            rmsnorm_row_avx2(c->x + r * c->h, res, c->w, c->h, c->eps, c->out + r * c->h);
        else
            rmsnorm_row_portable(c->x + r * c->h, res, c->w, c->h, c->eps, c->out + r * c->h);
    }
}

static void norm_task(void *vctx, int64_t task, int tid) {
    (void)tid;
    const norm_ctx *c = vctx;
    const int64_t r0 = task * c->rows;
    norm_rows(c, r0, r0 + c->rows < c->m ? r0 + c->rows : c->m);
}

void shmk_rmsnorm(float *x, const float *residual, const float *w, int64_t m, int64_t h, float eps,
                  float *out) {
    norm_ctx c = {x, residual, w, m, h, 0, eps, out, shmk_path() >= SHMK_AVX2};
    c.rows = rows_per_task(m, h);
    if (c.rows == 0)
        norm_rows(&c, 0, m);
    else
        shmk_parallel(norm_task, &c, shmk_cdiv(m, c.rows));
}

/* ------------------------------------------------------------------ RoPE */
/* out[i] = x[i] c[i] - x[i+d/2] s[i];  out[i+d/2] = x[i+d/2] c[i] + x[i] s[i]  (HF rotate_half) */
/* rope_heads on 8 lanes (half a multiple of 8): the same products and sums, so the same bits */
AVX2_FN static void rope_heads_avx2(float *x, int64_t nh, int64_t d, const float *cs) {
    const int64_t half = d / 2;
    for (int64_t h = 0; h < nh; h++) {
        float *a = x + h * d, *b = a + half;
        for (int64_t i = 0; i < half; i += 8) {
            const __m256 x1 = _mm256_loadu_ps(a + i), x2 = _mm256_loadu_ps(b + i);
            const __m256 c = _mm256_loadu_ps(cs + i), s = _mm256_loadu_ps(cs + half + i);
            _mm256_storeu_ps(a + i, _mm256_sub_ps(_mm256_mul_ps(x1, c), _mm256_mul_ps(x2, s)));
            _mm256_storeu_ps(b + i, _mm256_add_ps(_mm256_mul_ps(x2, c), _mm256_mul_ps(x1, s)));
        }
    }
}

static void rope_heads(float *x, int64_t nh, int64_t d, const float *cs) {
    const int64_t half = d / 2;
    if (half % 8 == 0 && shmk_path() >= SHMK_AVX2) {
        rope_heads_avx2(x, nh, d, cs);
        return;
    }
    const float *c = cs, *s = cs + half;
    for (int64_t h = 0; h < nh; h++) {
        float *a = x + h * d, *b = a + half;
        for (int64_t i = 0; i < half; i++) {
            float x1 = a[i], x2 = b[i];
            a[i] = x1 * c[i] - x2 * s[i];
            b[i] = x2 * c[i] + x1 * s[i];
        }
    }
}

void shmk_rope(float *q, float *k, const int64_t *pos, int64_t t, int64_t hq, int64_t hk, int64_t d,
               const float *cos_sin, int64_t max_pos) {
    if (max_pos < 1) return; /* no table: the wrapper refuses it; never read before it */
    for (int64_t i = 0; i < t; i++) {
        int64_t p = pos[i];
        if (p < 0) p = 0;
        if (p >= max_pos) p = max_pos - 1;
        const float *cs = cos_sin + p * d;
        rope_heads(q + i * hq * d, hq, d, cs);
        if (k) rope_heads(k + i * hk * d, hk, d, cs);
    }
}

typedef struct {
    float *qkv;
    const int64_t *pos;
    int64_t t, nh, d, stride, rows, max_pos;
    const float *cos_sin;
} rope_ctx;

static void rope_rows(const rope_ctx *c, int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; i++) {
        int64_t p = c->pos[i];
        if (p < 0) p = 0;
        if (p >= c->max_pos) p = c->max_pos - 1;
        rope_heads(c->qkv + i * c->stride, c->nh, c->d, c->cos_sin + p * c->d);
    }
}

static void rope_task(void *vctx, int64_t task, int tid) {
    (void)tid;
    const rope_ctx *c = vctx;
    const int64_t i0 = task * c->rows;
    rope_rows(c, i0, i0 + c->rows < c->t ? i0 + c->rows : c->t);
}

/* RoPE on the fused qkv rows [t][(hq + 2hk) d] (q and k parts only). */
void shmk_rope_qkv(float *qkv, const int64_t *pos, int64_t t, int64_t hq, int64_t hk, int64_t d,
                   const float *cos_sin, int64_t max_pos) {
    if (max_pos < 1) return; /* as shmk_rope */
    rope_ctx c = {qkv, pos, t, hq + hk, d, (hq + 2 * hk) * d, 0, max_pos, cos_sin};
    c.rows = rows_per_task(t, c.nh * d);
    if (c.rows == 0)
        rope_rows(&c, 0, t);
    else
        shmk_parallel(rope_task, &c, shmk_cdiv(t, c.rows));
}

/* ------------------------------------------------------------------ SiLU * mul */
AVX2_FN static void silu_mul_row_avx2(const float *g, const float *u, int64_t f, float *out) {
    int64_t i = 0;
    const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
    for (; i + 8 <= f; i += 8) {
        __m256 x = _mm256_loadu_ps(g + i);
        __m256 e = exp256(_mm256_sub_ps(zero, x));
        __m256 s = _mm256_div_ps(x, _mm256_add_ps(one, e));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
    }
    for (; i < f; i++) out[i] = g[i] / (1.f + expf(-g[i])) * u[i];
}

#define AVX512_FN __attribute__((target("avx512f")))

AVX512_FN static void silu_mul_row_avx512(const float *g, const float *u, int64_t f, float *out) {
    int64_t i = 0;
    const __m512 one = _mm512_set1_ps(1.f), zero = _mm512_setzero_ps();
    for (; i + 16 <= f; i += 16) {
        __m512 x = _mm512_loadu_ps(g + i);
        __m512 e = exp512(_mm512_sub_ps(zero, x));
        __m512 s = _mm512_div_ps(x, _mm512_add_ps(one, e));
        _mm512_storeu_ps(out + i, _mm512_mul_ps(s, _mm512_loadu_ps(u + i)));
    }
    silu_mul_row_avx2(g + i, u + i, f - i, out + i);
}

typedef struct {
    const float *gu;
    int64_t m, f, rows;
    float *out;
    int path;
} silu_ctx;

static void silu_task(void *vctx, int64_t task, int tid) {
    (void)tid;
    silu_ctx *c = vctx;
    int64_t r1 = (task + 1) * c->rows < c->m ? (task + 1) * c->rows : c->m;
    for (int64_t r = task * c->rows; r < r1; r++) {
        const float *g = c->gu + r * 2 * c->f, *u = g + c->f;
        float *o = c->out + r * c->f;
        if (c->path >= SHMK_VNNI)
            silu_mul_row_avx512(g, u, c->f, o);
        else if (c->path >= SHMK_AVX2)
            silu_mul_row_avx2(g, u, c->f, o);
        else
            for (int64_t i = 0; i < c->f; i++) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
    }
}

void shmk_silu_mul(const float *gu, int64_t m, int64_t f, float *out) {
    silu_ctx c = {gu, m, f, 0, out, shmk_path()};
    /* NOTE: split from 8192 elements: batch-16 decode's 16 x 1536 took ~20 us on one thread */
    c.rows = m * f < 8192 ? m : shmk_cdiv(m, 2 * shmk_threads());
    if (c.rows < 1) c.rows = 1;
    shmk_parallel(silu_task, &c, shmk_cdiv(m, c.rows));
}

/* ------------------------------------------------------------------ argmax (greedy sampling)
 * NOTE: the LM head's batch-16 logits are 3 MB; numpy's argmax read them on one thread in
 * ~370 us (from Python, caches cold), split over the pool by rows ~200 us.  The model step runs
 * it right after the LM head when every row is greedy (shmk_model_forward). */

/* the argmax of x[0..n) given that of x[0..j0) (value v at best) */
static int64_t argmax_from(const float *x, int64_t j0, int64_t n, float v, int64_t best) {
    for (int64_t j = j0; j < n; j++)
        if (x[j] > v) v = x[j], best = j; /* NaN compares false: never taken */
    return best;
}

AVX512_FN static int64_t argmax_row_avx512(const float *x, int64_t n) {
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    __m512i vidx = _mm512_setzero_si512(), idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9,
                                                                    10, 11, 12, 13, 14, 15);
    const __m512i step = _mm512_set1_epi32(16);
    int64_t j = 0;
    /* per lane the first position of its maximum (strict >: earlier wins ties, NaN never) */
    for (; j + 16 <= n; j += 16, idx = _mm512_add_epi32(idx, step)) { /* n < 2^31 (kernels.py) */
        const __m512 v = _mm512_loadu_ps(x + j);
        const __mmask16 gt = _mm512_cmp_ps_mask(v, vmax, _CMP_GT_OQ);
        vmax = _mm512_mask_mov_ps(vmax, gt, v);
        vidx = _mm512_mask_mov_epi32(vidx, gt, idx);
    }
    const float m = _mm512_reduce_max_ps(vmax);
    if (!(m > -INFINITY)) return argmax_from(x, j, n, -INFINITY, 0);
    /* the smallest index among the lanes holding the maximum */
    const __mmask16 at = _mm512_cmp_ps_mask(vmax, _mm512_set1_ps(m), _CMP_EQ_OQ);
    return argmax_from(x, j, n, m, _mm512_mask_reduce_min_epi32(at, vidx));
}

typedef struct {
    const float *x;
    int64_t n;
    int64_t *out;
    int wide;
} argmax_ctx;

static void argmax_task(void *vctx, int64_t row, int tid) { /* one task a row */
    (void)tid;
    const argmax_ctx *c = vctx;
    const float *x = c->x + row * c->n;
    c->out[row] = c->wide ? argmax_row_avx512(x, c->n) : argmax_from(x, 0, c->n, -INFINITY, 0);
}

void shmk_argmax_rows(const float *x, int64_t m, int64_t n, int64_t *out) {
    argmax_ctx c = {x, n, out, shmk_path() >= SHMK_VNNI};
    if (m * n < 16384) { /* one row of a small vocabulary: not worth a wake-up */
        for (int64_t r = 0; r < m; r++) argmax_task(&c, r, 0);
        return;
    }
    shmk_parallel(argmax_task, &c, m);
}
