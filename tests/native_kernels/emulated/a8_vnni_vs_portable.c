/* gemm_a8.c's VNNI kernel against its portable twin, bit for bit, where the CPU has no AVX-512:
 * built against SIMDe's emulation of the intrinsics (immintrin.h here) by
 * test_kernels_a8_emulated.py, which splices in gemm_a8.c (target attributes removed) and
 * pool.c's work split.  Tasks run in reverse order on one thread: any order must give the
 * same bits. */
#include <stdio.h>
#include <stdlib.h>
#include "gemm_a8.c"
#include "split.inc"
int64_t shmk_padded_k(int64_t k) { return shmk_cdiv(k, GK) * GK; }
static int g_path = SHMK_VNNI, g_threads = 1;
int shmk_path(void) { return g_path; }
int shmk_threads(void) { return g_threads; }
void shmk_parallel(shmk_task_fn fn, void *ctx, int64_t n) {
    /* tasks in reverse, tid alternating: any order must give the same bits */
    for (int64_t t = n - 1; t >= 0; t--) fn(ctx, t, (int)(t % 2));
}
void *shmk_scratch(int slot, size_t bytes) {
    static void *p[9]; static size_t sz[9];
    if (sz[slot] < bytes) { free(p[slot]); p[slot] = aligned_alloc(64, (bytes + 4159) & ~(size_t)63); sz[slot] = bytes; }
    return p[slot];
}
static uint32_t rs = 12345;
static uint32_t rnd(void) { rs = rs * 1664525u + 1013904223u; return rs >> 8; }
static float frand(void) { return ((float)(rnd() & 0xffff) / 32768.f - 1.f); }
int main(void) {
    const int64_t shapes[][2] = {{16, 32}, {17, 7}, {33, 131}, {960, 576}, {50, 1536}, {40, 70}};
    const int64_t ms[] = {1, 2, 3, 4, 5, 16, 17, 24, 25, 70};
    int bad = 0, runs = 0;
    for (int si = 0; si < 6; si++) for (int mi = 0; mi < 10; mi++) for (int th = 1; th <= 2; th++)
    for (int bias = 0; bias < 2; bias++) for (int accum = 0; accum < 2; accum++) {
        const int64_t n = shapes[si][0], k = shapes[si][1], m = ms[mi];
        const int64_t kp = shmk_padded_k(k), nb = shmk_cdiv(n, NB), G = kp / GK;
        int8_t *packed = malloc(nb * NB * kp);
        uint16_t *sc = malloc(nb * G * NB * 2);
        for (int64_t i = 0; i < nb * NB * kp; i++) packed[i] = (int8_t)((int)(rnd() % 255) - 127);
        for (int64_t i = 0; i < nb * G * NB; i++) sc[i] = (uint16_t)(0x2c00 + rnd() % 0x1000);
        float *b = malloc(n * 4), *x = malloc(m * k * 4), *y0 = malloc(m * n * 4), *y1 = malloc(m * n * 4);
        for (int64_t i = 0; i < n; i++) b[i] = frand();
        for (int64_t i = 0; i < m * k; i++) x[i] = frand() * ((rnd() % 40) ? 1.f : 30.f);
        /* edge rows */
        if (m > 1) for (int64_t t = 0; t < k; t++) x[1 * k + t] = 0.f;
        if (m > 2) for (int64_t t = 0; t < k; t++) x[2 * k + t] = 1e-35f;
        if (m > 3) for (int64_t t = 0; t < k; t += 3) x[3 * k + t] = NAN;
        if (m > 4) x[4 * k] = INFINITY;
        if (m > 5) for (int64_t t = 0; t < k && t < 32; t++) x[5 * k + t] = (float)(t % 3) - 1.f;
        if (m > 6) for (int64_t t = 0; t < k && t < 32; t++) x[6 * k + t] = 2.5f;
        for (int64_t i = 0; i < m * n; i++) y0[i] = y1[i] = frand();
        shmk_linear_t w = {.n = n, .k = k, .packed = packed, .scales = sc, .scale_mult = 0.5f,
                           .bias = bias ? b : NULL, .act_bf16 = 0, .act8 = 1};
        g_threads = th;
        g_path = SHMK_PORTABLE; linear_a8(SHMK_PORTABLE, &w, x, m, y0, accum);
        g_path = SHMK_VNNI; linear_a8(SHMK_VNNI, &w, x, m, y1, accum);
        runs++;
        if (memcmp(y0, y1, m * n * 4)) {
            bad++;
            for (int64_t i = 0; i < m * n; i++) if (memcmp(&y0[i], &y1[i], 4)) {
                printf("DIFF n=%ld k=%ld m=%ld th=%d bias=%d acc=%d at row %ld col %ld: %g vs %g\n",
                       n, k, m, th, bias, accum, i / n, i % n, y0[i], y1[i]);
                break;
            }
        }
        /* quantiser alone */
        uint8_t *q0 = malloc(m * kp), *q1 = malloc(m * kp); float *s0 = malloc(m * G * 4), *s1 = malloc(m * G * 4);
        quant_rows(SHMK_PORTABLE, x, 0, m, k, q0, s0); quant_rows(SHMK_VNNI, x, 0, m, k, q1, s1);
        if (memcmp(q0, q1, m * kp) || memcmp(s0, s1, m * G * 4)) { bad++; printf("QDIFF n=%ld k=%ld m=%ld\n", n, k, m); }
        free(q0); free(q1); free(s0); free(s1);
        free(packed); free(sc); free(b); free(x); free(y0); free(y1);
    }
    printf("%d runs, %d differ\n", runs, bad);
    return bad != 0;
}
