/* gemm_a8.c's VNNI kernel against its portable twin, bit for bit, where the CPU has no AVX-512:
 * built against SIMDe's emulation of the intrinsics (immintrin.h here) by
 * test_kernels_vnni_emulated.py, which splices in gemm_a8.c (target attributes removed) and
 * pool.c's work split.  Tasks run in reverse order on one thread: any order must give the
 * same bits. */
#include <stdio.h>
#include <stdlib.h>
#include "gemm_a8.c"
#include "split.inc"
int64_t shmk_padded_k(int64_t k) { return shmk_cdiv(k, GK) * GK; }

/* ---- what gemm_a8.c takes from the rest of the library (gemm16.c, pool.c) ---- */
#include "driver.h"
static int g_path = SHMK_VNNI;
int shmk_path(void) { return g_path; }

/* 1 if the VNNI kernel (or its quantiser) and the portable one differ in any bit */
static int differs(int64_t n, int64_t k, int64_t m, int threads, int bias, int accum) {
    const int64_t kp = shmk_padded_k(k), nb = shmk_cdiv(n, NB), G = kp / GK;
    int8_t *packed = malloc(nb * NB * kp);
    uint16_t *scales = malloc(nb * G * NB * sizeof(uint16_t));
    float *b = malloc(n * sizeof(float)), *x = malloc(m * k * sizeof(float));
    float *y0 = malloc(m * n * sizeof(float)), *y1 = malloc(m * n * sizeof(float));
    int8_t *q0 = malloc(m * kp), *q1 = malloc(m * kp);
    float *s0 = malloc(m * G * sizeof(float)), *s1 = malloc(m * G * sizeof(float));
    int32_t *v0 = malloc(m * G * sizeof(int32_t)), *v1 = malloc(m * G * sizeof(int32_t));
    for (int64_t i = 0; i < nb * NB * kp; i++) packed[i] = (int8_t)((int)(rnd() % 255) - 127);
    for (int64_t i = 0; i < nb * G * NB; i++) scales[i] = (uint16_t)(0x2c00 + rnd() % 0x1000);
    for (int64_t i = 0; i < n; i++) b[i] = frand();
    fill_rows(x, m, k);
    for (int64_t i = 0; i < m * n; i++) y0[i] = y1[i] = frand();
    shmk_linear_t w = {.n = n, .k = k, .packed = packed, .scales = scales, .scale_mult = 0.5f,
                       .bias = bias ? b : NULL, .act_bf16 = 0, .act8 = 1};
    g_threads = threads;
    g_path = SHMK_PORTABLE;
    linear_a8(SHMK_PORTABLE, &w, x, m, y0, accum);
    quant_rows(SHMK_PORTABLE, x, 0, m, k, q0, s0, v0);
    g_path = SHMK_VNNI;
    linear_a8(SHMK_VNNI, &w, x, m, y1, accum);
    quant_rows(SHMK_VNNI, x, 0, m, k, q1, s1, v1);
    int bad = memcmp(q0, q1, m * kp) || memcmp(s0, s1, m * G * sizeof(float)) ||
              memcmp(v0, v1, m * G * sizeof(int32_t));
    for (int64_t i = 0; i < m * n && !bad; i++)
        if (memcmp(&y0[i], &y1[i], sizeof(float))) {
            printf("differ: n=%ld k=%ld m=%ld threads=%d bias=%d accum=%d row %ld col %ld: %g %g\n",
                   (long)n, (long)k, (long)m, threads, bias, accum, (long)(i / n), (long)(i % n),
                   y0[i], y1[i]);
            bad = 1;
        }
    free(packed), free(scales), free(b), free(x), free(y0), free(y1);
    free(q0), free(q1), free(s0), free(s1), free(v0), free(v1);
    return bad;
}

int main(void) {
    const int64_t ms[] = {1, 2, 3, 4, 5, 8, 16, 17, 24, 25, 70, 100};
    return run_cases(differs, ms, sizeof ms / sizeof ms[0]);
}
