/* int8 weight packing, dynamic per-row activation quantisation and the int8 GEMM.
 *
 * Math (identical on every path, so results are bit-for-bit equal across paths/threads):
 *   weights   q[j][k] = rint(w[j][k] * 127 / max_k|w[j][k]|)  in [-127, 127], sw[j] = max|w|/127
 *   activations xq[i][k] = rint(x[i][k] * 127 / max_k|x[i][k]|) in [-127, 127], sx[i] = max|x|/127
 *   acc[i][j] = sum_k xq[i][k] * q[j][k]                    (exact int32)
 *   y[i][j]   = (float)acc * (sx[i] * sw[j]) (+ bias[j]) (+ y[i][j] when accumulating)
 * rint is round-half-to-even (nearbyintf / cvtps2dq in the default MXCSR mode).
 *
 * Packed layout: block b holds channels 16b..16b+15; inside it, for each group g of 4
 * consecutive k, 64 bytes = 16 channels x 4 k: byte (b, g, c, t) = q[16b+c][4g+t].  One block is a
 * contiguous stream of kp*16 bytes, one zmm (or two ymm) per k-group.  Padding channels/k are 0.
 *
 * AVX512-VNNI: vpdpbusd needs u8 x s8, so activations go in as u = xq + 128 and the kernel
 *   subtracts 128 * sum_k q[j][k] (the packed `sums`).  No saturation: int32 accumulation.
 * AVX2: vpmaddubsw (u8 x s8 -> saturating s16 pair sums) is made exact with the sign trick:
 *   |xq| * (q * sign(xq)); each pair sum is <= 2*127*127 = 32258 < 32767, then vpmaddwd by 1
 *   widens to int32.  Exact as long as both operands stay within [-127, 127].
 * int32 overflow needs k > 2^31 / 127^2 ~ 133000 (VNNI: k > 66000), far above any model here. */
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

#define AVX2_FN __attribute__((target("avx2,fma")))
#define VNNI_FN __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
#define INLINE static inline __attribute__((always_inline))
#define PF_BYTES 2048 /* software prefetch distance in the weight stream */

/* ------------------------------------------------------------------ dispatch */
static int g_path = -1;

int shmk_best_path(void) {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
        return SHMK_VNNI;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return SHMK_AVX2;
    return SHMK_PORTABLE;
}

int shmk_path(void) {
    if (g_path < 0) {
        int best = shmk_best_path();
        const char *env = getenv("SHMK_PATH");
        g_path = best;
        if (env) {
            int want = !strcmp(env, "portable") ? SHMK_PORTABLE
                       : !strcmp(env, "avx2")   ? SHMK_AVX2
                       : !strcmp(env, "vnni")   ? SHMK_VNNI
                                                : best;
            if (want <= best) g_path = want;
        }
    }
    return g_path;
}

int shmk_get_path(void) { return shmk_path(); }

int shmk_set_path(int path) {
    if (path < 0 || path > shmk_best_path()) return -1;
    g_path = path;
    return 0;
}

/* ------------------------------------------------------------------ packing */
int64_t shmk_padded_k(int64_t k) { return shmk_cdiv(k, SHMK_KG) * SHMK_KG; }

size_t shmk_packed_bytes(int64_t n, int64_t k) {
    return (size_t)(shmk_cdiv(n, SHMK_NB) * SHMK_NB) * (size_t)shmk_padded_k(k);
}

static inline int8_t *packed_at(int8_t *p, int64_t kp, int64_t j, int64_t kk) {
    return p + ((j / SHMK_NB) * (kp / SHMK_KG) + kk / SHMK_KG) * (SHMK_NB * SHMK_KG) +
           (j % SHMK_NB) * SHMK_KG + kk % SHMK_KG;
}

static inline int8_t quant1(float v, float inv) {
    float r = nearbyintf(v * inv);
    if (r > 127.f) r = 127.f;
    if (r < -127.f) r = -127.f;
    return (int8_t)r;
}

typedef struct {
    const float *w;
    int64_t n, k, kp;
    int8_t *packed;
    float *scales;
    int32_t *sums;
} pack_ctx;

