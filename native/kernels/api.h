/* Public C API of shm_engine._kernels_cffi.  build_kernels.py feeds the lines of this file that
 * do not start with '#' to ffi.cdef(), so keep it to plain declarations.
 *
 * Conventions: all matrices are dense row-major; index arrays are int32 unless noted; float is fp32.
 * Path ids: 0 = portable C, 1 = AVX2 (+FMA), 2 = AVX512-VNNI (F/BW/VL/VNNI). */
#ifndef SHMK_API_H
#define SHMK_API_H
#include <stddef.h>
#include <stdint.h>

/* ---- dispatch and thread pool ---- */
int shmk_best_path(void);                 /* best path this CPU supports */
int shmk_get_path(void);                  /* path in use */
int shmk_set_path(int path);              /* 0 on success, -1 if the CPU lacks it */
int shmk_set_num_threads(int n);          /* resizes the persistent pool (n >= 1); returns n */
int shmk_get_num_threads(void);
/* on = 1 before a run of parallel calls (one model forward), 0 after: meanwhile idle pool threads
 * spin up to ~1 ms instead of ~30 us before they park (see pool.c) */
void shmk_pool_hold(int on);
int shmk_pool_holds(void); /* holds in force (tests) */

/* ---- W8 (group-32) x A16 (per-token) GEMM (gemm16.c) ----
 * weights: int8, a scale per (output channel, 32 consecutive k); kp = ceil(k/32)*32.
 *   packed [nb = ceil(n/16)][kp/32][16 pairs][16 channels][2 k] int8 (zero padded);
 *   scales fp16 bits [nb][kp/32][16]; real scale = fp16(scales) * scale_mult (a power of two). */
int64_t shmk_padded_k(int64_t k);                  /* k rounded up to a multiple of 32 */
size_t shmk_packed_bytes(int64_t n, int64_t k);    /* int8 bytes of packed */
size_t shmk_packed_scales(int64_t n, int64_t k);   /* number of fp16 scales */
/* w fp32 [n,k] -> packed, scales; returns scale_mult */
float shmk_pack_weights(const float *w, int64_t n, int64_t k, int8_t *packed, uint16_t *scales);
/* max |w| of numel floats, NaN ignored: what shmk_pack_weights derives scale_mult from */
float shmk_weights_amax(const float *w, int64_t numel);
/* shmk_pack_weights for n rows of a larger matrix whose max |w| is amax (the max of the chunks'
 * shmk_weights_amax): rows 16b .. of a matrix go to packed + b * kp/32 * 512 and
 * scales + b * kp/32 * 16, and every chunk returns the matrix's scale_mult, so chunks of a
 * multiple of 16 rows pack exactly what one call on the whole matrix does. */
float shmk_pack_rows(const float *w, int64_t n, int64_t k, float amax, int8_t *packed,
                     uint16_t *scales);
/* q int8 [n,k] and the real group scales fp32 [n][kp/32] */
void shmk_unpack_weights(const int8_t *packed, const uint16_t *scales, float scale_mult, int64_t n,
                         int64_t k, int8_t *q, float *gscales);

typedef struct {
    int64_t n, k;
    const int8_t *packed;
    const uint16_t *scales;
    float scale_mult;
    const float *bias; /* may be NULL */
    /* 1: on AMX machines, calls of >= shmk_amx_bf16_min_rows() rows round the activations to bf16
     * (gemm_amx.c);
     * 0: always int16 activations (for inputs whose range bf16 serves badly; on AMX machines
     * those run on int8 tiles from 9 rows, with the same results: gemm_amx8.c) */
    int act_bf16;
    /* 1: packed from W H / 32 (kernels.rotate_groups), each byte + 128: every call takes
     * gemm_a8.c, which rotates each 32 k of the activations by H and quantises them to 8 bits,
     * a scale per group (on path vnni faster than the int16 kernel, at a cost in accuracy);
     * on W4 weights (mins), packed as ever: every call takes gemm_w4a8.c, 8-bit activations a
     * scale per 16 k, unrotated (vpmaddubsw: on AVX2 faster than the int16 kernels) */
    int act8;
    /* non-NULL: W4 weights (packed by shmk_pack_rows_w4; packed then holds nibbles), w = s u + m
     * with these group minimums m (fp16 bits, signed, times scale_mult) */
    const uint16_t *mins;
} shmk_linear_t;

