/* The paged KV cache and causal attention over it, for mixed prefill / decode batches.
 *
 * Cache, per layer: k and v each [num_blocks][hk][slab rows][d], fp32, IEEE fp16 or int8.
 * Head-major inside a block: one (block, kv head) is a contiguous slab of block_size rows, so a
 * task (one sequence, one kv head) streams contiguous memory that the hardware prefetcher
 * follows.  fp16 halves the bytes batched decode reads (at a few hundred tokens of context it is
 * bound by reading the cache); values are rounded to nearest even once, on write (F16C, or the
 * portable conversion, bit-identical), and widened exactly on read; all arithmetic stays fp32.
 * int8 halves them again: each row is quantised on write with its own fp32 scale (kv_quant.c;
 * key rows Hadamard-rotated first), the block_size scales stored after the slab's rows, in
 * cdiv(4 block_size, d) more rows; readers widen int8 to fp32 and apply the row's scale to its
 * score (keys) or its softmax weight (values), and see queries rotated like the keys. */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "avx2_math.h"
#include "common.h"

/* ------------------------------------------------------------------ fp16 <-> fp32 (portable)
 * Bit-identical to vcvtps2ph (round to nearest even) and vcvtph2ps for finite values,
 * subnormals included (F. Giesen's float_to_half_fast3_rtne). */
static uint16_t f32_to_f16(float value) {
    const uint32_t f16_max = (127u + 16u) << 23, f32_inf = 255u << 23;
    const uint32_t denorm_magic = ((127u - 15u) + (23u - 10u) + 1u) << 23;
    uint32_t f;
    memcpy(&f, &value, 4);
    const uint32_t sign = f & 0x80000000u;
    f ^= sign;
    uint16_t h;
    if (f >= f16_max) {
        h = f > f32_inf ? 0x7e00 : 0x7c00; /* NaN -> quiet NaN; overflow -> inf */
    } else if (f < (113u << 23)) {         /* below the fp16 normal range: the FPU rounds */
        float x, magic;
        memcpy(&x, &f, 4);
        memcpy(&magic, &denorm_magic, 4);
        x += magic;
        uint32_t r;
        memcpy(&r, &x, 4);
        h = (uint16_t)(r - denorm_magic);
    } else {
        const uint32_t mant_odd = (f >> 13) & 1u;
        f += ((uint32_t)(15 - 127) << 23) + 0xfffu; /* rebias; round half up... */
        f += mant_odd;                             /* ...or to even on an exact tie */
        h = (uint16_t)(f >> 13);
    }
    return h | (uint16_t)(sign >> 16);
}

static float f16_to_f32(uint16_t h) {
    const uint32_t e = (h >> 10) & 31u, m = h & 1023u;
    float f;
    if (e == 31) {
        uint32_t bits = ((uint32_t)(h & 0x8000) << 16) | 0x7f800000u | (m << 13);
        memcpy(&f, &bits, 4);
        return f;
    }
    f = e ? ldexpf((float)(m | 1024u), (int)e - 25) : ldexpf((float)m, -24);
    return (h & 0x8000) ? -f : f;
}

/* ------------------------------------------------------------------ cache addressing */
static inline size_t kv_esize(const shmk_kv_t *kv) {
    return kv->dtype == 2 ? 1 : kv->dtype == 1 ? 2 : 4;
}

/* rows of one (block, kv head) slab: its block_size cache rows, then for int8 their scales.
 * NOTE: no division (int8 head_dim is a power of two): this runs for every row address, and
 * divisions here and in the block/offset split below cost the decode kernel a fifth of its
 * time. */
static inline int64_t slab_rows(const shmk_kv_t *kv) {
    if (kv->dtype != 2) return kv->block_size;
    return kv->block_size + ((4 * kv->block_size + kv->d - 1) >> __builtin_ctzll(kv->d));
}

/* position p -> (block index in the table, offset in the block); shifts for power-of-two
 * block sizes (the engine's) */
static inline void split_pos(const shmk_kv_t *kv, int64_t p, int64_t *bi, int64_t *off) {
    const int64_t bs = kv->block_size;
    if ((bs & (bs - 1)) == 0) {
        *bi = p >> __builtin_ctzll(bs), *off = p & (bs - 1);
    } else {
        *bi = p / bs, *off = p % bs;
    }
}

/* element offset of position `off` of kv head `h` in cache block `blk` */
static inline size_t kv_offset(const shmk_kv_t *kv, int64_t blk, int64_t h, int64_t off) {
    return (size_t)(((blk * kv->hk + h) * slab_rows(kv) + off) * kv->d);
}

/* the int8 row scale of position `off` of kv head `h` in cache block `blk` */
static inline float *kv_scale(const shmk_kv_t *kv, const void *cache, int64_t blk, int64_t h,
                              int64_t off) {
    return (float *)((char *)cache + kv_offset(kv, blk, h, kv->block_size)) + off;
}

/* an int8 cache's rows can be rotated (power-of-two d) and copied to the stack (d <= 1024); the
 * Python callers refuse other shapes, this keeps a direct C caller from overrunning */
static inline int int8_rows_unsupported(const shmk_kv_t *kv) {
    return kv->dtype == 2 && (kv->d > 1024 || (kv->d & (kv->d - 1)));
}

/* the scale a row's values are multiplied by (1 unless int8) */
static inline float row_scale(const shmk_kv_t *kv, const void *cache, int64_t blk, int64_t h,
                              int64_t off) {
    return kv->dtype == 2 ? *kv_scale(kv, cache, blk, h, off) : 1.f;
}

