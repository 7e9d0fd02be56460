/* Internal helpers shared by the kernel translation units. */
#ifndef SHMK_COMMON_H
#define SHMK_COMMON_H
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "api.h"

/* AMX: the VNNI kernels, except linear layers of >= SHMK_AMX_MIN_M rows with act_bf16 weights
 * (bf16 tiles, gemm_amx.c) and the others of >= SHMK_AMX8_MIN_M rows (int8 tiles, exact:
 * gemm_amx8.c) */
enum { SHMK_PORTABLE = 0, SHMK_AVX2 = 1, SHMK_VNNI = 2, SHMK_AMX = 3 };
/* NOTE: since the packed layout is the int8 tiles' own (gemm16.c), the exact int8-tile kernel
 * beats the bf16 one up to ~48 rows (hot GEMMs, 2 threads: 6-20% at 17-48 rows, even at 64,
 * bf16 ahead 5-50% from 128) */
#define SHMK_AMX_MIN_M 64
/* NOTE: a tile pass costs the same for 9 rows as for 16 and decode at 9-16 rows waits on the
 * weight stream either way; model steps at 9-12 rows measured 8-12% faster than on VNNI (tie at
 * 8, VNNI ahead at 4) */
#define SHMK_AMX8_MIN_M 9

/* Packed weight layout shared by gemm16.c (which documents it), gemm_amx.c and gemm_amx8.c. */
#define GK 32            /* k per scale group */
#define NB 16            /* channels per block */
#define GBYTES (GK * NB) /* bytes of one block-group */

static inline int64_t shmk_cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* A packed weight scale (fp16 bits) as a float: exact; only 0 and normals are ever stored. */
static inline float shmk_h2f(uint16_t h) {
    if (!(h & 0x7fff)) return 0.f;
    return ldexpf(1.f + (float)(h & 1023) / 1024.f, ((h >> 10) & 31) - 15);
}

/* A non-negative float as fp16 bits, rounded to nearest even; values below the fp16 normal
 * range flush to 0 (only 0 and normals are ever stored as weight scales). */
static inline uint16_t shmk_f2h(float f) {
    if (!(f > 0.f)) return 0;
    int e;
    float m = frexpf(f, &e); /* f = m 2^e, m in [0.5, 1) */
    int E = e + 14;
    if (E < 1) return 0;
    uint32_t mi = (uint32_t)nearbyintf((2.f * m - 1.f) * 1024.f);
    if (mi == 1024) mi = 0, E++;
    if (E > 30) return 0x7bff;
    return (uint16_t)((E << 10) | mi);
}

/* shmk_h2f with the sign bit (W4 group minimums are signed) */
static inline float shmk_h2f_signed(uint16_t h) {
    return (h & 0x8000) ? -shmk_h2f(h) : shmk_h2f(h);
}

/* max(m, |v|) where a NaN v leaves m, as fmaxf(m, fabsf(v)) does (m is never NaN), inline:
 * GCC calls fmaxf through the PLT at baseline x86-64, once per weight. */
static inline float shmk_max_abs(float m, float v) {
    const float a = fabsf(v);
    return a > m ? a : m;
}

/* nearbyintf(x) for |x| <= 2^22 and for infinities and NaN, in the default rounding mode:
 * x + 1.5 * 2^23 lies in [2^23, 2^24), where the float ulp is 1, so the add rounds x half to
 * even and the subtraction is exact.  NOTE: the libm call (it saves and restores the FP
 * environment) took ~2/3 of the packing time, ~1.5 s of every engine start. */
static inline float shmk_rint_small(float x) {
    const float magic = 0x1.8p23f;
    return (x + magic) - magic;
}

/* A GEMM's output element: y[i][j] = v (+ bias[j]) (+ y[i][j] when accumulating), v already
 * scaled: the scalar epilogue the kernel files share (their vector stores do the same). */
static inline void shmk_store_one(float *y, int64_t n, const float *bias, int accumulate,
                                  int64_t i, int64_t j, float v) {
    if (bias) v = v + bias[j];
    float *o = y + i * n + j;
    *o = accumulate ? *o + v : v;
}

/* Current dispatch path (set once from the CPU / SHMK_PATH env, or by shmk_set_path). */
int shmk_path(void);

/* Persistent pthread pool.  fn(ctx, task, thread_id) is called once for every task in
 * [0, ntasks); tasks are handed out dynamically, the caller's thread takes part.
 * Returns when every task has finished.  Not reentrant: fn must not call shmk_parallel. */
typedef void (*shmk_task_fn)(void *ctx, int64_t task, int tid);
void shmk_parallel(shmk_task_fn fn, void *ctx, int64_t ntasks);
int shmk_threads(void);

/* Thread-local growable scratch (64-byte aligned).  slot selects one of a few buffers. */
void *shmk_scratch(int slot, size_t bytes);

/* AMX-BF16 and AMX-INT8 support, checked once (CPU flags and the kernel's permission for tile
 * state) */
int shmk_amx_available(void);
/* The AMX tile configuration (palette 1, tiles 0-7), to load at the start of every task. */
void shmk_amx_config(const uint8_t rows[8], const uint16_t colsb[8]);
/* GEMM work split over m rows and nunits weight units (two 16-channel blocks each), for every
 * path's small-row calls and the AMX kernels' all (pool.c):
 * tasks = mtasks row ranges x ceil(nunits / units_per_task) unit ranges. */
