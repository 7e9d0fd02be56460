"""Shared fixtures: the real default model (loaded once per session) and tiny synthetic models.

Tiny models are written the way the real converters write them (llama.cpp's GGUF writer with its
Q/K row permutation, safetensors HF directories), so both load paths are exercised end to end
without any download.
"""

from __future__ import annotations

import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import quantize

from shm_engine.model.config import ModelConfig
from shm_engine.model.default_model import DefaultModelNotFoundError, default_model_path
from shm_engine.model.loader import LoadedModel, expected_weight_names, load_model
from shm_engine.model.reference import ReferenceModel
from shm_engine.model.tokenizer import Tokenizer

CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# ---------------------------------------------------------------------- the real default model
@pytest.fixture(scope="session")
def smollm_path() -> Path:
    try:
        return default_model_path()
    except DefaultModelNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def smollm(smollm_path: Path) -> LoadedModel:
    """Metadata, tokenizer and lazy weights of SmolLM2 (~1.5 s: the vocabulary dominates)."""
    t0 = time.perf_counter()
    m = load_model(None)
    print(f"\nload_model(None): {time.perf_counter() - t0:.2f} s")
    return m


@pytest.fixture(scope="session")
def smollm_ref(smollm: LoadedModel) -> ReferenceModel:
    """fp32 reference of SmolLM2 (dequantizes all 272 tensors, ~540 MB)."""
    t0 = time.perf_counter()
    ref = ReferenceModel(smollm.config, smollm.weights)
    print(f"\ndequantize + ReferenceModel: {time.perf_counter() - t0:.2f} s")
    return ref


# ---------------------------------------------------------------------- tiny synthetic models
def byte_tokens() -> list[str]:
    """The 256 GPT-2 byte-level symbols, in byte order."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    )
    table, n = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + n)
            n += 1
    return [table[b] for b in range(256)]


def tiny_tokenizer_metadata(pre: str = "smollm") -> dict:
    """GGUF tokenizer keys for a small byte-level BPE: specials, 256 bytes, a few merges."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    merges = ["Ġ t", "h e", "Ġt he", "Ġ a", "i n", "Ġa n"]
    merged = [m.replace(" ", "") for m in merges]
    tokens = specials + byte_tokens() + merged
    types = [3] * len(specials) + [1] * (len(tokens) - len(specials))
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.padding_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": CHATML_TEMPLATE,
    }


def tiny_config(**overrides) -> ModelConfig:
    base = dict(
        architecture="llama",
        vocab_size=len(tiny_tokenizer_metadata()["tokenizer.ggml.tokens"]),
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    base.update(overrides)
    return ModelConfig(**base)


def tiny_weights(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights scaled so activations stay O(1) through the layers."""
    g = torch.Generator().manual_seed(seed)
    c = config
    shapes = {
        "model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
        "model.norm.weight": (c.hidden_size,),
        "lm_head.weight": (c.vocab_size, c.hidden_size),
    }
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (c.hidden_size,),
            p + "post_attention_layernorm.weight": (c.hidden_size,),
            p + "self_attn.q_proj.weight": (c.q_size, c.hidden_size),
            p + "self_attn.k_proj.weight": (c.kv_size, c.hidden_size),
            p + "self_attn.v_proj.weight": (c.kv_size, c.hidden_size),
            p + "self_attn.o_proj.weight": (c.hidden_size, c.q_size),
            p + "self_attn.q_proj.bias": (c.q_size,),
            p + "self_attn.k_proj.bias": (c.kv_size,),
            p + "self_attn.v_proj.bias": (c.kv_size,),
            p + "self_attn.q_norm.weight": (c.head_dim,),
            p + "self_attn.k_norm.weight": (c.head_dim,),
            p + "mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
            p + "mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
            p + "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
        }
    out = {}
    for name in expected_weight_names(config):
        shape = shapes[name]
        if name.endswith("norm.weight"):
            out[name] = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif name.endswith(".bias"):
            out[name] = 0.1 * torch.randn(shape, generator=g)
        else:
            out[name] = torch.randn(shape, generator=g) / shape[-1] ** 0.5
    return out


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's Q/K row permutation (HF rotate_half -> interleaved pairs)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


_GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def write_tiny_gguf(
    path: Path,
    config: ModelConfig,
    weights: dict[str, torch.Tensor],
    qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
    rope_freqs: np.ndarray | None = None,
    extra_meta: dict[str, int | float] | None = None,
) -> Path:
    """Write a GGUF like llama.cpp's converter: metadata, permuted Q/K, matrices in `qtype`,
    and Llama 3's RoPE divisors as `rope_freqs.weight` if given (`extra_meta`: more keys, ints as
    uint16, floats as float32)."""
    arch = config.architecture
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in (extra_meta or {}).items():
        (w.add_uint16 if isinstance(value, int) else w.add_float32)(key, value)
    w.add_block_count(config.num_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_heads)
    w.add_head_count_kv(config.num_kv_heads)
    w.add_rope_freq_base(config.rope_theta)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_dimension_count(config.head_dim)
    w.add_key_length(config.head_dim)
    w.add_value_length(config.head_dim)
    w.add_vocab_size(config.vocab_size)
    meta = tiny_tokenizer_metadata()
    w.add_tokenizer_model(meta["tokenizer.ggml.model"])
    w.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    w.add_token_merges(meta["tokenizer.ggml.merges"])
    w.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    w.add_pad_token_id(meta["tokenizer.ggml.padding_token_id"])
    w.add_unk_token_id(meta["tokenizer.ggml.unknown_token_id"])
    w.add_add_bos_token(False)
    w.add_chat_template(meta["tokenizer.chat_template"])
    for name, t in weights.items():
        a = t.numpy().astype(np.float32)
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            gname = f"blk.{layer}.{_GGUF_NAMES[rest]}"
            if arch in ("llama", "smollm3") and rest.startswith("self_attn.q_proj"):
                a = llama_cpp_permute(a, config.num_heads)
            elif arch in ("llama", "smollm3") and rest.startswith("self_attn.k_proj"):
                a = llama_cpp_permute(a, config.num_kv_heads)
        if a.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            w.add_tensor(gname, quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, np.ascontiguousarray(a))
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="session")
def tiny_hf_tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf_metadata(tiny_tokenizer_metadata())
