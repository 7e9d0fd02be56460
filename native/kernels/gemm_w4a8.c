/* W4 x A8 GEMM: 4-bit weights on 8-bit activations, for AVX2's vpmaddubsw (and AVX512-VNNI's
 * vpdpbusd).
 *
 * A W4 weight (shmk_linear_t.mins) with `act8` set takes this kernel for every call, on every
 * path (shmk_linear_impl; the VNNI code on paths vnni and amx, the AVX2 code on avx2, else the
 * portable twin, all with the same bits).  The weights are packed as for the int16 kernels
 * (w4.c), unrotated and on the file's own grids: only the activations change.
 *
 * Why it is faster on AVX2: `vpmaddubsw` multiplies 32 u8 x s8 pairs an instruction and adds
 * them in pairs to int16, which saturates for 8-bit weights (2 x 127 x 127 > 32767; hence the
 * 7-bit activations fbgemm uses).  With u in [0, 15] a pair sums to at most 2 x 15 x 127 = 3810,
 * so eight of them add in int16 without overflow (30480), and one `vpmaddwd` by ones widens the
 * lot: ~1.1 multiplies per 32 products, against two for the int16 activations (`vpmaddwd`).
 *
 * Activations are quantised per 16 k, not per 32: on SmolLM2 (W4 layers from its Q4_1 file, a
 * simulation over four texts) per-16 scales on o, gate_up and down cost KL 0.00076 to fp32 and
 * top-1 98.9 %, per-32 ones 0.00127 and 98.1 %; the W8 x A16 default has 0.00119 and 98.7 %.
 * The two halves of a group are exactly its low and high nibbles (w4.c's layout), so each half
 * has its own int16 sums.  The qkv projection keeps int16 activations (int8_model.py: 8 bits
 * there cost the most).
 *
 * Math (portable, AVX2 and VNNI agree bit for bit):
 *   activations, per row i and half h of 32 k (16 consecutive k, zeros past k):
 *     sx[i][h] = max|x| / 127, xq = rint(x * (127 / max|x|)) in [-127, 127]; NaN elements are
 *     ignored by the max and quantise to 0; a half with max|x| < 2^-100 is zeros with sx = 0
 *     xs[i][g] = fmaf(sx[i][2g+1], sum(xq of half 2g+1), sx[i][2g] * sum(xq of half 2g)):
 *     the group's activation sum as quantised, for the minimums
 *   weights w = s u + m per (channel j, group g) as w4.c packs them
 *   dlo, dhi = sum over each half of u * xq                          exact int32 (<= 30480)
 *   acc = 0; for g in order:
 *     t = (float)dlo * sx[i][2g]; t = fmaf((float)dhi, sx[i][2g+1], t);
 *     acc = fmaf(t, s[j][g], acc); acc = fmaf(xs[i][g], m[j][g], acc)
 *   y[i][j] = acc * scale_mult (+ bias[j]) (+ y[i][j] when accumulating) */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "common.h"
#include "vnni_tile.h" /* SHMK_PF_DIST */

#define AVX2_FN __attribute__((target("avx2,fma,f16c")))
#define INLINE static inline __attribute__((always_inline))
#define W4A8_MIN_AMAX 0x1p-100f /* gemm16.c's QUANT_MIN_AMAX, for the same reason */
#define HALF (GK / 2)
#define NIBBLE_GBYTES (GBYTES / 2) /* a W4 block-group: 4 nibble rows of 64 bytes */

/* ------------------------------------------------------------------ activation quantisation */
static void quant_half_portable(const float *x, int64_t len, int8_t *q, float *s, int32_t *sum) {
    float v[HALF];
    for (int t = 0; t < HALF; t++) v[t] = t < len ? x[t] : 0.f;
    float amax = 0.f;
    for (int t = 0; t < HALF; t++) amax = shmk_max_abs(amax, v[t]);
    *sum = 0;
    if (!(amax >= W4A8_MIN_AMAX)) {
        memset(q, 0, HALF);
        *s = 0.f;
        return;
    }
    const float inv = 127.f / amax;
    for (int t = 0; t < HALF; t++) {
        /* |v| <= amax: |v * inv| rounds into [-127, 127]; NaN (or inf * 0) -> 0 */
        const float r = shmk_rint_small(v[t] * inv);
        q[t] = (int8_t)(r == r ? (int)r : 0);
        *sum += q[t];
    }
    *s = amax / 127.f;
}

