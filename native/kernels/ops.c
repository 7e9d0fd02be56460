/* RMSNorm, RoPE, SiLU*mul, KV-cache writes and paged attention (fp32).
 * Each op has a portable C version and an AVX2+FMA version; the AVX512 path uses the AVX2 code. */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "common.h"

#define AVX2_FN __attribute__((target("avx2,fma")))
#define INLINE static inline __attribute__((always_inline))

/* ------------------------------------------------------------------ AVX2 helpers */
/* e^x: x = n ln2 + r, |r| <= ln2/2, degree-6 Taylor for e^r (rel. err ~2e-7), 2^n via exponent
 * bits.  Inputs are clamped to [-87.3, 88.7]; callers zero masked lanes themselves. */
INLINE AVX2_FN __m256 exp256(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.7f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
    __m256 p = _mm256_set1_ps(1.f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
    return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e));
}

INLINE AVX2_FN float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

INLINE AVX2_FN float hmax256(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

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

void shmk_rmsnorm(float *x, const float *residual, const float *w, int64_t m, int64_t h, float eps,
                  float *out) {
    int avx2 = shmk_path() >= SHMK_AVX2;
    for (int64_t r = 0; r < m; r++) {
        const float *res = residual ? residual + r * h : NULL;
        if (avx2)
            rmsnorm_row_avx2(x + r * h, res, w, h, eps, out + r * h);
        else
            rmsnorm_row_portable(x + r * h, res, w, h, eps, out + r * h);
    }
}

/* ------------------------------------------------------------------ RoPE */
/* out[i] = x[i] c[i] - x[i+d/2] s[i];  out[i+d/2] = x[i+d/2] c[i] + x[i] s[i]  (HF rotate_half) */
static void rope_heads(float *x, int64_t nh, int64_t d, const float *cs) {
    const int64_t half = d / 2;
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
    for (int64_t i = 0; i < t; i++) {
        int64_t p = pos[i];
        if (p < 0) p = 0;
        if (p >= max_pos) p = max_pos - 1;
        const float *cs = cos_sin + p * d;
        rope_heads(q + i * hq * d, hq, d, cs);
        if (k) rope_heads(k + i * hk * d, hk, d, cs);
    }
}

/* RoPE on the fused qkv rows [t][(hq + 2hk) d] (q and k parts only). */
void shmk_rope_qkv(float *qkv, const int64_t *pos, int64_t t, int64_t hq, int64_t hk, int64_t d,
                   const float *cos_sin, int64_t max_pos) {
    const int64_t stride = (hq + 2 * hk) * d;
    for (int64_t i = 0; i < t; i++) {
        int64_t p = pos[i];
        if (p < 0) p = 0;
        if (p >= max_pos) p = max_pos - 1;
        rope_heads(qkv + i * stride, hq + hk, d, cos_sin + p * d);
    }
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

typedef struct {
    const float *gu;
    int64_t m, f, rows;
    float *out;
    int avx2;
} silu_ctx;

static void silu_task(void *vctx, int64_t task, int tid) {
    (void)tid;
    silu_ctx *c = vctx;
    int64_t r1 = (task + 1) * c->rows < c->m ? (task + 1) * c->rows : c->m;
    for (int64_t r = task * c->rows; r < r1; r++) {
        const float *g = c->gu + r * 2 * c->f, *u = g + c->f;
        float *o = c->out + r * c->f;
        if (c->avx2)
            silu_mul_row_avx2(g, u, c->f, o);
        else
            for (int64_t i = 0; i < c->f; i++) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
    }
}

void shmk_silu_mul(const float *gu, int64_t m, int64_t f, float *out) {
    silu_ctx c = {gu, m, f, 0, out, shmk_path() >= SHMK_AVX2};
    c.rows = m * f < 65536 ? m : shmk_cdiv(m, 2 * shmk_threads());
    if (c.rows < 1) c.rows = 1;
    shmk_parallel(silu_task, &c, shmk_cdiv(m, c.rows));
}

/* ------------------------------------------------------------------ KV cache */
void shmk_write_kv(const float *k, const float *v, const int64_t *slots, int64_t t, int64_t hk,
                   int64_t d, float *k_cache, float *v_cache, int64_t num_slots) {
    const int64_t row = hk * d;
    for (int64_t i = 0; i < t; i++) {
        int64_t s = slots[i];
        if (s < 0 || s >= num_slots) continue;
        memcpy(k_cache + s * row, k + i * row, (size_t)row * sizeof(float));
        memcpy(v_cache + s * row, v + i * row, (size_t)row * sizeof(float));
    }
}

/* Same, reading k and v out of fused qkv rows [t][(hq + 2hk) d]. */
void shmk_write_kv_qkv(const float *qkv, const int64_t *slots, int64_t t, int64_t hq, int64_t hk,
                       int64_t d, float *k_cache, float *v_cache, int64_t num_slots) {
    const int64_t row = hk * d, stride = (hq + 2 * hk) * d;
    for (int64_t i = 0; i < t; i++) {
        int64_t s = slots[i];
        if (s < 0 || s >= num_slots) continue;
        memcpy(k_cache + s * row, qkv + i * stride + hq * d, (size_t)row * sizeof(float));
        memcpy(v_cache + s * row, qkv + i * stride + (hq + hk) * d, (size_t)row * sizeof(float));
    }
}

/* ------------------------------------------------------------------ paged attention
 * Sequence b owns query rows [qsl[b], qsl[b+1]) and kv positions [0, seq_lens[b]); its query
 * token i sits at position seq_lens[b] - q_len + i and attends to kv positions 0..pos.
 * kv position p lives in cache block block_table[b][p / bs] at offset p % bs.
 * A task is (sequence, kv head, tile of query tokens, range of q heads of the group); online
 * softmax over chunks of 16 kv positions, fp32 throughout. */
#define ATT_CHUNK 16
#define ATT_QTILE 16

typedef struct {
    int32_t b, hk, t0, t1, g0, g1;
} att_task;

typedef struct {
    const float *q, *kc, *vc;
    const int32_t *bt, *seq_lens, *qsl;
    int64_t max_blocks, hq, hk, d, bs;
    float scale;
    float *out;
    const att_task *tasks;
    int avx2;
    /* for the fused layer: q rows inside qkv rows of this stride (floats); else hq*d */
    int64_t q_stride;
} att_ctx;

static inline const float *kv_row(const att_ctx *c, const float *cache, int32_t b, int64_t p,
                                  int64_t hk) {
    int64_t blk = c->bt[b * c->max_blocks + p / c->bs];
    return cache + ((blk * c->bs + p % c->bs) * c->hk + hk) * c->d;
}

static void att_task_portable(const att_ctx *c, const att_task *tk) {
    const int64_t d = c->d, G = c->hq / c->hk;
    const int64_t q_start = c->qsl[tk->b], q_len = c->qsl[tk->b + 1] - q_start;
    const int64_t ctx0 = c->seq_lens[tk->b] - q_len;
    float o[1024];
    for (int64_t ti = tk->t0; ti < tk->t1; ti++) {
        const int64_t pos = ctx0 + ti;
        for (int64_t g = tk->g0; g < tk->g1; g++) {
            const int64_t h = tk->hk * G + g;
            const float *q = c->q + (q_start + ti) * c->q_stride + h * d;
            float m = -INFINITY, l = 0.f;
            for (int64_t i = 0; i < d; i++) o[i] = 0.f;
            for (int64_t p = 0; p <= pos; p++) {
                const float *kr = kv_row(c, c->kc, tk->b, p, tk->hk);
                const float *vr = kv_row(c, c->vc, tk->b, p, tk->hk);
                float s = 0.f;
                for (int64_t i = 0; i < d; i++) s += q[i] * kr[i];
                s *= c->scale;
                if (s > m) {
                    float alpha = expf(m - s);
                    for (int64_t i = 0; i < d; i++) o[i] *= alpha;
                    l *= alpha;
                    m = s;
                }
                float pr = expf(s - m);
                l += pr;
                for (int64_t i = 0; i < d; i++) o[i] += pr * vr[i];
            }
            float *out = c->out + ((q_start + ti) * c->hq + h) * d;
            for (int64_t i = 0; i < d; i++) out[i] = o[i] / l;
        }
    }
}

/* 8 dot products q.k_j (d % 8 == 0) -> one ymm, via 8 accumulators and an hadd tree. */
INLINE AVX2_FN __m256 dot8(const float *q, const float *const *kp, int64_t d) {
    /* named accumulators: GCC keeps an array of them on the stack */
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    const float *k0 = kp[0], *k1 = kp[1], *k2 = kp[2], *k3 = kp[3];
    const float *k4 = kp[4], *k5 = kp[5], *k6 = kp[6], *k7 = kp[7];
    for (int64_t i = 0; i < d; i += 8) {
        const __m256 qv = _mm256_loadu_ps(q + i);
        a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + i), a0);
        a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + i), a1);
        a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k2 + i), a2);
        a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k3 + i), a3);
        a4 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k4 + i), a4);
        a5 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k5 + i), a5);
        a6 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k6 + i), a6);
        a7 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k7 + i), a7);
    }
    __m256 t0 = _mm256_hadd_ps(a0, a1), t1 = _mm256_hadd_ps(a2, a3);
    __m256 t2 = _mm256_hadd_ps(a4, a5), t3 = _mm256_hadd_ps(a6, a7);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

