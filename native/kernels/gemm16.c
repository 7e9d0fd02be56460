/* W8 (group-32) x A16 (per-token) GEMM: the model's linear layers and LM head.
 *
 * Math (identical on every path, so results agree bit for bit across paths and thread counts):
 *   weights, once at load, per output channel j and group g of 32 consecutive k:
 *     s[j][g] = fp16(max|w| / 127 * 2^E) * 2^-E   (E per matrix: fp16 keeps the scales compact
 *               without losing range; 2^-E is `scale_mult`, exact)
 *     q[j][k] = rint(w[j][k] / s[j][g]) in [-127, 127]
 *   activations, per call, per row i: sx[i] = max|x| / 32767, xq = rint(x * (32767 / max|x|))
 *     in [-32767, 32767] (int16); NaN elements are ignored by the max and quantise to 0, and a
 *     row with max|x| < 2^-100 (all zeros, NaN only, or tiny) is all zeros with sx = 0
 *   dot[i][j][g] = sum_{k in g} xq[i][k] * q[j][k]        exact int32 (|.| <= 32*32767*127)
 *   acc = 0; for g in order: acc = fmaf((float)dot, fp16(s)[j][g], acc)
 *   y[i][j] = acc * (sx[i] * scale_mult) (+ bias[j]) (+ y[i][j] when accumulating)
 * rint is round-half-to-even (nearbyintf / cvtps2dq in the default MXCSR mode).
 *
 * Packed layout (K padded to kp = multiple of 32, N to a multiple of 16, zeros):
 *   block b = channels 16b..16b+15; group g; quad row r (k = 32g + 4r .. 32g + 4r + 3):
 *   64 bytes = 16 channels x 4 k, byte (c, t) = q[16b + c][32g + 4r + t].
 *   A block is one contiguous stream of 512 bytes per group, and a group is exactly an AMX-INT8
 *   B tile (8 rows x 64 bytes), so gemm_amx8.c loads tiles straight from the weights.  The
 *   int16 kernels widen (vpmovsxbw) quad rows as they lie, so each dword lane holds one
 *   channel's k pair, and multiply them (vpdpwssd / vpmaddwd; exact: no -32768 operands) by a
 *   broadcast of the row's four activations; a group's two lanes per channel are added in int32
 *   before the fold (AVX2: one or two rows a pass, for calls of up to 4 rows).  Larger AVX2
 *   calls instead rearrange each block into pair rows (16 channels x 2 k) once and broadcast
 *   activation pairs to tiles of 3 rows (avx2_pair_block).
 *   Scales: fp16 [nb][G][16], one vcvtph2ps per block and group.
 *
 * W4 weights (mins != NULL; w4.c packs them, api.h gives the layout and the contract) run here
 * too (never on AMX tiles): on AVX2 up to 4 rows read the nibbles in the quad-row lane layout
 * (avx2_w4_kernel, avx2_w4_rows3_kernel), from 5 each block is unpacked into the pair rows of
 * the 3-row tiles (avx2_w4_pair_block); on VNNI the int16 activations are split into byte
 * planes and meet the nibbles as they lie in vpdpbusd (tile_vnni_w4b), and only the raw group
 * dots (group_dots: tile_vnni_w4_dots) widen each nibble row into its quad rows
 * (vnni_quad_half); the minimums' sum is added before the store (avx2_mins, add_mins, the VNNI
 * kernels' own loops).  W4 weights with act8 take gemm_w4a8.c instead. */
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "vnni_tile.h"

#define AVX2_FN __attribute__((target("avx2,fma,f16c")))
#define VNNI_FN SHMK_VNNI_FN
#define INLINE static inline __attribute__((always_inline))
#define PF_DIST SHMK_PF_DIST /* software prefetch distance in a block stream (bytes) */

/* ------------------------------------------------------------------ dispatch */
static int g_path = -1;

int shmk_best_path(void) {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
        return shmk_amx_available() ? SHMK_AMX : SHMK_VNNI;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c"))
        return SHMK_AVX2;
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
                       : !strcmp(env, "amx")    ? SHMK_AMX
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

/* ------------------------------------------------------------------ sizes */
int64_t shmk_padded_k(int64_t k) { return shmk_cdiv(k, GK) * GK; }

size_t shmk_packed_bytes(int64_t n, int64_t k) {
    return (size_t)(shmk_cdiv(n, NB) * NB) * (size_t)shmk_padded_k(k);
}

size_t shmk_packed_scales(int64_t n, int64_t k) {
    return (size_t)(shmk_cdiv(n, NB) * NB) * (size_t)(shmk_padded_k(k) / GK);
}

/* ------------------------------------------------------------------ packing */
static inline int8_t *wq_at(int8_t *p, int64_t G, int64_t j, int64_t kk) {
    int64_t b = j / NB, c = j % NB, g = kk / GK, r = kk % GK;
    return p + (b * G + g) * GBYTES + (r / 4) * (4 * NB) + c * 4 + (r & 3);
}

typedef struct {
    const float *w;
    int64_t n, k, G;
    float emul; /* 2^E */
    int8_t *packed;
    uint16_t *scales;
} pack_ctx;

/* One channel's group: its 32 weights (zeros past k) -> fp16 scale and 32 int8, which land in
 * the group's 8 quad rows at 4 bytes each (channel c's bytes 4c .. 4c + 3 of every row).
 * NOTE: written over a local copy in fixed-length loops so GCC vectorises the division and
 * rounding (the per-element wq_at stores and calls had cost ~8 ns a weight). */
static void pack_group(const float *w, int64_t len, float emul, int8_t *rows, uint16_t *scale) {
    float v[GK], amax = 0.f;
    for (int t = 0; t < GK; t++) v[t] = t < len ? w[t] : 0.f;
    for (int t = 0; t < GK; t++) amax = shmk_max_abs(amax, v[t]);
    const uint16_t h = shmk_f2h(amax / 127.f * emul);
    *scale = h;
    const float s = shmk_h2f(h) / emul;
    int8_t q[GK] = {0};
    if (s > 0.f) {
        for (int t = 0; t < GK; t++) {
            /* |w| <= amax and s >= amax / 127 (1 - 2^-11): |w / s| < 128, well in
             * rint_small's range.  A NaN weight packs as 0 (no NaN -> int cast). */
            const float r = shmk_rint_small(v[t] / s);
            q[t] = r == r ? (int8_t)(r > 127.f ? 127.f : r < -127.f ? -127.f : r) : 0;
        }
    }
    for (int r4 = 0; r4 < GK / 4; r4++) memcpy(rows + r4 * 4 * NB, q + 4 * r4, 4);
}

static void pack_task(void *vctx, int64_t blk, int tid) {
    (void)tid;
    const pack_ctx *c = vctx;
    for (int64_t j = blk * NB; j < (blk + 1) * NB; j++) {
        for (int64_t g = 0; g < c->G; g++) {
            const int64_t k0 = g * GK, left = c->k - k0;
            const int64_t len = j < c->n ? (left < GK ? left : GK) : 0;
            pack_group(c->w + (j < c->n ? j * c->k + k0 : 0), len, c->emul,
                       wq_at(c->packed, c->G, j, k0),
                       c->scales + (blk * c->G + g) * NB + (j % NB));
        }
    }
}

float shmk_weights_amax(const float *w, int64_t numel) {
    float amax = 0.f;
    for (int64_t i = 0; i < numel; i++) amax = shmk_max_abs(amax, w[i]);
    return amax;
}

float shmk_pack_weights(const float *w, int64_t n, int64_t k, int8_t *packed, uint16_t *scales) {
    return shmk_pack_rows(w, n, k, shmk_weights_amax(w, n * k), packed, scales);
}

float shmk_pack_rows(const float *w, int64_t n, int64_t k, float amax, int8_t *packed,
                     uint16_t *scales) {
    /* largest group scale lands in [2^14, 2^15): ~29 binades of fp16 normals below it */
    int e = 0;
    if (amax > 0.f) frexpf(amax / 127.f, &e); /* amax/127 in [2^(e-1), 2^e) */
    int E = 15 - e;
    pack_ctx c = {w, n, k, shmk_padded_k(k) / GK, ldexpf(1.f, E), packed, scales};
    shmk_parallel(pack_task, &c, shmk_cdiv(n, NB));
    return ldexpf(1.f, -E);
}

void shmk_unpack_weights(const int8_t *packed, const uint16_t *scales, float scale_mult, int64_t n,
                         int64_t k, int8_t *q, float *gscales) {
    int64_t G = shmk_padded_k(k) / GK;
    for (int64_t j = 0; j < n; j++) {
        for (int64_t kk = 0; kk < k; kk++) q[j * k + kk] = *wq_at((int8_t *)packed, G, j, kk);
        for (int64_t g = 0; g < G; g++)
            gscales[j * G + g] = shmk_h2f(scales[((j / NB) * G + g) * NB + j % NB]) * scale_mult;
    }
}

/* out[i] = output channel ids[i] of w dequantised: q * (fp16 scale * scale_mult), the same
 * floats as shmk_unpack_weights' q and gscales multiplied.  The model's embedding lookup reads
 * the packed LM head (tied) or a packed embedding this way, so no unpacked copy (31 MB for
 * SmolLM2) stays resident.  In the packed layout channel j's 32 k of group g are 8 runs of 4
 * bytes, 64 bytes apart. */
void shmk_dequant_channels(const shmk_linear_t *w, const int64_t *ids, int64_t t, float *out) {
    const int64_t k = w->k, G = shmk_padded_k(k) / GK;
    for (int64_t i = 0; i < t; i++) {
        const int64_t j = ids[i], b = j / NB, c = j % NB;
        const int8_t *blk = w->packed + b * G * GBYTES + c * 4;
        const uint16_t *sc = w->scales + b * G * NB + c;
        float *y = out + i * k;
        for (int64_t g = 0; g < G; g++) {
            const float s = shmk_h2f(sc[g * NB]) * w->scale_mult;
            const int8_t *q = blk + g * GBYTES;
            const int64_t len = k - g * GK < GK ? k - g * GK : GK;
            for (int64_t kk = 0; kk < len; kk++)
                y[g * GK + kk] = (float)q[(kk / 4) * (4 * NB) + (kk & 3)] * s;
        }
    }
}

/* ------------------------------------------------------------------ activation quantisation */
/* A row whose max|x| is below this (or NaN-only, or all zeros) quantises to zeros with scale 0.
 * NOTE: 32767 / amax overflows to +inf for amax < 32767 / FLT_MAX ~ 1.8e-34, and inf * x is
 * +-inf (NaN for x = 0): cvtps2dq turned those into INT_MIN, clamped to -32767 (signs flipped,
 * zeros too), and the portable cast of NaN to int16 was undefined.  2^-100 leaves
 * 32767 / amax far below FLT_MAX; such a row is ~1e-30 of any real activation's scale. */
#define QUANT_MIN_AMAX 0x1p-100f

/* NaN elements quantise to 0 (their product with inv is NaN): the same on every path, and no
 * float -> int cast of a NaN (undefined behaviour). */
static inline int16_t quant16(float v, float inv) {
    float r = nearbyintf(v * inv);
    if (r != r) return 0;
    if (r > 32767.f) r = 32767.f;
    if (r < -32767.f) r = -32767.f;
    return (int16_t)r;
}

static void quant_zero_row(int64_t kp, int16_t *q, float *s) {
    memset(q, 0, (size_t)kp * sizeof(int16_t));
    *s = 0.f;
}

/* NOTE: fmaxf ignores a NaN operand, so NaN elements never set amax (the AVX2 reduction below
 * keeps the same rule); an infinite element makes amax inf, inv 0 and every element 0 (inf * 0
 * is NaN -> 0) with scale inf, on both paths alike. */
static void quant_row_portable(const float *x, int64_t k, int64_t kp, int16_t *q, float *s) {
    float amax = 0.f;
    for (int64_t i = 0; i < k; i++) amax = fmaxf(amax, fabsf(x[i]));
    if (!(amax >= QUANT_MIN_AMAX)) {
        quant_zero_row(kp, q, s);
        return;
    }
    float inv = 32767.f / amax;
    for (int64_t i = 0; i < k; i++) q[i] = quant16(x[i], inv);
    for (int64_t i = k; i < kp; i++) q[i] = 0;
    *s = amax / 32767.f;
}

AVX2_FN static void quant_row_avx2(const float *x, int64_t k, int64_t kp, int16_t *q, float *s) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 vmax = _mm256_setzero_ps();
    int64_t i = 0;
    /* NOTE: maxps returns its SECOND operand when either is NaN: with the running max second a
     * NaN element is skipped (as fmaxf does), and vmax itself never holds a NaN */
    for (; i + 8 <= k; i += 8)
        vmax = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + i), absmask), vmax);
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    float amax = _mm_cvtss_f32(m4);
    for (; i < k; i++) amax = fmaxf(amax, fabsf(x[i]));
    if (!(amax >= QUANT_MIN_AMAX)) {
        quant_zero_row(kp, q, s);
        return;
    }
    float inv = 32767.f / amax;
    const __m256 vinv = _mm256_set1_ps(inv);
    const __m256i nan_q = _mm256_set1_epi32(INT32_MIN);
    for (i = 0; i + 16 <= k; i += 16) {
        /* NOTE: |x| <= amax, so |x * inv| <= 32767 (1 + 2^-24)^2 < 32767.5 rounds into
         * [-32767, 32767]: cvtps2dq's INT_MIN ("out of range") can only be a NaN lane, which
         * becomes 0 (quant16's rule); quant16's clamps never fire.  A NaN test on the floats
         * plus the int clamp that used to be here cost 20 % more (512 x 1536: 117 -> 141 us). */
        __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i), vinv));
        __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8), vinv));
        a = _mm256_andnot_si256(_mm256_cmpeq_epi32(a, nan_q), a);
        b = _mm256_andnot_si256(_mm256_cmpeq_epi32(b, nan_q), b);
        /* packs works per 128-bit lane: [a0-3 b0-3 a4-7 b4-7] -> qword order 0 2 1 3 */
        __m256i ab = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
        _mm256_storeu_si256((__m256i *)(q + i), ab);
    }
    for (; i < k; i++) q[i] = quant16(x[i], inv);
    for (; i < kp; i++) q[i] = 0;
    *s = amax / 32767.f;
}