static void pack_task(void *vctx, int64_t blk, int tid) {
    (void)tid;
    pack_ctx *c = vctx;
    for (int64_t j = blk * SHMK_NB; j < (blk + 1) * SHMK_NB; j++) {
        if (j >= c->n) {
            c->scales[j] = 0.f;
            c->sums[j] = 0;
            for (int64_t kk = 0; kk < c->kp; kk++) *packed_at(c->packed, c->kp, j, kk) = 0;
            continue;
        }
        const float *row = c->w + j * c->k;
        float amax = 0.f;
        for (int64_t kk = 0; kk < c->k; kk++) amax = fmaxf(amax, fabsf(row[kk]));
        float inv = amax > 0.f ? 127.f / amax : 0.f;
        int32_t sum = 0;
        for (int64_t kk = 0; kk < c->kp; kk++) {
            int8_t q = kk < c->k ? quant1(row[kk], inv) : 0;
            *packed_at(c->packed, c->kp, j, kk) = q;
            sum += q;
        }
        c->scales[j] = amax / 127.f;
        c->sums[j] = sum;
    }
}

void shmk_pack_weights(const float *w, int64_t n, int64_t k, int8_t *packed, float *scales,
                       int32_t *sums) {
    pack_ctx c = {w, n, k, shmk_padded_k(k), packed, scales, sums};
    shmk_parallel(pack_task, &c, shmk_cdiv(n, SHMK_NB));
}

void shmk_unpack_weights(const int8_t *packed, int64_t n, int64_t k, int8_t *out) {
    int64_t kp = shmk_padded_k(k);
    for (int64_t j = 0; j < n; j++)
        for (int64_t kk = 0; kk < k; kk++) out[j * k + kk] = *packed_at((int8_t *)packed, kp, j, kk);
}

/* ------------------------------------------------------------------ activation quantisation */
static void quant_row_portable(const float *x, int64_t k, int64_t kp, int8_t *q, float *s) {
    float amax = 0.f;
    for (int64_t i = 0; i < k; i++) amax = fmaxf(amax, fabsf(x[i]));
    float inv = amax > 0.f ? 127.f / amax : 0.f;
    for (int64_t i = 0; i < k; i++) q[i] = quant1(x[i], inv);
    for (int64_t i = k; i < kp; i++) q[i] = 0;
    *s = amax / 127.f;
}

AVX2_FN static void quant_row_avx2(const float *x, int64_t k, int64_t kp, int8_t *q, float *s) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 vmax = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= k; i += 8) vmax = _mm256_max_ps(vmax, _mm256_and_ps(_mm256_loadu_ps(x + i), absmask));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    float amax = _mm_cvtss_f32(m4);
    for (; i < k; i++) amax = fmaxf(amax, fabsf(x[i]));
    float inv = amax > 0.f ? 127.f / amax : 0.f;
    const __m256 vinv = _mm256_set1_ps(inv);
    const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
    const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (i = 0; i + 32 <= k; i += 32) {
        __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i), vinv));
        __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8), vinv));
        __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 16), vinv));
        __m256i d = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 24), vinv));
        a = _mm256_min_epi32(_mm256_max_epi32(a, lo), hi);
        b = _mm256_min_epi32(_mm256_max_epi32(b, lo), hi);
        c = _mm256_min_epi32(_mm256_max_epi32(c, lo), hi);
        d = _mm256_min_epi32(_mm256_max_epi32(d, lo), hi);
        /* packs work per 128-bit lane: fix the dword order at the end */
        __m256i ab = _mm256_packs_epi32(a, b), cd = _mm256_packs_epi32(c, d);
        __m256i abcd = _mm256_packs_epi16(ab, cd);
        _mm256_storeu_si256((__m256i *)(q + i), _mm256_permutevar8x32_epi32(abcd, perm));
    }
    for (; i < k; i++) q[i] = quant1(x[i], inv);
    for (; i < kp; i++) q[i] = 0;
    *s = amax / 127.f;
}

/* aux operand of the SIMD kernels: |xq| (AVX2) or xq + 128 (VNNI) */
static void make_aux(int path, const int8_t *q, int64_t kp, uint8_t *aux) {
    if (path == SHMK_AVX2)
        for (int64_t i = 0; i < kp; i++) aux[i] = (uint8_t)(q[i] < 0 ? -q[i] : q[i]);
    else if (path == SHMK_VNNI)
        for (int64_t i = 0; i < kp; i++) aux[i] = (uint8_t)(q[i] ^ 0x80);
}

static void quant_row(int path, const float *x, int64_t k, int64_t kp, int8_t *q, float *s) {
    if (path >= SHMK_AVX2)
        quant_row_avx2(x, k, kp, q, s);
    else
        quant_row_portable(x, k, kp, q, s);
}

