/* One fused Llama decoder layer: ~10 kernels in a single native call (no Python in between). */
#include "common.h"

static void lin(const shmk_linear_t *w, const float *x, int64_t t, float *y, int accumulate) {
    shmk_linear_impl(w, x, t, y, accumulate);
}

void shmk_llama_layer_forward(const shmk_layer_t *L, const shmk_step_t *S, float *hidden,
                              const shmk_kv_t *kv) {
    const int64_t t = S->t, h = L->hidden, d = L->d;
    if (t <= 0) return;
    /* attention block */
    shmk_rmsnorm(hidden, NULL, L->input_norm, t, h, L->eps, S->normed);
    lin(&L->qkv, S->normed, t, S->qkv, 0);
    shmk_rope_qkv(S->qkv, S->positions, t, L->hq, L->hk, d, S->cos_sin, S->max_pos);
    shmk_write_kv_qkv(S->qkv, S->slots, t, L->hq, kv);
    shmk_attention_impl(S->qkv, (L->hq + 2 * L->hk) * d, kv, S->block_table, S->max_blocks,
                        S->seq_lens, S->query_start_loc, S->b, L->hq, S->scale, S->attn);
    lin(&L->o, S->attn, t, hidden, 1); /* hidden += o_proj(attn) */
    /* MLP block */
    shmk_rmsnorm(hidden, NULL, L->post_norm, t, h, L->eps, S->normed);
    lin(&L->gate_up, S->normed, t, S->gate_up, 0);
    shmk_silu_mul(S->gate_up, t, L->ffn, S->act);
    lin(&L->down, S->act, t, hidden, 1); /* hidden += down_proj(act) */
}

void shmk_llama_forward(const shmk_layer_t *layers, const shmk_kv_t *kv, int64_t n,
                        const shmk_step_t *step, float *hidden) {
    for (int64_t i = 0; i < n; i++) shmk_llama_layer_forward(&layers[i], step, hidden, &kv[i]);
}
