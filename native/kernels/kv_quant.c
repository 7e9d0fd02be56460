/* int8 KV rows: the Walsh-Hadamard rotation of keys and per-row symmetric int8 quantisation.
 *
 * Why: an int8 cache holds 1.88x the tokens of an fp16 one in the same budget and halves the
 * bytes batched decode streams from it.  Quantised as they are, keys lose too much on their few
 * large channels (SmolLM2, fp32 weights, int8 rows against an fp32 cache: top-1 agreement
 * 97.5-98.6 %); rotating each key row by the Hadamard matrix first spreads those channels over
 * the row (QuaRot's observation) and halves the logit error (98.1-98.9 % on four texts).
 * Values quantise well as they are.  The attention kernels rotate the queries the same way:
 * with the unnormalised Sylvester matrix, H H = d I, so (H q).(H k) = d (q.k) and 1/d joins the
 * softmax scale.
 *
 * Bit-identical across paths: the AVX-512 transform does the portable butterflies stage by stage
 * (each output is the same a + b or a - b), and the quantiser's per-element arithmetic is the
 * same, NaN included (fmaxf/fminf and max_ps/min_ps with the row value first both drop it). */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "common.h"

#define AVX512_FN __attribute__((target("avx512f,avx512bw")))

static void fwht_portable(float *x, int64_t d) {
    for (int64_t len = 1; len < d; len <<= 1)
        for (int64_t i = 0; i < d; i += 2 * len)
            for (int64_t j = i; j < i + len; j++) {
                const float a = x[j], b = x[j + len];
                x[j] = a + b;
                x[j + len] = a - b;
            }
}

/* d a multiple of 16: stages 1-8 inside each zmm (lane j pairs with lane j ^ len; the lanes with
 * that bit set take partner - self = a - b), the wider ones between registers */
AVX512_FN static void fwht_512(float *x, int64_t d) {
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t i = 0; i < d; i += 16) {
        __m512 v = _mm512_loadu_ps(x + i);
        for (int len = 1; len < 16; len <<= 1) {
            const __m512i partner = _mm512_xor_si512(lanes, _mm512_set1_epi32(len));
            const __mmask16 upper =
                _mm512_test_epi32_mask(lanes, _mm512_set1_epi32(len)); /* bit len set */
            const __m512 p = _mm512_permutexvar_ps(partner, v);
            v = _mm512_mask_sub_ps(_mm512_add_ps(v, p), upper, p, v);
        }
        _mm512_storeu_ps(x + i, v);
    }
    for (int64_t len = 16; len < d; len <<= 1)
        for (int64_t i = 0; i < d; i += 2 * len)
            for (int64_t j = i; j < i + len; j += 16) {
                const __m512 a = _mm512_loadu_ps(x + j), b = _mm512_loadu_ps(x + j + len);
                _mm512_storeu_ps(x + j, _mm512_add_ps(a, b));
                _mm512_storeu_ps(x + j + len, _mm512_sub_ps(a, b));
            }
}

void shmk_fwht(float *x, int64_t d) {
    if (shmk_path() >= SHMK_VNNI && d % 16 == 0)
        fwht_512(x, d);
    else
        fwht_portable(x, d);
}

/* scale = max|x| / 127 (0 for an all-zero row); q = round-to-nearest-even(x * 127 / max|x|),
 * clamped to +-127 */
static float row_amax(const float *x, int64_t d) {
    float amax = 0.f;
    for (int64_t i = 0; i < d; i++) amax = fmaxf(fabsf(x[i]), amax);
    return amax;
}

AVX512_FN static float row_amax_512(const float *x, int64_t d) {
    __m512 m = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= d; i += 16) m = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + i)), m);
    float amax = _mm512_reduce_max_ps(m);
    for (; i < d; i++) amax = fmaxf(fabsf(x[i]), amax);
    return amax;
}

static inline int8_t quant_one(float x, float inv) {
    return (int8_t)lrintf(fmaxf(fminf(x * inv, 127.f), -127.f));
}

AVX512_FN static void quant_512(const float *x, int64_t d, float inv, int8_t *q) {
    const __m512 vinv = _mm512_set1_ps(inv), hi = _mm512_set1_ps(127.f);
    const __m512 lo = _mm512_set1_ps(-127.f);
    int64_t i = 0;
    for (; i + 16 <= d; i += 16) {
        const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(x + i), vinv);
        const __m512 clamped = _mm512_max_ps(_mm512_min_ps(v, hi), lo); /* NaN -> 127, as fminf */
        _mm_storeu_si128((__m128i *)(q + i), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(clamped)));
    }
    for (; i < d; i++) q[i] = quant_one(x[i], inv);
}

void shmk_quant_kv_row(const float *x, int64_t d, int8_t *q, float *scale) {
    const int wide = shmk_path() >= SHMK_VNNI;
    const float amax = wide ? row_amax_512(x, d) : row_amax(x, d);
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    *scale = amax / 127.f;
    if (wide) {
        quant_512(x, d, inv, q);
        return;
    }
    for (int64_t i = 0; i < d; i++) q[i] = quant_one(x[i], inv);
}