static void quant_row(int path, const float *x, int64_t k, int64_t kp, int16_t *q, float *s) {
    if (path >= SHMK_AVX2)
        quant_row_avx2(x, k, kp, q, s);
    else
        quant_row_portable(x, k, kp, q, s);
}

void shmk_quant_row(const float *x, int64_t k, int64_t kp, int16_t *q, float *s) {
    quant_row(shmk_path(), x, k, kp, q, s);
}

void shmk_quantize_rows(const float *x, int64_t m, int64_t k, int16_t *xq, float *scales) {
    int path = shmk_path();
    int64_t kp = shmk_padded_k(k);
    for (int64_t i = 0; i < m; i++) quant_row(path, x + i * k, k, kp, xq + i * kp, scales + i);
}

/* ------------------------------------------------------------------ GEMM */
typedef struct {
    int path;
    const int16_t *xq; /* [m][kp] */
    const float *sx;   /* [m] */
    int64_t m, k, kp, G, n, nb;
    const int8_t *packed;
    const uint16_t *scales;
    const uint16_t *mins; /* W4 weights (w4.c): packed holds nibbles */
    const float *xsum;    /* W4: [m][G] each group's sum of the row's xq (exact) */
    /* W4 on path vnni: xq's bytes as planes, xq = 256 hi + lo (vnni_w4b_kernel) */
    const uint8_t *xlo; /* [m][kp] */
    const int8_t *xhi;  /* [m][kp] */
    float mult;
    const float *bias;
    float *y;          /* float mode */
    int32_t *dots;     /* raw mode: [m][n][G] */
    int accumulate;
    int64_t units_per_task, m_per_task, mtasks, nunits;
    /* quantisation stage */
    const float *x;
    int16_t *xq_w;
    float *sx_w;
    float *xsum_w;
    uint8_t *xlo_w;
    int8_t *xhi_w;
    int64_t rows_per_qtask;
} gemm_ctx;

/* raw mode: scatter the 16 dots of (row i, block blk, group g) */
static inline void store_dots(const gemm_ctx *c, int64_t i, int64_t blk, int64_t g,
                              const int32_t *d) {
    for (int64_t ch = 0; ch < NB && blk * NB + ch < c->n; ch++)
        c->dots[(i * c->n + blk * NB + ch) * c->G + g] = d[ch];
}

/* W4: the dots' sum acc continued over the groups (in order) with row i's activation sums
 * times channel j's minimums, before the scaling (avx2_mins: the same) */
static inline float add_mins(const gemm_ctx *c, int64_t i, int64_t j, float acc) {
    const uint16_t *mn = c->mins + (j / NB) * c->G * NB + j % NB;
    const float *xs = c->xsum + i * c->G;
    for (int64_t g = 0; g < c->G; g++) acc = fmaf(xs[g], shmk_h2f_signed(mn[g * NB]), acc);
    return acc;
}

/* scalar epilogue shared by the paths for one output element */
static inline void store_one(const gemm_ctx *c, int64_t i, int64_t j, float acc) {
    shmk_store_one(c->y, c->n, c->bias, c->accumulate, i, j, acc * (c->sx[i] * c->mult));
}

/* weight (channel ch, k kk) of a block-group: W8 quad rows, or W4 nibble rows (w4.c) */
static inline int32_t weight_at(const gemm_ctx *c, const int8_t *w, int ch, int kk) {
    if (!c->mins) return w[(kk / 4) * 4 * NB + 4 * ch + (kk & 3)];
    /* quad row r = kk / 4 lies in nibble row r % 4, in its high nibbles from r = 4 */
    const uint8_t b = (uint8_t)w[(kk / 4 % 4) * 4 * NB + 4 * ch + (kk & 3)];
    return kk >= GK / 2 ? b >> 4 : b & 15;
}

/* store_one after the W4 minimums' terms (add_mins) */
static inline void store_w4(const gemm_ctx *c, int64_t i, int64_t j, float acc) {
    store_one(c, i, j, c->mins ? add_mins(c, i, j, acc) : acc);
}

static void tile_portable(const gemm_ctx *c, int64_t blk, int64_t i0, int64_t i1) {
    const int64_t gbytes = c->mins ? GBYTES / 2 : GBYTES;
    const int8_t *wb = c->packed + blk * c->G * gbytes;
    for (int64_t i = i0; i < i1; i++) {
        const int16_t *x = c->xq + i * c->kp;
        float acc[NB] = {0};
        for (int64_t g = 0; g < c->G; g++) {
            int32_t d[NB] = {0};
            const int8_t *w = wb + g * gbytes;
            const int16_t *xg = x + g * GK;
            for (int kk = 0; kk < GK; kk++)
                for (int ch = 0; ch < NB; ch++) d[ch] += (int32_t)xg[kk] * weight_at(c, w, ch, kk);
            if (c->dots) {
                store_dots(c, i, blk, g, d);
                continue;
            }
            const uint16_t *s = c->scales + (blk * c->G + g) * NB;
            for (int ch = 0; ch < NB; ch++)
                acc[ch] = fmaf((float)d[ch], shmk_h2f_signed(s[ch]), acc[ch]);
        }
        if (c->dots) continue;
        for (int64_t ch = 0; ch < NB && blk * NB + ch < c->n; ch++)
            store_w4(c, i, blk * NB + ch, acc[ch]);
    }
}

