/* Public C API of shm_engine._sampler_cffi.  build_sampler.py feeds the lines of this file that
 * do not start with '#' to ffi.cdef(), so keep it to plain declarations.
 *
 * Path ids: 0 = portable C, 1 = AVX2 (+FMA).  The Python wrapper is shm_engine/model/sample_native.py;
 * the semantics are those of shm_engine/model/sampler.py (filtered_probs + sample_inverse_cdf):
 * temperature, then vLLM V1's order, min-p, top-k among its survivors, top-p on what they keep. */
#ifndef SHMS_SAMPLE_H
#define SHMS_SAMPLE_H
#include <stddef.h>
#include <stdint.h>

int shms_best_path(void); /* best path this CPU supports */

/* Bytes of the `work` scratch shms_sample_rows needs for vocabulary size v (any alignment). */
size_t shms_work_bytes(int64_t v);

/* Draw one token for each of n rows of logits (float32, v per row, unit stride along v).
 *   row j reads logits + rows[j] * stride (rows == NULL: row j itself; stride may be 0);
 *   temperature[j] finite and >= 0 (raised to 1e-5 if below, like filtered_probs);
 *   top_k[j] >= -1, in 1..v-1 it enables top-k; top_p[j] in (0, 1] (1: off); min_p[j] in [0, 1];
 *   u[j] in [0, 1).
 *   out[j]: the token; probs (may be NULL): [n][v] the filtered distribution each draw used.
 *   work: shms_work_bytes(v) bytes, reused row after row (one call at a time per buffer).
 * Returns 0, -1 on invalid arguments (nothing written), -2 if the CPU lacks `path`. */
int shms_sample_rows(const float *logits, int64_t stride, int64_t v, int64_t n,
                     const int64_t *rows, const float *temperature, const int64_t *top_k,
                     const float *top_p, const float *min_p, const double *u, int64_t *out,
                     float *probs, void *work, int path);

/* Structured outputs: set logits[rows[j] * stride + t] = -inf for each token t < v whose bit is
 * clear in row j's mask (bit t % 32 of word t / 32 of masks + j * words; words >= ceil(v / 32)).
 * argmax (may be NULL): [n] each masked row's argmax (first index of the largest, NaN as -inf).
 * Returns 0, -1 on invalid arguments (nothing written), -2 if the CPU lacks `path`. */
int shms_mask_rows(float *logits, int64_t stride, int64_t v, int64_t n, const int64_t *rows,
                   const uint32_t *masks, int64_t words, int64_t *argmax, int path);

#endif