AVX2_FN static void quant_half_avx2(const float *x, int64_t len, int8_t *q, float *s,
                                    int32_t *sum) {
    __m256 a, b;
    if (len >= HALF) {
        a = _mm256_loadu_ps(x), b = _mm256_loadu_ps(x + 8);
    } else {
        float t[HALF] = {0};
        memcpy(t, x, (size_t)len * sizeof(float));
        a = _mm256_loadu_ps(t), b = _mm256_loadu_ps(t + 8);
    }
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    /* NOTE: maxps returns its SECOND operand when either is NaN, so a NaN lane leaves the
     * running max (shmk_max_abs's rule in the portable loop) */
    __m256 m = _mm256_max_ps(_mm256_and_ps(a, abs_mask), _mm256_setzero_ps());
    m = _mm256_max_ps(_mm256_and_ps(b, abs_mask), m);
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
    const float amax = _mm_cvtss_f32(h);
    if (!(amax >= W4A8_MIN_AMAX)) {
        memset(q, 0, HALF);
        *s = 0.f, *sum = 0;
        return;
    }
    const __m256 inv = _mm256_set1_ps(127.f / amax);
    __m256 pa = _mm256_mul_ps(a, inv), pb = _mm256_mul_ps(b, inv);
    /* NaN lanes -> 0 before cvtps2dq (which rounds half to even, as shmk_rint_small does) */
    pa = _mm256_and_ps(pa, _mm256_cmp_ps(pa, pa, _CMP_ORD_Q));
    pb = _mm256_and_ps(pb, _mm256_cmp_ps(pb, pb, _CMP_ORD_Q));
    const __m256i ia = _mm256_cvtps_epi32(pa), ib = _mm256_cvtps_epi32(pb);
    /* int16 lanes a0-3 b0-3 | a4-7 b4-7 -> a0-7 b0-7 -> 16 bytes in order */
    const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(ia, ib), 0xD8);
    _mm_storeu_si128((__m128i *)q,
                     _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1)));
    __m256i t = _mm256_add_epi32(ia, ib);
    __m128i u = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
    u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 0x4E));
    u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 0xB1));
    *s = amax / 127.f, *sum = _mm_cvtsi128_si32(u);
}

/* rows i0 .. i1 - 1: xq[i][kp], sx[i][2G], xs[i][G] */
static void quant_rows(int path, const float *x, int64_t i0, int64_t i1, int64_t k, int8_t *xq,
                       float *sx, float *xs) {
    const int64_t kp = shmk_padded_k(k), G = kp / GK;
    for (int64_t i = i0; i < i1; i++)
        for (int64_t g = 0; g < G; g++) {
            int32_t sum[2];
            float *s = sx + i * 2 * G + 2 * g;
            for (int h = 0; h < 2; h++) {
                const int64_t k0 = g * GK + h * HALF;
                const int64_t len = k - k0 < 0 ? 0 : k - k0 < HALF ? k - k0 : HALF;
                int8_t *q = xq + i * kp + k0;
                if (path >= SHMK_AVX2)
                    quant_half_avx2(x + i * k + k0, len, q, s + h, sum + h);
                else
                    quant_half_portable(x + i * k + k0, len, q, s + h, sum + h);
            }
            xs[i * G + g] = fmaf(s[1], (float)sum[1], s[0] * (float)sum[0]);
        }
}

/* ------------------------------------------------------------------ GEMM */
typedef struct {
    int path;
    const int8_t *xq; /* [m][kp] */
    const float *sx;  /* [m][2G] */
    const float *xs;  /* [m][G] */
    const float *x;   /* quantisation stage */
    int64_t m, k, kp, G, n, nb;
    const uint8_t *packed;
    const uint16_t *scales, *mins;
    float mult;
    const float *bias;
    float *y;
    int accumulate;
    shmk_split_plan plan;
    int64_t rows_per_qtask;
} w4a8_ctx;

static inline void store_one(const w4a8_ctx *c, int64_t i, int64_t j, float acc) {
    shmk_store_one(c->y, c->n, c->bias, c->accumulate, i, j, acc * c->mult);
}