typedef struct {
    int64_t m, nunits, rows_per_task, mtasks, units_per_task, ntasks;
} shmk_split_plan;
shmk_split_plan shmk_split_units(int64_t m, int64_t nunits, int nth);
/* The integer GEMMs' split: up to mtile rows as shmk_split_units does; more in row tiles of
 * mtile rows (a block's weights stay in L1 across a tile's rows) x unit ranges, ~8 tasks a
 * thread in all. */
shmk_split_plan shmk_split_tiles(int64_t m, int64_t nunits, int nth, int64_t mtile);
/* task's units [u0, u1) and rows [i0, i1) */
static inline void shmk_split_task(const shmk_split_plan *p, int64_t task, int64_t *u0,
                                   int64_t *u1, int64_t *i0, int64_t *i1) {
    const int64_t mt = task % p->mtasks, nt = task / p->mtasks;
    *u0 = nt * p->units_per_task, *u1 = *u0 + p->units_per_task;
    *i0 = mt * p->rows_per_task, *i1 = *i0 + p->rows_per_task;
    if (*u1 > p->nunits) *u1 = p->nunits;
    if (*i1 > p->m) *i1 = p->m;
}
/* The tile kernels' accumulators for a 16 x 16 block: 16 zmm named a0 .. a15, one a row (named,
 * not an array, which would live on the stack), declared zeroed and spilled to acc[16][16] for
 * the epilogue.  Expand inside functions compiled for AVX-512. */
#define SHMK_ACC16_ZERO()                                                                      \
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0,     \
           a7 = a0, a8 = a0, a9 = a0, a10 = a0, a11 = a0, a12 = a0, a13 = a0, a14 = a0, a15 = a0
#define SHMK_ACC16_STORE(acc)                                                                  \
    do {                                                                                       \
        _mm512_store_ps((acc), a0), _mm512_store_ps((acc) + 16, a1);                           \
        _mm512_store_ps((acc) + 32, a2), _mm512_store_ps((acc) + 48, a3);                      \
        _mm512_store_ps((acc) + 64, a4), _mm512_store_ps((acc) + 80, a5);                      \
        _mm512_store_ps((acc) + 96, a6), _mm512_store_ps((acc) + 112, a7);                     \
        _mm512_store_ps((acc) + 128, a8), _mm512_store_ps((acc) + 144, a9);                    \
        _mm512_store_ps((acc) + 160, a10), _mm512_store_ps((acc) + 176, a11);                  \
        _mm512_store_ps((acc) + 192, a12), _mm512_store_ps((acc) + 208, a13);                  \
        _mm512_store_ps((acc) + 224, a14), _mm512_store_ps((acc) + 240, a15);                  \
    } while (0)
/* y (+)= linear(x) on AMX tiles (bf16 activations; see gemm_amx.c) */
void shmk_linear_amx(const shmk_linear_t *w, const float *x, int64_t m, float *y, int accumulate);

/* y (+)= linear(x) on AMX-INT8 tiles (exact: path "vnni"'s results; see gemm_amx8.c) */
void shmk_linear_amx8(const shmk_linear_t *w, const float *x, int64_t m, float *y, int accumulate);
/* one row of x -> per-row symmetric int16 (zero padded to kp) and its scale; see gemm16.c */
void shmk_quant_row(const float *x, int64_t k, int64_t kp, int16_t *q, float *s);

/* int8 KV rows (kv_quant.c): the unnormalised Walsh-Hadamard transform in place (d a power of
 * two), and one row's symmetric int8 quantisation with its scale */
void shmk_fwht(float *x, int64_t d);
void shmk_quant_kv_row(const float *x, int64_t d, int8_t *q, float *scale);

/* y (+)= linear(x) on 8-bit activations (gemm_a8.c; shmk_linear_impl's choice for act8
 * weights) */
void shmk_linear_a8_impl(const shmk_linear_t *w, const float *x, int64_t m, float *y,
                         int accumulate);

/* y (+)= linear(x) of a W4 weight on 8-bit activations (gemm_w4a8.c; shmk_linear_impl's
 * choice for W4 weights with act8) */
void shmk_linear_w4a8_impl(const shmk_linear_t *w, const float *x, int64_t m, float *y,
                           int accumulate);

/* GEMM internal reused by the fused layer: y (+)= linear(x). */
void shmk_linear_impl(const shmk_linear_t *w, const float *x, int64_t m, float *y, int accumulate);

void shmk_rope_qkv(float *qkv, const int64_t *pos, int64_t t, int64_t hq, int64_t hk, int64_t d,
                   const float *cos_sin, int64_t max_pos);
/* k and v out of fused qkv rows [t][(hq + 2hk) d] */
void shmk_write_kv_qkv(const float *qkv, const int64_t *slots, int64_t t, int64_t hq,
                       const shmk_kv_t *kv);
/* shmk_paged_attention with q rows q_stride floats apart (q inside fused qkv rows) */
void shmk_attention_impl(const float *q, int64_t q_stride, const shmk_kv_t *kv,
                         const int32_t *block_table, int64_t max_blocks, const int32_t *seq_lens,
                         const int32_t *qsl, int64_t b, int64_t hq, float scale, float *out);

#endif
