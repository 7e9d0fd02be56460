/* Speed probe for an 8-bit-activation GEMM on AVX512-VNNI (docs/kernels.md, "Why this scheme"):
 * u8 x s8 `vpdpbusd` tiles over the packed quad-row layout as gemm16.c lays it out (lane c of a
 * quad row = channel c's 4 k, so no widening and no lane-pair permutes), activations as
 * u8 = int8 + 128 with the offset taken back by starting each accumulator at -128 x the weights'
 * sum over the span, one activation scale per SPAN k (16 or 32) folded with the weight group's.
 * Random data, one thread, cache-hot, no activation quantisation: the kernel core only.
 *
 *   gcc -O3 -DMR=4 -DSPAN=16 benchmarks/probe_a8_tile.c -o /tmp/a8 && /tmp/a8 3072 576 256
 *
 * Measured 2026-12-06 on the Zen 4 machine (benchmarks/RESULTS.md, Model), one thread,
 * alternated with kernels.linear (int16, ~174-181 GOP/s): SPAN 16 288-309 GOP/s (1.6-1.7x),
 * SPAN 32 347-371 (2.0x). */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#define T __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
#define GK 32
#define NB 16
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
/* packed: [nb][G][8 quad rows][64]; corr: int32 [nb][G][HALVES][16] = -128 x the span's
 * weight sum; ws fp32 [nb][G][16]; xu: u8 [m][kp]; xs: fp32 [m][kp / SPAN] */
#ifndef MR
#define MR 4
#endif
#ifndef SPAN
#define SPAN 16 /* k per activation scale: 16 or 32 */
#endif
#define HALVES (32 / SPAN)
#define QUADS (SPAN / 4)
T static void tile(const int8_t *wp, const int32_t *corr, const float *ws, const uint8_t *xu,
                   const float *xs, int64_t kp, int64_t G, int64_t blk, int64_t i0, int mr,
                   float *y, int64_t n) {
    const int8_t *w0 = wp + blk * G * 512, *w1 = w0 + G * 512;
    __m512 f[MR][2];
    for (int r = 0; r < mr; r++) f[r][0] = f[r][1] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const __m512 s0 = _mm512_loadu_ps(ws + (blk * G + g) * 16);
        const __m512 s1 = _mm512_loadu_ps(ws + ((blk + 1) * G + g) * 16);
        for (int h = 0; h < HALVES; h++) {
            const __m512i c0 = _mm512_loadu_si512(corr + ((blk * G + g) * HALVES + h) * 16);
            const __m512i c1 = _mm512_loadu_si512(corr + (((blk + 1) * G + g) * HALVES + h) * 16);
            __m512i d[MR][2];
            for (int r = 0; r < mr; r++) d[r][0] = c0, d[r][1] = c1;
#pragma GCC unroll 8
            for (int q = 0; q < QUADS; q++) {
                const __m512i a = _mm512_loadu_si512(w0 + g * 512 + (h * QUADS + q) * 64);
                const __m512i b = _mm512_loadu_si512(w1 + g * 512 + (h * QUADS + q) * 64);
                for (int r = 0; r < mr; r++) {
                    int32_t v; memcpy(&v, xu + (i0 + r) * kp + g * 32 + h * SPAN + q * 4, 4);
                    const __m512i xb = _mm512_set1_epi32(v);
                    d[r][0] = _mm512_dpbusd_epi32(d[r][0], xb, a);
                    d[r][1] = _mm512_dpbusd_epi32(d[r][1], xb, b);
                }
            }
            for (int r = 0; r < mr; r++) {
                const __m512 sx = _mm512_set1_ps(xs[(i0 + r) * (kp / SPAN) + g * HALVES + h]);
                f[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d[r][0]), _mm512_mul_ps(s0, sx), f[r][0]);
                f[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d[r][1]), _mm512_mul_ps(s1, sx), f[r][1]);
            }
        }
    }
    for (int r = 0; r < mr; r++) {
        _mm512_storeu_ps(y + (i0 + r) * n + blk * 16, f[r][0]);
        _mm512_storeu_ps(y + (i0 + r) * n + blk * 16 + 16, f[r][1]);
    }
}
T static void gemm(const int8_t *wp, const int32_t *corr, const float *ws, const uint8_t *xu,
                   const float *xs, int64_t m, int64_t n, int64_t kp, float *y) {
    int64_t G = kp / 32, nb = n / 16;
    const int64_t MT = 24;
    for (int64_t i0 = 0; i0 < m; i0 += MT) {
        int64_t i1 = i0 + MT < m ? i0 + MT : m;
        for (int64_t blk = 0; blk < nb; blk += 2) {
            int64_t i = i0;
            for (; i + MR <= i1; i += MR) tile(wp, corr, ws, xu, xs, kp, G, blk, i, MR, y, n);
            if (i < i1) tile(wp, corr, ws, xu, xs, kp, G, blk, i, (int)(i1 - i), y, n);
        }
    }
}
int main(int argc, char **argv) {
    int64_t n = atoi(argv[1]), k = atoi(argv[2]), m = atoi(argv[3]);
    int64_t G = k / 32, nb = n / 16;
    int8_t *wp = aligned_alloc(64, nb * G * 512);
    int32_t *corr = aligned_alloc(64, nb * G * 2 * 16 * 4);
    float *ws = aligned_alloc(64, nb * G * 16 * 4);
    uint8_t *xu = aligned_alloc(64, m * k);
    float *xs = aligned_alloc(64, m * (k / 16) * 4);
    float *y = aligned_alloc(64, m * n * 4);
    for (int64_t i = 0; i < nb * G * 512; i++) wp[i] = (int8_t)(rand() % 255 - 127);
    for (int64_t i = 0; i < nb * G * 32; i++) corr[i] = rand() % 1000;
    for (int64_t i = 0; i < nb * G * 16; i++) ws[i] = 1e-3f;
    for (int64_t i = 0; i < m * k; i++) xu[i] = (uint8_t)rand();
    for (int64_t i = 0; i < m * k / 16; i++) xs[i] = 1e-2f;
    gemm(wp, corr, ws, xu, xs, m, n, k, y);
    double best = 1e9;
    for (int rep = 0; rep < 7; rep++) {
        int it = (int)(2e8 / (2.0 * m * n * k)) + 1;
        double t0 = now();
        for (int j = 0; j < it; j++) gemm(wp, corr, ws, xu, xs, m, n, k, y);
        double dt = (now() - t0) / it;
        if (dt < best) best = dt;
    }
    printf("n=%ld k=%ld m=%ld MR=%d SPAN=%d: %.1f GOP/s one thread (y0 %g)\n", n, k, m, MR, SPAN, 2.0 * m * n * k / best / 1e9, y[0]);
    return 0;
}