static void tile_portable(const w4a8_ctx *c, int64_t blk, int64_t i0, int64_t i1) {
    const int64_t G = c->G;
    const uint8_t *wb = c->packed + blk * G * NIBBLE_GBYTES;
    for (int64_t i = i0; i < i1; i++) {
        const int8_t *x = c->xq + i * c->kp;
        float acc[NB] = {0};
        for (int64_t g = 0; g < G; g++) {
            const uint8_t *w = wb + g * NIBBLE_GBYTES;
            int32_t d[2][NB] = {{0}};
            /* k = 4r + t of the group: nibble row r % 4, high nibbles (half 1) from r = 4 */
            for (int kk = 0; kk < GK; kk++)
                for (int ch = 0; ch < NB; ch++) {
                    const uint8_t b = w[(kk / 4 % 4) * 4 * NB + 4 * ch + (kk & 3)];
                    const int32_t u = kk >= HALF ? b >> 4 : b & 15;
                    d[kk >= HALF][ch] += u * x[g * GK + kk];
                }
            const float slo = c->sx[i * 2 * G + 2 * g], shi = c->sx[i * 2 * G + 2 * g + 1];
            const float xsum = c->xs[i * G + g];
            const uint16_t *s = c->scales + (blk * G + g) * NB, *mn = c->mins + (blk * G + g) * NB;
            for (int ch = 0; ch < NB; ch++) {
                float t = (float)d[0][ch] * slo;
                t = fmaf((float)d[1][ch], shi, t);
                acc[ch] = fmaf(t, shmk_h2f_signed(s[ch]), acc[ch]);
                acc[ch] = fmaf(xsum, shmk_h2f_signed(mn[ch]), acc[ch]);
            }
        }
        for (int64_t ch = 0; ch < NB && blk * NB + ch < c->n; ch++)
            store_one(c, i, blk * NB + ch, acc[ch]);
    }
}

/* --- AVX2: slabs of up to 4 rows x a block (two halves of 8 channels) --- */
INLINE AVX2_FN void avx2_store8(const w4a8_ctx *c, int64_t i, int64_t j0, __m256 f) {
    if (c->n - j0 < 8) {
        float t[8];
        _mm256_storeu_ps(t, f);
        for (int64_t ch = 0; ch < c->n - j0; ch++) store_one(c, i, j0 + ch, t[ch]);
        return;
    }
    __m256 v = _mm256_mul_ps(f, _mm256_set1_ps(c->mult));
    if (c->bias) v = _mm256_add_ps(v, _mm256_loadu_ps(c->bias + j0));
    float *y = c->y + i * c->n + j0;
    if (c->accumulate) v = _mm256_add_ps(_mm256_loadu_ps(y), v);
    _mm256_storeu_ps(y, v);
}

/* The broadcasts a row slab's kernels multiply by, built once per slab, task and chunk of
 * groups and read as memory operands by every block's passes: for group g0 + gi,
 * bx[((gi * 4 + p) * 2 + h) * mr + r] = row i0 + r's activations k 4p .. 4p + 3 (h = 0) or
 * k 16 + 4p .. (h = 1) of the group, in each dword lane.
 * NOTE: a vpbroadcastd per product in the loop had been a third of its instructions; chunks of
 * W4A8_BX_BYTES keep the broadcasts in L1 (all of k = 1536 for 4 rows, 48 KB, had left the
 * down projection's speed where the int16 kernel's is). */
#define W4A8_BX_BYTES (28 * 1024)
#define W4A8_BX_PER_ROW 11 /* ymm a row and group: 8 activation broadcasts, 2 scales, 1 sum */
AVX2_FN static void avx2_broadcasts(const w4a8_ctx *c, int64_t i0, int mr, int64_t g0, int64_t g1,
                                    __m256i *bx) {
    __m256 *bs = (__m256 *)(bx + (g1 - g0) * 8 * mr);
    for (int64_t g = g0; g < g1; g++)
        for (int r = 0; r < mr; r++) {
            for (int p = 0; p < 4; p++)
                for (int h = 0; h < 2; h++) {
                    int32_t v;
                    memcpy(&v, c->xq + (i0 + r) * c->kp + g * GK + h * HALF + 4 * p, 4);
                    bx[(((g - g0) * 4 + p) * 2 + h) * mr + r] = _mm256_set1_epi32(v);
                }
            /* the row's two half scales and its activation sum, for the epilogue */
            const float *sx = c->sx + (i0 + r) * 2 * c->G + 2 * g;
            __m256 *o = bs + ((g - g0) * mr + r) * 3;
            o[0] = _mm256_set1_ps(sx[0]), o[1] = _mm256_set1_ps(sx[1]);
            o[2] = _mm256_set1_ps(c->xs[(i0 + r) * c->G + g]);
        }
}