/* rows from which act_bf16 weights take the bf16 AMX kernel (SHMK_AMX_MIN_M) */
int shmk_amx_bf16_min_rows(void);

/* activations: per-row symmetric int16, xq[m][kp] zero padded, scale = max|x|/32767 */
void shmk_quantize_rows(const float *x, int64_t m, int64_t k, int16_t *xq, float *scales);
/* exact group dot products dots[i][j][g] = sum_{k in group g} xq[i][k] * q[j][k] (int32) */
void shmk_gemm_group_dots(const int16_t *xq, int64_t m, const shmk_linear_t *w, int32_t *dots);
/* out[i][0..k) = output channel ids[i] of w dequantised (ids in [0, n), unchecked): what
 * shmk_unpack_weights' q times its group scales gives */
void shmk_dequant_channels(const shmk_linear_t *w, const int64_t *ids, int64_t t, float *out);
/* y[m,n] = x @ dequant(W)^T (+ bias), via per-row int16 quantisation of x */
void shmk_linear(const float *x, int64_t m, const shmk_linear_t *w, float *y);

/* ---- W4 (group-32, affine) weights (w4.c): w[j][k] = s[j][g] u[j][k] + m[j][g], u in [0, 15]
 *   packed [nb][kp/32][4 nibble rows][64 bytes]: byte i of nibble row p holds byte i of the W8
 *   layout's quad row p (low nibble) and of quad row p + 4 (high nibble), as u values;
 *   scales, mins fp16 bits [nb][kp/32][16], both signed; real = fp16 * scale_mult.
 * Per group the better (least squares) of the min/max grid (llama.cpp's Q4_1) and the
 * symmetric one about the largest |w| (Q4_0), so groups as llama.cpp's reference quantisers
 * write them come back exact (with an importance matrix they need not: the engine packs GGUF
 * matrices from their own blocks, kernels.PackedLinear.from_w4_grid).
 * shmk_linear runs them on W8's int16 activations: each group's dot of u is exact int32, then
 *   acc = fmaf((float)dot_g, s_g, acc) over the groups in order, as for W8; then
 *   acc = fmaf(xsum_g, m_g, acc) over the groups in order
 * with xsum_g the group's sum of the row's int16 activations (exact); y = acc * (sx scale_mult). */
size_t shmk_packed_bytes_w4(int64_t n, int64_t k);
/* as shmk_pack_rows (chunks of 16 rows at a time pack what one call does); returns scale_mult */
float shmk_pack_rows_w4(const float *w, int64_t n, int64_t k, float amax, uint8_t *packed,
                        uint16_t *scales, uint16_t *mins);
/* u [n][k] and the real group scales and minimums fp32 [n][kp/32] */
void shmk_unpack_w4(const uint8_t *packed, const uint16_t *scales, const uint16_t *mins,
                    float scale_mult, int64_t n, int64_t k, uint8_t *u, float *gscales,
                    float *gmins);

/* ---- W8 x A8 GEMM (gemm_a8.c) on weights packed rotated, opt-in per weight ---- */
/* activations: each 32 k (zero padded) times the Walsh-Hadamard matrix H, then
 * xq[m][kp] = int8 per group, scales[m][kp/32] */
void shmk_quantize_rows_a8(const float *x, int64_t m, int64_t k, int8_t *xq, float *scales);
/* y[m,n] = (H x) @ dequant(W)^T (+ bias) on 8-bit activations at any m (whatever w->act8 says):
 * the VNNI kernel on paths vnni / amx, else the portable one (the same bits) */