void shmk_quantize_rows(const float *x, int64_t m, int64_t k, int8_t *xq, float *scales) {
    int path = shmk_path();
    int64_t kp = shmk_padded_k(k);
    for (int64_t i = 0; i < m; i++) quant_row(path, x + i * k, k, kp, xq + i * kp, scales + i);
}

/* ------------------------------------------------------------------ GEMM */
typedef struct {
    int path;
    const int8_t *xq;   /* [m][kp] */
    const uint8_t *xa;  /* [m][kp] aux */
    const float *sx;    /* [m] (NULL in raw mode) */
    int64_t m, k, kp, n, nb;
    const int8_t *packed;
    const float *ws;
    const int32_t *wsums;
    const float *bias;
    float *y;           /* float mode */
    int32_t *iacc;      /* raw mode */
    int accumulate;
    int64_t nb_per_task, m_per_task, mtasks;
    /* quantisation stage */
    const float *x;
    int8_t *xq_w;
    uint8_t *xa_w;
    float *sx_w;
    int64_t rows_per_qtask;
} gemm_ctx;

/* Scalar epilogue shared by every path for one output element. */
static inline void store_one(const gemm_ctx *c, int64_t i, int64_t j, int32_t acc) {
    if (c->iacc) {
        c->iacc[i * c->n + j] = acc;
        return;
    }
    float v = (float)acc * (c->sx[i] * c->ws[j]);
    if (c->bias) v = v + c->bias[j];
    float *o = c->y + i * c->n + j;
    *o = c->accumulate ? *o + v : v;
}

static void tile_portable(const gemm_ctx *c, int64_t blk, int64_t i0, int64_t i1) {
    const int8_t *wb = c->packed + blk * SHMK_NB * c->kp;
    int64_t ncols = c->n - blk * SHMK_NB < SHMK_NB ? c->n - blk * SHMK_NB : SHMK_NB;
    for (int64_t i = i0; i < i1; i++) {
        int32_t acc[SHMK_NB] = {0};
        const int8_t *x = c->xq + i * c->kp;
        for (int64_t g = 0; g < c->kp / SHMK_KG; g++) {
            const int8_t *w = wb + g * SHMK_NB * SHMK_KG;
            const int8_t *xg = x + g * SHMK_KG;
            for (int ch = 0; ch < SHMK_NB; ch++)
                for (int t = 0; t < SHMK_KG; t++) acc[ch] += (int32_t)xg[t] * w[ch * SHMK_KG + t];
        }
        for (int ch = 0; ch < ncols; ch++) store_one(c, i, blk * SHMK_NB + ch, acc[ch]);
    }
}

/* --- AVX2: 4 (or 1) rows x 16 channels, two ymm accumulators per row.  Accumulators are named
 * variables, not an array: GCC otherwise keeps them on the stack and the loop-carried
 * store->load chain halves the throughput. --- */
#define AVX2_MR 4

/* acc (+)= |x| * (w * sign(x)) for one row and both 8-channel halves of the k-group */
#define AVX2_ROW(r, a0, a1)                                                                   \
    do {                                                                                      \
        int32_t sv_, av_;                                                                     \
        memcpy(&sv_, xq + (r) * kp + g * 4, 4);                                               \
        memcpy(&av_, xa + (r) * kp + g * 4, 4);                                               \
        const __m256i xs_ = _mm256_set1_epi32(sv_), xb_ = _mm256_set1_epi32(av_);             \
        a0 = _mm256_add_epi32(                                                                \
            a0, _mm256_madd_epi16(_mm256_maddubs_epi16(xb_, _mm256_sign_epi8(w0, xs_)), ones)); \
        a1 = _mm256_add_epi32(                                                                \
            a1, _mm256_madd_epi16(_mm256_maddubs_epi16(xb_, _mm256_sign_epi8(w1, xs_)), ones)); \
    } while (0)