/* ------------------------------------------------------------------ writes */
AVX2_FN static void put_f16_avx2(uint16_t *dst, const float *src, int64_t d) {
    int64_t i = 0;
    for (; i + 8 <= d; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    for (; i < d; i++) dst[i] = f32_to_f16(src[i]);
}

/* src (d floats) -> position `off` of kv head `h` in block `blk`; keys are rotated first in int8
 * (the row's copy: d <= 1024, checked by the callers) */
static void put_row(const shmk_kv_t *kv, void *cache, int64_t blk, int64_t h, int64_t pos,
                    const float *src, int is_key, int avx2) {
    const int64_t d = kv->d;
    const size_t off = kv_offset(kv, blk, h, pos);
    if (kv->dtype == 2) {
        float rotated[1024];
        if (is_key) {
            memcpy(rotated, src, (size_t)d * sizeof(float));
            shmk_fwht(rotated, d);
            src = rotated;
        }
        shmk_quant_kv_row(src, d, (int8_t *)cache + off, kv_scale(kv, cache, blk, h, pos));
    } else if (kv->dtype == 0) {
        memcpy((float *)cache + off, src, (size_t)d * sizeof(float));
    } else if (avx2) {
        put_f16_avx2((uint16_t *)cache + off, src, d);
    } else {
        uint16_t *dst = (uint16_t *)cache + off;
        for (int64_t i = 0; i < d; i++) dst[i] = f32_to_f16(src[i]);
    }
}

typedef struct {
    const float *k, *v;
    int64_t stride, t, rows;
    const int64_t *slots;
    const shmk_kv_t *kv;
} write_ctx;

/* tokens [i0, i1) of write_rows */
static void put_rows(const write_ctx *c, int64_t i0, int64_t i1) {
    const shmk_kv_t *kv = c->kv;
    const int avx2 = shmk_path() >= SHMK_AVX2;
    const int64_t nslots = kv->num_blocks * kv->block_size;
    for (int64_t i = i0; i < i1; i++) {
        const int64_t s = c->slots[i];
        if (s < 0 || s >= nslots) continue;
        const int64_t blk = s / kv->block_size, pos = s % kv->block_size;
        for (int64_t h = 0; h < kv->hk; h++) {
            put_row(kv, kv->k, blk, h, pos, c->k + i * c->stride + h * kv->d, 1, avx2);
            put_row(kv, kv->v, blk, h, pos, c->v + i * c->stride + h * kv->d, 0, avx2);
        }
    }
}

static void put_task(void *vctx, int64_t task, int tid) {
    (void)tid;
    const write_ctx *c = vctx;
    const int64_t i0 = task * c->rows;
    put_rows(c, i0, i0 + c->rows < c->t ? i0 + c->rows : c->t);
}

/* token i's kv head h is at k + i * stride + h * d (same for v); slots outside the cache are
 * skipped (the callers validate them; this keeps a bad slot from writing out of bounds). */
static void write_rows(const float *k, const float *v, int64_t stride, const int64_t *slots,
                       int64_t t, const shmk_kv_t *kv) {
    if (int8_rows_unsupported(kv)) return;
    write_ctx c = {k, v, stride, t, 0, slots, kv};
    /* NOTE: a prefill's rows over the pool (512 tokens: ~70 us a layer on one thread) */
    if (t > 64 && shmk_threads() > 1) {
        c.rows = shmk_cdiv(t, 4 * shmk_threads());
        shmk_parallel(put_task, &c, shmk_cdiv(t, c.rows));
        return;
    }
    const int64_t nslots = kv->num_blocks * kv->block_size;
    const size_t esz = kv_esize(kv);
    /* NOTE: a decode step's rows land in as many cache blocks as sequences, each store a miss:
     * ask for every destination line first so the misses overlap (batch 16: 8-10 -> 7-8 us;
     * a prefill's rows fill whole blocks in order, which the hardware prefetcher follows) */
    for (int64_t i = 0; i < t; i++) {
        const int64_t s = slots[i];
        if (s < 0 || s >= nslots) continue;
        for (int64_t h = 0; h < kv->hk; h++) {
            const size_t off = kv_offset(kv, s / kv->block_size, h, s % kv->block_size) * esz;
            for (size_t b = 0; b < (size_t)kv->d * esz; b += 64) {
                __builtin_prefetch((const char *)kv->k + off + b, 1, 3);
                __builtin_prefetch((const char *)kv->v + off + b, 1, 3);
            }
        }
    }
    put_rows(&c, 0, t);
}

void shmk_write_kv(const float *k, const float *v, const int64_t *slots, int64_t t,
                   const shmk_kv_t *kv) {
    write_rows(k, v, kv->hk * kv->d, slots, t, kv);
}

void shmk_write_kv_qkv(const float *qkv, const int64_t *slots, int64_t t, int64_t hq,
                       const shmk_kv_t *kv) {
    const int64_t d = kv->d;
    write_rows(qkv + hq * d, qkv + (hq + kv->hk) * d, (hq + 2 * kv->hk) * d, slots, t, kv);
}

/* ------------------------------------------------------------------ attention
 * Sequence b owns query rows [qsl[b], qsl[b+1]) and kv positions [0, seq_lens[b]); its query
 * token i sits at position seq_lens[b] - q_len + i and attends to kv positions 0..pos.
 * A task is (sequence, kv head, tile of query tokens): the G = hq / hk query heads of the group
 * share every K/V row it loads.  Online softmax over chunks of 16 kv positions, fp32. */
#define ATT_CHUNK 16
#define ATT_QTILE 16

typedef struct {
    int32_t b, hk, t0, t1;
    /* a decode token split across tasks: its segment of DEC_SEG positions and the slot of its
     * partial result (seg -1: the whole task in one) */
    int32_t seg, part;
} att_task;

typedef struct {
    const float *q;
    int64_t q_stride; /* floats between query rows (q may sit inside fused qkv rows) */
    const shmk_kv_t *kv;
    const int32_t *bt, *seq_lens, *qsl;
    int64_t max_blocks, hq;
    float scale;
    float *out;
    const att_task *tasks;
    float *parts; /* partial results of split decode tokens (part_floats each) */
    int avx2;     /* the SIMD driver (att_task_avx2); else portable */
    int wide; /* inside it, the AVX-512 inner loops (d % 16 == 0) */
} att_ctx;

/* positions of sequence b cached before its first query token (its kv for token t: ctx + t + 1) */
static inline int64_t ctx_len(const att_ctx *c, int64_t b) {
    return c->seq_lens[b] - (c->qsl[b + 1] - c->qsl[b]);
}

/* element i of the cache as stored (an int8 row's scale not applied) */
static inline float kv_at(const shmk_kv_t *kv, const void *cache, size_t i) {
    if (kv->dtype == 2) return (float)((const int8_t *)cache)[i];
    return kv->dtype == 1 ? f16_to_f32(((const uint16_t *)cache)[i]) : ((const float *)cache)[i];
}

static void att_task_portable(const att_ctx *c, const att_task *tk) {
    const shmk_kv_t *kv = c->kv;
    const int64_t d = kv->d, G = c->hq / kv->hk, bs = kv->block_size;
    const int64_t q_start = c->qsl[tk->b];
    const int64_t ctx0 = ctx_len(c, tk->b);
    const int32_t *bt_row = c->bt + tk->b * c->max_blocks;
    float o[1024];
    for (int64_t ti = tk->t0; ti < tk->t1; ti++) {
        const int64_t pos = ctx0 + ti;
        for (int64_t g = 0; g < G; g++) {
            const int64_t h = tk->hk * G + g;
            const float *q = c->q + (q_start + ti) * c->q_stride + h * d;
            float m = -INFINITY, l = 0.f;
            for (int64_t i = 0; i < d; i++) o[i] = 0.f;
            for (int64_t p = 0; p <= pos; p++) {
                const int64_t blk = bt_row[p / bs];
                const size_t off = kv_offset(kv, blk, tk->hk, p % bs);
                float s = 0.f;
                for (int64_t i = 0; i < d; i++) s += q[i] * kv_at(kv, kv->k, off + i);
                s *= row_scale(kv, kv->k, blk, tk->hk, p % bs) * c->scale;
                if (s > m) {
                    float alpha = expf(m - s);
                    for (int64_t i = 0; i < d; i++) o[i] *= alpha;
                    l *= alpha;
                    m = s;
                }
                float pr = expf(s - m);
                l += pr;
                const float pv = pr * row_scale(kv, kv->v, blk, tk->hk, p % bs);
                for (int64_t i = 0; i < d; i++) o[i] += pv * kv_at(kv, kv->v, off + i);
            }
            float *out = c->out + ((q_start + ti) * c->hq + h) * d;
            for (int64_t i = 0; i < d; i++) out[i] = o[i] / l;
        }
    }
}

/* Row pointers of kv positions c0 .. min(c0 + ATT_CHUNK, end) - 1 of one kv head in `cache`
 * (c0 a multiple of ATT_CHUNK); lanes past `end` repeat row c0 (their results are masked or
 * multiplied by zero). */
static inline void chunk_rows(const shmk_kv_t *kv, const void *cache, const int32_t *bt_row,
                              int64_t h, int64_t c0, int64_t end, const void **out) {
    const int64_t bs = kv->block_size;
    const size_t esz = kv_esize(kv);
    const int cn = end - c0 < ATT_CHUNK ? (int)(end - c0) : ATT_CHUNK;
    int64_t bi, off;
    split_pos(kv, c0, &bi, &off);
    if (bs % ATT_CHUNK == 0) { /* the chunk lies in one block: its rows are contiguous */
        /* NOTE: a running pointer: GCC vectorised base + j * row with emulated 64-bit
         * multiplies, ~10% of the decode kernel */
        const char *row = (const char *)cache + kv_offset(kv, bt_row[bi], h, off) * esz;
        const size_t row_bytes = (size_t)kv->d * esz;
        for (int j = 0; j < cn; j++, row += row_bytes) out[j] = row;
    } else {
        for (int j = 0; j < cn; j++) {
            out[j] = (const char *)cache + kv_offset(kv, bt_row[bi], h, off) * esz;
            if (++off == bs) off = 0, bi++;
        }
    }
    for (int j = cn; j < ATT_CHUNK; j++) out[j] = out[0];
}

/* The int8 row scales of the same rows (1 past `end`).  NOTE: one address a block (the
 * scales of a slab are contiguous): per row, the slab arithmetic cost a third of the decode
 * kernel's time. */
static inline void chunk_scales(const shmk_kv_t *kv, const void *cache, const int32_t *bt_row,
                                int64_t h, int64_t c0, int64_t end, float *out) {
    const int64_t bs = kv->block_size;
    const int cn = end - c0 < ATT_CHUNK ? (int)(end - c0) : ATT_CHUNK;
    int64_t bi, off;
    split_pos(kv, c0, &bi, &off);
    for (int j = 0; j < cn;) {
        const float *sc = kv_scale(kv, cache, bt_row[bi], h, 0);
        for (; j < cn && off < bs; j++, off++) out[j] = sc[off];
        off = 0, bi++;
    }
    for (int j = cn; j < ATT_CHUNK; j++) out[j] = 1.f;
}

/* Streams one kv head's cache rows chunk by chunk.  NOTE: rows ATT_PF chunks ahead are
 * prefetched: decode reads every cache row exactly once and does little arithmetic per row, so
 * without it each chunk waits on memory (perf put over half of the kernel's samples on the first
 * use of each loaded row; one chunk ahead was not enough). */
#define ATT_PF 1
typedef struct {
    const shmk_kv_t *kv;
    const void *cache;
    const int32_t *bt_row;
    int64_t h, end;
    float *f32; /* [ATT_CHUNK][d] widened rows when the cache is fp16 or int8 */
    int wide;   /* widen with AVX-512 */
    float scales[ATT_CHUNK]; /* int8: the chunk's row scales, which the caller applies */
} chunk_stream;

/* Prefetches (to L1) the chunk ATT_PF ahead of the one at c0, and on the first call the ones
 * before it. */
static inline void prefetch_ahead(const shmk_kv_t *kv, const void *cache, const int32_t *bt_row,
                                  int64_t h, int64_t c0, int64_t end) {
    const void *rows[ATT_CHUNK];
    const int64_t row_bytes = kv->d * (int64_t)kv_esize(kv);
    for (int64_t p0 = c0 == 0 ? ATT_CHUNK : c0 + ATT_PF * ATT_CHUNK;
         p0 <= c0 + ATT_PF * ATT_CHUNK && p0 < end; p0 += ATT_CHUNK) {
        chunk_rows(kv, cache, bt_row, h, p0, end, rows);
        const int cn = end - p0 < ATT_CHUNK ? (int)(end - p0) : ATT_CHUNK;
        for (int j = 0; j < cn; j++)
            for (int64_t b = 0; b < row_bytes; b += 64)
                _mm_prefetch((const char *)rows[j] + b, _MM_HINT_T0);
    }
}

AVX2_FN static void widen_f16(float *dst, const uint16_t *src, int64_t d) {
    for (int64_t i = 0; i < d; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
}

/* dst = src, one int8 row as stored (its scale not applied) */
AVX2_FN static void widen_i8(float *dst, const int8_t *src, int64_t d) {
    for (int64_t i = 0; i < d; i += 8) {
        const __m128i b = _mm_loadl_epi64((const __m128i *)(src + i));
        _mm256_storeu_ps(dst + i, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)));
    }
}

/* ------------------------------------------------------------------ AVX-512 inner loops
 * The AVX2 driver below calls these (not inlined: they are compiled for another target) once
 * per chunk and query row, so a call's cost is spread over 16 kv rows.  zmm halves the
 * instructions per kv element of the AVX2 loops; the arithmetic is the same fp32, summed in
 * another order (results agree to rounding, not bit for bit, with the AVX2 path). */
#define AVX512_FN __attribute__((target("avx512f,avx2,fma,f16c")))

AVX512_FN static void widen_f16_512(float *dst, const uint16_t *src, int64_t d) {
    for (int64_t i = 0; i < d; i += 16)
        _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + i))));
}

AVX512_FN static void widen_i8_512(float *dst, const int8_t *src, float scale, int64_t d) {
    const __m512 s = _mm512_set1_ps(scale);
    for (int64_t i = 0; i < d; i += 16) {
        const __m128i b = _mm_loadu_si128((const __m128i *)(src + i));
        _mm512_storeu_ps(dst + i, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), s));
    }
}