void shmk_linear_a8(const float *x, int64_t m, const shmk_linear_t *w, float *y);

/* ---- W4 x A8 GEMM (gemm_w4a8.c): W4 weights with act8 ---- */
/* activations: xq[m][kp] int8 a scale per 16 k (zero padded), scales[m][kp/16], and sums[m][kp/32]
 * each group's sum as quantised (fmaf(s_hi, sum_hi, s_lo sum_lo)); see gemm_w4a8.c */
void shmk_quantize_rows_w4a8(const float *x, int64_t m, int64_t k, int8_t *xq, float *scales,
                             float *sums);

/* ---- elementwise / normalisation ---- */
/* if residual != NULL: x += residual (in place); then out = x * rsqrt(mean(x^2) + eps) * w */
void shmk_rmsnorm(float *x, const float *residual, const float *w, int64_t m, int64_t h, float eps,
                  float *out);
/* NeoX/HF rotate_half RoPE in place.  q [t][hq][d], k [t][hk][d] (k may be NULL), pos int64 [t],
 * cos_sin [max_pos][d]: first d/2 = cos(p*inv_freq), last d/2 = sin(p*inv_freq). */
void shmk_rope(float *q, float *k, const int64_t *pos, int64_t t, int64_t hq, int64_t hk, int64_t d,
               const float *cos_sin, int64_t max_pos);
/* out[m][f] = silu(gu[m][f]) * gu[m][f + f_dim] */
void shmk_silu_mul(const float *gu, int64_t m, int64_t f, float *out);
/* out[i] = the first index of row i's largest value (x [m][n], n >= 1); NaN counts as -inf, so a
 * row without a number above -inf gives 0 */
void shmk_argmax_rows(const float *x, int64_t m, int64_t n, int64_t *out);

/* ---- paged KV cache (attention.c) ----
 * Per layer, k and v each [num_blocks][hk][rows][d] (head-major inside a block), fp32 or IEEE
 * fp16 (rounded to nearest even on write, widened exactly on read; math is fp32), rows =
 * block_size; or int8 (d a power of two <= 1024), rows = block_size + cdiv(4 block_size, d): a
 * row per position (keys Hadamard-rotated) quantised with its own fp32 scale, the block_size
 * scales after them (see kv_quant.c).
 * slot s -> (block s / block_size, offset s % block_size); slots outside the cache are skipped. */
typedef struct {
    void *k, *v;
    int64_t num_blocks, block_size, hk, d;
    int dtype;                    /* 0 = fp32, 1 = fp16, 2 = int8 */
} shmk_kv_t;

/* k, v [t][hk][d] fp32 -> the cache at slots (int64 [t]) */
void shmk_write_kv(const float *k, const float *v, const int64_t *slots, int64_t t,
                   const shmk_kv_t *kv);
/* causal attention of q [t][hq][d] over the cache; see shmk_attention_impl in attention.c */
void shmk_paged_attention(const float *q, const shmk_kv_t *kv, const int32_t *block_table,
                          int64_t max_blocks, const int32_t *seq_lens,
                          const int32_t *query_start_loc, int64_t b, int64_t hq, float scale,
                          float *out);

/* ---- one fused decoder layer ---- */
typedef struct {
    int64_t hidden, hq, hk, d, ffn;
    float eps;
    const float *input_norm;      /* [hidden] */
    const float *post_norm;       /* [hidden] */
    const float *q_norm, *k_norm; /* [d] each: Qwen3's per-head RMSNorm before RoPE; or NULL */
    int rope;                     /* 0: no RoPE in this layer (SmolLM3's NoPE layers) */
    shmk_linear_t qkv;            /* n = (hq + 2 hk) d, rows ordered q | k | v */
    shmk_linear_t o;              /* n = hidden, k = hq d */
    shmk_linear_t gate_up;        /* n = 2 ffn, rows ordered gate | up */
    shmk_linear_t down;           /* n = hidden, k = ffn */
} shmk_layer_t;