/* float / raw epilogue of an mr x 16 tile of int32 accumulators */
AVX2_FN static void avx2_epilogue(const gemm_ctx *c, int64_t blk, int64_t i0, int mr,
                                  const int32_t *tile) {
    const int64_t j0 = blk * SHMK_NB;
    const int full = c->n - j0 >= SHMK_NB;
    for (int r = 0; r < mr; r++) {
        const int64_t i = i0 + r;
        const int32_t *t = tile + r * 16;
        if (!full) {
            for (int64_t ch = 0; ch < c->n - j0; ch++) {
                if (c->iacc)
                    c->iacc[i * c->n + j0 + ch] = t[ch];
                else
                    store_one(c, i, j0 + ch, t[ch]);
            }
            continue;
        }
        if (c->iacc) {
            memcpy(c->iacc + i * c->n + j0, t, 16 * sizeof(int32_t));
            continue;
        }
        const __m256 sx = _mm256_set1_ps(c->sx[i]);
        float *y = c->y + i * c->n + j0;
        for (int h = 0; h < 2; h++) {
            __m256 s = _mm256_mul_ps(sx, _mm256_loadu_ps(c->ws + j0 + 8 * h));
            __m256i a = _mm256_loadu_si256((const __m256i *)(t + 8 * h));
            __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(a), s);
            if (c->bias) v = _mm256_add_ps(v, _mm256_loadu_ps(c->bias + j0 + 8 * h));
            if (c->accumulate) v = _mm256_add_ps(_mm256_loadu_ps(y + 8 * h), v);
            _mm256_storeu_ps(y + 8 * h, v);
        }
    }
}

AVX2_FN static void avx2_kernel4(const gemm_ctx *c, int64_t blk, int64_t i0) {
    const int8_t *wb = c->packed + blk * SHMK_NB * c->kp;
    const int64_t ng = c->kp / SHMK_KG, kp = c->kp;
    const int8_t *xq = c->xq + i0 * kp;
    const uint8_t *xa = c->xa + i0 * kp;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i a00 = _mm256_setzero_si256(), a01 = a00, a10 = a00, a11 = a00;
    __m256i a20 = a00, a21 = a00, a30 = a00, a31 = a00;
    for (int64_t g = 0; g < ng; g++) {
        const int8_t *w = wb + g * 64;
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)w);
        const __m256i w1 = _mm256_loadu_si256((const __m256i *)(w + 32));
        AVX2_ROW(0, a00, a01);
        AVX2_ROW(1, a10, a11);
        AVX2_ROW(2, a20, a21);
        AVX2_ROW(3, a30, a31);
    }
    int32_t tile[4 * 16] __attribute__((aligned(32)));
    _mm256_store_si256((__m256i *)(tile + 0), a00);
    _mm256_store_si256((__m256i *)(tile + 8), a01);
    _mm256_store_si256((__m256i *)(tile + 16), a10);
    _mm256_store_si256((__m256i *)(tile + 24), a11);
    _mm256_store_si256((__m256i *)(tile + 32), a20);
    _mm256_store_si256((__m256i *)(tile + 40), a21);
    _mm256_store_si256((__m256i *)(tile + 48), a30);
    _mm256_store_si256((__m256i *)(tile + 56), a31);
    avx2_epilogue(c, blk, i0, 4, tile);
}

/* one row: the M = 1 decode case, streaming the weights (prefetched ahead) */
AVX2_FN static void avx2_kernel1(const gemm_ctx *c, int64_t blk, int64_t i0) {
    const int8_t *wb = c->packed + blk * SHMK_NB * c->kp;
    const int64_t ng = c->kp / SHMK_KG, kp = c->kp;
    const int8_t *xq = c->xq + i0 * kp;
    const uint8_t *xa = c->xa + i0 * kp;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, b0 = a0, b1 = a0;
    int64_t g = 0;
    for (; g + 2 <= ng; g += 2) { /* two independent accumulator pairs for ILP */
        const int8_t *w = wb + g * 64;
        _mm_prefetch((const char *)w + PF_BYTES, _MM_HINT_T0);
        _mm_prefetch((const char *)w + PF_BYTES + 64, _MM_HINT_T0);
        __m256i w0 = _mm256_loadu_si256((const __m256i *)w);
        __m256i w1 = _mm256_loadu_si256((const __m256i *)(w + 32));
        AVX2_ROW(0, a0, a1);
        g++;
        w0 = _mm256_loadu_si256((const __m256i *)(w + 64));
        w1 = _mm256_loadu_si256((const __m256i *)(w + 96));
        AVX2_ROW(0, b0, b1);
        g--;
    }
    for (; g < ng; g++) {
        const int8_t *w = wb + g * 64;
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)w);
        const __m256i w1 = _mm256_loadu_si256((const __m256i *)(w + 32));
        AVX2_ROW(0, a0, a1);
    }
    int32_t tile[16] __attribute__((aligned(32)));
    _mm256_store_si256((__m256i *)tile, _mm256_add_epi32(a0, b0));
    _mm256_store_si256((__m256i *)(tile + 8), _mm256_add_epi32(a1, b1));
    avx2_epilogue(c, blk, i0, 1, tile);
}