/* fp32 row pointers (into rows_out) of the chunk at c0; prefetches the chunk ATT_PF ahead (and,
 * on the first call, the ones before it).  int8 rows come as stored, their scales in
 * st->scales.  NOTE: the caller scales the scores and the softmax weights, as att_decode does,
 * so a token's result is the same bits whichever path computes it (scaling the elements
 * instead rounded differently: greedy output changed under preemption). */
AVX2_FN static const float *const *stream_chunk(chunk_stream *st, int64_t c0, float **rows_out) {
    const void *rows[ATT_CHUNK];
    prefetch_ahead(st->kv, st->cache, st->bt_row, st->h, c0, st->end);
    chunk_rows(st->kv, st->cache, st->bt_row, st->h, c0, st->end, rows);
    if (st->kv->dtype == 2) {
        const int64_t d = st->kv->d;
        const int cn = st->end - c0 < ATT_CHUNK ? (int)(st->end - c0) : ATT_CHUNK;
        chunk_scales(st->kv, st->cache, st->bt_row, st->h, c0, st->end, st->scales);
        for (int j = 0; j < ATT_CHUNK; j++) rows_out[j] = st->f32 + (j < cn ? j : 0) * d;
        for (int j = 0; j < cn; j++) {
            if (st->wide)
                widen_i8_512(rows_out[j], rows[j], 1.f, d);
            else
                widen_i8(rows_out[j], rows[j], d);
        }
    } else if (st->kv->dtype == 1) {
        /* widen once here, not once per query row that reads the chunk */
        const int64_t d = st->kv->d;
        const int cn = st->end - c0 < ATT_CHUNK ? (int)(st->end - c0) : ATT_CHUNK;
        for (int j = 0; j < ATT_CHUNK; j++) rows_out[j] = st->f32 + (j < cn ? j : 0) * d;
        if (st->kv->block_size % ATT_CHUNK == 0) /* contiguous rows: one call */
            (st->wide ? widen_f16_512 : widen_f16)(st->f32, rows[0], cn * d);
        else
            for (int j = 0; j < cn; j++)
                (st->wide ? widen_f16_512 : widen_f16)(rows_out[j], rows[j], d);
    } else {
        for (int j = 0; j < ATT_CHUNK; j++) rows_out[j] = (float *)rows[j];
    }
    return (const float *const *)rows_out;
}

/* lane j = the sum of a_j's 8 lanes (an hadd tree) */
INLINE AVX2_FN __m256 reduce8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5,
                              __m256 a6, __m256 a7) {
    __m256 t0 = _mm256_hadd_ps(a0, a1), t1 = _mm256_hadd_ps(a2, a3);
    __m256 t2 = _mm256_hadd_ps(a4, a5), t3 = _mm256_hadd_ps(a6, a7);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* 8 dot products q.k_j (d % 8 == 0) -> one ymm, via 8 accumulators and an hadd tree. */
INLINE AVX2_FN __m256 dot8(const float *q, const float *const *kp, int64_t d) {
    /* named accumulators: GCC keeps an array of them on the stack */
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    const float *k0 = kp[0], *k1 = kp[1], *k2 = kp[2], *k3 = kp[3];
    const float *k4 = kp[4], *k5 = kp[5], *k6 = kp[6], *k7 = kp[7];
    for (int64_t i = 0; i < d; i += 8) {
        const __m256 qv = _mm256_loadu_ps(q + i);
        a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + i), a0);
        a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + i), a1);
        a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k2 + i), a2);
        a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k3 + i), a3);
        a4 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k4 + i), a4);
        a5 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k5 + i), a5);
        a6 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k6 + i), a6);
        a7 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k7 + i), a7);
    }
    return reduce8(a0, a1, a2, a3, a4, a5, a6, a7);
}

/* o[0..d) += sum_{j < n} p[j] * v_j; 64 columns at a time in 8 independent FMA chains (4 would
 * leave the loop bound by FMA latency). */
INLINE AVX2_FN void pv_accumulate(float *o, const float *p, const float *const *vp, int n,
                                  int64_t d) {
    int64_t i = 0;
    for (; i + 64 <= d; i += 64) {
        __m256 o0 = _mm256_loadu_ps(o + i), o1 = _mm256_loadu_ps(o + i + 8);
        __m256 o2 = _mm256_loadu_ps(o + i + 16), o3 = _mm256_loadu_ps(o + i + 24);
        __m256 o4 = _mm256_loadu_ps(o + i + 32), o5 = _mm256_loadu_ps(o + i + 40);
        __m256 o6 = _mm256_loadu_ps(o + i + 48), o7 = _mm256_loadu_ps(o + i + 56);
        for (int j = 0; j < n; j++) {
            const __m256 pj = _mm256_set1_ps(p[j]);
            const float *v = vp[j] + i;
            o0 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v), o0);
            o1 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 8), o1);
            o2 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 16), o2);
            o3 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 24), o3);
            o4 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 32), o4);
            o5 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 40), o5);
            o6 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 48), o6);
            o7 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 56), o7);
        }
        _mm256_storeu_ps(o + i, o0);
        _mm256_storeu_ps(o + i + 8, o1);
        _mm256_storeu_ps(o + i + 16, o2);
        _mm256_storeu_ps(o + i + 24, o3);
        _mm256_storeu_ps(o + i + 32, o4);
        _mm256_storeu_ps(o + i + 40, o5);
        _mm256_storeu_ps(o + i + 48, o6);
        _mm256_storeu_ps(o + i + 56, o7);
    }
    for (; i < d; i += 8) {
        __m256 o0 = _mm256_loadu_ps(o + i);
        for (int j = 0; j < n; j++)
            o0 = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), _mm256_loadu_ps(vp[j] + i), o0);
        _mm256_storeu_ps(o + i, o0);
    }
}

INLINE AVX512_FN __m256 fold512(__m512 a) { /* the two 256-bit halves added */
    return _mm256_add_ps(_mm512_castps512_ps256(a),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}

INLINE AVX512_FN __m256 dot8_512(const float *q, const float *const *kp, int64_t d) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    const float *k0 = kp[0], *k1 = kp[1], *k2 = kp[2], *k3 = kp[3];
    const float *k4 = kp[4], *k5 = kp[5], *k6 = kp[6], *k7 = kp[7];
    for (int64_t i = 0; i < d; i += 16) {
        const __m512 qv = _mm512_loadu_ps(q + i);
        a0 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k0 + i), a0);
        a1 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k1 + i), a1);
        a2 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k2 + i), a2);
        a3 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k3 + i), a3);
        a4 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k4 + i), a4);
        a5 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k5 + i), a5);
        a6 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k6 + i), a6);
        a7 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k7 + i), a7);
    }
    return reduce8(fold512(a0), fold512(a1), fold512(a2), fold512(a3), fold512(a4), fold512(a5),
                   fold512(a6), fold512(a7));
}

/* s[0..8) (and s[8..16) when two) = scale * q.k_j for the chunk's rows */
AVX512_FN static void scores_512(const float *q, const float *const *kp, int64_t d, float scale,
                                 int two, float *s) {
    const __m256 vscale = _mm256_set1_ps(scale);
    _mm256_storeu_ps(s, _mm256_mul_ps(dot8_512(q, kp, d), vscale));
    if (two) _mm256_storeu_ps(s + 8, _mm256_mul_ps(dot8_512(q, kp + 8, d), vscale));
}

/* pv_accumulate with zmm: 64 columns in 4 registers, even and odd kv rows in separate chains
 * (8 in flight, as in the AVX2 version). */
AVX512_FN static void pv_accumulate_512(float *o, const float *p, const float *const *vp, int n,
                                        int64_t d) {
    int64_t i = 0;
    for (; i + 64 <= d; i += 64) {
        __m512 e0 = _mm512_loadu_ps(o + i), e1 = _mm512_loadu_ps(o + i + 16);
        __m512 e2 = _mm512_loadu_ps(o + i + 32), e3 = _mm512_loadu_ps(o + i + 48);
        __m512 d0 = _mm512_setzero_ps(), d1 = d0, d2 = d0, d3 = d0;
        int j = 0;
        for (; j + 2 <= n; j += 2) {
            const __m512 pe = _mm512_set1_ps(p[j]), po = _mm512_set1_ps(p[j + 1]);
            const float *ve = vp[j] + i, *vo = vp[j + 1] + i;
            e0 = _mm512_fmadd_ps(pe, _mm512_loadu_ps(ve), e0);
            e1 = _mm512_fmadd_ps(pe, _mm512_loadu_ps(ve + 16), e1);
            e2 = _mm512_fmadd_ps(pe, _mm512_loadu_ps(ve + 32), e2);
            e3 = _mm512_fmadd_ps(pe, _mm512_loadu_ps(ve + 48), e3);
            d0 = _mm512_fmadd_ps(po, _mm512_loadu_ps(vo), d0);
            d1 = _mm512_fmadd_ps(po, _mm512_loadu_ps(vo + 16), d1);
            d2 = _mm512_fmadd_ps(po, _mm512_loadu_ps(vo + 32), d2);
            d3 = _mm512_fmadd_ps(po, _mm512_loadu_ps(vo + 48), d3);
        }
        if (j < n) {
            const __m512 pe = _mm512_set1_ps(p[j]);
            const float *ve = vp[j] + i;
            e0 = _mm512_fmadd_ps(pe, _mm512_loadu_ps(ve), e0);
            e1 = _mm512_fmadd_ps(pe, _mm512_loadu_ps(ve + 16), e1);
            e2 = _mm512_fmadd_ps(pe, _mm512_loadu_ps(ve + 32), e2);
            e3 = _mm512_fmadd_ps(pe, _mm512_loadu_ps(ve + 48), e3);
        }
        _mm512_storeu_ps(o + i, _mm512_add_ps(e0, d0));
        _mm512_storeu_ps(o + i + 16, _mm512_add_ps(e1, d1));
        _mm512_storeu_ps(o + i + 32, _mm512_add_ps(e2, d2));
        _mm512_storeu_ps(o + i + 48, _mm512_add_ps(e3, d3));
    }
    for (; i < d; i += 16) {
        __m512 o0 = _mm512_loadu_ps(o + i);
        for (int j = 0; j < n; j++)
            o0 = _mm512_fmadd_ps(_mm512_set1_ps(p[j]), _mm512_loadu_ps(vp[j] + i), o0);
        _mm512_storeu_ps(o + i, o0);
    }
}

