"""Plain fp32 torch forward of the Llama family (Llama, SmolLM2/3, Mistral, Qwen2, Qwen3).

Written to be obviously correct rather than fast: it is the yardstick for the int8 runner's
error bounds and the fp32 baseline in benchmarks. Weights use Hugging Face names and layouts;
RoPE is the HF rotate_half form.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .config import ModelConfig


@dataclass
class KVCache:
    """Contiguous per-sequence cache: per layer K and V of [num_kv_heads, capacity, head_dim]."""

    k: list[torch.Tensor] = field(default_factory=list)
    v: list[torch.Tensor] = field(default_factory=list)
    length: int = 0  # tokens written so far (positions 0 .. length-1)

    @property
    def capacity(self) -> int:
        return self.k[0].shape[1] if self.k else 0


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class ReferenceModel:
    def __init__(self, config: ModelConfig, weights: Mapping[str, torch.Tensor]) -> None:
        """`weights`: HF-named fp32 tensors (a lazy source is materialized here, ~4 B/param)."""
        self.config = config
        self.w = {name: weights[name].to(torch.float32).contiguous() for name in weights}
        self.embed = self.w["model.embed_tokens.weight"]
        self.lm_head = self.embed if config.tie_word_embeddings else self.w["lm_head.weight"]
        self.inv_freq = config.inv_freq()

    # ------------------------------------------------------------------ cache
    def new_cache(self, capacity: int | None = None) -> KVCache:
        c = self.config
        cap = capacity or c.max_position_embeddings
        shape = (c.num_kv_heads, cap, c.head_dim)
        return KVCache(
            k=[torch.zeros(shape) for _ in range(c.num_layers)],
            v=[torch.zeros(shape) for _ in range(c.num_layers)],
        )

    # ------------------------------------------------------------------ forward
    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Every projection and the LM head go through here: studies of other number formats
        (scripts/act_quant_study.py) override it."""
        return F.linear(x, weight, bias)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [T, head_dim] (angles in fp32, as HF computes them; cos/sin in float64 rounded
        to fp32, like kernels.rope_cos_sin, whose NOTE says why)."""
        angles = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat([angles, angles], dim=-1).double()
        return emb.cos().float(), emb.sin().float()

    @torch.no_grad()
    def forward(
        self,
        token_ids: torch.Tensor | Sequence[int],
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Logits [T, V] for a run of tokens of one sequence.

        Without a cache: positions default to 0..T-1, causal attention within the run.
        With a cache: the run continues the cached sequence (positions default to
        cache.length..), its K/V are written there, and cache.length advances.
        """
        c = self.config
        ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
        t = ids.numel()
        start = cache.length if cache is not None else 0
        if positions is None:
            positions = torch.arange(start, start + t)
        positions = positions.to(torch.long)
        if cache is not None and start + t > cache.capacity:
            raise ValueError(f"KV cache full: {start} + {t} > {cache.capacity}")
        cos, sin = self.rope(positions)
        # causal mask over keys [0, start + t): key j visible to query i iff j <= start + i
        q_idx = torch.arange(start, start + t)[:, None]
        k_idx = torch.arange(0, start + t)[None, :]
        allowed = k_idx <= q_idx
        if c.sliding_window is not None:
            allowed &= k_idx > q_idx - c.sliding_window
        mask = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))
        groups = c.num_heads // c.num_kv_heads

        x = self.embed[ids]
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            w = self.w
            h = rms_norm(x, w[p + "input_layernorm.weight"], c.rms_norm_eps)
            q = self.linear(h, w[p + "self_attn.q_proj.weight"], w.get(p + "self_attn.q_proj.bias"))
            k = self.linear(h, w[p + "self_attn.k_proj.weight"], w.get(p + "self_attn.k_proj.bias"))
            v = self.linear(h, w[p + "self_attn.v_proj.weight"], w.get(p + "self_attn.v_proj.bias"))
            q = q.view(t, c.num_heads, c.head_dim).transpose(0, 1)  # [H, T, D]
            k = k.view(t, c.num_kv_heads, c.head_dim).transpose(0, 1)
            v = v.view(t, c.num_kv_heads, c.head_dim).transpose(0, 1)
            if c.qk_norm:  # Qwen3: each head normalised before RoPE
                q = rms_norm(q, w[p + "self_attn.q_norm.weight"], c.rms_norm_eps)
                k = rms_norm(k, w[p + "self_attn.k_norm.weight"], c.rms_norm_eps)
            if c.rope_in_layer(i):  # SmolLM3's NoPE layers have none
                q = q * cos + rotate_half(q) * sin
                k = k * cos + rotate_half(k) * sin
            if cache is not None:
                cache.k[i][:, start : start + t] = k
                cache.v[i][:, start : start + t] = v
                k = cache.k[i][:, : start + t]
                v = cache.v[i][:, : start + t]
            k = k.repeat_interleave(groups, dim=0)
            v = v.repeat_interleave(groups, dim=0)
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [H, T, D]
            attn = attn.transpose(0, 1).reshape(t, c.num_heads * c.head_dim)
            x = x + self.linear(attn, w[p + "self_attn.o_proj.weight"])
            h = rms_norm(x, w[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
            gate = self.linear(h, w[p + "mlp.gate_proj.weight"])
            up = self.linear(h, w[p + "mlp.up_proj.weight"])
            x = x + self.linear(F.silu(gate) * up, w[p + "mlp.down_proj.weight"])
        if cache is not None:
            cache.length = start + t
        x = rms_norm(x, self.w["model.norm.weight"], c.rms_norm_eps)
        return self.linear(x, self.lm_head)

    def prefill(self, prompt_ids: Sequence[int], cache: KVCache) -> torch.Tensor:
        """Run the prompt into an empty cache; returns the last position's logits [V]."""
        if cache.length:
            raise ValueError("prefill expects an empty cache")
        return self.forward(prompt_ids, cache=cache)[-1]

    def decode_step(self, token_id: int, cache: KVCache) -> torch.Tensor:
        """One token after the cached sequence; returns its logits [V]."""
        return self.forward([token_id], cache=cache)[-1]

    def generate_greedy(self, prompt_ids: Sequence[int], n: int) -> list[int]:
        """n greedily decoded tokens (no stop on EOS: callers compare fixed-length outputs)."""
        cache = self.new_cache(len(prompt_ids) + n)
        logits = self.prefill(prompt_ids, cache)
        out: list[int] = []
        for _ in range(n):
            tok = int(torch.argmax(logits))
            out.append(tok)
            if len(out) < n:
                logits = self.decode_step(tok, cache)
        return out