AVX2_FN static void att_task_avx2(const att_ctx *c, const att_task *tk) {
    const int64_t d = c->d, G = c->hq / c->hk;
    const int64_t q_start = c->qsl[tk->b], q_len = c->qsl[tk->b + 1] - q_start;
    const int64_t ctx0 = c->seq_lens[tk->b] - q_len;
    const int64_t ng = tk->g1 - tk->g0, nrows = (tk->t1 - tk->t0) * ng;
    float *O = shmk_scratch(3, (size_t)(nrows * d + 2 * nrows) * sizeof(float));
    float *M = O + nrows * d, *L = M + nrows;
    for (int64_t r = 0; r < nrows; r++) M[r] = -INFINITY, L[r] = 0.f;
    memset(O, 0, (size_t)(nrows * d) * sizeof(float));
    const int64_t kv_end = ctx0 + tk->t1; /* exclusive */
    const float *kp[ATT_CHUNK], *vp[ATT_CHUNK];
    const int32_t *bt_row = c->bt + tk->b * c->max_blocks;
    const __m256 vscale = _mm256_set1_ps(c->scale);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    float p[ATT_CHUNK] __attribute__((aligned(32)));
    for (int64_t c0 = 0; c0 < kv_end; c0 += ATT_CHUNK) {
        const int cn = kv_end - c0 < ATT_CHUNK ? (int)(kv_end - c0) : ATT_CHUNK;
        /* cache rows of positions c0 .. c0+cn-1 (one division per chunk; padding lanes reuse
         * row 0 and are masked below) */
        int64_t bi = c0 / c->bs, off = c0 % c->bs;
        for (int j = 0; j < cn; j++) {
            int64_t row = ((int64_t)bt_row[bi] * c->bs + off) * c->hk + tk->hk;
            kp[j] = c->kc + row * d;
            vp[j] = c->vc + row * d;
            if (++off == c->bs) off = 0, bi++;
        }
        for (int j = cn; j < ATT_CHUNK; j++) kp[j] = kp[0], vp[j] = vp[0];
        for (int64_t ti = tk->t0; ti < tk->t1; ti++) {
            const int64_t pos = ctx0 + ti;
            if (pos < c0) continue; /* whole chunk in this token's future */
            const int valid = pos - c0 + 1 < cn ? (int)(pos - c0 + 1) : cn;
            const __m256i vlim = _mm256_set1_epi32(valid);
            for (int64_t g = tk->g0; g < tk->g1; g++) {
                const int64_t r = (ti - tk->t0) * ng + (g - tk->g0);
                const int64_t h = tk->hk * G + g;
                const float *q = c->q + (q_start + ti) * c->q_stride + h * d;
                __m256 s0 = _mm256_mul_ps(dot8(q, kp, d), vscale);
                __m256 s1 = valid > 8 ? _mm256_mul_ps(dot8(q, kp + 8, d), vscale)
                                      : _mm256_set1_ps(-INFINITY);
                __m256 m0 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(vlim, lane));
                __m256 m1 = _mm256_castsi256_ps(
                    _mm256_cmpgt_epi32(vlim, _mm256_add_epi32(lane, _mm256_set1_epi32(8))));
                const __m256 ninf = _mm256_set1_ps(-INFINITY);
                s0 = _mm256_blendv_ps(ninf, s0, m0);
                s1 = _mm256_blendv_ps(ninf, s1, m1);
                float cmax = hmax256(_mm256_max_ps(s0, s1));
                float mnew = M[r] > cmax ? M[r] : cmax;
                float alpha = expf(M[r] - mnew); /* 0 on the first chunk (M = -inf) */
                __m256 vm = _mm256_set1_ps(mnew);
                __m256 p0 = _mm256_and_ps(exp256(_mm256_sub_ps(s0, vm)), m0);
                __m256 p1 = _mm256_and_ps(exp256(_mm256_sub_ps(s1, vm)), m1);
                L[r] = L[r] * alpha + hsum256(_mm256_add_ps(p0, p1));
                M[r] = mnew;
                _mm256_store_ps(p, p0);
                _mm256_store_ps(p + 8, p1);
                float *o = O + r * d;
                const __m256 va = _mm256_set1_ps(alpha);
                int64_t i = 0;
                for (; i + 32 <= d; i += 32) {
                    __m256 o0 = _mm256_mul_ps(_mm256_loadu_ps(o + i), va);
                    __m256 o1 = _mm256_mul_ps(_mm256_loadu_ps(o + i + 8), va);
                    __m256 o2 = _mm256_mul_ps(_mm256_loadu_ps(o + i + 16), va);
                    __m256 o3 = _mm256_mul_ps(_mm256_loadu_ps(o + i + 24), va);
                    for (int j = 0; j < valid; j++) {
                        __m256 pj = _mm256_set1_ps(p[j]);
                        const float *v = vp[j] + i;
                        o0 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v), o0);
                        o1 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 8), o1);
                        o2 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 16), o2);
                        o3 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 24), o3);
                    }
                    _mm256_storeu_ps(o + i, o0);
                    _mm256_storeu_ps(o + i + 8, o1);
                    _mm256_storeu_ps(o + i + 16, o2);
                    _mm256_storeu_ps(o + i + 24, o3);
                }
                for (; i < d; i += 8) {
                    __m256 o0 = _mm256_mul_ps(_mm256_loadu_ps(o + i), va);
                    for (int j = 0; j < valid; j++)
                        o0 = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), _mm256_loadu_ps(vp[j] + i), o0);
                    _mm256_storeu_ps(o + i, o0);
                }
            }
        }
    }
    for (int64_t ti = tk->t0; ti < tk->t1; ti++)
        for (int64_t g = tk->g0; g < tk->g1; g++) {
            const int64_t r = (ti - tk->t0) * ng + (g - tk->g0);
            const int64_t h = tk->hk * G + g;
            float *out = c->out + ((q_start + ti) * c->hq + h) * d;
            const __m256 inv = _mm256_set1_ps(1.f / L[r]);
            for (int64_t i = 0; i < d; i += 8)
                _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(O + r * d + i), inv));
        }
}