/* Row r's scores s[0..len) -> exp(s - max) in place, zeros up to npos; returns their sum (and
 * the max through max_out unless NULL). */
AVX2_FN static float softmax_row(float *s, int64_t len, int64_t npos, float *max_out) {
    __m256 vmax = _mm256_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 8 <= len; i += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(s + i));
    float m = hmax256(vmax);
    for (; i < len; i++) m = s[i] > m ? s[i] : m;
    if (max_out) *max_out = m;
    const __m256 vm = _mm256_set1_ps(m);
    __m256 vsum = _mm256_setzero_ps();
    for (i = 0; i + 8 <= len; i += 8) {
        const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + i), vm));
        _mm256_storeu_ps(s + i, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    float sum = hsum256(vsum);
    for (; i < len; i++) sum += (s[i] = expf(s[i] - m));
    for (; i < npos; i++) s[i] = 0.f;
    return sum;
}

/* softmax_row on 16 lanes, for att_decode (AVX-512 machines only): the same exp per element
 * (exp512 is exp256 lane for lane), the sum in another order.  NOTE: 11 % of the decode
 * kernel's samples went to the 8-lane version (b16, 180 tokens of context, hot cache). */
AVX512_FN static float softmax_row_512(float *s, int64_t len, int64_t npos, float *max_out) {
    const int64_t full = len & ~(int64_t)15;
    const __mmask16 tail = (__mmask16)((1u << (len - full)) - 1u);
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    for (int64_t i = 0; i < full; i += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(s + i));
    vmax = _mm512_mask_max_ps(vmax, tail, vmax, _mm512_maskz_loadu_ps(tail, s + full));
    const float m = _mm512_reduce_max_ps(vmax);
    if (max_out) *max_out = m;
    const __m512 vm = _mm512_set1_ps(m);
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t i = 0; i < full; i += 16) {
        const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(s + i), vm));
        _mm512_storeu_ps(s + i, e);
        vsum = _mm512_add_ps(vsum, e);
    }
    int64_t i = full;
    if (tail) {
        const __m512 e = _mm512_maskz_mov_ps(
            tail, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + full), vm)));
        _mm512_storeu_ps(s + full, e); /* zeros past len, within npos (a multiple of 16) */
        vsum = _mm512_add_ps(vsum, e);
        i += 16;
    }
    for (; i < npos; i++) s[i] = 0.f;
    return _mm512_reduce_add_ps(vsum);
}

/* Asks for all of a task's K and V (up to ATT_PF_TASK_BYTES) in L2 at its start.  NOTE: one
 * (block, head) slab is only block_size x d elements (2 KB for 16 x 64 fp16) and a sequence's
 * blocks lie anywhere in the pool, so the hardware prefetcher restarts at every slab and the
 * chunk-ahead prefetch covers one slab; issuing every slab up front keeps many misses in flight
 * and lets V arrive while K is being used. */
#define ATT_PF_TASK_BYTES (256 * 1024)
static void prefetch_task_kv(const shmk_kv_t *kv, const int32_t *bt_row, int64_t h, int64_t end) {
    const int64_t bs = kv->block_size, esz = (int64_t)kv_esize(kv);
    const int64_t slab = slab_rows(kv) * kv->d * esz, nblk = shmk_cdiv(end, bs);
    if (2 * nblk * slab > ATT_PF_TASK_BYTES) return;
    for (int64_t b = 0; b < nblk; b++) {
        const size_t off = kv_offset(kv, bt_row[b], h, 0) * (size_t)esz;
        /* int8: the whole slab, its scale rows too */
        const int64_t bytes =
            b == nblk - 1 && kv->dtype != 2 ? (end - b * bs) * kv->d * esz : slab;
        for (int64_t x = 0; x < bytes; x += 64) {
            _mm_prefetch((const char *)kv->k + off + x, _MM_HINT_T1);
            _mm_prefetch((const char *)kv->v + off + x, _MM_HINT_T1);
        }
    }
}

/* out[0..d) = o[0..d) * inv (d % 8 == 0): a row's softmax normalisation, on the way out */
AVX2_FN static void store_scaled(float *out, const float *o, float inv, int64_t d) {
    const __m256 v = _mm256_set1_ps(inv);
    for (int64_t i = 0; i < d; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(o + i), v));
}

/* ------------------------------------------------------------------ decode, fp16 or int8 cache
 * One query token: the G query rows of a kv head against its context, the fp16 or int8 cache
 * read in place (head_dim a multiple of DEC_COLS); int8 row scales multiply the chunk's scores
 * and, for values, the softmax weights (p_j s_j).  Where att_task_avx2 widens each chunk into a
 * scratch tile and then loads every element again per query row, here a K or V element is
 * widened once in a register and feeds the FMAs of up to DEC_ROWS rows (scores: 8 positions x
 * DEC_ROWS rows of accumulators, one reduction tree per row; P.V: DEC_ROWS rows x DEC_COLS
 * columns in registers, one column block after another).  Same fp32 math and two-pass
 * softmax, summed in another order. */
#define DEC_COLS 64
#define DEC_ROWS 3 /* query rows a pass: 8 x 3 score accumulators + 3 q + 1 k = 28 zmm */

/* rows in the pass that starts at row r0 of G */
static inline int dec_rows(int64_t G, int64_t r0) {
    return G - r0 < DEC_ROWS ? (int)(G - r0) : DEC_ROWS;
}

/* 16 cache elements at element i of row p, widened to fp32 */
#define LOAD16_F16(p, i) \
    _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)(p) + (i))))
#define LOAD16_I8(p, i)                                \
    _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(           \
        _mm_loadu_si128((const __m128i *)((const int8_t *)(p) + (i)))))

/* s[r * sstride + j] = scale * q_r . k_j, j < 8, for NR rows (q_r at q + r * d) */
#define DEC_SCORES(NR, T)                                                                      \
    AVX512_FN static void dec_scores8_##T##_##NR(const float *q, int64_t d,                     \
                                                 const void *const *kp, float scale, float *s, \
                                                 int64_t sstride) {                            \
        __m512 a[NR][8];                                                                       \
        for (int r = 0; r < NR; r++)                                                           \
            for (int j = 0; j < 8; j++) a[r][j] = _mm512_setzero_ps();                         \
        for (int64_t i = 0; i < d; i += 16) {                                                  \
            __m512 qv[NR];                                                                     \
            for (int r = 0; r < NR; r++) qv[r] = _mm512_loadu_ps(q + r * d + i);               \
            for (int j = 0; j < 8; j++) {                                                      \
                const __m512 k = LOAD16_##T(kp[j], i);                                         \
                for (int r = 0; r < NR; r++) a[r][j] = _mm512_fmadd_ps(qv[r], k, a[r][j]);     \
            }                                                                                  \
        }                                                                                      \
        const __m256 vscale = _mm256_set1_ps(scale);                                           \
        for (int r = 0; r < NR; r++)                                                           \
            _mm256_storeu_ps(                                                                  \
                s + r * sstride,                                                               \
                _mm256_mul_ps(reduce8(fold512(a[r][0]), fold512(a[r][1]), fold512(a[r][2]),    \
                                      fold512(a[r][3]), fold512(a[r][4]), fold512(a[r][5]),    \
                                      fold512(a[r][6]), fold512(a[r][7])),                     \
                              vscale));                                                        \
    }
DEC_SCORES(1, F16)
DEC_SCORES(2, F16)
DEC_SCORES(3, F16)
DEC_SCORES(1, I8)
DEC_SCORES(2, I8)
DEC_SCORES(3, I8)

/* o_r[col0 .. col0 + 64) += sum_{j < n} p_r[j] v_j[col0 ..] for NR rows (o_r at o + r * d,
 * p_r at p + r * pstride) */
#define DEC_PV(NR, T)                                                                          \
    AVX512_FN static void dec_pv_##T##_##NR(float *o, int64_t d, int64_t col0, const float *p,  \
                                            int64_t pstride, const void *const *vp, int n) {   \
        __m512 acc[NR][4];                                                                     \
        for (int r = 0; r < NR; r++)                                                           \
            for (int c = 0; c < 4; c++) acc[r][c] = _mm512_loadu_ps(o + r * d + col0 + c * 16); \
        for (int j = 0; j < n; j++) {                                                          \
            __m512 vv[4];                                                                      \
            for (int c = 0; c < 4; c++) vv[c] = LOAD16_##T(vp[j], col0 + c * 16);              \
            for (int r = 0; r < NR; r++) {                                                     \
                const __m512 pr = _mm512_set1_ps(p[r * pstride + j]);                          \
                for (int c = 0; c < 4; c++) acc[r][c] = _mm512_fmadd_ps(pr, vv[c], acc[r][c]); \
            }                                                                                  \
        }                                                                                      \
        for (int r = 0; r < NR; r++)                                                           \
            for (int c = 0; c < 4; c++) _mm512_storeu_ps(o + r * d + col0 + c * 16, acc[r][c]); \
    }
DEC_PV(1, F16)
DEC_PV(2, F16)
DEC_PV(3, F16)
DEC_PV(1, I8)
DEC_PV(2, I8)
DEC_PV(3, I8)

/* The same two inner loops on ymm for AVX2 machines.  NOTE: 16 ymm registers, not 32 zmm:
 * scores take 4 positions at a time (NR x 4 accumulators, q read as the FMAs' memory
 * operand), P.V 32 columns at a time (NR x 4 accumulators, the NR weights broadcast once per
 * position).  Where att_task_avx2 widened each chunk into scratch and read it back per row,
 * widening, its stores and the chunk streaming took ~40 % of b1 decode (perf, 6k context). */
#define LOAD8_F16(p, i) \
    _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)(p) + (i))))