/* --- AVX2: MR (<= 3) rows x 16 channels (two ymm halves).  Accumulators are named variables:
 * with arrays GCC keeps the products on the stack. --- */
#define AVX2_MR 3
/* NOTE: up to this many rows read the quad rows as they lie, two rows a pass, instead of a
 * pair-row copy of each block: decode b2 +40 %, b4 +35 % (medians of four alternated pairs; the
 * copy had made b2 slower than b1).  At 6-8 rows the 3-row tiles, copy included, are as fast or
 * faster (b6 339 vs 302, b8 310 vs 304 tok/s) at the same instruction count. */
#define AVX2_QUAD_MAX_M 4

INLINE AVX2_FN void avx2_store(const gemm_ctx *c, int64_t blk, int64_t i, __m256 f0, __m256 f1) {
    const int64_t j0 = blk * NB;
    if (c->n - j0 < NB) {
        float t[NB];
        _mm256_storeu_ps(t, f0);
        _mm256_storeu_ps(t + 8, f1);
        for (int64_t ch = 0; ch < c->n - j0; ch++) store_one(c, i, j0 + ch, t[ch]);
        return;
    }
    const __m256 s = _mm256_set1_ps(c->sx[i] * c->mult);
    float *y = c->y + i * c->n + j0;
    __m256 v0 = _mm256_mul_ps(f0, s), v1 = _mm256_mul_ps(f1, s);
    if (c->bias) {
        v0 = _mm256_add_ps(v0, _mm256_loadu_ps(c->bias + j0));
        v1 = _mm256_add_ps(v1, _mm256_loadu_ps(c->bias + j0 + 8));
    }
    if (c->accumulate) {
        v0 = _mm256_add_ps(_mm256_loadu_ps(y), v0);
        v1 = _mm256_add_ps(_mm256_loadu_ps(y + 8), v1);
    }
    _mm256_storeu_ps(y, v0);
    _mm256_storeu_ps(y + 8, v1);
}

/* W4: f[r] = add_mins of rows i0 .. i0 + mr - 1 (mr <= 3), the 16 channels of block blk.
 * NOTE: the rows share each group's converted minimums, and their chains of fmas overlap: one
 * row's chain alone, at the store of each row, was latency bound (~4 cycles a group) and cost the
 * 3-row tiles 10-13 %. */
INLINE AVX2_FN void avx2_mins(const gemm_ctx *c, int64_t blk, int64_t i0, const int mr,
                              float f[][NB]) {
    const __m128i *mp = (const __m128i *)(c->mins + blk * c->G * NB);
    const float *xs = c->xsum + i0 * c->G;
    __m256 a0 = _mm256_load_ps(f[0]), a1 = _mm256_load_ps(f[0] + 8), b0 = a0, b1 = a1, c0 = a0,
           c1 = a1;
    if (mr > 1) b0 = _mm256_load_ps(f[1]), b1 = _mm256_load_ps(f[1] + 8);
    if (mr > 2) c0 = _mm256_load_ps(f[2]), c1 = _mm256_load_ps(f[2] + 8);
    for (int64_t g = 0; g < c->G; g++) {
        const __m256 m0 = _mm256_cvtph_ps(_mm_loadu_si128(mp + 2 * g));
        const __m256 m1 = _mm256_cvtph_ps(_mm_loadu_si128(mp + 2 * g + 1));
        __m256 v = _mm256_broadcast_ss(xs + g);
        a0 = _mm256_fmadd_ps(v, m0, a0), a1 = _mm256_fmadd_ps(v, m1, a1);
        if (mr > 1) {
            v = _mm256_broadcast_ss(xs + c->G + g);
            b0 = _mm256_fmadd_ps(v, m0, b0), b1 = _mm256_fmadd_ps(v, m1, b1);
        }
        if (mr > 2) {
            v = _mm256_broadcast_ss(xs + 2 * c->G + g);
            c0 = _mm256_fmadd_ps(v, m0, c0), c1 = _mm256_fmadd_ps(v, m1, c1);
        }
    }
    _mm256_store_ps(f[0], a0), _mm256_store_ps(f[0] + 8, a1);
    if (mr > 1) _mm256_store_ps(f[1], b0), _mm256_store_ps(f[1] + 8, b1);
    if (mr > 2) _mm256_store_ps(f[2], c0), _mm256_store_ps(f[2] + 8, c1);
}

/* acc (+)= madd(broadcast activation pair, widened weights) for one row, both channel halves */
#define AVX2_ROW(xr, a0, a1)                                                                  \
    do {                                                                                      \
        int32_t pv_;                                                                          \
        memcpy(&pv_, (xr) + 2 * p, 4);                                                        \
        const __m256i xb_ = _mm256_set1_epi32(pv_);                                           \
        a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(xb_, w0));                                \
        a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(xb_, w1));                                \
    } while (0)

/* 8 channels x 4 k of a quad row (32 bytes) -> [8 channels x k 0,1 | 8 channels x k 2,3] */
INLINE AVX2_FN __m256i avx2_pairs(__m256i v) {
    const __m256i lane = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, 0,
                                          1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    return _mm256_permute4x64_epi64(_mm256_shuffle_epi8(v, lane), 0xD8); /* qwords 0 2 1 3 */
}

/* a quad row's two halves (channels 0-7, 8-15) -> its pair rows at wb (64 bytes) */
INLINE AVX2_FN void avx2_store_pairs(int8_t *wb, __m256i lo, __m256i hi) {
    const __m256i a = avx2_pairs(lo), b = avx2_pairs(hi);
    _mm256_storeu_si256((__m256i *)wb, _mm256_permute2x128_si256(a, b, 0x20));
    _mm256_storeu_si256((__m256i *)(wb + 32), _mm256_permute2x128_si256(a, b, 0x31));
}

/* wb: the block's weights, as packed (quad rows; one row only) or, pair_rows, rearranged by
 * avx2_pair_block */
INLINE AVX2_FN void avx2_kernel(const gemm_ctx *c, int64_t blk, const int8_t *wb, int64_t i0,
                                const int mr, const int raw, const int pair_rows) {
    const int64_t kp = c->kp;
    const int16_t *x0 = c->xq + i0 * kp;
    const int16_t *x1 = x0 + (mr > 1 ? kp : 0), *x2 = x0 + (mr > 2 ? 2 * kp : 0);
    __m256 f00 = _mm256_setzero_ps(), f01 = f00, f10 = f00, f11 = f00, f20 = f00, f21 = f00;
    for (int64_t g = 0; g < c->G; g++) {
        const int8_t *w = wb + g * GBYTES;
        const int16_t *xa = x0 + g * GK, *xb = x1 + g * GK, *xc = x2 + g * GK;
        __m256i d00 = _mm256_setzero_si256(), d01 = d00, d10 = d00, d11 = d00, d20 = d00, d21 = d00;
        if (pair_rows) {
#pragma GCC unroll 4
            for (int p = 0; p < GK / 2; p++) {
                const __m256i w0 =
                    _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + p * 32)));
                const __m256i w1 =
                    _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + p * 32 + 16)));
                AVX2_ROW(xa, d00, d01);
                if (mr > 1) AVX2_ROW(xb, d10, d11);
                if (mr > 2) AVX2_ROW(xc, d20, d21);
            }
        } else { /* one row, quad rows as they lie: dword lane 2c + h = channel c's k pair h */
            __m256i e0 = _mm256_setzero_si256(), e1 = e0, e2 = e0, e3 = e0;
#pragma GCC unroll 4
            for (int r = 0; r < GK / 4; r++) {
                _mm_prefetch((const char *)w + r * 64 + PF_DIST, _MM_HINT_T0);
                int64_t pv; /* activations k 4r .. 4r + 3: the pairs alternate along the lanes */
                memcpy(&pv, xa + 4 * r, 8);
                const __m256i xb = _mm256_set1_epi64x(pv);
                const __m128i *q = (const __m128i *)(w + r * 64); /* 4 channels x 4 k each */
#define AVX2_QUAD(e, i) \
    e = _mm256_add_epi32(e, _mm256_madd_epi16(xb, _mm256_cvtepi8_epi16(_mm_loadu_si128(q + (i)))))
                AVX2_QUAD(e0, 0);
                AVX2_QUAD(e1, 1);
                AVX2_QUAD(e2, 2);
                AVX2_QUAD(e3, 3);
#undef AVX2_QUAD
            }
            /* per channel, k pair 0 + k pair 1 (exact): hadd gives channels 0 1 4 5 | 2 3 6 7 */
            d00 = _mm256_permute4x64_epi64(_mm256_hadd_epi32(e0, e1), 0xD8);
            d01 = _mm256_permute4x64_epi64(_mm256_hadd_epi32(e2, e3), 0xD8);
        }
        if (raw) {
            int32_t t[3][NB];
            _mm256_storeu_si256((__m256i *)t[0], d00);
            _mm256_storeu_si256((__m256i *)(t[0] + 8), d01);
            _mm256_storeu_si256((__m256i *)t[1], d10);
            _mm256_storeu_si256((__m256i *)(t[1] + 8), d11);
            _mm256_storeu_si256((__m256i *)t[2], d20);
            _mm256_storeu_si256((__m256i *)(t[2] + 8), d21);
            for (int r = 0; r < mr; r++) store_dots(c, i0 + r, blk, g, t[r]);
            continue;
        }
        const uint16_t *sp = c->scales + (blk * c->G + g) * NB;
        const __m256 s0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)sp));
        const __m256 s1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sp + 8)));
        f00 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d00), s0, f00);
        f01 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d01), s1, f01);
        if (mr > 1) {
            f10 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d10), s0, f10);
            f11 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d11), s1, f11);
        }
        if (mr > 2) {
            f20 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d20), s0, f20);
            f21 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d21), s1, f21);
        }
    }
    if (raw) return;
    if (c->mins) {
        float f[3][NB] __attribute__((aligned(32)));
        _mm256_store_ps(f[0], f00), _mm256_store_ps(f[0] + 8, f01);
        _mm256_store_ps(f[1], f10), _mm256_store_ps(f[1] + 8, f11);
        _mm256_store_ps(f[2], f20), _mm256_store_ps(f[2] + 8, f21);
        avx2_mins(c, blk, i0, mr, f);
        f00 = _mm256_load_ps(f[0]), f01 = _mm256_load_ps(f[0] + 8);
        f10 = _mm256_load_ps(f[1]), f11 = _mm256_load_ps(f[1] + 8);
        f20 = _mm256_load_ps(f[2]), f21 = _mm256_load_ps(f[2] + 8);
    }
    avx2_store(c, blk, i0, f00, f01);
    if (mr > 1) avx2_store(c, blk, i0 + 1, f10, f11);
    if (mr > 2) avx2_store(c, blk, i0 + 2, f20, f21);
}

