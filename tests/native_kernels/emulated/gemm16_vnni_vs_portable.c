/* gemm16.c's VNNI kernel, on W8 and on W4 (nibble) weights, against its portable twin, bit for
 * bit, where the CPU has no AVX-512: built against SIMDe's emulation of the intrinsics
 * (immintrin.h here) by test_kernels_vnni_emulated.py, which splices in gemm16.c (target
 * attributes removed; the AVX2 tiles, whose asm takes no emulated types, replaced by the
 * portable ones: test_kernels_gemm.py and test_kernels_w4.py check them on the CPU) and
 * pool.c's work split.  Both the float results and the raw group dots
 * (shmk_gemm_group_dots).  Tasks run in reverse order on one thread: any order must give the
 * same bits. */
#include <stdio.h>
#include <stdlib.h>
#include "gemm16.c"
#include "split.inc"

/* ---- what gemm16.c takes from the rest of the library (pool.c, the other kernels) ---- */
#include "driver.h"
int shmk_amx_available(void) { return 0; }
#define UNUSED_KERNEL(NAME)                                                                   \
    void NAME(const shmk_linear_t *w, const float *x, int64_t m, float *y, int accumulate) {  \
        (void)w, (void)x, (void)m, (void)y, (void)accumulate;                                 \
        abort();                                                                              \
    }
UNUSED_KERNEL(shmk_linear_amx)
UNUSED_KERNEL(shmk_linear_amx8)
UNUSED_KERNEL(shmk_linear_a8_impl)
UNUSED_KERNEL(shmk_linear_w4a8_impl)

/* ---- cases ---- */
/* 1 if the VNNI kernel and the portable one differ in any bit (results or raw dots) */
static int differs(int w4, int64_t n, int64_t k, int64_t m, int threads, int bias, int accum) {
    const int64_t kp = shmk_padded_k(k), nb = shmk_cdiv(n, NB), G = kp / GK;
    const int64_t bytes = nb * G * (w4 ? GBYTES / 2 : GBYTES);
    int8_t *packed = malloc(bytes);
    uint16_t *scales = malloc(nb * G * NB * sizeof(uint16_t));
    uint16_t *mins = malloc(nb * G * NB * sizeof(uint16_t));
    float *b = malloc(n * sizeof(float)), *x = malloc(m * k * sizeof(float));
    float *y0 = malloc(m * n * sizeof(float)), *y1 = malloc(m * n * sizeof(float));
    int16_t *xq = malloc(m * kp * sizeof(int16_t));
    int32_t *d0 = malloc(m * n * G * sizeof(int32_t)), *d1 = malloc(m * n * G * sizeof(int32_t));
    /* W8 weights in [-127, 127] (the kernels' contract: no -128), W4 any byte */
    for (int64_t i = 0; i < bytes; i++)
        packed[i] = w4 ? (int8_t)rnd() : (int8_t)((int)(rnd() % 255) - 127);
    for (int64_t i = 0; i < nb * G * NB; i++) {
        /* either sign: W4 grids may be flipped (w4.c) */
        scales[i] = (uint16_t)((rnd() & 0x8000) | (0x2c00 + rnd() % 0x1000));
        mins[i] = (uint16_t)((rnd() & 0x8000) | (0x2c00 + rnd() % 0x1000));
    }
    for (int64_t i = 0; i < n; i++) b[i] = frand();
    fill_rows(x, m, k);
    for (int64_t i = 0; i < m * n; i++) y0[i] = y1[i] = frand();
    for (int64_t i = 0; i < m * kp; i++) xq[i] = (int16_t)((int)(rnd() % 65535) - 32767);
    shmk_linear_t w = {.n = n, .k = k, .packed = packed, .scales = scales, .scale_mult = 0.5f,
                       .bias = bias ? b : NULL, .act_bf16 = 0, .act8 = 0,
                       .mins = w4 ? mins : NULL};
    g_threads = threads;
    g_path = SHMK_PORTABLE;
    shmk_linear_impl(&w, x, m, y0, accum);
    shmk_gemm_group_dots(xq, m, &w, d0);
    g_path = SHMK_VNNI;
    shmk_linear_impl(&w, x, m, y1, accum);
    shmk_gemm_group_dots(xq, m, &w, d1);
    int bad = 0;
    if (memcmp(d0, d1, m * n * G * sizeof(int32_t))) {
        printf("dots differ: w4=%d n=%ld k=%ld m=%ld threads=%d\n", w4, (long)n, (long)k,
               (long)m, threads);
        bad = 1;
    }
    for (int64_t i = 0; i < m * n && !bad; i++)
        if (memcmp(&y0[i], &y1[i], sizeof(float))) {
            printf("differ: w4=%d n=%ld k=%ld m=%ld threads=%d bias=%d accum=%d row %ld col %ld: "
                   "%g %g\n", w4, (long)n, (long)k, (long)m, threads, bias, accum,
                   (long)(i / n), (long)(i % n), y0[i], y1[i]);
            bad = 1;
        }
    free(packed), free(scales), free(mins), free(b), free(x), free(y0), free(y1);
    free(xq), free(d0), free(d1);
    return bad;
}

static int differs_w8(int64_t n, int64_t k, int64_t m, int threads, int bias, int accum) {
    return differs(0, n, k, m, threads, bias, accum);
}

static int differs_w4(int64_t n, int64_t k, int64_t m, int threads, int bias, int accum) {
    return differs(1, n, k, m, threads, bias, accum);
}

int main(void) {
    const int64_t ms[] = {1, 2, 3, 4, 5, 7, 8, 16, 25, 70}; /* tiles of 4 and their tails */
    const int w8 = run_cases(differs_w8, ms, sizeof ms / sizeof ms[0]);
    return run_cases(differs_w4, ms, sizeof ms / sizeof ms[0]) || w8;
}