#define LOAD8_I8(p, i) \
    _mm256_cvtepi32_ps(   \
        _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)(p) + (i)))))

/* lane j = the sum of a_j's 8 lanes */
INLINE AVX2_FN __m128 reduce4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

#define DEC2_SCORES(NR, T)                                                                     \
    AVX2_FN static void dec2_scores8_##T##_##NR(const float *q, int64_t d,                      \
                                                const void *const *kp, float scale, float *s,  \
                                                int64_t sstride) {                             \
        const __m128 vscale = _mm_set1_ps(scale);                                              \
        for (int j0 = 0; j0 < 8; j0 += 4) {                                                    \
            __m256 a[NR][4];                                                                   \
            for (int r = 0; r < NR; r++)                                                       \
                for (int j = 0; j < 4; j++) a[r][j] = _mm256_setzero_ps();                     \
            for (int64_t i = 0; i < d; i += 8)                                                 \
                for (int j = 0; j < 4; j++) {                                                  \
                    const __m256 k = LOAD8_##T(kp[j0 + j], i);                                 \
                    for (int r = 0; r < NR; r++)                                               \
                        a[r][j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * d + i), k, a[r][j]); \
                }                                                                              \
            for (int r = 0; r < NR; r++)                                                       \
                _mm_storeu_ps(s + r * sstride + j0,                                            \
                              _mm_mul_ps(reduce4(a[r][0], a[r][1], a[r][2], a[r][3]), vscale)); \
        }                                                                                      \
    }
DEC2_SCORES(1, F16)
DEC2_SCORES(2, F16)
DEC2_SCORES(3, F16)
DEC2_SCORES(1, I8)
DEC2_SCORES(2, I8)
DEC2_SCORES(3, I8)

#define DEC2_PV(NR, T)                                                                         \
    AVX2_FN static void dec2_pv_##T##_##NR(float *o, int64_t d, int64_t col0, const float *p,   \
                                           int64_t pstride, const void *const *vp, int n) {    \
        for (int64_t c0 = col0; c0 < col0 + DEC_COLS; c0 += 32) {                              \
            __m256 acc[NR][4];                                                                 \
            for (int r = 0; r < NR; r++)                                                       \
                for (int c = 0; c < 4; c++) acc[r][c] = _mm256_loadu_ps(o + r * d + c0 + 8 * c); \
            for (int j = 0; j < n; j++) {                                                      \
                __m256 pr[NR];                                                                 \
                for (int r = 0; r < NR; r++) pr[r] = _mm256_set1_ps(p[r * pstride + j]);      \
                for (int c = 0; c < 4; c++) {                                                  \
                    const __m256 v = LOAD8_##T(vp[j], c0 + 8 * c);                             \
                    for (int r = 0; r < NR; r++) acc[r][c] = _mm256_fmadd_ps(pr[r], v, acc[r][c]); \
                }                                                                              \
            }                                                                                  \
            for (int r = 0; r < NR; r++)                                                       \
                for (int c = 0; c < 4; c++) _mm256_storeu_ps(o + r * d + c0 + 8 * c, acc[r][c]); \
        }                                                                                      \
    }
DEC2_PV(1, F16)
DEC2_PV(2, F16)
DEC2_PV(3, F16)
DEC2_PV(1, I8)
DEC2_PV(2, I8)
DEC2_PV(3, I8)

typedef void (*dec_scores_fn)(const float *, int64_t, const void *const *, float, float *,
                              int64_t);
typedef void (*dec_pv_fn)(float *, int64_t, int64_t, const float *, int64_t, const void *const *,
                          int);

/* The decode passes read one kv head's K chunks, then its V chunks: one stream of 2 x nch
 * chunks.  Prefetches (to L1) stream chunk s: its rows and, for int8, its scales.
 * NOTE: a rolling window DEC_PF chunks ahead, V's first chunks arriving during K's last ones,
 * against all of a task's K and V asked for up front (prefetch_task_kv): batch-16 decode
 * attention in the model 105-110 -> 97-103 us a layer, b32 -3.5 %, alone at 400 tokens of
 * context -9-15 % (alternated builds); the up-front requests had stalled on full miss queues
 * with nothing computed meanwhile.  Small batches the same. */
#define DEC_PF 4
static inline void prefetch_stream_chunk(const shmk_kv_t *kv, const int32_t *bt_row, int64_t h,
                                         int64_t s, int64_t nch, int64_t p0, int64_t end) {
    if (s >= 2 * nch) return;
    const void *cache = s < nch ? kv->k : kv->v;
    const int64_t c0 = p0 + (s < nch ? s : s - nch) * ATT_CHUNK;
    const int cn = end - c0 < ATT_CHUNK ? (int)(end - c0) : ATT_CHUNK;
    const int64_t row_bytes = kv->d * (int64_t)kv_esize(kv);
    const void *rows[ATT_CHUNK];
    chunk_rows(kv, cache, bt_row, h, c0, end, rows);
    for (int j = 0; j < cn; j++)
        for (int64_t b = 0; b < row_bytes; b += 64)
            _mm_prefetch((const char *)rows[j] + b, _MM_HINT_T0);
    if (kv->dtype == 2) { /* the chunk's first and last scales (at most two lines) */
        int64_t bi, off;
        split_pos(kv, c0, &bi, &off);
        _mm_prefetch((const char *)kv_scale(kv, cache, bt_row[bi], h, off), _MM_HINT_T0);
        split_pos(kv, c0 + cn - 1, &bi, &off);
        _mm_prefetch((const char *)kv_scale(kv, cache, bt_row[bi], h, off), _MM_HINT_T0);
    }
}

/* Decode positions [p0, p1) (p0 a multiple of ATT_CHUNK) for one token and kv head: the
 * normalised output rows when part is NULL, else the segment's partial result there. */
AVX2_FN static void att_decode(const att_ctx *c, const att_task *tk, int64_t p0, int64_t p1,
                               float *part) {
    /* [zmm (AVX-512) or ymm][fp16 or int8][rows] */
    static const dec_scores_fn scores_by_type[2][2][DEC_ROWS + 1] = {
        {{NULL, dec2_scores8_F16_1, dec2_scores8_F16_2, dec2_scores8_F16_3},
         {NULL, dec2_scores8_I8_1, dec2_scores8_I8_2, dec2_scores8_I8_3}},
        {{NULL, dec_scores8_F16_1, dec_scores8_F16_2, dec_scores8_F16_3},
         {NULL, dec_scores8_I8_1, dec_scores8_I8_2, dec_scores8_I8_3}}};
    static const dec_pv_fn pv_by_type[2][2][DEC_ROWS + 1] = {
        {{NULL, dec2_pv_F16_1, dec2_pv_F16_2, dec2_pv_F16_3},
         {NULL, dec2_pv_I8_1, dec2_pv_I8_2, dec2_pv_I8_3}},
        {{NULL, dec_pv_F16_1, dec_pv_F16_2, dec_pv_F16_3},
         {NULL, dec_pv_I8_1, dec_pv_I8_2, dec_pv_I8_3}}};
    const shmk_kv_t *kv = c->kv;
    const int i8 = kv->dtype == 2;
    const dec_scores_fn *scores = scores_by_type[c->wide][i8];
    const dec_pv_fn *pv = pv_by_type[c->wide][i8];
    float (*const softmax)(float *, int64_t, int64_t, float *) =
        c->wide ? softmax_row_512 : softmax_row;
    const int64_t G = c->hq / kv->hk, h = tk->hk, d = kv->d;
    const int64_t len = p1 - p0;
    const int64_t npos = shmk_cdiv(len, ATT_CHUNK) * ATT_CHUNK;
    const float *q = c->q + (c->qsl[tk->b] + tk->t0) * c->q_stride + h * G * d;
    float *S = shmk_scratch(3, (size_t)(G * (npos + d + 2 + ATT_CHUNK)) * sizeof(float));
    float *O = S + G * npos, *sum = O + G * d, *max = sum + G, *Pv = max + G;
    const int32_t *bt_row = c->bt + tk->b * c->max_blocks;
    const void *rows[ATT_CHUNK];
    const int64_t nch = shmk_cdiv(len, ATT_CHUNK);
    for (int64_t s = 0; s < DEC_PF; s++) prefetch_stream_chunk(kv, bt_row, h, s, nch, p0, p1);
    /* pass 1: scores (lanes past p1 are overwritten by softmax_row) */
    for (int64_t c0 = p0; c0 < p1; c0 += ATT_CHUNK) {
        const int64_t at = c0 - p0; /* this chunk's column in S */
        prefetch_stream_chunk(kv, bt_row, h, at / ATT_CHUNK + DEC_PF, nch, p0, p1);
        chunk_rows(kv, kv->k, bt_row, h, c0, p1, rows);
        for (int64_t r0 = 0; r0 < G; r0 += DEC_ROWS) {
            const int nr = dec_rows(G, r0);
            scores[nr](q + r0 * d, d, rows, c->scale, S + r0 * npos + at, npos);
            if (p1 - c0 > 8)
                scores[nr](q + r0 * d, d, rows + 8, c->scale, S + r0 * npos + at + 8, npos);
        }
        if (i8) {
            float ks[ATT_CHUNK];
            chunk_scales(kv, kv->k, bt_row, h, c0, p1, ks);
            const __m256 k0 = _mm256_loadu_ps(ks), k1 = _mm256_loadu_ps(ks + 8);
            for (int64_t r = 0; r < G; r++) {
                float *sr = S + r * npos + at;
                _mm256_storeu_ps(sr, _mm256_mul_ps(_mm256_loadu_ps(sr), k0));
                _mm256_storeu_ps(sr + 8, _mm256_mul_ps(_mm256_loadu_ps(sr + 8), k1));
            }
        }
    }
    for (int64_t r = 0; r < G; r++) sum[r] = softmax(S + r * npos, len, npos, max + r);
    memset(O, 0, (size_t)(G * d) * sizeof(float));
    /* pass 2: O = P.V */
    for (int64_t c0 = p0; c0 < p1; c0 += ATT_CHUNK) {
        const int64_t at = c0 - p0;
        prefetch_stream_chunk(kv, bt_row, h, nch + at / ATT_CHUNK + DEC_PF, nch, p0, p1);
        chunk_rows(kv, kv->v, bt_row, h, c0, p1, rows);
        const int n = p1 - c0 < ATT_CHUNK ? (int)(p1 - c0) : ATT_CHUNK;
        const float *P = S + at; /* row r's weights at P + r * pstride */
        int64_t pstride = npos;
        if (i8) { /* p_j s_j into Pv, the chunk's weights only */
            float vs[ATT_CHUNK];
            chunk_scales(kv, kv->v, bt_row, h, c0, p1, vs);
            const __m256 v0 = _mm256_loadu_ps(vs), v1 = _mm256_loadu_ps(vs + 8);
            for (int64_t r = 0; r < G; r++) {
                const float *sr = S + r * npos + at;
                float *pr = Pv + r * ATT_CHUNK;
                _mm256_storeu_ps(pr, _mm256_mul_ps(_mm256_loadu_ps(sr), v0));
                _mm256_storeu_ps(pr + 8, _mm256_mul_ps(_mm256_loadu_ps(sr + 8), v1));
            }
            P = Pv, pstride = ATT_CHUNK;
        }
        for (int64_t r0 = 0; r0 < G; r0 += DEC_ROWS) {
            const int nr = dec_rows(G, r0);
            for (int64_t col0 = 0; col0 < d; col0 += DEC_COLS)
                pv[nr](O + r0 * d, d, col0, P + r0 * pstride, pstride, rows, n);
        }
    }
    if (part != NULL) {
        memcpy(part, O, (size_t)(G * d) * sizeof(float));
        memcpy(part + G * d, max, (size_t)G * sizeof(float));
        memcpy(part + G * d + G, sum, (size_t)G * sizeof(float));
        return;
    }
    float *out = c->out + ((c->qsl[tk->b] + tk->t0) * c->hq + h * G) * d;
    for (int64_t r = 0; r < G; r++) store_scaled(out + r * d, O + r * d, 1.f / sum[r], d);
}