/* the block's G groups in pair rows (16 channels x 2 k, 32 bytes): wb[g][p] */
AVX2_FN static void avx2_pair_block(const gemm_ctx *c, int64_t blk, int8_t *wb) {
    const int8_t *src = c->packed + blk * c->G * GBYTES;
    for (int64_t q = 0; q < c->G * (GK / 4); q++) /* quad row -> pair rows 2q, 2q + 1 */
        avx2_store_pairs(wb + q * 64, _mm256_loadu_si256((const __m256i *)(src + q * 64)),
                         _mm256_loadu_si256((const __m256i *)(src + q * 64 + 32)));
}

/* avx2_pair_block of a W4 block: its u values (0 .. 15) in pair rows, which the W8 tiles read
 * (avx2_mins adds the minimums).  Nibble row p gives quad rows p (low) and p + 4 (high). */
AVX2_FN static void avx2_w4_pair_block(const gemm_ctx *c, int64_t blk, int8_t *wb) {
    const int8_t *src = c->packed + blk * c->G * (GBYTES / 2);
    const __m256i low = _mm256_set1_epi8(15);
    for (int64_t g = 0; g < c->G; g++)
        for (int p = 0; p < 4; p++) {
            const int8_t *s = src + g * (GBYTES / 2) + p * 64;
            const __m256i v0 = _mm256_loadu_si256((const __m256i *)s);
            const __m256i v1 = _mm256_loadu_si256((const __m256i *)(s + 32));
            int8_t *o = wb + g * GBYTES + p * 64;
            avx2_store_pairs(o, _mm256_and_si256(v0, low), _mm256_and_si256(v1, low));
            avx2_store_pairs(o + 4 * 64, _mm256_and_si256(_mm256_srli_epi16(v0, 4), low),
                             _mm256_and_si256(_mm256_srli_epi16(v1, 4), low));
        }
}

/* NOTE: up to AVX2_QUAD_MAX_M rows read the quad rows as they lie (lane-pair sums, four
 * accumulators a row); from more the block is rearranged into pair rows once and every 3-row tile
 * reads those: shuffling quad rows in the loop cost batch-8 and batch-16 decode 14-20% on this
 * path, batch 1 ~4%. */
#define AVX2_TILES(RAW)                                                                       \
    do {                                                                                      \
        for (; i + AVX2_MR <= i1; i += AVX2_MR)                                               \
            avx2_kernel(c, blk, wb, i, AVX2_MR, RAW, 1);                                      \
        if (i1 - i == 2) avx2_kernel(c, blk, wb, i, 2, RAW, 1);                              \
        if (i1 - i == 1) avx2_kernel(c, blk, wb, i, 1, RAW, 1);                              \
    } while (0)

/* NOTE: the single row's kernels live out of line and unroll 4, not 8: inlined into tile_avx2
 * beside the row tiles, GCC kept 20-43 stack accesses inside the loop (the accumulators spilled);
 * on its own it keeps them in registers (an L3-resident GEMV on one thread +5-15 %). */
AVX2_FN __attribute__((noinline)) static void avx2_row(const gemm_ctx *c, int64_t blk,
                                                       const int8_t *wb, int64_t i) {
    avx2_kernel(c, blk, wb, i, 1, 0, 0);
}

AVX2_FN __attribute__((noinline)) static void avx2_row_dots(const gemm_ctx *c, int64_t blk,
                                                            const int8_t *wb, int64_t i) {
    avx2_kernel(c, blk, wb, i, 1, 1, 0);
}

/* Per channel, k pair 0 + k pair 1 of quad-row lane sums (exact): hadd gives channels
 * 0 1 4 5 | 2 3 6 7, the permute puts them in order. */
INLINE AVX2_FN __m256i avx2_pair_sum(__m256i a, __m256i b) {
    return _mm256_permute4x64_epi64(_mm256_hadd_epi32(a, b), 0xD8);
}

/* Group g's exact dots of rows i0 .. i0 + rows - 1 (d[r]: channels 0-7, 8-15): stored raw, or
 * folded with the group's scales into the rows' fp32 sums f (kept in memory between groups). */
INLINE AVX2_FN void avx2_group_out(const gemm_ctx *c, int64_t blk, int64_t g, int64_t i0,
                                   const int rows, const __m256i d[][2], const int raw,
                                   float f[][NB]) {
    if (raw) {
        for (int r = 0; r < rows; r++) {
            int32_t t[NB];
            _mm256_storeu_si256((__m256i *)t, d[r][0]);
            _mm256_storeu_si256((__m256i *)(t + 8), d[r][1]);
            store_dots(c, i0 + r, blk, g, t);
        }
        return;
    }
    const uint16_t *sp = c->scales + (blk * c->G + g) * NB;
    const __m256 s0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)sp));
    const __m256 s1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sp + 8)));
    for (int r = 0; r < rows; r++) {
        _mm256_store_ps(f[r], _mm256_fmadd_ps(_mm256_cvtepi32_ps(d[r][0]), s0,
                                              _mm256_load_ps(f[r])));
        _mm256_store_ps(f[r] + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(d[r][1]), s1,
                                                  _mm256_load_ps(f[r] + 8)));
    }
}

/* Two rows from the quad rows as they lie (no pair-row copy of the block): each widened weight
 * quad feeds both rows.  The fp32 sums live in memory between groups so that the loop's eight
 * accumulators, two broadcasts and the weight stay in registers. */
INLINE AVX2_FN void avx2_rows2_kernel(const gemm_ctx *c, int64_t blk, const int8_t *wb,
                                      int64_t i0, const int raw) {
    const int16_t *x0 = c->xq + i0 * c->kp, *x1 = x0 + c->kp;
    float f[2][NB] __attribute__((aligned(32))) = {{0}};
    for (int64_t g = 0; g < c->G; g++) {
        const int8_t *w = wb + g * GBYTES;
        const int16_t *xa = x0 + g * GK, *xb = x1 + g * GK;
        __m256i e0 = _mm256_setzero_si256(), e1 = e0, e2 = e0, e3 = e0;
        __m256i h0 = e0, h1 = e0, h2 = e0, h3 = e0;
#pragma GCC unroll 2
        for (int r = 0; r < GK / 4; r++) {
            _mm_prefetch((const char *)w + r * 64 + PF_DIST, _MM_HINT_T0);
            int64_t pa, pb; /* activations k 4r .. 4r + 3: the pairs alternate along the lanes */
            memcpy(&pa, xa + 4 * r, 8);
            memcpy(&pb, xb + 4 * r, 8);
            const __m256i va = _mm256_set1_epi64x(pa), vb = _mm256_set1_epi64x(pb);
            const int8_t *q = w + r * 64; /* four 16-byte chunks: 4 channels x 4 k each */
            /* NOTE: in asm so that the eight accumulators stay put: from intrinsics GCC re-homed
             * each sum through a register copy every iteration (+46 % instructions at 8 rows). */
            __m256i wq, t0, t1;
#define AVX2_QUAD2(OFF, E, H)                                                                \
    "vpmovsxbw " #OFF "(%[q]), %[wq]\n\t"                                                    \
    "vpmaddwd %[wq], %[va], %[t0]\n\t"                                                       \
    "vpmaddwd %[wq], %[vb], %[t1]\n\t"                                                       \
    "vpaddd %[t0], %[" #E "], %[" #E "]\n\t"                                                  \
    "vpaddd %[t1], %[" #H "], %[" #H "]\n\t"
            __asm__(AVX2_QUAD2(0, e0, h0) AVX2_QUAD2(16, e1, h1) AVX2_QUAD2(32, e2, h2)
                        AVX2_QUAD2(48, e3, h3)
                    : [e0] "+x"(e0), [e1] "+x"(e1), [e2] "+x"(e2), [e3] "+x"(e3),
                      [h0] "+x"(h0), [h1] "+x"(h1), [h2] "+x"(h2), [h3] "+x"(h3),
                      [wq] "=&x"(wq), [t0] "=&x"(t0), [t1] "=&x"(t1)
                    : [q] "r"(q), [va] "x"(va), [vb] "x"(vb), "m"(*(const char(*)[64])q));
#undef AVX2_QUAD2
        }
        const __m256i d[2][2] = {{avx2_pair_sum(e0, e1), avx2_pair_sum(e2, e3)},
                                 {avx2_pair_sum(h0, h1), avx2_pair_sum(h2, h3)}};
        avx2_group_out(c, blk, g, i0, 2, d, raw, f);
    }
    if (raw) return;
    for (int r = 0; r < 2; r++)
        avx2_store(c, blk, i0 + r, _mm256_load_ps(f[r]), _mm256_load_ps(f[r] + 8));
}