static void att_task_fn(void *vctx, int64_t task, int tid) {
    (void)tid;
    const att_ctx *c = vctx;
    if (c->avx2)
        att_task_avx2(c, &c->tasks[task]);
    else
        att_task_portable(c, &c->tasks[task]);
}

void shmk_attention_impl(const float *q, int64_t q_stride, const float *k_cache,
                         const float *v_cache, const int32_t *block_table, int64_t max_blocks,
                         const int32_t *seq_lens, const int32_t *qsl, int64_t b, int64_t hq,
                         int64_t hk, int64_t d, int64_t block_size, float scale, float *out) {
    const int64_t G = hq / hk;
    int64_t total_q = qsl[b] - qsl[0];
    if (total_q <= 0) return;
    /* few, short sequences (decode): one task per q head to keep both cores busy */
    int nth = shmk_threads();
    (void)nth;
    int split_heads = 0; /* sharing each K/V chunk across the G heads of a group wins */
    int64_t ntasks = 0;
    for (int64_t s = 0; s < b; s++) {
        int64_t ql = qsl[s + 1] - qsl[s];
        ntasks += shmk_cdiv(ql, ATT_QTILE) * hk * (split_heads ? G : 1);
    }
    att_task *tasks = shmk_scratch(4, (size_t)ntasks * sizeof(att_task));
    int64_t n = 0;
    /* longest (most causal work) tiles first so dynamic scheduling balances the tail */
    for (int64_t s = 0; s < b; s++) {
        int64_t ql = qsl[s + 1] - qsl[s];
        for (int64_t t1 = ql; t1 > 0; t1 -= ATT_QTILE) {
            int64_t t0 = t1 - ATT_QTILE > 0 ? t1 - ATT_QTILE : 0;
            for (int64_t h = 0; h < hk; h++) {
                if (split_heads)
                    for (int64_t g = 0; g < G; g++)
                        tasks[n++] = (att_task){(int32_t)s, (int32_t)h, (int32_t)t0, (int32_t)t1,
                                                (int32_t)g, (int32_t)g + 1};
                else
                    tasks[n++] = (att_task){(int32_t)s, (int32_t)h, (int32_t)t0, (int32_t)t1, 0,
                                            (int32_t)G};
            }
        }
    }
    att_ctx c = {q,     k_cache, v_cache, block_table, seq_lens, qsl,
                 max_blocks, hq, hk, d, block_size, scale, out, tasks,
                 shmk_path() >= SHMK_AVX2 && d % 8 == 0, q_stride};
    if (!c.avx2 && d > 1024) return; /* portable path keeps o[] on the stack */
    shmk_parallel(att_task_fn, &c, ntasks);
}

void shmk_paged_attention(const float *q, const float *k_cache, const float *v_cache,
                          const int32_t *block_table, int64_t max_blocks, const int32_t *seq_lens,
                          const int32_t *query_start_loc, int64_t b, int64_t hq, int64_t hk,
                          int64_t d, int64_t block_size, float scale, float *out) {
    shmk_attention_impl(q, hq * d, k_cache, v_cache, block_table, max_blocks, seq_lens,
                        query_start_loc, b, hq, hk, d, block_size, scale, out);
}