/* ------------------------------------------------------------------ long decode contexts
 * A decode token's context is taken in segments of DEC_SEG positions past DEC_SEG, each a
 * partial softmax (its max m_s, exp-sum l_s and unnormalised P.V O_s), combined as
 * O = sum_s e^(m_s - M) O_s / sum_s e^(m_s - M) l_s.  NOTE: always at the same boundaries, so
 * a token's result does not depend on the batch it is in or on the thread count (the model's
 * greedy output stays batch-invariant); in batches of few tasks each segment is a task of its
 * own, combined after the parallel call: at batch 1 the kv heads alone (3 for SmolLM2) left a
 * thread of two with half the work of the other. */
#define DEC_SEG 512

/* caches att_decode reads in place (fp16, int8) with head_dim a multiple of its column block */
static inline int decode_kernel(const shmk_kv_t *kv) {
    return kv->dtype >= 1 && kv->d % DEC_COLS == 0;
}

static inline int64_t part_floats(int64_t G, int64_t d) { return G * (d + 2); }

/* the end of segment s of a context of kv_end positions */
static inline int64_t seg_end(int64_t s, int64_t kv_end) {
    return (s + 1) * DEC_SEG < kv_end ? (s + 1) * DEC_SEG : kv_end;
}

/* o[0..d) = one query row's nseg partial results combined; segment s's unnormalised output,
 * max and exp-sum at o_part, m_part and l_part + s * stride */
static void combine_row(const float *o_part, const float *m_part, const float *l_part,
                        int64_t stride, int64_t nseg, int64_t d, float *o) {
    float M = -INFINITY, L = 0.f;
    for (int64_t s = 0; s < nseg; s++) M = m_part[s * stride] > M ? m_part[s * stride] : M;
    for (int64_t j = 0; j < d; j++) o[j] = 0.f;
    for (int64_t s = 0; s < nseg; s++) {
        const float w = expf(m_part[s * stride] - M);
        L += w * l_part[s * stride];
        for (int64_t j = 0; j < d; j++) o[j] += w * o_part[s * stride + j];
    }
    const float inv = 1.f / L;
    for (int64_t j = 0; j < d; j++) o[j] *= inv;
}

/* out rows [G][d] = the nseg partial results at parts combined */
static void combine_parts(const float *parts, int64_t nseg, int64_t G, int64_t d, float *out) {
    const int64_t pf = part_floats(G, d);
    for (int64_t r = 0; r < G; r++)
        combine_row(parts + r * d, parts + G * d + r, parts + G * d + G + r, pf, nseg, d,
                    out + r * d);
}

/* A decode token's kv head: one segment of a split token, or its whole context */
AVX2_FN static void att_decode_task(const att_ctx *c, const att_task *tk) {
    const int64_t G = c->hq / c->kv->hk, d = c->kv->d;
    const int64_t kv_end = ctx_len(c, tk->b) + tk->t1; /* the token sees every cached position */
    if (tk->seg >= 0) {
        att_decode(c, tk, (int64_t)tk->seg * DEC_SEG, seg_end(tk->seg, kv_end),
                   c->parts + tk->part * part_floats(G, d));
        return;
    }
    if (kv_end <= DEC_SEG) {
        att_decode(c, tk, 0, kv_end, NULL);
        return;
    }
    const int64_t nseg = shmk_cdiv(kv_end, DEC_SEG);
    float *parts = shmk_scratch(6, (size_t)(nseg * part_floats(G, d)) * sizeof(float));
    for (int64_t s = 0; s < nseg; s++)
        att_decode(c, tk, s * DEC_SEG, seg_end(s, kv_end), parts + s * part_floats(G, d));
    combine_parts(parts, nseg, G, d,
                  c->out + ((c->qsl[tk->b] + tk->t0) * c->hq + tk->hk * G) * d);
}

/* whether a query row that sees len positions is taken in segments (nseg: the task's room) */
static inline int row_segmented(int64_t nseg, int64_t len) {
    return nseg > 0 && len > DEC_SEG;
}

/* row's S lanes [0, 16) *= sc[0, 16) */
INLINE AVX2_FN void scale_chunk(float *row, const float *sc) {
    _mm256_storeu_ps(row, _mm256_mul_ps(_mm256_loadu_ps(row), _mm256_loadu_ps(sc)));
    _mm256_storeu_ps(row + 8, _mm256_mul_ps(_mm256_loadu_ps(row + 8), _mm256_loadu_ps(sc + 8)));
}

/* Exact (two-pass) softmax per task: scores of every query row of the task against every kv
 * position it sees, then softmax over each row, then P.V.  K and V are each read once per task;
 * the G query heads and the tile's tokens share every chunk loaded; no per-chunk rescaling.
 * NOTE: with a cache att_decode reads, a row that sees more than DEC_SEG positions is taken in
 * att_decode's segments and combined by combine_row, int8 scales applied as att_decode applies
 * them: on the AVX2 path a token's output is then the same bits as a prefill row or a decode
 * token (preemption recomputes, chunk and prefix-cache boundaries leave greedy output
 * unchanged; tested).  The zmm inner loops (wide) sum in another order than zmm decode, and
 * agree to rounding only. */
AVX2_FN static void att_task_avx2(const att_ctx *c, const att_task *tk, int prefetch) {
    const shmk_kv_t *kv = c->kv;
    if (decode_kernel(c->kv) && tk->t1 - tk->t0 == 1) {
        att_decode_task(c, tk);
        return;
    }
    const int64_t d = kv->d, G = c->hq / kv->hk;
    const int64_t q_start = c->qsl[tk->b];
    const int64_t ctx0 = ctx_len(c, tk->b);
    const int64_t kv_end = ctx0 + tk->t1; /* exclusive */
    const int64_t npos = shmk_cdiv(kv_end, ATT_CHUNK) * ATT_CHUNK;
    const int64_t nrows = (tk->t1 - tk->t0) * G; /* row r = (token t0 + r / G, head r % G) */
    const int i8 = kv->dtype == 2;
    /* segments a row has room for: [d outputs, max, exp-sum] each */
    const int64_t nseg = decode_kernel(kv) && kv_end > DEC_SEG ? shmk_cdiv(kv_end, DEC_SEG) : 0;
    const int64_t seg_floats = d + 2;
    float *S = shmk_scratch(3, (size_t)(nrows * (npos + d + 1 + nseg * seg_floats) +
                                        ATT_CHUNK * d) *
                                   sizeof(float));
    float *O = S + nrows * npos, *W = O + nrows * d, *inv_sum = W + ATT_CHUNK * d;
    float *parts = inv_sum + nrows; /* row r's segment s at parts + (r * nseg + s) * seg_floats */
    float *rowbuf[ATT_CHUNK];
    const int32_t *bt_row = c->bt + tk->b * c->max_blocks;
    chunk_stream st = {
        .kv = kv, .bt_row = bt_row, .h = tk->hk, .end = kv_end, .f32 = W, .wide = c->wide};
    const __m256 vscale = _mm256_set1_ps(c->scale);
    if (prefetch) prefetch_task_kv(kv, bt_row, tk->hk, kv_end);
    /* pass 1: scores (lanes past a row's causal limit are overwritten by softmax_row) */
    st.cache = kv->k;
    for (int64_t c0 = 0; c0 < kv_end; c0 += ATT_CHUNK) {
        const float *const *kp = stream_chunk(&st, c0, rowbuf);
        const int two = kv_end - c0 > 8;
        for (int64_t r = 0; r < nrows; r++) {
            const int64_t ti = tk->t0 + r / G;
            if (ctx0 + ti < c0) continue; /* the whole chunk is in this token's future */
            const float *q = c->q + (q_start + ti) * c->q_stride + (tk->hk * G + r % G) * d;
            float *s = S + r * npos + c0;
            if (c->wide) {
                scores_512(q, kp, d, c->scale, two, s);
            } else {
                _mm256_storeu_ps(s, _mm256_mul_ps(dot8(q, kp, d), vscale));
                if (two) _mm256_storeu_ps(s + 8, _mm256_mul_ps(dot8(q, kp + 8, d), vscale));
            }
            if (i8) scale_chunk(s, st.scales);
        }
    }
    /* pass 2: softmax (normalised at the end, in the output store) */
    for (int64_t r = 0; r < nrows; r++) {
        const int64_t len = ctx0 + tk->t0 + r / G + 1;
        if (!row_segmented(nseg, len)) {
            inv_sum[r] = 1.f / softmax_row(S + r * npos, len, npos, NULL);
            continue;
        }
        for (int64_t sg = 0; sg * DEC_SEG < len; sg++) {
            const int64_t p0 = sg * DEC_SEG, n = seg_end(sg, len) - p0;
            float *part = parts + (r * nseg + sg) * seg_floats;
            part[d + 1] = softmax_row(S + r * npos + p0, n, shmk_cdiv(n, ATT_CHUNK) * ATT_CHUNK,
                                      part + d);
            memset(part, 0, (size_t)d * sizeof(float));
        }
    }
    memset(O, 0, (size_t)(nrows * d) * sizeof(float));
    /* pass 3: O = P.V (a segmented row's into its segment's part) */
    st.cache = kv->v;
    for (int64_t c0 = 0; c0 < kv_end; c0 += ATT_CHUNK) {
        const float *const *vp = stream_chunk(&st, c0, rowbuf);
        for (int64_t r = 0; r < nrows; r++) {
            const int64_t pos = ctx0 + tk->t0 + r / G;
            if (pos < c0) continue;
            const int n = pos - c0 + 1 < ATT_CHUNK ? (int)(pos - c0 + 1) : ATT_CHUNK;
            float *p = S + r * npos + c0;
            float *o = row_segmented(nseg, pos + 1)
                           ? parts + (r * nseg + c0 / DEC_SEG) * seg_floats
                           : O + r * d;
            if (i8) scale_chunk(p, st.scales); /* p_j s_j */
            if (c->wide)
                pv_accumulate_512(o, p, vp, n, d);
            else
                pv_accumulate(o, p, vp, n, d);
        }
    }
    for (int64_t r = 0; r < nrows; r++) {
        const int64_t ti = tk->t0 + r / G;
        float *out = c->out + ((q_start + ti) * c->hq + tk->hk * G + r % G) * d;
        const int64_t len = ctx0 + ti + 1;
        if (row_segmented(nseg, len)) {
            const float *part = parts + r * nseg * seg_floats;
            combine_row(part, part + d, part + d + 1, seg_floats, shmk_cdiv(len, DEC_SEG), d, out);
        } else {
            store_scaled(out, O + r * d, inv_sum[r], d);
        }
    }
}