AVX2_FN __attribute__((noinline)) static void avx2_rows2(const gemm_ctx *c, int64_t blk,
                                                         const int8_t *wb, int64_t i) {
    avx2_rows2_kernel(c, blk, wb, i, 0);
}

AVX2_FN __attribute__((noinline)) static void avx2_rows2_dots(const gemm_ctx *c, int64_t blk,
                                                              const int8_t *wb, int64_t i) {
    avx2_rows2_kernel(c, blk, wb, i, 1);
}

/* bx[row][r]: rows i0 .. i0 + 2's activations k 4r .. 4r + 3 of group g, broadcast (the pairs
 * alternate along the lanes), for the 3-row passes' memory operands */
INLINE AVX2_FN void avx2_broadcast_rows3(const gemm_ctx *c, int64_t i0, int64_t g,
                                         __m256i bx[3][GK / 4]) {
    for (int row = 0; row < 3; row++)
        for (int r = 0; r < GK / 4; r++) {
            int64_t t;
            memcpy(&t, c->xq + (i0 + row) * c->kp + g * GK + 4 * r, 8);
            bx[row][r] = _mm256_set1_epi64x(t);
        }
}

/* Three rows from the quad rows as they lie: each widened weight quad feeds all three, so the
 * block's weights are read once where a two-row and a one-row pass read them twice (3 rows cost
 * 1.54x one row that way on AVX2; speculative decoding with 2 drafts runs 3 rows a step).
 * NOTE: 12 accumulators, the widened weight and a product fill the 16 ymm registers, so the
 * rows' broadcast activations are memory operands: each group's are written to `bx` first
 * (3 x 8 x 32 bytes, L1-resident), and the loop is asm as in avx2_rows2_kernel. */
INLINE AVX2_FN void avx2_rows3_kernel(const gemm_ctx *c, int64_t blk, const int8_t *wb,
                                      int64_t i0, const int raw) {
    float f[3][NB] __attribute__((aligned(32))) = {{0}};
    __m256i bx[3][GK / 4];
    for (int64_t g = 0; g < c->G; g++) {
        const int8_t *w = wb + g * GBYTES;
        avx2_broadcast_rows3(c, i0, g, bx);
        __m256i e0 = _mm256_setzero_si256(), e1 = e0, e2 = e0, e3 = e0;
        __m256i h0 = e0, h1 = e0, h2 = e0, h3 = e0, k0 = e0, k1 = e0, k2 = e0, k3 = e0;
        for (int r = 0; r < GK / 4; r++) {
            _mm_prefetch((const char *)w + r * 64 + PF_DIST, _MM_HINT_T0);
            const int8_t *q = w + r * 64; /* four 16-byte chunks: 4 channels x 4 k each */
            __m256i wq, t;
#define AVX2_QUAD3(OFF, E, H, K)                                                             \
    "vpmovsxbw " #OFF "(%[q]), %[wq]\n\t"                                                    \
    "vpmaddwd %[a], %[wq], %[t]\n\t"                                                         \
    "vpaddd %[t], %[" #E "], %[" #E "]\n\t"                                                  \
    "vpmaddwd %[b], %[wq], %[t]\n\t"                                                         \
    "vpaddd %[t], %[" #H "], %[" #H "]\n\t"                                                  \
    "vpmaddwd %[c], %[wq], %[t]\n\t"                                                         \
    "vpaddd %[t], %[" #K "], %[" #K "]\n\t"
            /* one statement a chunk (three "+x" sums each: asm takes at most 30 operands) */
#define AVX2_QUAD3_ASM(OFF, E, H, K)                                                         \
    __asm__(AVX2_QUAD3(OFF, E, H, K)                                                         \
            : [E] "+x"(E), [H] "+x"(H), [K] "+x"(K), [wq] "=&x"(wq), [t] "=&x"(t)            \
            : [q] "r"(q), [a] "m"(bx[0][r]), [b] "m"(bx[1][r]), [c] "m"(bx[2][r]),           \
              "m"(*(const char(*)[64])q))
            AVX2_QUAD3_ASM(0, e0, h0, k0);
            AVX2_QUAD3_ASM(16, e1, h1, k1);
            AVX2_QUAD3_ASM(32, e2, h2, k2);
            AVX2_QUAD3_ASM(48, e3, h3, k3);
#undef AVX2_QUAD3_ASM
#undef AVX2_QUAD3
        }
        const __m256i d[3][2] = {{avx2_pair_sum(e0, e1), avx2_pair_sum(e2, e3)},
                                 {avx2_pair_sum(h0, h1), avx2_pair_sum(h2, h3)},
                                 {avx2_pair_sum(k0, k1), avx2_pair_sum(k2, k3)}};
        avx2_group_out(c, blk, g, i0, 3, d, raw, f);
    }
    if (raw) return;
    for (int row = 0; row < 3; row++)
        avx2_store(c, blk, i0 + row, _mm256_load_ps(f[row]), _mm256_load_ps(f[row] + 8));
}

AVX2_FN __attribute__((noinline)) static void avx2_rows3(const gemm_ctx *c, int64_t blk,
                                                         const int8_t *wb, int64_t i) {
    avx2_rows3_kernel(c, blk, wb, i, 0);
}

AVX2_FN __attribute__((noinline)) static void avx2_rows3_dots(const gemm_ctx *c, int64_t blk,
                                                              const int8_t *wb, int64_t i) {
    avx2_rows3_kernel(c, blk, wb, i, 1);
}

/* One or two rows of W4 weights read as nibbles (no unpacked copy): each 16 bytes of a nibble
 * row p widen (vpmovzxbw) to 4 channels x 4 k of quad row p in the low nibbles and of quad row
 * p + 4 in the high ones, which meet the broadcasts of activations k 4p .. and 4p + 16 .. in the
 * same accumulators (the lane layout of avx2_kernel's quad-row pass, so its pair sums and
 * fold).  Two rows share each widened chunk. */
INLINE AVX2_FN void avx2_w4_kernel(const gemm_ctx *c, int64_t blk, int64_t i0, const int mr) {
    const int8_t *wb = c->packed + blk * c->G * (GBYTES / 2);
    const int16_t *x[2] = {c->xq + i0 * c->kp, c->xq + (i0 + (mr > 1)) * c->kp};
    const __m256i low = _mm256_set1_epi16(15);
    float f[2][NB] __attribute__((aligned(32))) = {{0}};
    for (int64_t g = 0; g < c->G; g++) {
        const int8_t *w = wb + g * (GBYTES / 2);
        const int16_t *xa = x[0] + g * GK, *xb = x[1] + g * GK;
        __m256i e0 = _mm256_setzero_si256(), e1 = e0, e2 = e0, e3 = e0;
        __m256i h0 = e0, h1 = e0, h2 = e0, h3 = e0;
        for (int p = 0; p < 4; p++) {
            _mm_prefetch((const char *)w + p * 64 + PF_DIST, _MM_HINT_T0);
            const int8_t *q = w + p * 64; /* four 16-byte chunks: 4 channels x 4 k, two quads */
            int64_t k4; /* broadcasts of activations k 4p .. 4p + 3 (l) and 4p + 16 .. (h) */
            memcpy(&k4, xa + 4 * p, 8);
            const __m256i al = _mm256_set1_epi64x(k4);
            memcpy(&k4, xa + 4 * p + 16, 8);
            const __m256i ah = _mm256_set1_epi64x(k4);
            memcpy(&k4, xb + 4 * p, 8);
            const __m256i bl = _mm256_set1_epi64x(k4);
            memcpy(&k4, xb + 4 * p + 16, 8);
            const __m256i bh = _mm256_set1_epi64x(k4);
            __m256i v, hi, t;
            /* NOTE: asm, as avx2_rows2_kernel: from intrinsics GCC spilled the products to the
             * stack (two rows: 8 sums, 4 broadcasts, the mask and 3 temporaries fill the 16
             * registers exactly) */
#define AVX2_NIB1(OFF, E)                                                                     \
    "vpmovzxbw " #OFF "(%[q]), %[v]\n\t"                                                      \
    "vpsrlw $4, %[v], %[hi]\n\t"                                                              \
    "vpand %[low], %[v], %[v]\n\t"                                                            \
    "vpmaddwd %[al], %[v], %[t]\n\t"                                                          \
    "vpaddd %[t], %[" #E "], %[" #E "]\n\t"                                                   \
    "vpmaddwd %[ah], %[hi], %[t]\n\t"                                                         \
    "vpaddd %[t], %[" #E "], %[" #E "]\n\t"
#define AVX2_NIB2(OFF, E, H)                                                                  \
    AVX2_NIB1(OFF, E)                                                                         \
    "vpmaddwd %[bl], %[v], %[t]\n\t"                                                          \
    "vpaddd %[t], %[" #H "], %[" #H "]\n\t"                                                   \
    "vpmaddwd %[bh], %[hi], %[t]\n\t"                                                         \
    "vpaddd %[t], %[" #H "], %[" #H "]\n\t"
#define AVX2_NIB_OPS(E, H)                                                                    \
    : [E] "+x"(E), [H] "+x"(H), [v] "=&x"(v), [hi] "=&x"(hi), [t] "=&x"(t)                   \
    : [q] "r"(q), [low] "x"(low), [al] "x"(al), [ah] "x"(ah), [bl] "x"(bl), [bh] "x"(bh),     \
      "m"(*(const char(*)[64])q)
            if (mr > 1) {
                __asm__(AVX2_NIB2(0, e0, h0) AVX2_NIB_OPS(e0, h0));
                __asm__(AVX2_NIB2(16, e1, h1) AVX2_NIB_OPS(e1, h1));
                __asm__(AVX2_NIB2(32, e2, h2) AVX2_NIB_OPS(e2, h2));
                __asm__(AVX2_NIB2(48, e3, h3) AVX2_NIB_OPS(e3, h3));
            } else {
                __asm__(AVX2_NIB1(0, e0) AVX2_NIB_OPS(e0, h0));
                __asm__(AVX2_NIB1(16, e1) AVX2_NIB_OPS(e1, h1));
                __asm__(AVX2_NIB1(32, e2) AVX2_NIB_OPS(e2, h2));
                __asm__(AVX2_NIB1(48, e3) AVX2_NIB_OPS(e3, h3));
            }
#undef AVX2_NIB_OPS
#undef AVX2_NIB2
#undef AVX2_NIB1
        }
        const __m256i d[2][2] = {{avx2_pair_sum(e0, e1), avx2_pair_sum(e2, e3)},
                                 {avx2_pair_sum(h0, h1), avx2_pair_sum(h2, h3)}};
        avx2_group_out(c, blk, g, i0, mr, d, c->dots != NULL, f);
    }
    if (c->dots) return;
    avx2_mins(c, blk, i0, mr, f);
    for (int r = 0; r < mr; r++)
        avx2_store(c, blk, i0 + r, _mm256_load_ps(f[r]), _mm256_load_ps(f[r] + 8));
}

