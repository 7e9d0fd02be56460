"""fp32 reference forward: KV-cache consistency, an independent naive check, SmolLM2 sanity."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from shm_engine.model.config import ModelConfig
from shm_engine.model.loader import LoadedModel
from shm_engine.model.reference import ReferenceModel

from .conftest import llama_cpp_permute, tiny_config, tiny_weights


@pytest.mark.parametrize(
    "overrides",
    [{}, {"tie_word_embeddings": False}, {"architecture": "qwen2", "attention_bias": True}],
)
def test_cached_decode_equals_full_forward(overrides: dict) -> None:
    config = tiny_config(**overrides)
    ref = ReferenceModel(config, tiny_weights(config, seed=7))
    ids = torch.randint(0, config.vocab_size, (11,), generator=torch.Generator().manual_seed(0))
    full = ref.forward(ids)
    cache = ref.new_cache(32)
    parts = [ref.forward(ids[:5], cache=cache), ref.forward(ids[5:6], cache=cache)]
    parts += [ref.forward(ids[i : i + 1], cache=cache) for i in range(6, 11)]
    assert cache.length == 11
    torch.testing.assert_close(torch.cat(parts), full, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(ref.forward(ids, positions=torch.arange(11)), full)


def _naive_logits(config: ModelConfig, w: dict[str, np.ndarray], ids: list[int]) -> np.ndarray:
    """Independent float64 implementation in llama.cpp's convention: Q/K rows permuted by the
    converter and RoPE rotating adjacent pairs (2i, 2i+1); loops instead of tensor ops."""
    c = config
    hd, groups = c.head_dim, c.num_heads // c.num_kv_heads
    inv = [1.0 / c.rope_theta ** (2 * i / hd) for i in range(hd // 2)]

    def norm(x: np.ndarray, g: np.ndarray) -> np.ndarray:
        return x / np.sqrt((x * x).mean() + c.rms_norm_eps) * g

    def rope_pairs(v: np.ndarray, pos: int) -> np.ndarray:
        out = v.copy()
        for i in range(hd // 2):
            a, b = v[2 * i], v[2 * i + 1]
            cs, sn = math.cos(pos * inv[i]), math.sin(pos * inv[i])
            out[2 * i], out[2 * i + 1] = a * cs - b * sn, a * sn + b * cs
        return out

    xs = [w["model.embed_tokens.weight"][t].copy() for t in ids]
    for layer in range(c.num_layers):
        p = f"model.layers.{layer}."
        q_w = llama_cpp_permute(w[p + "self_attn.q_proj.weight"], c.num_heads)
        k_w = llama_cpp_permute(w[p + "self_attn.k_proj.weight"], c.num_kv_heads)
        ks, vs, new = [], [], []
        for pos, x in enumerate(xs):
            h = norm(x, w[p + "input_layernorm.weight"])
            q = (q_w @ h).reshape(c.num_heads, hd)
            k = (k_w @ h).reshape(c.num_kv_heads, hd)
            ks.append(np.stack([rope_pairs(k[j], pos) for j in range(c.num_kv_heads)]))
            vs.append((w[p + "self_attn.v_proj.weight"] @ h).reshape(c.num_kv_heads, hd))
            heads = []
            for head in range(c.num_heads):
                qh = rope_pairs(q[head], pos)
                kv = head // groups
                scores = np.array([qh @ ks[j][kv] for j in range(pos + 1)]) / math.sqrt(hd)
                prob = np.exp(scores - scores.max())
                prob /= prob.sum()
                heads.append(sum(prob[j] * vs[j][kv] for j in range(pos + 1)))
            x = x + w[p + "self_attn.o_proj.weight"] @ np.concatenate(heads)
            h = norm(x, w[p + "post_attention_layernorm.weight"])
            gate = w[p + "mlp.gate_proj.weight"] @ h
            up = w[p + "mlp.up_proj.weight"] @ h
            new.append(x + w[p + "mlp.down_proj.weight"] @ (gate / (1 + np.exp(-gate)) * up))
        xs = new
    head_w = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return np.stack([head_w @ norm(x, w["model.norm.weight"]) for x in xs])


def test_reference_matches_naive_interleaved_rope_implementation() -> None:
    config = tiny_config()
    weights = tiny_weights(config, seed=11)
    ids = [1, 5, 77, 200, 31, 9]
    got = ReferenceModel(config, weights).forward(ids).double().numpy()
    want = _naive_logits(config, {k: v.double().numpy() for k, v in weights.items()}, ids)
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4)


def test_sliding_window_limits_receptive_field() -> None:
    config = tiny_config(architecture="mistral", sliding_window=3)
    ref = ReferenceModel(config, tiny_weights(config, seed=5))
    a = torch.tensor([3, 10, 20, 30, 40, 50, 60, 70, 80, 90])
    b = a.clone()
    b[0] = 4
    # 2 layers x (window - 1) = 4 positions of reach: position 9 cannot see position 0
    la, lb = ref.forward(a), ref.forward(b)
    torch.testing.assert_close(la[9], lb[9])
    assert not torch.allclose(la[3], lb[3])


@pytest.mark.slow
def test_smollm2_greedy_continuation(smollm: LoadedModel, smollm_ref: ReferenceModel) -> None:
    tok = smollm.tokenizer
    out = smollm_ref.generate_greedy(tok.encode("The capital of France is"), 4)
    assert "Paris" in tok.decode(out)
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    out = smollm_ref.generate_greedy(tok.encode(chat, add_special_tokens=False), 12)
    assert "Paris" in tok.decode(out)
    counting = smollm_ref.generate_greedy(tok.encode("1, 2, 3, 4,"), 9)  # digit = 1 token
    assert tok.decode(counting).startswith(" 5, 6, 7")


@pytest.mark.slow
def test_smollm2_cached_decode_matches_full(
    smollm: LoadedModel, smollm_ref: ReferenceModel
) -> None:
    ids = smollm.tokenizer.encode("Water boils at a temperature of")
    out = smollm_ref.generate_greedy(ids, 5)
    full = smollm_ref.forward(ids + out[:-1])
    assert full[len(ids) - 1 :].argmax(-1).tolist() == out