/* ------------------------------------------------------------------ prefill tiles, AVX-512
 * A task's query rows (16 tokens x G heads) against its whole context is a small GEMM pair; the
 * per-row dot products above spend as much on loads and horizontal sums as on FMAs.  Here the
 * rows run along zmm lanes: with Q transposed once per task (Qt[i][r], scale folded in) a score
 * block is 16 rows x 8 positions in 8 accumulators, each FMA taking one broadcast K element;
 * softmax is elementwise across lanes; P.V keeps R rows x D columns in registers and shares each
 * V load across the R rows.  K and V are widened to fp32 once per task into one buffer.
 * D is a compile-time 64 or 128 (the broadcasts then use immediate offsets). */
#define ATT_ROWS_MAX_G 16 /* query heads per kv head this path takes */

/* dst[p][0..d) = the fp32 kv rows p = 0 .. end-1 of head h; rows end .. pad-1 zero */
AVX512_FN static void widen_all(const shmk_kv_t *kv, const void *cache, const int32_t *bt_row,
                                int64_t h, int64_t end, int64_t pad, float *dst) {
    const void *rows[ATT_CHUNK];
    const int64_t d = kv->d;
    for (int64_t c0 = 0; c0 < end; c0 += ATT_CHUNK) {
        chunk_rows(kv, cache, bt_row, h, c0, end, rows);
        const int cn = end - c0 < ATT_CHUNK ? (int)(end - c0) : ATT_CHUNK;
        float sc[ATT_CHUNK];
        if (kv->dtype == 2) chunk_scales(kv, cache, bt_row, h, c0, end, sc);
        for (int j = 0; j < cn; j++) {
            if (kv->dtype == 2)
                widen_i8_512(dst + (c0 + j) * d, rows[j], sc[j], d);
            else if (kv->dtype == 1)
                widen_f16_512(dst + (c0 + j) * d, rows[j], d);
            else
                memcpy(dst + (c0 + j) * d, rows[j], (size_t)d * sizeof(float));
        }
    }
    memset(dst + end * d, 0, (size_t)((pad - end) * d) * sizeof(float));
}

/* St[p][b0 .. b0+16) = scores of the block's 16 rows at positions p0 .. p0+7 (-inf past each
 * row's causal limit) */
#define SCORE_ACC(k) a##k = _mm512_fmadd_ps(qv, _mm512_set1_ps(w[k * D]), a##k)
#define SCORE_STORE(k)                                                                       \
    do {                                                                                     \
        const __mmask16 late = _mm512_cmplt_epi32_mask(lim, _mm512_set1_epi32((int)p0 + k)); \
        _mm512_storeu_ps(St + (p0 + k) * rp + b0, _mm512_mask_mov_ps(a##k, late, ninf));     \
    } while (0)
INLINE AVX512_FN void score_block8(const float *Qt, const float *Kw, float *St, int64_t rp,
                                   int64_t b0, int64_t p0, __m512i lim, const int D) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int i = 0; i < D; i++) {
        const __m512 qv = _mm512_loadu_ps(Qt + i * rp + b0);
        const float *w = Kw + p0 * D + i;
        SCORE_ACC(0); SCORE_ACC(1); SCORE_ACC(2); SCORE_ACC(3);
        SCORE_ACC(4); SCORE_ACC(5); SCORE_ACC(6); SCORE_ACC(7);
    }
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    SCORE_STORE(0); SCORE_STORE(1); SCORE_STORE(2); SCORE_STORE(3);
    SCORE_STORE(4); SCORE_STORE(5); SCORE_STORE(6); SCORE_STORE(7);
}

/* out rows r0 .. r0+nr-1 (nr <= R) = (sum_p P[p][r] V[p]) / sum_r, for positions 0 .. pend-1 */
INLINE AVX512_FN void pv_rows(const float *St, const float *Vw, int64_t rp, int64_t r0,
                              int64_t pend, const float *inv_sum, float *const *outs, const int D,
                              const int R) {
    __m512 acc[6][8]; /* [R][D / 16]; R * D / 16 <= 24 */
    for (int r = 0; r < R; r++)
        for (int k = 0; k < D / 16; k++) acc[r][k] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pend; p++) {
        __m512 v[8];
        for (int k = 0; k < D / 16; k++) v[k] = _mm512_loadu_ps(Vw + p * D + 16 * k);
        for (int r = 0; r < R; r++) {
            const __m512 pb = _mm512_set1_ps(St[p * rp + r0 + r]);
            for (int k = 0; k < D / 16; k++) acc[r][k] = _mm512_fmadd_ps(pb, v[k], acc[r][k]);
        }
    }
    for (int r = 0; r < R; r++) {
        const __m512 inv = _mm512_set1_ps(inv_sum[r0 + r]);
        for (int k = 0; k < D / 16; k++)
            _mm512_storeu_ps(outs[r] + 16 * k, _mm512_mul_ps(acc[r][k], inv));
    }
}

INLINE AVX512_FN void att_rows_impl(const att_ctx *c, const att_task *tk, const int D) {
    const shmk_kv_t *kv = c->kv;
    const int64_t G = c->hq / kv->hk;
    const int64_t q_start = c->qsl[tk->b];
    const int64_t ctx0 = ctx_len(c, tk->b);
    const int64_t kv_end = ctx0 + tk->t1; /* exclusive */
    const int64_t pad = shmk_cdiv(kv_end, 8) * 8;
    const int64_t nrows = (tk->t1 - tk->t0) * G; /* row r = (token t0 + r / G, head r % G) */
    const int64_t rp = shmk_cdiv(nrows, 16) * 16;
    float *Qt = shmk_scratch(5, (size_t)(D * rp + pad * rp + pad * D + 2 * rp) * sizeof(float));
    float *St = Qt + D * rp, *KVw = St + pad * rp, *inv_sum = KVw + pad * D;
    int32_t *lim = (int32_t *)(inv_sum + rp); /* last position each row sees */
    const int32_t *bt_row = c->bt + tk->b * c->max_blocks;
    float *outs[ATT_QTILE * ATT_ROWS_MAX_G];
    for (int64_t r = 0; r < rp; r++) {
        const int live = r < nrows;
        const int64_t ti = tk->t0 + (live ? r : nrows - 1) / G;
        const float *q = c->q + (q_start + ti) * c->q_stride + (tk->hk * G + r % G) * D;
        lim[r] = (int32_t)(ctx0 + ti);
        for (int i = 0; i < D; i++) Qt[i * rp + r] = live ? q[i] * c->scale : 0.f;
    }
    /* pass 1: scores, block by block of 16 rows, only as far as the block's last row sees */
    widen_all(kv, kv->k, bt_row, tk->hk, kv_end, pad, KVw);
    for (int64_t b0 = 0; b0 < rp; b0 += 16) {
        const __m512i limv = _mm512_loadu_si512((const void *)(lim + b0));
        const int64_t last = lim[b0 + 15]; /* rows are in token order: the block's largest */
        for (int64_t p0 = 0; p0 <= last; p0 += 8) score_block8(Qt, KVw, St, rp, b0, p0, limv, D);
        /* pass 2: softmax along positions, 16 rows at once; zeros past `last` for pv_rows */
        __m512 m = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
        for (int64_t p = 0; p <= last; p++) m = _mm512_max_ps(m, _mm512_loadu_ps(St + p * rp + b0));
        for (int64_t p = 0; p <= last; p++) {
            const __mmask16 late = _mm512_cmplt_epi32_mask(limv, _mm512_set1_epi32((int)p));
            const __m512 e = _mm512_maskz_mov_ps(
                (__mmask16)~late, exp512(_mm512_sub_ps(_mm512_loadu_ps(St + p * rp + b0), m)));
            _mm512_storeu_ps(St + p * rp + b0, e);
            sum = _mm512_add_ps(sum, e);
        }
        for (int64_t p = last + 1; p < kv_end; p++)
            _mm512_storeu_ps(St + p * rp + b0, _mm512_setzero_ps());
        _mm512_storeu_ps(inv_sum + b0, _mm512_div_ps(_mm512_set1_ps(1.f), sum));
    }
    /* pass 3: P.V */
    widen_all(kv, kv->v, bt_row, tk->hk, kv_end, pad, KVw);
    for (int64_t r = 0; r < nrows; r++)
        outs[r] = c->out + ((q_start + tk->t0 + r / G) * c->hq + tk->hk * G + r % G) * D;
    const int R = D == 64 ? 6 : 3;
    int64_t r0 = 0;
    for (; r0 + R <= nrows; r0 += R)
        pv_rows(St, KVw, rp, r0, lim[r0 + R - 1] + 1, inv_sum, outs + r0, D, R);
    for (; r0 < nrows; r0++) pv_rows(St, KVw, rp, r0, lim[r0] + 1, inv_sum, outs + r0, D, 1);
}