/* Three rows of W4 weights as nibbles: each widened chunk feeds all three (2 + 1 passes widen
 * it twice).  12 sums, the mask and 3 temporaries fill the registers, so the rows' broadcast
 * activations are memory operands, written per group to bx first (as avx2_rows3_kernel). */
INLINE AVX2_FN void avx2_w4_rows3_kernel(const gemm_ctx *c, int64_t blk, int64_t i0) {
    const int8_t *wb = c->packed + blk * c->G * (GBYTES / 2);
    const __m256i low = _mm256_set1_epi16(15);
    float f[3][NB] __attribute__((aligned(32))) = {{0}};
    __m256i bx[3][GK / 4];
    for (int64_t g = 0; g < c->G; g++) {
        const int8_t *w = wb + g * (GBYTES / 2);
        avx2_broadcast_rows3(c, i0, g, bx);
        __m256i e0 = _mm256_setzero_si256(), e1 = e0, e2 = e0, e3 = e0;
        __m256i h0 = e0, h1 = e0, h2 = e0, h3 = e0, k0 = e0, k1 = e0, k2 = e0, k3 = e0;
        for (int p = 0; p < 4; p++) {
            _mm_prefetch((const char *)w + p * 64 + PF_DIST, _MM_HINT_T0);
            const int8_t *q = w + p * 64;
            __m256i v, hi, t;
#define AVX2_NIB3_ROW(L, H, S)                                                                \
    "vpmaddwd %[" #L "], %[v], %[t]\n\t"                                                      \
    "vpaddd %[t], %[" #S "], %[" #S "]\n\t"                                                   \
    "vpmaddwd %[" #H "], %[hi], %[t]\n\t"                                                     \
    "vpaddd %[t], %[" #S "], %[" #S "]\n\t"
#define AVX2_NIB3(OFF, E, H, K)                                                               \
    __asm__("vpmovzxbw " #OFF "(%[q]), %[v]\n\t"                                              \
            "vpsrlw $4, %[v], %[hi]\n\t"                                                      \
            "vpand %[low], %[v], %[v]\n\t" AVX2_NIB3_ROW(al, ah, E) AVX2_NIB3_ROW(bl, bh, H)   \
                AVX2_NIB3_ROW(cl, ch, K)                                                      \
            : [E] "+x"(E), [H] "+x"(H), [K] "+x"(K), [v] "=&x"(v), [hi] "=&x"(hi),            \
              [t] "=&x"(t)                                                                    \
            : [q] "r"(q), [low] "x"(low), [al] "m"(bx[0][p]), [ah] "m"(bx[0][p + 4]),         \
              [bl] "m"(bx[1][p]), [bh] "m"(bx[1][p + 4]), [cl] "m"(bx[2][p]),                 \
              [ch] "m"(bx[2][p + 4]), "m"(*(const char(*)[64])q))
            AVX2_NIB3(0, e0, h0, k0);
            AVX2_NIB3(16, e1, h1, k1);
            AVX2_NIB3(32, e2, h2, k2);
            AVX2_NIB3(48, e3, h3, k3);
#undef AVX2_NIB3
#undef AVX2_NIB3_ROW
        }
        const __m256i d[3][2] = {{avx2_pair_sum(e0, e1), avx2_pair_sum(e2, e3)},
                                 {avx2_pair_sum(h0, h1), avx2_pair_sum(h2, h3)},
                                 {avx2_pair_sum(k0, k1), avx2_pair_sum(k2, k3)}};
        avx2_group_out(c, blk, g, i0, 3, d, c->dots != NULL, f);
    }
    if (c->dots) return;
    avx2_mins(c, blk, i0, 3, f);
    for (int r = 0; r < 3; r++)
        avx2_store(c, blk, i0 + r, _mm256_load_ps(f[r]), _mm256_load_ps(f[r] + 8));
}

AVX2_FN __attribute__((noinline)) static void avx2_w4_rows3(const gemm_ctx *c, int64_t blk,
                                                            int64_t i) {
    avx2_w4_rows3_kernel(c, blk, i);
}

AVX2_FN __attribute__((noinline)) static void avx2_w4_row(const gemm_ctx *c, int64_t blk,
                                                          int64_t i) {
    avx2_w4_kernel(c, blk, i, 1);
}

AVX2_FN __attribute__((noinline)) static void avx2_w4_rows2(const gemm_ctx *c, int64_t blk,
                                                            int64_t i) {
    avx2_w4_kernel(c, blk, i, 2);
}

AVX2_FN static void tile_avx2(const gemm_ctx *c, int64_t blk, int64_t i0, int64_t i1) {
    int64_t i = i0;
    const int8_t *wb = c->packed + blk * c->G * GBYTES;
    if (c->mins && i1 - i0 <= AVX2_QUAD_MAX_M) {
        if (i1 - i0 == 3) {
            avx2_w4_rows3(c, blk, i);
            return;
        }
        for (; i + 2 <= i1; i += 2) avx2_w4_rows2(c, blk, i);
        if (i < i1) avx2_w4_row(c, blk, i);
        return;
    }
    if (i1 - i0 <= AVX2_QUAD_MAX_M) {
        if (i1 - i0 == 3) {
            (c->dots ? avx2_rows3_dots : avx2_rows3)(c, blk, wb, i);
            return;
        }
        for (; i + 2 <= i1; i += 2) (c->dots ? avx2_rows2_dots : avx2_rows2)(c, blk, wb, i);
        if (i < i1) (c->dots ? avx2_row_dots : avx2_row)(c, blk, wb, i);
        return;
    }
    int8_t *pairs = shmk_scratch(5, (size_t)(c->G * GBYTES));
    (c->mins ? avx2_w4_pair_block : avx2_pair_block)(c, blk, pairs);
    wb = pairs;
    if (c->dots)
        AVX2_TILES(1);
    else
        AVX2_TILES(0);
}

/* --- AVX512-VNNI: MR rows x NR blocks (16 channels each).  A quad row (16 channels x 4 k) is
 * widened in its two 32-byte halves as it lies, so each dword lane holds one channel's k pair
 * (2c + h); a broadcast of the row's four activations (pairs alternating along the lanes) feeds
 * vpdpwssd, and a group's lane pairs are added per channel (exact int32) before its fold.  No
 * shuffle in the loop (a vpermw a quad row cost batch-8 decode 5-8%); against the pair-row
 * layout of before, batch 8-32 runs 2-3% slower on this path (twice the accumulators), batch 1-2
 * the same. --- */
#define VNNI_MR 4

INLINE VNNI_FN void vnni_store(const gemm_ctx *c, int64_t blk, int64_t i, __m512 f) {
    const __m512 v = _mm512_mul_ps(f, _mm512_set1_ps(c->sx[i] * c->mult));
    shmk_vnni_store(c->y + i * c->n, c->bias, c->n, blk, v, c->accumulate);
}

/* Half h (channels 8h .. 8h + 7) of quad row q of a block-group, widened to int16 as it lies:
 * W8 as packed; W4 from nibble row q % 4, its low nibbles for q < 4 and high ones from 4 (w4.c:
 * u in [0, 15], the minimums added after the groups) */