AVX2_FN static void tile_avx2(const gemm_ctx *c, int64_t blk, int64_t i0, int64_t i1) {
    int64_t i = i0;
    for (; i + AVX2_MR <= i1; i += AVX2_MR) avx2_kernel4(c, blk, i);
    for (; i < i1; i++) avx2_kernel1(c, blk, i);
}

/* --- AVX512-VNNI: MR rows x 16 channels, one zmm accumulator per row --- */
#define VNNI_MR 8
INLINE VNNI_FN void vnni_kernel(const gemm_ctx *c, int64_t blk, int64_t i0, const int mr) {
    const int8_t *wb = c->packed + blk * SHMK_NB * c->kp;
    const int64_t ng = c->kp / SHMK_KG, kp = c->kp;
    const uint8_t *xu = c->xa + i0 * kp;
    __m512i acc[VNNI_MR];
    for (int r = 0; r < mr; r++) acc[r] = _mm512_setzero_si512();
    for (int64_t g = 0; g < ng; g++) {
        const int8_t *w = wb + g * 64;
        _mm_prefetch((const char *)w + PF_BYTES, _MM_HINT_T0);
        __m512i w0 = _mm512_loadu_si512((const void *)w);
        for (int r = 0; r < mr; r++) {
            int32_t uv;
            memcpy(&uv, xu + r * kp + g * 4, 4);
            acc[r] = _mm512_dpbusd_epi32(acc[r], _mm512_set1_epi32(uv), w0);
        }
    }
    const int64_t j0 = blk * SHMK_NB;
    const int64_t ncols = c->n - j0 < SHMK_NB ? c->n - j0 : SHMK_NB;
    const __mmask16 mask = (__mmask16)((1u << ncols) - 1u);
    /* undo the +128 offset of the activations: acc -= 128 * sum_k q[j][k] */
    const __m512i comp = _mm512_slli_epi32(_mm512_loadu_si512((const void *)(c->wsums + j0)), 7);
    for (int r = 0; r < mr; r++) {
        const int64_t i = i0 + r;
        __m512i a = _mm512_sub_epi32(acc[r], comp);
        if (c->iacc) {
            _mm512_mask_storeu_epi32(c->iacc + i * c->n + j0, mask, a);
            continue;
        }
        __m512 s = _mm512_mul_ps(_mm512_set1_ps(c->sx[i]), _mm512_loadu_ps(c->ws + j0));
        __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(a), s);
        if (c->bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, c->bias + j0));
        float *y = c->y + i * c->n + j0;
        if (c->accumulate) v = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, y), v);
        _mm512_mask_storeu_ps(y, mask, v);
    }
}

VNNI_FN static void tile_vnni(const gemm_ctx *c, int64_t blk, int64_t i0, int64_t i1) {
    int64_t i = i0;
    for (; i + VNNI_MR <= i1; i += VNNI_MR) vnni_kernel(c, blk, i, VNNI_MR);
    switch (i1 - i) {
    case 7: vnni_kernel(c, blk, i, 7); break;
    case 6: vnni_kernel(c, blk, i, 6); break;
    case 5: vnni_kernel(c, blk, i, 5); break;
    case 4: vnni_kernel(c, blk, i, 4); break;
    case 3: vnni_kernel(c, blk, i, 3); break;
    case 2: vnni_kernel(c, blk, i, 2); break;
    case 1: vnni_kernel(c, blk, i, 1); break;
    default: break;
    }
}

static void gemm_task(void *vctx, int64_t task, int tid) {
    (void)tid;
    const gemm_ctx *c = vctx;
    int64_t mt = task % c->mtasks, nt = task / c->mtasks;
    int64_t b0 = nt * c->nb_per_task, b1 = b0 + c->nb_per_task;
    int64_t i0 = mt * c->m_per_task, i1 = i0 + c->m_per_task;
    if (b1 > c->nb) b1 = c->nb;
    if (i1 > c->m) i1 = c->m;
    for (int64_t b = b0; b < b1; b++) {
        if (c->path == SHMK_VNNI)
            tile_vnni(c, b, i0, i1);
        else if (c->path == SHMK_AVX2)
            tile_avx2(c, b, i0, i1);
        else
            tile_portable(c, b, i0, i1);
    }
}