/* Each 32 bytes of a nibble row p (8 channels x 4 k) give the u8 weights of k 4p .. 4p + 3
 * (low nibbles) and k 16 + 4p .. (high), in vpmaddubsw's layout: a dword lane per channel, so
 * a broadcast of the row's 4 activations multiplies them and the int16 lane pair (2c, 2c + 1)
 * holds channel c.  Per half, 4 products add in int16 (at most 4 x 3810) and vpmaddwd by ones
 * gives each channel's exact int32 dot.
 * This runs groups g0 .. g1 - 1 of block blk (halves e0 .. e0 + nh - 1) for rows
 * i0 .. i0 + mr - 1, continuing the fp32 sums f[e * mr + r] (zeroed by the caller before group
 * 0), and stores them after the last group.
 * NOTE: the products and sums are asm: from intrinsics GCC reassociated the int16 adds into
 * trees, computing all 32 products of a group first and spilling them to the stack. */
INLINE AVX2_FN void avx2_kernel(const w4a8_ctx *c, int64_t blk, int e0, int64_t i0, const int mr,
                                const int nh, const __m256i *bx, int64_t g0, int64_t g1,
                                float f[][8]) {
    const int64_t G = c->G;
    const uint8_t *wb = c->packed + blk * G * NIBBLE_GBYTES + 32 * e0;
    const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    const __m256 *bs = (const __m256 *)(bx + (g1 - g0) * 8 * mr); /* avx2_broadcasts */
    for (int64_t g = g0; g < g1; g++) {
        const uint8_t *w = wb + g * NIBBLE_GBYTES;
        __m256i lo[4], hi[4]; /* [e * mr + r] */
#pragma GCC unroll 4
        for (int a = 0; a < 4; a++) lo[a] = hi[a] = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int p = 0; p < 4; p++) {
            const __m256i *b = bx + ((g - g0) * 4 + p) * 2 * mr; /* [h][r] */
            /* the weights stream from memory in decode: the first pass over a line fetches
             * ahead (as gemm16.c's W4 kernels do, the same distance in nibble bytes) */
            if (e0 == 0) _mm_prefetch((const char *)w + p * 64 + SHMK_PF_DIST, _MM_HINT_T0);
#pragma GCC unroll 2
            for (int e = 0; e < nh; e++) {
                __m256i ul, uh, t;
                __asm__("vmovdqu %[w], %[ul]\n\t"
                        "vpsrlw $4, %[ul], %[uh]\n\t"
                        "vpand %[low], %[ul], %[ul]\n\t"
                        "vpand %[low], %[uh], %[uh]"
                        : [ul] "=&x"(ul), [uh] "=&x"(uh) /* written before low's last read */
                        : [w] "m"(*(const char(*)[32])(w + p * 64 + 32 * e)), [low] "x"(low));
#pragma GCC unroll 4
                for (int r = 0; r < mr; r++)
                    /* l += maddubs(u_lo, k 4p ..), h += maddubs(u_hi, k 16 + 4p ..) */
                    __asm__("vpmaddubsw %[bl], %[ul], %[t]\n\t"
                            "vpaddw %[t], %[l], %[l]\n\t"
                            "vpmaddubsw %[bh], %[uh], %[t]\n\t"
                            "vpaddw %[t], %[h], %[h]"
                            : [l] "+x"(lo[e * mr + r]), [h] "+x"(hi[e * mr + r]), [t] "=&x"(t)
                            : [ul] "x"(ul), [uh] "x"(uh), [bl] "m"(b[r]), [bh] "m"(b[mr + r]));
            }
        }
#pragma GCC unroll 2
        for (int e = 0; e < nh; e++) {
            const int64_t sg = (blk * G + g) * NB + 8 * (e0 + e);
            const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(c->scales + sg)));
            const __m256 mn = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(c->mins + sg)));