INLINE VNNI_FN __m512i vnni_quad_half(const int8_t *w, const int q, const int h, const int w4) {
    if (!w4)
        return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(w + q * 64 + 32 * h)));
    __m256i u = _mm256_loadu_si256((const __m256i *)(w + (q % 4) * 64 + 32 * h));
    if (q >= 4) u = _mm256_srli_epi16(u, 4);
    return _mm512_cvtepu8_epi16(_mm256_and_si256(u, _mm256_set1_epi8(15)));
}

/* pf_next: the first row tile of a unit (shmk_vnni_prefetch); w4: W4 nibbles (c->mins), for
 * the raw group dots only (tile_vnni_w4_dots; float mode: tile_vnni_w4b) */
INLINE VNNI_FN void vnni_kernel(const gemm_ctx *c, int64_t blk, int64_t i0, const int mr,
                                const int nr, const int raw, const int pf_next, const int w4) {
    const int64_t G = c->G, kp = c->kp, gb = w4 ? GBYTES / 2 : GBYTES;
    const int8_t *wb0 = c->packed + blk * G * gb;
    const int8_t *wb1 = wb0 + G * gb;
    const int16_t *x = c->xq + i0 * kp;
    /* lane-pair sums: dword lane 2c + h of half e holds channel 8e + c's k pair h */
    const __m512i even =
        _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    __m512 f[VNNI_MR][2];
    for (int r = 0; r < mr; r++) f[r][0] = f[r][1] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const int8_t *w0 = wb0 + g * gb, *w1 = wb1 + g * gb;
        const int16_t *xr[VNNI_MR];
        for (int r = 0; r < mr; r++) xr[r] = x + r * kp + g * GK;
        /* d[row][block][half]: half e = channels 8e .. 8e + 7, both k pairs of a quad row */
        __m512i d[VNNI_MR][2][2];
        for (int r = 0; r < mr; r++)
            for (int b = 0; b < nr; b++) d[r][b][0] = d[r][b][1] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int q = 0; q < GK / 4; q++) {
            if (!w4 || q < 4) shmk_vnni_prefetch(wb0, G, gb, g, q, mr, nr, pf_next);
            /* quad row q widened as it lies: 8 channels x (k pair 0, k pair 1) per half */
            const __m512i v00 = vnni_quad_half(w0, q, 0, w4), v01 = vnni_quad_half(w0, q, 1, w4);
            __m512i v10 = v00, v11 = v01;
            if (nr == 2) v10 = vnni_quad_half(w1, q, 0, w4), v11 = vnni_quad_half(w1, q, 1, w4);
            for (int r = 0; r < mr; r++) {
                int64_t pv; /* activations k 4q .. 4q + 3: the pairs alternate along the lanes */
                memcpy(&pv, xr[r] + 4 * q, 8);
                const __m512i xb = _mm512_set1_epi64(pv);
                d[r][0][0] = _mm512_dpwssd_epi32(d[r][0][0], xb, v00);
                d[r][0][1] = _mm512_dpwssd_epi32(d[r][0][1], xb, v01);
                if (nr == 2) {
                    d[r][1][0] = _mm512_dpwssd_epi32(d[r][1][0], xb, v10);
                    d[r][1][1] = _mm512_dpwssd_epi32(d[r][1][1], xb, v11);
                }
            }
        }
        /* per channel: k pair 0 + k pair 1 (exact int32), channels 0-15 in order */
        for (int r = 0; r < mr; r++)
            for (int b = 0; b < nr; b++)
                d[r][b][0] = _mm512_add_epi32(
                    _mm512_permutex2var_epi32(d[r][b][0], even, d[r][b][1]),
                    _mm512_permutex2var_epi32(d[r][b][0], odd, d[r][b][1]));
        if (raw) {
            for (int r = 0; r < mr; r++)
                for (int b = 0; b < nr; b++) {
                    int32_t t[NB];
                    _mm512_storeu_si512((void *)t, d[r][b][0]);
                    store_dots(c, i0 + r, blk + b, g, t);
                }
            continue;
        }
        const __m512 s0 = _mm512_cvtph_ps(
            _mm256_loadu_si256((const __m256i *)(c->scales + (blk * G + g) * NB)));
        __m512 s1 = s0;
        if (nr == 2)
            s1 = _mm512_cvtph_ps(
                _mm256_loadu_si256((const __m256i *)(c->scales + ((blk + 1) * G + g) * NB)));
        for (int r = 0; r < mr; r++) {
            f[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d[r][0][0]), s0, f[r][0]);
            if (nr == 2) f[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d[r][1][0]), s1, f[r][1]);
        }
    }
    if (raw) return;
    if (w4) { /* the minimums' terms after every group's dots, in group order (add_mins) */
        const float *xs = c->xsum + i0 * G;
        for (int64_t g = 0; g < G; g++) {
            const __m512 m0 = _mm512_cvtph_ps(
                _mm256_loadu_si256((const __m256i *)(c->mins + (blk * G + g) * NB)));
            __m512 m1 = m0;
            if (nr == 2)
                m1 = _mm512_cvtph_ps(
                    _mm256_loadu_si256((const __m256i *)(c->mins + ((blk + 1) * G + g) * NB)));
            for (int r = 0; r < mr; r++) {
                const __m512 xv = _mm512_set1_ps(xs[r * G + g]);
                f[r][0] = _mm512_fmadd_ps(xv, m0, f[r][0]);
                if (nr == 2) f[r][1] = _mm512_fmadd_ps(xv, m1, f[r][1]);
            }
        }
    }
    for (int r = 0; r < mr; r++) {
        vnni_store(c, blk, i0 + r, f[r][0]);
        if (nr == 2) vnni_store(c, blk + 1, i0 + r, f[r][1]);
    }
}

#define VNNI_ROWS(NR, RAW, W4)                                                             \
    do {                                                                                   \
        int64_t i = i0;                                                                    \
        for (; i + VNNI_MR <= i1; i += VNNI_MR)                                            \
            vnni_kernel(c, blk, i, VNNI_MR, NR, RAW, i == i0, W4);                         \
        switch (i1 - i) {                                                                  \
        case 3: vnni_kernel(c, blk, i, 3, NR, RAW, i == i0, W4); break;                   \
        case 2: vnni_kernel(c, blk, i, 2, NR, RAW, 0, W4); break;                         \
        case 1: vnni_kernel(c, blk, i, 1, NR, RAW, 0, W4); break;                         \
        default: break;                                                                    \
        }                                                                                  \
    } while (0)

/* unit u = blocks 2u, 2u+1 (the last unit may hold one block); W4 = 1: nibble weights */
#define VNNI_TILE(NAME, W4)                                                                \
    VNNI_FN __attribute__((noinline)) static void NAME(const gemm_ctx *c, int64_t u,        \
                                                       int64_t i0, int64_t i1) {           \
        const int64_t blk = 2 * u;                                                         \
        const int two = blk + 1 < c->nb;                                                   \
        if (c->dots) {                                                                     \
            if (two)                                                                       \
                VNNI_ROWS(2, 1, W4);                                                       \
            else                                                                           \
                VNNI_ROWS(1, 1, W4);                                                       \
        } else {                                                                           \
            if (two)                                                                       \
                VNNI_ROWS(2, 0, W4);                                                       \
            else                                                                           \
                VNNI_ROWS(1, 0, W4);                                                       \
        }                                                                                  \
    }
VNNI_TILE(tile_vnni_w8, 0)
#undef VNNI_TILE

/* W4's raw group dots (group_dots): float mode takes tile_vnni_w4b */
VNNI_FN __attribute__((noinline)) static void tile_vnni_w4_dots(const gemm_ctx *c, int64_t u,
                                                                int64_t i0, int64_t i1) {
    const int64_t blk = 2 * u;
    if (blk + 1 < c->nb)
        VNNI_ROWS(2, 1, 1);
    else
        VNNI_ROWS(1, 1, 1);
}

/* --- W4 on int16 activations by vpdpbusd (path vnni, float mode): x = 256 h + l with
 * l = x & 255 (u8) and h = x >> 8 (s8), so u . x = 256 (u . h) + u . l, and each is one
 * vpdpbusd on the nibbles as they lie (l u8 x u s8, u u8 x h s8: u in [0, 15] fits either
 * side), the same exact int32 group dots as vnni_kernel's with no widening to int16 and no
 * lane-pair adds.  |256 (u . h)| <= 256 x 32 x 15 x 128 < 2^24.  Slabs of up to W4B_MR rows
 * (two int32 sums each), a block's nibbles from L1 after the first slab, prefetched there.
 * Zen 4, one thread, cache-hot, against the widening tiles: qkv 1.09-1.12x, gate_up 1.18-1.22x,
 * o and down 1.04-1.07x at 1, 16 and 256 rows (benchmarks/RESULTS.md, Model). --- */
#define W4B_MR 8
_Static_assert(W4B_MR == 8, "SHMK_SLAB_SWITCH takes slabs of up to 8 rows");

/* acc += a . b in fours (vpdpbusd: a u8, b s8), b or a the 4 bytes at p broadcast */
#define DPB_X_U(acc, p, u) _mm512_dpbusd_epi32(acc, _mm512_set1_epi32(load4(p)), u)
#define DPB_U_X(acc, u, p) _mm512_dpbusd_epi32(acc, u, _mm512_set1_epi32(load4(p)))