static void quant_task(void *vctx, int64_t task, int tid) {
    (void)tid;
    const gemm_ctx *c = vctx;
    int64_t i0 = task * c->rows_per_qtask, i1 = i0 + c->rows_per_qtask;
    if (i1 > c->m) i1 = c->m;
    for (int64_t i = i0; i < i1; i++) {
        if (c->x) quant_row(c->path, c->x + i * c->k, c->k, c->kp, c->xq_w + i * c->kp, c->sx_w + i);
        make_aux(c->path, c->xq_w + i * c->kp, c->kp, c->xa_w + i * c->kp);
    }
}

/* Split the work: N only for small M (each thread streams its own weight range once), M x N
 * tiles of up to 64 rows for large M (a 16-channel weight block stays in L1 across the rows). */
static void plan_and_run(gemm_ctx *c) {
    int nth = shmk_threads();
    c->nb = shmk_cdiv(c->n, SHMK_NB);
    if (c->m <= 16) {
        c->m_per_task = c->m;
        c->mtasks = 1;
    } else {
        c->m_per_task = 64;
        c->mtasks = shmk_cdiv(c->m, 64);
    }
    int64_t nchunks = shmk_cdiv(8 * nth, c->mtasks);
    if (nchunks < 1) nchunks = 1;
    if (nth == 1) nchunks = 1;
    c->nb_per_task = shmk_cdiv(c->nb, nchunks);
    int64_t ntasks = shmk_cdiv(c->nb, c->nb_per_task) * c->mtasks;
    shmk_parallel(gemm_task, c, ntasks);
}

/* Quantise x (or take xq as given) into thread-local scratch and prepare the aux operand. */
static void prepare(gemm_ctx *c, const float *x, const int8_t *xq_given) {
    int64_t m = c->m, kp = c->kp;
    int8_t *xq = xq_given ? (int8_t *)xq_given : shmk_scratch(0, (size_t)(m * kp));
    uint8_t *xa = shmk_scratch(1, (size_t)(m * kp));
    float *sx = shmk_scratch(2, (size_t)m * sizeof(float));
    c->x = xq_given ? NULL : x;
    c->xq_w = xq;
    c->xa_w = xa;
    c->sx_w = sx;
    c->xq = xq;
    c->xa = xa;
    c->sx = sx;
    if (!c->x && c->path == SHMK_PORTABLE) return;
    if (m <= 8) {
        c->rows_per_qtask = m;
        quant_task(c, 0, 0);
    } else {
        c->rows_per_qtask = shmk_cdiv(m, 4 * shmk_threads());
        shmk_parallel(quant_task, c, shmk_cdiv(m, c->rows_per_qtask));
    }
}

void shmk_gemm_s8_acc(const int8_t *xq, int64_t m, const int8_t *packed, const int32_t *sums,
                      int64_t n, int64_t k, int32_t *acc) {
    gemm_ctx c = {0};
    c.path = shmk_path();
    c.m = m, c.k = k, c.kp = shmk_padded_k(k), c.n = n;
    c.packed = packed, c.wsums = sums, c.iacc = acc;
    prepare(&c, NULL, xq);
    plan_and_run(&c);
}

void shmk_linear_impl(const float *x, int64_t m, int64_t k, const int8_t *packed,
                      const float *wscales, const int32_t *wsums, const float *bias, int64_t n,
                      float *y, int accumulate) {
    if (m <= 0 || n <= 0) return;
    gemm_ctx c = {0};
    c.path = shmk_path();
    c.m = m, c.k = k, c.kp = shmk_padded_k(k), c.n = n;
    c.packed = packed, c.ws = wscales, c.wsums = wsums, c.bias = bias, c.y = y;
    c.accumulate = accumulate;
    prepare(&c, x, NULL);
    plan_and_run(&c);
}

void shmk_linear(const float *x, int64_t m, int64_t k, const int8_t *packed, const float *wscales,
                 const int32_t *wsums, const float *bias, int64_t n, float *y) {
    shmk_linear_impl(x, m, k, packed, wscales, wsums, bias, n, y, 0);
}