#pragma GCC unroll 4
            for (int r = 0; r < mr; r++) {
                const __m256 *v = bs + ((g - g0) * mr + r) * 3; /* sx lo, sx hi, xs */
                const int a = e * mr + r;
                const __m256 dl = _mm256_cvtepi32_ps(_mm256_madd_epi16(lo[a], ones));
                const __m256 dh = _mm256_cvtepi32_ps(_mm256_madd_epi16(hi[a], ones));
                __m256 t = _mm256_mul_ps(dl, v[0]);
                t = _mm256_fmadd_ps(dh, v[1], t);
                __m256 acc = _mm256_fmadd_ps(t, s, _mm256_load_ps(f[a]));
                acc = _mm256_fmadd_ps(v[2], mn, acc);
                _mm256_store_ps(f[a], acc);
            }
        }
    }
    if (g1 < G) return;
    for (int e = 0; e < nh; e++)
        for (int r = 0; r < mr; r++)
            avx2_store8(c, i0 + r, blk * NB + 8 * (e0 + e), _mm256_load_ps(f[e * mr + r]));
}

/* Block blk for rows i .. i + MR - 1, groups g0 .. g1 - 1, sums f (8 rows of 8: [e][r]): 1-2
 * rows take both halves a pass (each broadcast feeds two products; one row as two passes had
 * been 12 % slower than the int16 kernel at k = 1536), 3-4 rows one half a pass (8 int16 sums
 * fill the registers). */
#define W4A8_PASSES(MR)                                                                       \
    AVX2_FN __attribute__((noinline)) static void avx2_rows##MR(                               \
        const w4a8_ctx *c, int64_t blk, int64_t i, const __m256i *bx, int64_t g0, int64_t g1,  \
        float f[][8]) {                                                                       \
        if (MR <= 2) {                                                                        \
            avx2_kernel(c, blk, 0, i, MR, 2, bx, g0, g1, f);                                  \
        } else {                                                                              \
            avx2_kernel(c, blk, 0, i, MR, 1, bx, g0, g1, f);                                  \
            avx2_kernel(c, blk, 1, i, MR, 1, bx, g0, g1, f + MR);                             \
        }                                                                                     \
    }
W4A8_PASSES(1)
W4A8_PASSES(2)
W4A8_PASSES(3)
W4A8_PASSES(4)
#undef W4A8_PASSES

/* The task's blocks b0 .. b1 - 1 for rows i0 .. i1 - 1: runs of blocks whose nibbles fit in
 * W4A8_RUN_BYTES, each for every slab of up to 4 rows, a chunk of groups at a time (the blocks'
 * fp32 sums wait in scratch between chunks: the groups still fold in order).
 * NOTE: slabs outside the blocks had read all of a task's weights again for every 4 rows (at
 * batch 16 the up projection's 442 KB a thread, four times per step, from L3 or memory). */
#define W4A8_RUN_BYTES (128 * 1024)
static void task_avx2(const w4a8_ctx *c, int64_t b0, int64_t b1, int64_t i0, int64_t i1) {
    typedef void (*rows_fn)(const w4a8_ctx *, int64_t, int64_t, const __m256i *, int64_t,
                            int64_t, float[][8]);
    static const rows_fn rows[4] = {avx2_rows1, avx2_rows2, avx2_rows3, avx2_rows4};
    __m256i *bx = shmk_scratch(5, W4A8_BX_BYTES);
    int64_t run = W4A8_RUN_BYTES / (c->G * NIBBLE_GBYTES);
    if (run < 1) run = 1;
    float(*f)[8][8] = shmk_scratch(6, (size_t)run * sizeof *f);
    for (int64_t r0 = b0; r0 < b1; r0 += run) {
        const int64_t r1 = r0 + run < b1 ? r0 + run : b1;
        for (int64_t i = i0; i < i1; i += 4) {
            const int mr = i1 - i < 4 ? (int)(i1 - i) : 4;
            /* as few chunks as fit, of equal size (k = 576: one; 1536: three for 4 rows) */
            const int64_t most = W4A8_BX_BYTES / (W4A8_BX_PER_ROW * mr * (int64_t)sizeof(__m256i));
            const int64_t chunk = shmk_cdiv(c->G, shmk_cdiv(c->G, most));
            memset(f, 0, (size_t)(r1 - r0) * sizeof *f);
            for (int64_t g0 = 0; g0 < c->G; g0 += chunk) {
                const int64_t g1 = g0 + chunk < c->G ? g0 + chunk : c->G;
                avx2_broadcasts(c, i, mr, g0, g1, bx);
                for (int64_t b = r0; b < r1; b++) rows[mr - 1](c, b, i, bx, g0, g1, f[b - r0]);
            }
        }
    }
}