typedef struct {
    int64_t t;                    /* tokens in the batch */
    int64_t b;                    /* sequences */
    const int64_t *positions;     /* [t] */
    const int64_t *slots;         /* [t] */
    const int32_t *block_table;   /* [b][max_blocks] */
    int64_t max_blocks;
    const int32_t *seq_lens;      /* [b] */
    const int32_t *query_start_loc; /* [b+1] */
    const float *cos_sin;         /* [max_pos][d] */
    int64_t max_pos;
    float scale;                  /* attention softmax scale */
    /* scratch, each at least as large as noted */
    float *normed;                /* [t][hidden] */
    float *qkv;                   /* [t][(hq+2hk) d] */
    float *attn;                  /* [t][hq d] */
    float *gate_up;               /* [t][2 ffn] */
    float *act;                   /* [t][ffn] */
    /* NULL, or [hidden + hq d + hidden + ffn]: raised to the max |x| per input channel this
     * step feeds qkv, o, gate_up and down, in that order (calibration of the smoothing; NaN
     * ignored) */
    float *act_max;
} shmk_step_t;

/* hidden [t][hidden] is the residual stream, updated in place:
 *   h += o(attn(rope(qkv(rms(h))))) ; h += down(silu_mul(gate_up(rms(h)))) */
void shmk_llama_layer_forward(const shmk_layer_t *layer, const shmk_step_t *step, float *hidden,
                              const shmk_kv_t *kv);
/* layers[0..n) in order, layer i with kv[i]: a whole model step in one call */
void shmk_llama_forward(const shmk_layer_t *layers, const shmk_kv_t *kv, int64_t n,
                        const shmk_step_t *step, float *hidden);

/* 0 if the step's metadata is safe to run on a cache of num_blocks x block_size slots, else
 * the first problem found (SHMK_STEP_*): qsl runs 0 .. t, 0 <= q_len <= seq_len <= max_blocks x
 * block_size, every block a sequence reaches is in [0, num_blocks), every slot < num_blocks x
 * block_size (negative slots are skipped by the writers; slots may be NULL) */
enum {
    SHMK_STEP_OK = 0,
    SHMK_STEP_QSL = 1,
    SHMK_STEP_QLEN = 2,
    SHMK_STEP_CAPACITY = 3,
    SHMK_STEP_BLOCK = 4,
    SHMK_STEP_SLOT = 5
};
int shmk_check_step(const shmk_step_t *step, int64_t num_blocks, int64_t block_size);

/* The embedding, the layers, the final norm and the LM head of one step in one call:
 *   hidden[i] = channel ids[i] of the packed embedding, dequantised (shmk_dequant_channels;
 *   with tied weights the embedding is the LM head itself);
 *   the layers on hidden; x[r] = rmsnorm(hidden[rows[r]]) with final_norm; logits = lm_head(x);
 *   argmax[r] = shmk_argmax_rows of logits row r, unless argmax is NULL.
 * Returns 0, or (nothing run) -1 if an id is outside [0, vocab), -2 if a row is outside [0, t). */
typedef struct {
    const shmk_linear_t *embedding; /* n = vocab, k = hidden */
    int64_t vocab, hidden;
    const float *final_norm;      /* [hidden] */
    float eps;
    const shmk_linear_t *lm_head; /* n = logits' columns, k = hidden */
} shmk_model_t;
int shmk_model_forward(const shmk_model_t *model, const shmk_layer_t *layers,
                       const shmk_kv_t *kv, int64_t n, const shmk_step_t *step,
                       const int64_t *ids, const int64_t *rows, int64_t nrows, float *hidden,
                       float *x, float *logits, int64_t *argmax);

#endif