static inline int32_t load4(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

INLINE VNNI_FN void vnni_w4b_kernel(const gemm_ctx *c, int64_t blk, int64_t i0, const int mr,
                                    const int pf) {
    const int64_t G = c->G, kp = c->kp;
    const uint8_t *wb = (const uint8_t *)c->packed + blk * G * (GBYTES / 2);
    const __m512i low = _mm512_set1_epi8(15);
    __m512 f[W4B_MR];
    for (int r = 0; r < mr; r++) f[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *w = wb + g * (GBYTES / 2);
        __m512i lo[W4B_MR], hi[W4B_MR];
        for (int r = 0; r < mr; r++) lo[r] = hi[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int q = 0; q < 4; q++) { /* nibble row q: k 4q .. 4q + 3 low, 16 + 4q .. high */
            if (pf) _mm_prefetch((const char *)w + q * 64 + PF_DIST, _MM_HINT_T0);
            const __m512i u = _mm512_loadu_si512((const void *)(w + q * 64));
            const __m512i ul = _mm512_and_si512(u, low);
            const __m512i uh = _mm512_and_si512(_mm512_srli_epi16(u, 4), low);
            for (int r = 0; r < mr; r++) {
                const int64_t o = (i0 + r) * kp + g * GK + 4 * q;
                lo[r] = DPB_X_U(lo[r], c->xlo + o, ul);
                hi[r] = DPB_U_X(hi[r], ul, c->xhi + o);
                lo[r] = DPB_X_U(lo[r], c->xlo + o + GK / 2, uh);
                hi[r] = DPB_U_X(hi[r], uh, c->xhi + o + GK / 2);
            }
        }
        const __m512 s = _mm512_cvtph_ps(
            _mm256_loadu_si256((const __m256i *)(c->scales + (blk * G + g) * NB)));
        for (int r = 0; r < mr; r++) {
            const __m512i d = _mm512_add_epi32(_mm512_slli_epi32(hi[r], 8), lo[r]);
            f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), s, f[r]);
        }
    }
    const float *xs = c->xsum + i0 * G; /* the minimums' terms after the groups, in order */
    for (int64_t g = 0; g < G; g++) {
        const __m512 m = _mm512_cvtph_ps(
            _mm256_loadu_si256((const __m256i *)(c->mins + (blk * G + g) * NB)));
        for (int r = 0; r < mr; r++) f[r] = _mm512_fmadd_ps(_mm512_set1_ps(xs[r * G + g]), m, f[r]);
    }
    for (int r = 0; r < mr; r++) vnni_store(c, blk, i0 + r, f[r]);
}

/* unit u = blocks 2u, 2u+1, rows i0 .. i1 - 1 in slabs of W4B_MR */
VNNI_FN __attribute__((noinline)) static void tile_vnni_w4b(const gemm_ctx *c, int64_t u,
                                                            int64_t i0, int64_t i1) {
    for (int64_t b = 2 * u; b < 2 * u + 2 && b < c->nb; b++)
        for (int64_t i = i0; i < i1; i += W4B_MR) {
#define W4B_SLAB(mr) vnni_w4b_kernel(c, b, i, mr, i == i0)
            SHMK_SLAB_SWITCH(i1 - i, W4B_SLAB)
#undef W4B_SLAB
        }
}

static void gemm_task(void *vctx, int64_t task, int tid) {
    (void)tid;
    const gemm_ctx *c = vctx;
    int64_t mt = task % c->mtasks, nt = task / c->mtasks;
    int64_t u0 = nt * c->units_per_task, u1 = u0 + c->units_per_task;
    int64_t i0 = mt * c->m_per_task, i1 = i0 + c->m_per_task;
    if (u1 > c->nunits) u1 = c->nunits;
    if (i1 > c->m) i1 = c->m;
    for (int64_t u = u0; u < u1; u++) {
        if (c->path == SHMK_VNNI) {
            (c->xlo ? tile_vnni_w4b : c->mins ? tile_vnni_w4_dots : tile_vnni_w8)(c, u, i0, i1);
            continue;
        }
        for (int64_t b = 2 * u; b < 2 * u + 2 && b < c->nb; b++) {
            if (c->path == SHMK_AVX2)
                tile_avx2(c, b, i0, i1);
            else
                tile_portable(c, b, i0, i1);
        }
    }
}

static void quant_task(void *vctx, int64_t task, int tid) {
    (void)tid;
    const gemm_ctx *c = vctx;
    int64_t i0 = task * c->rows_per_qtask, i1 = i0 + c->rows_per_qtask;
    if (i1 > c->m) i1 = c->m;
    for (int64_t i = i0; i < i1; i++) {
        int16_t *q = c->xq_w + i * c->kp;
        quant_row(c->path, c->x + i * c->k, c->k, c->kp, q, c->sx_w + i);
        if (!c->xsum_w) continue;
        for (int64_t g = 0; g < c->G; g++) { /* exact: |sum| <= 32 x 32767 */
            int32_t s = 0;
            for (int t = 0; t < GK; t++) s += q[g * GK + t];
            c->xsum_w[i * c->G + g] = (float)s;
        }
        if (!c->xlo_w) continue;
        for (int64_t t = 0; t < c->kp; t++) { /* two's complement: q = 256 (q >> 8) + (q & 255) */
            c->xlo_w[i * c->kp + t] = (uint8_t)(q[t] & 255);
            c->xhi_w[i * c->kp + t] = (int8_t)(q[t] >> 8);
        }
    }
}

/* Work split.  Small M: N only (each thread streams its own weight range once), split as the
 * AMX kernels do (shmk_split_units: one task a thread when that balances).  NOTE: 8 tasks a
 * thread had each task start its two weight streams cold; one a thread took decode b1 186-188
 * -> 200 tok/s and b8 730 -> 781 (medians of 8-10 alternated rounds in one process).  Large M:
 * tiles of MTILE rows x a few 32-channel units; a block's weights stay in L1 across the rows and
 * the tile's int16 activations (24 x 1.2-3 KB) mostly too (96-row tiles measured ~35% slower). */
#define MTILE 24
static void plan_and_run(gemm_ctx *c) {
    c->nb = shmk_cdiv(c->n, NB);
    c->nunits = shmk_cdiv(c->nb, 2);
    const shmk_split_plan p = shmk_split_tiles(c->m, c->nunits, shmk_threads(), MTILE);
    c->m_per_task = p.rows_per_task, c->mtasks = p.mtasks, c->units_per_task = p.units_per_task;
    shmk_parallel(gemm_task, c, p.ntasks);
}

static void prepare(gemm_ctx *c, const float *x, const int16_t *xq_given) {
    int64_t m = c->m, kp = c->kp;
    if (xq_given) {
        c->xq = xq_given;
        return;
    }
    c->x = x;
    c->xq_w = shmk_scratch(0, (size_t)(m * kp) * sizeof(int16_t));
    c->sx_w = shmk_scratch(1, (size_t)m * sizeof(float));
    c->xq = c->xq_w;
    c->sx = c->sx_w;
    if (c->mins) c->xsum = c->xsum_w = shmk_scratch(9, (size_t)(m * c->G) * sizeof(float));
    if (c->mins && c->path == SHMK_VNNI) {
        uint8_t *planes = shmk_scratch(4, (size_t)(2 * m * kp));
        c->xlo = c->xlo_w = planes;
        c->xhi = c->xhi_w = (int8_t *)planes + m * kp;
    }
    if (m <= 8) {
        c->rows_per_qtask = m;
        quant_task(c, 0, 0);
    } else {
        c->rows_per_qtask = shmk_cdiv(m, 4 * shmk_threads());
        shmk_parallel(quant_task, c, shmk_cdiv(m, c->rows_per_qtask));
    }
}

static void init_ctx(gemm_ctx *c, int64_t m, const shmk_linear_t *w) {
    memset(c, 0, sizeof *c);
    c->path = shmk_path() == SHMK_AMX ? SHMK_VNNI : shmk_path(); /* the integer kernels */
    c->m = m, c->k = w->k, c->kp = shmk_padded_k(w->k), c->G = c->kp / GK, c->n = w->n;
    c->packed = w->packed, c->scales = w->scales, c->mult = w->scale_mult, c->bias = w->bias;
    c->mins = w->mins;
}

void shmk_gemm_group_dots(const int16_t *xq, int64_t m, const shmk_linear_t *w, int32_t *dots) {
    if (m <= 0 || w->n <= 0) return;
    gemm_ctx c;
    init_ctx(&c, m, w);
    c.dots = dots;
    prepare(&c, NULL, xq);
    plan_and_run(&c);
}

int shmk_amx_bf16_min_rows(void) { return SHMK_AMX_MIN_M; }

void shmk_linear_impl(const shmk_linear_t *w, const float *x, int64_t m, float *y,
                      int accumulate) {
    if (m <= 0 || w->n <= 0) return;
    /* NOTE: on every path: act8 weights are packed rotated, which only gemm_a8.c undoes, or
     * (W4) want 8-bit activations (gemm_w4a8.c); other W4 weights (mins) take the integer
     * kernels below whatever the path */
    if (w->act8) {
        (w->mins ? shmk_linear_w4a8_impl : shmk_linear_a8_impl)(w, x, m, y, accumulate);
        return;
    }
    const int amx = shmk_path() == SHMK_AMX && !w->mins;
    if (amx && m >= SHMK_AMX_MIN_M && w->act_bf16) {
        shmk_linear_amx(w, x, m, y, accumulate);
        return;
    }
    if (amx && m >= SHMK_AMX8_MIN_M) {
        shmk_linear_amx8(w, x, m, y, accumulate);
        return;
    }
    gemm_ctx c;
    init_ctx(&c, m, w);
    c.y = y;
    c.accumulate = accumulate;
    prepare(&c, x, NULL);
    plan_and_run(&c);
}

void shmk_linear(const float *x, int64_t m, const shmk_linear_t *w, float *y) {
    shmk_linear_impl(w, x, m, y, 0);
}