/* --- AVX512-VNNI: vpdpbusd multiplies u8 x s8 in fours and adds them into int32 lanes, which is
 * the nibble rows' layout as they lie: lane c of a 64-byte nibble row p holds channel c's four u
 * of k 4p .. 4p + 3 (low nibbles) and 16 + 4p .. (high), so a masked copy of each half meets an
 * embedded broadcast of the row's four activations.  No widening and no int16 sums (the AVX2
 * kernel's pair adds and their vpmaddwd by ones): per group, row and 16 channels two int32 sums
 * and the same epilogue.  Rows in slabs of up to W4A8_VNNI_MR (2 sums each: 16 of the 32 zmm,
 * plus the fp32 sums and the weights); a block's nibbles (G x 256 bytes: 4.5 KB at k = 576)
 * stay in L1 across a task's slabs, in L2 for the longest k.
 * NOTE: tested bit for bit against the portable twin under SIMDe's emulation of the intrinsics
 * (test_kernels_vnni_emulated.py); not yet timed on a VNNI CPU. --- */
#define W4A8_VNNI_MR 8
_Static_assert(W4A8_VNNI_MR == 8, "SHMK_SLAB_SWITCH takes slabs of up to 8 rows");

INLINE SHMK_VNNI_FN void vnni_kernel(const w4a8_ctx *c, int64_t blk, int64_t i0, const int mr,
                                     const int pf) {
    const int64_t G = c->G, kp = c->kp;
    const uint8_t *wb = c->packed + blk * G * NIBBLE_GBYTES;
    const __m512i low = _mm512_set1_epi8(15);
    __m512 f[W4A8_VNNI_MR];
    for (int r = 0; r < mr; r++) f[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *w = wb + g * NIBBLE_GBYTES;
        __m512i lo[W4A8_VNNI_MR], hi[W4A8_VNNI_MR];
        for (int r = 0; r < mr; r++) lo[r] = hi[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int p = 0; p < 4; p++) {
            if (pf) _mm_prefetch((const char *)w + p * 64 + SHMK_PF_DIST, _MM_HINT_T0);
            const __m512i u = _mm512_loadu_si512((const void *)(w + p * 64));
            const __m512i ul = _mm512_and_si512(u, low);
            const __m512i uh = _mm512_and_si512(_mm512_srli_epi16(u, 4), low);
            for (int r = 0; r < mr; r++) {
                const int8_t *x = c->xq + (i0 + r) * kp + g * GK + 4 * p;
                int32_t a, b; /* activations k 4p .. 4p + 3 and 16 + 4p .. of the group */
                memcpy(&a, x, 4);
                memcpy(&b, x + HALF, 4);
                lo[r] = _mm512_dpbusd_epi32(lo[r], ul, _mm512_set1_epi32(a));
                hi[r] = _mm512_dpbusd_epi32(hi[r], uh, _mm512_set1_epi32(b));
            }
        }
        const int64_t sg = (blk * G + g) * NB;
        const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(c->scales + sg)));
        const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(c->mins + sg)));
        for (int r = 0; r < mr; r++) {
            const float *sx = c->sx + (i0 + r) * 2 * G + 2 * g;
            __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(lo[r]), _mm512_set1_ps(sx[0]));
            t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi[r]), _mm512_set1_ps(sx[1]), t);
            f[r] = _mm512_fmadd_ps(t, s, f[r]);
            f[r] = _mm512_fmadd_ps(_mm512_set1_ps(c->xs[(i0 + r) * G + g]), mn, f[r]);
        }
    }
    const __m512 mult = _mm512_set1_ps(c->mult);
    for (int r = 0; r < mr; r++)
        shmk_vnni_store(c->y + (i0 + r) * c->n, c->bias, c->n, blk, _mm512_mul_ps(f[r], mult),
                        c->accumulate);
}