AVX512_FN static void att_rows_d64(const att_ctx *c, const att_task *tk) {
    att_rows_impl(c, tk, 64);
}
AVX512_FN static void att_rows_d128(const att_ctx *c, const att_task *tk) {
    att_rows_impl(c, tk, 128);
}

static void att_task_fn(void *vctx, int64_t task, int tid) {
    (void)tid;
    const att_ctx *c = vctx;
    const att_task *tk = &c->tasks[task];
    const int64_t G = c->hq / c->kv->hk;
    if (tk->seg >= 0) { /* a segment of a split decode token */
        att_decode_task(c, tk);
        return;
    }
    /* lanes are rows: worth it from 16 rows (prefill tiles), not for decode's G rows */
    const int rows = c->wide && (tk->t1 - tk->t0) * G >= 16 && G <= ATT_ROWS_MAX_G;
    if (rows && c->kv->d == 64)
        att_rows_d64(c, tk);
    else if (rows && c->kv->d == 128)
        att_rows_d128(c, tk);
    else if (c->avx2 && tk->hk < 0) { /* a decode token's every kv head (see the task list) */
        for (int32_t h = 0; h < c->kv->hk; h++) {
            const att_task one = {tk->b, h, tk->t0, tk->t1, -1, 0};
            att_task_avx2(c, &one, 1);
        }
    } else if (c->avx2)
        att_task_avx2(c, &c->tasks[task], 1);
    else
        att_task_portable(c, &c->tasks[task]);
}

typedef struct {
    const float *q;
    int64_t q_stride, hq, d, rows_per_task, end;
    float *out;
} rotate_ctx;

/* queries rows [i0, i1): each head's d values copied to out [row][hq][d] and rotated */
static void rotate_rows(const rotate_ctx *c, int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; i++)
        for (int64_t h = 0; h < c->hq; h++) {
            float *dst = c->out + (i * c->hq + h) * c->d;
            memcpy(dst, c->q + i * c->q_stride + h * c->d, (size_t)c->d * sizeof(float));
            shmk_fwht(dst, c->d);
        }
}

static void rotate_task(void *vctx, int64_t task, int tid) {
    (void)tid;
    const rotate_ctx *c = vctx;
    const int64_t i0 = task * c->rows_per_task;
    rotate_rows(c, i0, i0 + c->rows_per_task < c->end ? i0 + c->rows_per_task : c->end);
}

/* an int8 cache holds rotated keys: the queries, rotated the same way, into scratch slot 8 */
static const float *rotate_queries(const float *q, int64_t q_stride, int64_t rows, int64_t hq,
                                   int64_t d) {
    rotate_ctx c = {q, q_stride, hq, d, 0, rows, shmk_scratch(8, (size_t)(rows * hq * d) * 4)};
    if (rows < 64) { /* a decode step's few rows: cheaper than waking the pool */
        rotate_rows(&c, 0, rows);
        return c.out;
    }
    c.rows_per_task = shmk_cdiv(rows, 4 * shmk_threads());
    shmk_parallel(rotate_task, &c, shmk_cdiv(rows, c.rows_per_task));
    return c.out;
}

void shmk_attention_impl(const float *q, int64_t q_stride, const shmk_kv_t *kv,
                         const int32_t *block_table, int64_t max_blocks, const int32_t *seq_lens,
                         const int32_t *qsl, int64_t b, int64_t hq, float scale, float *out) {
    const int64_t total_q = qsl[b] - qsl[0];
    if (total_q <= 0) return;
    if (int8_rows_unsupported(kv)) return;
    if (kv->dtype == 2) {
        /* NOTE: (H q).(H k) = d (q.k) with the unnormalised transform */
        q = rotate_queries(q, q_stride, qsl[b], hq, kv->d);
        q_stride = hq * kv->d;
        scale /= (float)kv->d;
    }
    const int avx2 = shmk_path() >= SHMK_AVX2 && kv->d % 8 == 0;
    if (!avx2 && kv->d > 1024) return; /* the portable path keeps o[] on the stack */
    const int64_t G = hq / kv->hk;
    const int wide = avx2 && shmk_path() >= SHMK_VNNI && kv->d % 16 == 0;
    const int whole_decode = avx2 && G < 16 && b >= 2 * shmk_threads();
    /* small batches: a long decode token's segments are tasks of their own (see DEC_SEG); only
     * where att_task_fn would reach att_decode_task (not att_rows' >= 16 rows) */
    const int split = avx2 && decode_kernel(kv) && !(wide && G >= 16) && !whole_decode;
    /* pass 0 counts, pass 1 fills: tasks, then the split tokens (groups), then their parts */
    int64_t ntasks = 0, ngroups = 0, nparts = 0;
    att_task *tasks = NULL, *groups = NULL;
    float *parts = NULL;
    for (int pass = 0; pass < 2; pass++) {
        if (pass == 1) {
            const size_t tbytes = (size_t)(ntasks + ngroups) * sizeof(att_task);
            const size_t toff = (tbytes + 63) & ~(size_t)63;
            char *mem = shmk_scratch(
                4, toff + (size_t)(nparts * part_floats(G, kv->d)) * sizeof(float));
            tasks = (att_task *)mem, groups = tasks + ntasks, parts = (float *)(mem + toff);
        }
        int64_t n = 0, ng = 0, np = 0;
        /* longest (most causal work) tiles first so dynamic scheduling balances the tail */
        for (int64_t s = 0; s < b; s++) {
            const int64_t q_len = qsl[s + 1] - qsl[s];
            for (int64_t t1 = q_len; t1 > 0; t1 -= ATT_QTILE) {
                const int64_t t0 = t1 - ATT_QTILE > 0 ? t1 - ATT_QTILE : 0;
                /* NOTE: in a batch of several sequences, a decode token (not an att_rows tile)
                 * is one task for all its kv heads: hk times fewer tasks, each reading
                 * adjacent head slabs of the same blocks (b16 decode at 256 tokens of context
                 * 553-575 -> 587-596 tok/s, b32 at 128 +1-3%, alternated builds; with
                 * att_decode's rolling prefetch, a task a head still cost b16 -3 % and b32
                 * -5-7 %).  Small batches keep a task a head so every thread gets work. */
                if (whole_decode && t1 - t0 == 1) {
                    if (pass) tasks[n] = (att_task){(int32_t)s, -1, (int32_t)t0, (int32_t)t1, -1, 0};
                    n++;
                    continue;
                }
                const int64_t kv_end = seq_lens[s] - q_len + t1;
                const int64_t nseg =
                    split && t1 - t0 == 1 && kv_end > DEC_SEG ? shmk_cdiv(kv_end, DEC_SEG) : 0;
                for (int64_t h = 0; h < kv->hk; h++) {
                    if (!nseg) {
                        if (pass) tasks[n] = (att_task){(int32_t)s, (int32_t)h, (int32_t)t0,
                                                        (int32_t)t1, -1, 0};
                        n++;
                        continue;
                    }
                    if (pass) groups[ng] = (att_task){(int32_t)s, (int32_t)h, (int32_t)t0,
                                                      (int32_t)t1, (int32_t)nseg, (int32_t)np};
                    ng++;
                    for (int64_t g = 0; g < nseg; g++, n++, np++)
                        if (pass) tasks[n] = (att_task){(int32_t)s, (int32_t)h, (int32_t)t0,
                                                        (int32_t)t1, (int32_t)g, (int32_t)np};
                }
            }
        }
        ntasks = n, ngroups = ng, nparts = np;
    }
    att_ctx c = {q,     q_stride, kv,  block_table, seq_lens, qsl,  max_blocks,
                 hq,    scale,    out, tasks,       parts,    avx2, wide};
    shmk_parallel(att_task_fn, &c, ntasks);
    /* the split tokens' segments, combined (a few rows: batches of under 2 x threads) */
    const int64_t pf = part_floats(G, kv->d);
    for (int64_t i = 0; i < ngroups; i++) {
        const att_task *g = &groups[i];
        combine_parts(parts + g->part * pf, g->seg, G, kv->d,
                      out + ((qsl[g->b] + g->t0) * hq + g->hk * G) * kv->d);
    }
}

void shmk_paged_attention(const float *q, const shmk_kv_t *kv, const int32_t *block_table,
                          int64_t max_blocks, const int32_t *seq_lens,
                          const int32_t *query_start_loc, int64_t b, int64_t hq, float scale,
                          float *out) {
    shmk_attention_impl(q, hq * kv->d, kv, block_table, max_blocks, seq_lens, query_start_loc, b,
                        hq, scale, out);
}
