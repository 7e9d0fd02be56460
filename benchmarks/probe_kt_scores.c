/* Speed probe for decode attention's scores with the keys stored transposed within each cache
 * block (docs/kernels.md, "Attention"): what the score pass would gain if a block of 16
 * positions held its keys dimension-major ([d][16] per kv head) instead of position-major
 * ([16][d], the cache's layout today).
 *
 * Position-major (attention.c's dec_scores8_F16_3, copied here): per 8 positions and query row
 * 8 zmm accumulators over d, then a reduction tree to 8 sums (~3 operations a position and row
 * beside the 4 FMAs at d = 64). Dimension-major: per block and row ACC zmm accumulators whose
 * lanes are the 16 positions, each FMA a key row times a broadcast query element (memory
 * operand), no horizontal reduction, the ACC partial sums added at the end. Same products, fp16
 * keys widened in registers, G = 3 query rows per kv head (SmolLM2), random data, one thread,
 * cache-resident (the compute side; the cache stream is the same bytes either way).
 *
 *   gcc -O3 benchmarks/probe_kt_scores.c -o /tmp/kt -lm && /tmp/kt 256 20000
 *
 * Measured 2026-12-08 on the Zen 4 machine (benchmarks/RESULTS.md, Model), min of 5 rounds:
 * position-major 6.06-6.13 ns a position (three query rows), dimension-major 3.30-3.46 ns
 * (1.77-1.84x; ACC 2 / 4 / 8 alike) at 128, 256 and 1024 positions; the scores agree to 5e-7.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define FN __attribute__((target("avx512f,avx512bw,avx512vl,f16c,fma,avx2")))
#define D 64
#define G 3
#define BLK 16
#ifndef ACC
#define ACC 4 /* accumulators a row in the dimension-major kernel (FMA chains of D / ACC) */
#endif

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

FN static __m256 fold512(__m512 a) {
    return _mm256_add_ps(_mm512_castps512_ps256(a),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}

FN static __m256 reduce8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5,
                         __m256 a6, __m256 a7) {
    __m256 t0 = _mm256_hadd_ps(a0, a1), t1 = _mm256_hadd_ps(a2, a3);
    __m256 t2 = _mm256_hadd_ps(a4, a5), t3 = _mm256_hadd_ps(a6, a7);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                         _mm256_permute2f128_ps(u0, u1, 0x31));
}

#define LOAD16(p, i) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((p) + (i))))

/* position-major: s[r * ss + j] = q_r . k_j for 8 positions (keys at kp[j]) */
FN static void scores8_pos(const float *q, const uint16_t *const *kp, float *s, int64_t ss) {
    __m512 a[G][8];
    for (int r = 0; r < G; r++)
        for (int j = 0; j < 8; j++) a[r][j] = _mm512_setzero_ps();
    for (int i = 0; i < D; i += 16) {
        __m512 qv[G];
        for (int r = 0; r < G; r++) qv[r] = _mm512_loadu_ps(q + r * D + i);
        for (int j = 0; j < 8; j++) {
            const __m512 k = LOAD16(kp[j], i);
            for (int r = 0; r < G; r++) a[r][j] = _mm512_fmadd_ps(qv[r], k, a[r][j]);
        }
    }
    for (int r = 0; r < G; r++)
        _mm256_storeu_ps(s + r * ss,
                         reduce8(fold512(a[r][0]), fold512(a[r][1]), fold512(a[r][2]),
                                 fold512(a[r][3]), fold512(a[r][4]), fold512(a[r][5]),
                                 fold512(a[r][6]), fold512(a[r][7])));
}

/* dimension-major: s[r * ss + j] = q_r . k_j for the block's 16 positions (kt: [D][16]) */
FN static void scores16_dim(const float *q, const uint16_t *kt, float *s, int64_t ss) {
    __m512 a[G][ACC];
    for (int r = 0; r < G; r++)
        for (int c = 0; c < ACC; c++) a[r][c] = _mm512_setzero_ps();
    for (int i = 0; i < D; i += ACC)
        for (int c = 0; c < ACC; c++) {
            const __m512 k = LOAD16(kt, (i + c) * BLK);
            for (int r = 0; r < G; r++)
                a[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(q[r * D + i + c]), k, a[r][c]);
        }
    for (int r = 0; r < G; r++) {
        __m512 t = a[r][0];
        for (int c = 1; c < ACC; c++) t = _mm512_add_ps(t, a[r][c]);
        _mm512_storeu_ps(s + r * ss, t);
    }
}

FN int main(int argc, char **argv) {
    const int npos = argc > 1 ? atoi(argv[1]) : 256, reps = argc > 2 ? atoi(argv[2]) : 20000;
    const int nblk = (npos + BLK - 1) / BLK, np = nblk * BLK;
    uint16_t *kpos = aligned_alloc(64, (size_t)np * D * 2), *kdim = aligned_alloc(64, (size_t)np * D * 2);
    float *q = aligned_alloc(64, G * D * 4), *s0 = aligned_alloc(64, (size_t)G * np * 4),
          *s1 = aligned_alloc(64, (size_t)G * np * 4);
    srand(1);
    for (int p = 0; p < np; p++)
        for (int i = 0; i < D; i++) {
            const uint16_t h = _cvtss_sh((float)rand() / RAND_MAX - 0.5f, 0);
            kpos[p * D + i] = h;                                  /* [pos][d] */
            kdim[(p / BLK) * BLK * D + i * BLK + p % BLK] = h;    /* [block][d][16] */
        }
    for (int i = 0; i < G * D; i++) q[i] = (float)rand() / RAND_MAX - 0.5f;
    const uint16_t *rows[8];
    double best[2] = {1e9, 1e9};
    for (int round = 0; round < 5; round++) {
        double t = now();
        for (int it = 0; it < reps; it++)
            for (int p = 0; p < np; p += 8) {
                for (int j = 0; j < 8; j++) rows[j] = kpos + (p + j) * D;
                scores8_pos(q, rows, s0 + p, np);
            }
        best[0] = fmin(best[0], (now() - t) / reps);
        t = now();
        for (int it = 0; it < reps; it++)
            for (int b = 0; b < nblk; b++) scores16_dim(q, kdim + (size_t)b * BLK * D, s1 + b * BLK, np);
        best[1] = fmin(best[1], (now() - t) / reps);
    }
    double err = 0;
    for (int i = 0; i < G * np; i++) err = fmax(err, fabs(s0[i] - s1[i]));
    printf("%d positions, %d query rows, d %d: position-major %.2f ns a position, "
           "dimension-major (ACC %d) %.2f ns (%.2fx); max |diff| %.2e\n",
           npos, G, D, best[0] / np * 1e9, ACC, best[1] / np * 1e9, best[0] / best[1], err);
    return 0;
}
