"""fp32 Llama forward in plain torch over the paged KV cache: the engine's float32 path.

It runs the same batches as the int8 model (mixed prefill/decode over block tables), so the engine
can be checked and benchmarked against it; attention loops over sequences, which is fine for a
baseline and keeps the code obviously right.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from shm_engine.model import kernels
from shm_engine.model.batch import BatchInputs
from shm_engine.model.config import ModelConfig


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF rotate_half convention: element i pairs with i + d/2. x: [T, H, D], cos/sin: [T, D/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


class TorchLlama:
    kv_dtype = torch.float32

    def __init__(self, config: ModelConfig, weights: Mapping[str, torch.Tensor]) -> None:
        self.config = config
        self.w = {k: v.float().contiguous() for k, v in weights.items()}
        self.embed = self.w["model.embed_tokens.weight"]
        self.lm_head = self.w.get("lm_head.weight", self.embed)
        self.inv_freq = config.inv_freq()

    def release_kv(self) -> None:
        """Nothing to drop: this model keeps no reference to the cache between steps."""

    @torch.inference_mode()
    def forward(
        self,
        batch: BatchInputs,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        argmax_out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Returns fp32 logits [len(logits_indices), vocab]; each row's argmax (first index of
        the largest) into ``argmax_out`` (int64) if given."""
        c = self.config
        x = self.embed[batch.input_ids]
        freqs = (batch.positions.float()[:, None] * self.inv_freq[None, :]).double()
        cos, sin = freqs.cos().float(), freqs.sin().float()  # see kernels.rope_cos_sin
        for i, (k_cache, v_cache) in enumerate(kv_caches):
            p = f"model.layers.{i}."
            h = rms_norm(x, self.w[p + "input_layernorm.weight"], c.rms_norm_eps)
            q = self._linear(h, p + "self_attn.q_proj").view(-1, c.num_heads, c.head_dim)
            k = self._linear(h, p + "self_attn.k_proj").view(-1, c.num_kv_heads, c.head_dim)
            v = self._linear(h, p + "self_attn.v_proj").view(-1, c.num_kv_heads, c.head_dim)
            if c.qk_norm:
                q = rms_norm(q, self.w[p + "self_attn.q_norm.weight"], c.rms_norm_eps)
                k = rms_norm(k, self.w[p + "self_attn.k_norm.weight"], c.rms_norm_eps)
            if c.rope_in_layer(i):
                q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            self._write_kv(k, v, batch.slot_mapping, k_cache, v_cache)
            attn = self._attention(q, k_cache, v_cache, batch)
            x = x + self._linear(attn.reshape(-1, c.q_size), p + "self_attn.o_proj")
            h = rms_norm(x, self.w[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
            gate = self._linear(h, p + "mlp.gate_proj")
            up = self._linear(h, p + "mlp.up_proj")
            x = x + self._linear(F.silu(gate) * up, p + "mlp.down_proj")
        x = rms_norm(x[batch.logits_indices], self.w["model.norm.weight"], c.rms_norm_eps)
        logits = x @ self.lm_head.T
        if argmax_out is not None:  # the int8 model's argmax, for the same ties and NaN
            argmax_out.copy_(kernels.argmax_rows(logits.contiguous()))
        return logits

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.w[name + ".weight"], self.w.get(name + ".bias"))

    @staticmethod
    def _write_kv(k, v, slots, k_cache, v_cache) -> None:
        # cache [num_blocks, Hkv, block_size, D]: slot s is block s // bs, offset s % bs
        bs = k_cache.shape[2]
        blocks, offsets = slots // bs, slots % bs
        k_cache[blocks, :, offsets] = k.to(k_cache.dtype)
        v_cache[blocks, :, offsets] = v.to(v_cache.dtype)

    def _attention(self, q, k_cache, v_cache, batch: BatchInputs) -> torch.Tensor:
        c = self.config
        group = c.num_heads // c.num_kv_heads
        bs = k_cache.shape[2]
        out = torch.empty_like(q)
        qsl = batch.query_start_loc.tolist()
        for b, seq_len in enumerate(batch.seq_lens.tolist()):
            s, e = qsl[b], qsl[b + 1]
            n_blocks = -(-seq_len // bs)
            blocks = batch.block_table[b, :n_blocks].long()
            # [n_blocks, Hkv, bs, D] -> [positions, Hkv, D]
            keys = k_cache[blocks].transpose(1, 2).reshape(-1, c.num_kv_heads, c.head_dim)
            vals = v_cache[blocks].transpose(1, 2).reshape(-1, c.num_kv_heads, c.head_dim)
            keys, vals = keys[:seq_len].to(q.dtype), vals[:seq_len].to(q.dtype)
            keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, S, D]
            vals = vals.repeat_interleave(group, dim=1).transpose(0, 1)
            qb = q[s:e].transpose(0, 1)  # [H, n, D]
            n = e - s
            # Query j sits at position seq_len - n + j and sees keys 0 .. that position (within
            # the sliding window, if the model has one).
            k_idx = torch.arange(seq_len)[None, :]
            q_idx = torch.arange(seq_len - n, seq_len)[:, None]
            mask = k_idx <= q_idx
            if c.sliding_window is not None:
                mask &= k_idx > q_idx - c.sliding_window
            o = F.scaled_dot_product_attention(qb, keys, vals, attn_mask=mask)
            out[s:e] = o.transpose(0, 1)
        return out
