/* One fused Llama decoder layer: ~10 kernels in a single native call (no Python in between). */
#include <math.h>
#include <string.h>

#include "common.h"

static void lin(const shmk_linear_t *w, const float *x, int64_t t, float *y, int accumulate) {
    shmk_linear_impl(w, x, t, y, accumulate);
}

/* m[j] = max(m[j], |x[i][j]|) over the rows (NaN ignored: fmaxf) */
static void record_max(const float *x, int64_t t, int64_t k, float *m) {
    if (!m) return;
    for (int64_t i = 0; i < t; i++)
        for (int64_t j = 0; j < k; j++) m[j] = fmaxf(m[j], fabsf(x[i * k + j]));
}

void shmk_llama_layer_forward(const shmk_layer_t *L, const shmk_step_t *S, float *hidden,
                              const shmk_kv_t *kv) {
    const int64_t t = S->t, h = L->hidden, d = L->d, hqd = L->hq * d;
    if (t <= 0) return;
    float *m = S->act_max;
    /* attention block */
    shmk_rmsnorm(hidden, NULL, L->input_norm, t, h, L->eps, S->normed);
    record_max(S->normed, t, h, m);
    lin(&L->qkv, S->normed, t, S->qkv, 0);
    if (L->q_norm) {
        /* Qwen3: each query and key head is RMS-normalised (in place) before RoPE; a token's
         * heads are consecutive rows of d in its qkv row */
        const int64_t stride = (L->hq + 2 * L->hk) * d;
        for (int64_t i = 0; i < t; i++) {
            float *q = S->qkv + i * stride, *k = q + hqd;
            shmk_rmsnorm(q, NULL, L->q_norm, L->hq, d, L->eps, q);
            shmk_rmsnorm(k, NULL, L->k_norm, L->hk, d, L->eps, k);
        }
    }
    if (L->rope) shmk_rope_qkv(S->qkv, S->positions, t, L->hq, L->hk, d, S->cos_sin, S->max_pos);
    shmk_write_kv_qkv(S->qkv, S->slots, t, L->hq, kv);
    shmk_attention_impl(S->qkv, (L->hq + 2 * L->hk) * d, kv, S->block_table, S->max_blocks,
                        S->seq_lens, S->query_start_loc, S->b, L->hq, S->scale, S->attn);
    record_max(S->attn, t, hqd, m ? m + h : NULL);
    lin(&L->o, S->attn, t, hidden, 1); /* hidden += o_proj(attn) */
    /* MLP block */
    shmk_rmsnorm(hidden, NULL, L->post_norm, t, h, L->eps, S->normed);
    record_max(S->normed, t, h, m ? m + h + hqd : NULL);
    lin(&L->gate_up, S->normed, t, S->gate_up, 0);
    shmk_silu_mul(S->gate_up, t, L->ffn, S->act);
    record_max(S->act, t, L->ffn, m ? m + 2 * h + hqd : NULL);
    lin(&L->down, S->act, t, hidden, 1); /* hidden += down_proj(act) */
}

void shmk_llama_forward(const shmk_layer_t *layers, const shmk_kv_t *kv, int64_t n,
                        const shmk_step_t *step, float *hidden) {
    for (int64_t i = 0; i < n; i++) shmk_llama_layer_forward(&layers[i], step, hidden, &kv[i]);
}

int shmk_check_step(const shmk_step_t *s, int64_t num_blocks, int64_t block_size) {
    const int32_t *qsl = s->query_start_loc;
    /* NOTE: with no sequences there must be no query tokens either: t > 0 tokens that no
     * sequence owns would leave the attention output uninitialised (paged_attention) or stale
     * (the fused layer's scratch) */
    if (s->b > 0 ? qsl[0] != 0 || qsl[s->b] != s->t : s->t != 0) return SHMK_STEP_QSL;
    for (int64_t i = 0; i < s->b; i++) {
        const int64_t q_len = (int64_t)qsl[i + 1] - qsl[i], len = s->seq_lens[i];
        if (q_len < 0 || q_len > len) return SHMK_STEP_QLEN;
        if (len > s->max_blocks * block_size) return SHMK_STEP_CAPACITY;
        const int32_t *row = s->block_table + i * s->max_blocks;
        for (int64_t j = 0; j < shmk_cdiv(len, block_size); j++)
            if (row[j] < 0 || row[j] >= num_blocks) return SHMK_STEP_BLOCK;
    }
    for (int64_t i = 0; s->slots && i < s->t; i++)
        if (s->slots[i] >= num_blocks * block_size) return SHMK_STEP_SLOT;
    return SHMK_STEP_OK;
}

int shmk_model_forward(const shmk_model_t *m, const shmk_layer_t *layers, const shmk_kv_t *kv,
                       int64_t n, const shmk_step_t *step, const int64_t *ids,
                       const int64_t *rows, int64_t nrows, float *hidden, float *x,
                       float *logits, int64_t *argmax) {
    const int64_t t = step->t, h = m->hidden;
    for (int64_t i = 0; i < t; i++)
        if (ids[i] < 0 || ids[i] >= m->vocab) return -1;
    for (int64_t r = 0; r < nrows; r++)
        if (rows[r] < 0 || rows[r] >= t) return -2;
    /* NOTE: the pool's workers spin between the step's ~300 jobs instead of parking */
    shmk_pool_hold(1);
    shmk_dequant_channels(m->embedding, ids, t, hidden);
    shmk_llama_forward(layers, kv, n, step, hidden);
    for (int64_t r = 0; r < nrows; r++) memcpy(x + r * h, hidden + rows[r] * h, (size_t)h * 4);
    shmk_rmsnorm(x, NULL, m->final_norm, nrows, h, m->eps, x);
    shmk_linear_impl(m->lm_head, x, nrows, logits, 0);
    if (argmax) shmk_argmax_rows(logits, nrows, m->lm_head->n, argmax);
    shmk_pool_hold(0);
    return 0;
}
