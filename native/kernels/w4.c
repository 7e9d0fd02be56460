/* W4 (group-32, affine) weights: packing and unpacking (api.h documents the layout; gemm16.c
 * runs them).
 *
 * Why affine 4-bit groups of 32: they are llama.cpp's Q4_1 (and, with m = -8 s, its Q4_0) and
 * the sub-blocks of Q4_K, the formats most GGUF files on CPUs carry, at 0.625 bytes a weight
 * (nibbles + two fp16 per 32) against W8's 1.0625: batch-1 decode streams every weight each
 * step, so it reads 41 % fewer bytes.
 *
 * Per channel and group the packer tries two grids and keeps the one with the smaller squared
 * error after the fp16 rounding of s and m:
 *   min/max:   s = (max - min) / 15, m = min                     (Q4_1: exact on its values)
 *   symmetric: about the weight b of largest |w|, s = -b / 8 and m = b (Q4_0; s < 0 if b > 0)
 * so a tensor dequantised from Q4_0 or Q4_1 by llama.cpp's reference quantisers packs back to
 * its own values exactly (tested); an importance matrix's searched scales need not reach the
 * grid's ends, so the engine packs GGUF matrices from their blocks (PackedLinear.from_w4_grid). */
#include <math.h>
#include <string.h>

#include "common.h"

#define NIBBLE_ROW 64 /* bytes: 16 channels x 4 k, two quad rows in one */

size_t shmk_packed_bytes_w4(int64_t n, int64_t k) { return shmk_packed_bytes(n, k) / 2; }

/* byte offset of (channel c, k t of a group) inside the group's 256 bytes; high nibble? */
static inline int64_t nib_at(int c, int t, int *high) {
    const int r = t / 4; /* quad row */
    *high = r >= 4;
    return (r & 3) * NIBBLE_ROW + c * 4 + (t & 3);
}

/* fp16 bits of a signed float (normals and 0) */
static inline uint16_t signed_h(float x) {
    return (uint16_t)(shmk_f2h(fabsf(x)) | (x < 0.f ? 0x8000 : 0));
}

typedef struct {
    uint16_t hs, hm; /* fp16 bits: scale, signed minimum (both times 2^E) */
    float err;
    uint8_t u[GK];
} grid_fit;

/* u = the nearest grid point of each v on (s, m) rounded to fp16, and the squared error */
static void fit(const float *v, int len, float s, float m, float emul, grid_fit *f) {
    f->hs = signed_h(s * emul);
    f->hm = signed_h(m * emul);
    const float sr = shmk_h2f_signed(f->hs) / emul, mr = shmk_h2f_signed(f->hm) / emul;
    f->err = 0.f;
    for (int t = 0; t < GK; t++) {
        float q = 0.f;
        if (sr != 0.f && t < len) {
            /* NOTE: clamped before rounding: shmk_rint_small is exact only up to 2^22 */
            q = fminf(fmaxf((v[t] - mr) / sr, 0.f), 15.f);
            q = shmk_rint_small(q);
        }
        f->u[t] = (uint8_t)q;
        if (t < len) {
            const float e = sr * q + mr - v[t];
            f->err += e * e;
        }
    }
}

/* One channel's group: len real weights (NaN packs as 0) -> its fp16 scale and minimum and 32 u */
static void pack_group(const float *w, int len, float emul, grid_fit *best) {
    float v[GK] = {0}, lo = 0.f, hi = 0.f, big = 0.f;
    for (int t = 0; t < len; t++) {
        v[t] = w[t] == w[t] ? w[t] : 0.f;
        if (t == 0 || v[t] < lo) lo = v[t];
        if (t == 0 || v[t] > hi) hi = v[t];
        if (fabsf(v[t]) > fabsf(big)) big = v[t];
    }
    fit(v, len, (hi - lo) / 15.f, lo, emul, best);
    if (best->err == 0.f) return;
    grid_fit sym;
    /* u = 0 at big, the other end 7 |s| from zero on the other side (Q4_0's grid); for big > 0
     * the scale is negative: m = big is exact in fp16 where big - 15 |s| = -7 big / 8 is not */
    fit(v, len, -big / 8.f, big, emul, &sym);
    if (sym.err < best->err) *best = sym;
}

typedef struct {
    const float *w;
    int64_t n, k, G;
    float emul; /* 2^E */
    uint8_t *packed;
    uint16_t *scales, *mins;
} pack_ctx;

static void pack_task(void *vctx, int64_t blk, int tid) {
    (void)tid;
    const pack_ctx *c = vctx;
    uint8_t *base = c->packed + blk * c->G * (GBYTES / 2);
    memset(base, 0, (size_t)(c->G * (GBYTES / 2)));
    for (int64_t j = blk * NB; j < (blk + 1) * NB; j++) {
        const int ch = (int)(j % NB);
        for (int64_t g = 0; g < c->G; g++) {
            const int64_t k0 = g * GK, left = c->k - k0;
            const int len = j < c->n ? (int)(left < GK ? left : GK) : 0;
            grid_fit f;
            pack_group(c->w + (j < c->n ? j * c->k + k0 : 0), len, c->emul, &f);
            uint8_t *grp = base + g * (GBYTES / 2);
            for (int t = 0; t < GK; t++) {
                int high;
                const int64_t at = nib_at(ch, t, &high);
                grp[at] |= (uint8_t)(high ? f.u[t] << 4 : f.u[t]);
            }
            c->scales[(blk * c->G + g) * NB + ch] = f.hs;
            c->mins[(blk * c->G + g) * NB + ch] = f.hm;
        }
    }
}

float shmk_pack_rows_w4(const float *w, int64_t n, int64_t k, float amax, uint8_t *packed,
                        uint16_t *scales, uint16_t *mins) {
    /* amax lands in [2^14, 2^15) of fp16: every |scale| (<= 2 amax / 15) and |minimum| (<= amax)
     * is a normal fp16 or, ~28 binades below the largest, 0 */
    int e = 0;
    if (amax > 0.f) frexpf(amax, &e); /* amax in [2^(e-1), 2^e) */
    const int E = 15 - e;
    pack_ctx c = {w, n, k, shmk_padded_k(k) / GK, ldexpf(1.f, E), packed, scales, mins};
    shmk_parallel(pack_task, &c, shmk_cdiv(n, NB));
    return ldexpf(1.f, -E);
}

void shmk_unpack_w4(const uint8_t *packed, const uint16_t *scales, const uint16_t *mins,
                    float scale_mult, int64_t n, int64_t k, uint8_t *u, float *gscales,
                    float *gmins) {
    const int64_t G = shmk_padded_k(k) / GK;
    for (int64_t j = 0; j < n; j++) {
        const int64_t b = j / NB;
        const int ch = (int)(j % NB);
        for (int64_t kk = 0; kk < k; kk++) {
            int high;
            const uint8_t byte =
                packed[(b * G + kk / GK) * (GBYTES / 2) + nib_at(ch, (int)(kk % GK), &high)];
            u[j * k + kk] = high ? byte >> 4 : byte & 15;
        }
        for (int64_t g = 0; g < G; g++) {
            const int64_t at = (b * G + g) * NB + ch;
            gscales[j * G + g] = shmk_h2f_signed(scales[at]) * scale_mult;
            gmins[j * G + g] = shmk_h2f_signed(mins[at]) * scale_mult;
        }
    }
}
