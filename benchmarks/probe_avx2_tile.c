/* Speed probe for the AVX2 int16 GEMM core (docs/kernels.md, "Dispatch, threads"): how fast can
 * vpmaddwd + vpaddd tiles go when everything sits in L1, one thread, no epilogue.
 *
 *   gcc -O2 benchmarks/probe_avx2_tile.c -o /tmp/probe_avx2 && /tmp/probe_avx2
 *
 *   peak   12 independent vpmaddwd + vpaddd chains, register operands
 *   rows3  gemm16.c's 3-row tile on pair rows: 2 vpmovsxbw + 3 vpbroadcastd a pair row
 *   rows6b 6 rows, the same with 6 vpbroadcastd
 *   rows6m 6 rows on activation broadcasts prepared in memory (vpmaddwd's memory operand)
 *
 * Measured 2026-12-07 on the AVX2-only Zen 3 guest (best of 15, GMAC/s): peak 81-83, rows3 72,
 * rows6b 71, rows6m 80-81.  A kernel on rows6m (slabs of 6 rows, broadcast buffer per chunk
 * of groups, fp32 sums in memory) ran 13-35 % slower than the 3-row tiles: see docs/kernels.md. */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <time.h>
#define T __attribute__((target("avx2")))
#define P 16 /* pair rows a group */
static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}
static int8_t wbuf[16384] __attribute__((aligned(64)));
static int16_t xbuf[8192] __attribute__((aligned(64)));
#define ACC12                                                                                 \
    [d0] "+x"(d0), [d1] "+x"(d1), [d2] "+x"(d2), [d3] "+x"(d3), [d4] "+x"(d4), [d5] "+x"(d5), \
        [d6] "+x"(d6), [d7] "+x"(d7), [d8] "+x"(d8), [d9] "+x"(d9), [d10] "+x"(d10),          \
        [d11] "+x"(d11)
#define DECL12                                                                                \
    __m256i d0 = _mm256_setzero_si256(), d1 = d0, d2 = d0, d3 = d0, d4 = d0, d5 = d0, d6 = d0, \
            d7 = d0, d8 = d0, d9 = d0, d10 = d0, d11 = d0
#define SINK volatile int sink_ = _mm256_extract_epi32(_mm256_add_epi32(d0, d11), 0)
/* one row: madd both halves (ymm12, ymm13) by broadcast ymm14, or by a memory operand */
#define ROWB(OFF, A, B)                                                                       \
    "vpbroadcastd " #OFF "(%[x]), %%ymm14\n\t"                                                \
    "vpmaddwd %%ymm12, %%ymm14, %%ymm15\n\t vpaddd %%ymm15, %[" #A "], %[" #A "]\n\t"          \
    "vpmaddwd %%ymm13, %%ymm14, %%ymm14\n\t vpaddd %%ymm14, %[" #B "], %[" #B "]\n\t"
#define ROWM(OFF, A, B)                                                                       \
    "vpmaddwd " #OFF "(%[x]), %%ymm12, %%ymm15\n\t vpaddd %%ymm15, %[" #A "], %[" #A "]\n\t"   \
    "vpmaddwd " #OFF "(%[x]), %%ymm13, %%ymm14\n\t vpaddd %%ymm14, %[" #B "], %[" #B "]\n\t"
#define WIDEN "vpmovsxbw (%[w]), %%ymm12\n\t vpmovsxbw 16(%[w]), %%ymm13\n\t"
#define CLOB "xmm12", "xmm13", "xmm14", "xmm15", "memory"

T static double peak(long n) {
    DECL12;
    const __m256i w = _mm256_set1_epi16(3), x = _mm256_set1_epi16(2);
    double t0 = now();
    for (long i = 0; i < n; i++)
#define S(A) "vpmaddwd %[w], %[x], %%ymm15\n\t vpaddd %%ymm15, %[" #A "], %[" #A "]\n\t"
        __asm__ volatile(S(d0) S(d1) S(d2) S(d3) S(d4) S(d5) S(d6) S(d7) S(d8) S(d9) S(d10)
                             S(d11)
                         : ACC12
                         : [w] "x"(w), [x] "x"(x)
                         : "xmm15");
    double dt = now() - t0;
    SINK;
    (void)sink_;
    return n * 12.0 * 16 / dt / 1e9;
}
T static double rows3(long groups) {
    DECL12;
    double t0 = now();
    for (long g = 0; g < groups; g++)
        for (int p = 0; p < P; p++)
            __asm__ volatile(WIDEN ROWB(0, d0, d1) ROWB(64, d2, d3) ROWB(128, d4, d5)
                             : ACC12
                             : [w] "r"(wbuf + (g & 15) * 512 + p * 32), [x] "r"(xbuf + 2 * p)
                             : CLOB);
    double dt = now() - t0;
    SINK;
    (void)sink_;
    return groups * P * 6.0 * 16 / dt / 1e9;
}
T static double rows6b(long groups) {
    DECL12;
    double t0 = now();
    for (long g = 0; g < groups; g++)
        for (int p = 0; p < P; p++)
            __asm__ volatile(WIDEN ROWB(0, d0, d1) ROWB(64, d2, d3) ROWB(128, d4, d5)
                                 ROWB(192, d6, d7) ROWB(256, d8, d9) ROWB(320, d10, d11)
                             : ACC12
                             : [w] "r"(wbuf + (g & 15) * 512 + p * 32), [x] "r"(xbuf + 2 * p)
                             : CLOB);
    double dt = now() - t0;
    SINK;
    (void)sink_;
    return groups * P * 12.0 * 16 / dt / 1e9;
}
T static double rows6m(long groups) {
    DECL12;
    double t0 = now();
    for (long g = 0; g < groups; g++)
        for (int p = 0; p < P; p++)
            __asm__ volatile(WIDEN ROWM(0, d0, d1) ROWM(32, d2, d3) ROWM(64, d4, d5)
                                 ROWM(96, d6, d7) ROWM(128, d8, d9) ROWM(160, d10, d11)
                             : ACC12
                             : [w] "r"(wbuf + (g & 15) * 512 + p * 32), [x] "r"(xbuf + p * 96)
                             : CLOB);
    double dt = now() - t0;
    SINK;
    (void)sink_;
    return groups * P * 12.0 * 16 / dt / 1e9;
}
int main(void) {
    double best[4] = {0};
    const char *name[4] = {"peak", "rows3", "rows6b", "rows6m"};
    for (int rep = 0; rep < 15; rep++) {
        const double v[4] = {peak(8000000), rows3(1000000), rows6b(500000), rows6m(500000)};
        for (int i = 0; i < 4; i++) best[i] = v[i] > best[i] ? v[i] : best[i];
    }
    for (int i = 0; i < 4; i++) printf("%s %.1f  ", name[i], best[i]);
    printf("GMAC/s (best of 15)\n");
    return 0;
}
