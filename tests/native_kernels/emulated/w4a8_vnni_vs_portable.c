/* gemm_w4a8.c's VNNI kernel (and its AVX2 quantiser, which every path from avx2 up runs)
 * against the portable twin, bit for bit, where the CPU has no AVX-512: built against SIMDe's
 * emulation of the intrinsics (immintrin.h here) by test_kernels_vnni_emulated.py, which splices
 * in gemm_w4a8.c (target attributes removed; the AVX2 GEMM, whose asm takes no emulated
 * types, replaced by the portable tiles: test_kernels_w4a8.py checks it on the CPU) and
 * pool.c's work split.  Tasks run in reverse order on one thread: any order must give the
 * same bits. */
#include <stdio.h>
#include <stdlib.h>
#include "gemm_w4a8.c"
#include "split.inc"
int64_t shmk_padded_k(int64_t k) { return shmk_cdiv(k, GK) * GK; }

/* ---- what gemm_w4a8.c takes from the rest of the library (gemm16.c, pool.c) ---- */
#include "driver.h"
static int g_path = SHMK_VNNI;
int shmk_path(void) { return g_path; }

static int run_differs(const float *y0, const float *y1, int64_t m, int64_t n, int64_t k,
                       int threads, int bias, int accum) {
    for (int64_t i = 0; i < m * n; i++)
        if (memcmp(&y0[i], &y1[i], sizeof(float))) {
            printf("differ: n=%ld k=%ld m=%ld threads=%d bias=%d accum=%d row %ld col %ld: "
                   "%g %g\n", (long)n, (long)k, (long)m, threads, bias, accum,
                   (long)(i / n), (long)(i % n), y0[i], y1[i]);
            return 1;
        }
    return 0;
}

/* 1 if the VNNI kernel and the portable one differ in any bit */
static int differs(int64_t n, int64_t k, int64_t m, int threads, int bias, int accum) {
    const int64_t kp = shmk_padded_k(k), nb = shmk_cdiv(n, NB), G = kp / GK;
    uint8_t *packed = malloc(nb * G * NIBBLE_GBYTES);
    uint16_t *scales = malloc(nb * G * NB * sizeof(uint16_t));
    uint16_t *mins = malloc(nb * G * NB * sizeof(uint16_t));
    float *b = malloc(n * sizeof(float)), *x = malloc(m * k * sizeof(float));
    float *y[2];
    for (int p = 0; p < 2; p++) y[p] = malloc(m * n * sizeof(float));
    for (int64_t i = 0; i < nb * G * NIBBLE_GBYTES; i++) packed[i] = (uint8_t)rnd();
    for (int64_t i = 0; i < nb * G * NB; i++) {
        /* either sign: W4 grids may be flipped (w4.c) */
        scales[i] = (uint16_t)((rnd() & 0x8000) | (0x2c00 + rnd() % 0x1000));
        mins[i] = (uint16_t)((rnd() & 0x8000) | (0x2c00 + rnd() % 0x1000));
    }
    for (int64_t i = 0; i < n; i++) b[i] = frand();
    fill_rows(x, m, k);
    for (int64_t i = 0; i < m * n; i++) y[0][i] = y[1][i] = frand();
    shmk_linear_t w = {.n = n, .k = k, .packed = (const int8_t *)packed, .scales = scales,
                       .scale_mult = 0.5f, .bias = bias ? b : NULL, .act8 = 1, .mins = mins};
    g_threads = threads;
    const int paths[2] = {SHMK_PORTABLE, SHMK_VNNI};
    for (int p = 0; p < 2; p++) {
        g_path = paths[p];
        shmk_linear_w4a8_impl(&w, x, m, y[p], accum);
    }
    const int bad = run_differs(y[0], y[1], m, n, k, threads, bias, accum);
    free(packed), free(scales), free(mins), free(b), free(x);
    for (int p = 0; p < 2; p++) free(y[p]);
    return bad;
}

int main(void) {
    const int64_t ms[] = {1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 23, 24, 25, 70}; /* slabs 1-8 */
    return run_cases(differs, ms, sizeof ms / sizeof ms[0]);
}