/* blocks b0 .. b1 - 1, rows i0 .. i1 - 1; the first slab of a block streams its nibbles from
 * memory (prefetched), the others find them in L1 */
SHMK_VNNI_FN static void task_vnni(const w4a8_ctx *c, int64_t b0, int64_t b1, int64_t i0,
                                   int64_t i1) {
    for (int64_t b = b0; b < b1; b++)
        for (int64_t i = i0; i < i1; i += W4A8_VNNI_MR) {
#define W4A8_SLAB(mr) vnni_kernel(c, b, i, mr, i == i0)
            SHMK_SLAB_SWITCH(i1 - i, W4A8_SLAB)
#undef W4A8_SLAB
        }
}

static void gemm_task(void *vctx, int64_t task, int tid) {
    (void)tid;
    const w4a8_ctx *c = vctx;
    int64_t u0, u1, i0, i1;
    shmk_split_task(&c->plan, task, &u0, &u1, &i0, &i1);
    const int64_t b1 = 2 * u1 < c->nb ? 2 * u1 : c->nb;
    if (c->path >= SHMK_VNNI) {
        task_vnni(c, 2 * u0, b1, i0, i1);
        return;
    }
    if (c->path >= SHMK_AVX2) {
        task_avx2(c, 2 * u0, b1, i0, i1);
        return;
    }
    for (int64_t b = 2 * u0; b < b1; b++) tile_portable(c, b, i0, i1);
}

static void quant_task(void *vctx, int64_t task, int tid) {
    (void)tid;
    const w4a8_ctx *c = vctx;
    const int64_t i0 = task * c->rows_per_qtask;
    const int64_t i1 = i0 + c->rows_per_qtask < c->m ? i0 + c->rows_per_qtask : c->m;
    quant_rows(c->path, c->x, i0, i1, c->k, (int8_t *)c->xq, (float *)c->sx, (float *)c->xs);
}

/* NOTE: gemm16.c's row tile: a block's nibbles stay in L1 across the tile's rows */
#define W4A8_MTILE 24

void shmk_linear_w4a8_impl(const shmk_linear_t *w, const float *x, int64_t m, float *y,
                           int accumulate) {
    if (m <= 0 || w->n <= 0) return;
    w4a8_ctx c;
    memset(&c, 0, sizeof c);
    c.path = shmk_path() >= SHMK_VNNI ? SHMK_VNNI : shmk_path() >= SHMK_AVX2 ? SHMK_AVX2
                                                                         : SHMK_PORTABLE;
    c.m = m, c.k = w->k, c.kp = shmk_padded_k(w->k), c.G = c.kp / GK;
    c.n = w->n, c.nb = shmk_cdiv(w->n, NB);
    c.packed = (const uint8_t *)w->packed, c.scales = w->scales, c.mins = w->mins;
    c.mult = w->scale_mult, c.bias = w->bias, c.y = y, c.accumulate = accumulate, c.x = x;
    c.xq = shmk_scratch(0, (size_t)(m * c.kp));
    c.sx = shmk_scratch(1, (size_t)(m * 2 * c.G) * sizeof(float));
    c.xs = shmk_scratch(4, (size_t)(m * c.G) * sizeof(float));
    c.rows_per_qtask = m <= 8 ? m : shmk_cdiv(m, 4 * shmk_threads());
    shmk_parallel(quant_task, &c, shmk_cdiv(m, c.rows_per_qtask));
    c.plan = shmk_split_tiles(m, shmk_cdiv(c.nb, 2), shmk_threads(), W4A8_MTILE);
    shmk_parallel(gemm_task, &c, c.plan.ntasks);
}

void shmk_quantize_rows_w4a8(const float *x, int64_t m, int64_t k, int8_t *xq, float *scales,
                             float *sums) {
    quant_rows(shmk_path() >= SHMK_AVX2 ? SHMK_AVX2 : SHMK_PORTABLE, x, 0, m, k, xq, scales,
               sums);
}
