/* What the emulated drivers share: the library's thread pool, scratch and thread count as a
 * single thread that runs the tasks in reverse order (any order must give the same bits), a
 * fixed random stream and the edge rows every kernel is checked on.  Included after the kernel
 * source (common.h's types). */
#ifndef EMULATED_DRIVER_H
#define EMULATED_DRIVER_H
#include <math.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>

static int g_threads = 1;
int shmk_threads(void) { return g_threads; }

void shmk_parallel(shmk_task_fn fn, void *ctx, int64_t n) {
    for (int64_t t = n - 1; t >= 0; t--) fn(ctx, t, (int)(t % 2)); /* reverse order */
}

void *shmk_scratch(int slot, size_t bytes) {
    static void *p[10];
    static size_t sz[10];
    if (sz[slot] < bytes) {
        free(p[slot]);
        p[slot] = aligned_alloc(64, (bytes + 4159) & ~(size_t)63);
        sz[slot] = bytes;
    }
    return p[slot];
}

static uint32_t rs = 12345;
static uint32_t rnd(void) { return (rs = rs * 1664525u + 1013904223u) >> 8; }
static float frand(void) { return (float)(rnd() & 0xffff) / 32768.f - 1.f; }

/* rows 1.. are edge rows: zeros, below the smallest usable max, NaNs, an inf, rotation ties,
 * a constant group, values whose sums overflow fp32; the rest have a few large k */
static void fill_rows(float *x, int64_t m, int64_t k) {
    for (int64_t i = 0; i < m * k; i++) x[i] = frand() * ((rnd() % 40) ? 1.f : 30.f);
    for (int64_t t = 0; t < k; t++) {
        if (m > 1) x[1 * k + t] = 0.f;
        if (m > 2) x[2 * k + t] = 1e-35f;
        if (m > 3 && t % 3 == 0) x[3 * k + t] = NAN;
        if (m > 5 && t < 32) x[5 * k + t] = (float)(t % 3) - 1.f;
        if (m > 6 && t < 32) x[6 * k + t] = 2.5f;
        if (m > 7 && t % 5 == 0) x[7 * k + t] = 3e37f;
    }
    if (m > 4) x[4 * k] = INFINITY;
}

typedef int (*differs_fn)(int64_t n, int64_t k, int64_t m, int threads, int bias, int accum);

/* differs() on every shape x row count x 1 and 2 threads x bias x accumulation: prints
 * "R runs, D differ" and returns whether any did */
static int run_cases(differs_fn differs, const int64_t *ms, size_t nms) {
    static const int64_t shapes[][2] = {{16, 32}, {17, 7},    {33, 131}, {960, 576},
                                        {50, 1536}, {40, 70}, {20, 1},   {24, 4096}};
    int runs = 0, bad = 0;
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        for (size_t i = 0; i < nms; i++)
            for (int threads = 1; threads <= 2; threads++)
                for (int flags = 0; flags < 4; flags++, runs++)
                    bad += differs(shapes[s][0], shapes[s][1], ms[i], threads, flags & 1, flags >> 1);
    printf("%d runs, %d differ\n", runs, bad);
    return bad != 0;
}
#endif
