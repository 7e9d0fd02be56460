"""ModelConfig parsing (HF config.json, GGUF metadata) and RoPE frequencies."""

from __future__ import annotations

import math

import pytest
import torch

from shm_engine.model.config import ModelConfig

QWEN2_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 32768,
    "sliding_window": 32768,
    "use_sliding_window": False,
    "tie_word_embeddings": True,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}

LLAMA_UNTIED_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
}


def test_qwen2_config_has_bias_and_no_sliding_window() -> None:
    c = ModelConfig.from_hf_config(QWEN2_CONFIG)
    assert c.architecture == "qwen2"
    assert c.attention_bias  # Qwen2 q/k/v always carry a bias
    assert c.head_dim == 64 and c.num_kv_heads == 2
    assert c.sliding_window is None  # use_sliding_window is false
    assert c.tie_word_embeddings
    assert c.eos_token_ids == (151645,)
    assert ModelConfig.from_hf_config(c.to_hf_config()) == c


def test_untied_llama3_config_round_trips() -> None:
    c = ModelConfig.from_hf_config(LLAMA_UNTIED_CONFIG)
    assert not c.tie_word_embeddings and not c.attention_bias
    assert c.eos_token_ids == (128001, 128008, 128009)
    assert c.head_dim == 64
    assert ModelConfig.from_hf_config(c.to_hf_config()) == c
    assert hash(c)  # frozen and hashable even with a list eos


def test_mistral_sliding_window_and_explicit_head_dim() -> None:
    cfg = dict(LLAMA_UNTIED_CONFIG, model_type="mistral", sliding_window=4096, head_dim=128)
    cfg.pop("rope_scaling")
    c = ModelConfig.from_hf_config(cfg)
    assert c.architecture == "mistral" and c.sliding_window == 4096 and c.head_dim == 128


def test_sliding_window_applies_to_the_layers_transformers_slides() -> None:
    # Qwen2 slides only from layer max_window_layers on; Llama's attention has no window.
    qwen = dict(QWEN2_CONFIG, use_sliding_window=True, sliding_window=4096)
    assert ModelConfig.from_hf_config(dict(qwen, max_window_layers=24)).sliding_window is None
    every = ModelConfig.from_hf_config(dict(qwen, max_window_layers=0))
    assert every.sliding_window == 4096
    assert ModelConfig.from_hf_config(every.to_hf_config()) == every
    with pytest.raises(NotImplementedError, match="mixing full and sliding"):
        ModelConfig.from_hf_config(dict(qwen, max_window_layers=12))
    mixed = ["full_attention", "sliding_attention"] * 8
    mistral = dict(LLAMA_UNTIED_CONFIG, model_type="mistral", sliding_window=64, layer_types=mixed)
    mistral.pop("rope_scaling")
    with pytest.raises(NotImplementedError, match="mixing full and sliding"):
        ModelConfig.from_hf_config(mistral)
    llama = ModelConfig.from_hf_config(dict(LLAMA_UNTIED_CONFIG, sliding_window=64))
    assert llama.sliding_window is None


def test_keys_a_config_leaves_out_take_transformers_defaults_for_its_architecture() -> None:
    bare = {k: v for k, v in QWEN2_CONFIG.items() if k not in ("max_position_embeddings",
                                                                 "sliding_window")}  # fmt: skip
    assert ModelConfig.from_hf_config(bare).max_position_embeddings == 32768
    assert (
        ModelConfig.from_hf_config(dict(bare, model_type="llama")).max_position_embeddings == 2048
    )
    mistral = ModelConfig.from_hf_config(dict(bare, model_type="mistral", attention_bias=False))
    assert mistral.max_position_embeddings == 131072 and mistral.sliding_window == 4096
    assert (
        ModelConfig.from_hf_config(
            dict(bare, model_type="mistral", sliding_window=None)
        ).sliding_window
        is None
    )


def test_rejects_unknown_architecture() -> None:
    with pytest.raises(ValueError, match="unsupported"):
        ModelConfig.from_hf_config(dict(QWEN2_CONFIG, model_type="gpt_neox"))


def test_inv_freq_default() -> None:
    c = ModelConfig.from_hf_config(QWEN2_CONFIG)
    inv = c.inv_freq()
    assert inv.dtype == torch.float32 and inv.shape == (32,)
    expected = [1.0 / 1e6 ** (2 * i / 64) for i in range(32)]
    torch.testing.assert_close(inv, torch.tensor(expected, dtype=torch.float32))


def test_inv_freq_llama3_scaling() -> None:
    c = ModelConfig.from_hf_config(LLAMA_UNTIED_CONFIG)
    plain = c.replace(rope_scaling=None).inv_freq().double()
    scaled = c.inv_freq().double()
    wavelen = 2 * math.pi / plain
    high = wavelen < 8192 / 4.0  # short wavelengths: untouched
    low = wavelen > 8192 / 1.0  # long wavelengths: divided by the factor
    assert high.any() and low.any()
    torch.testing.assert_close(scaled[high], plain[high])
    torch.testing.assert_close(scaled[low], plain[low] / 32.0)
    mid = ~high & ~low
    # the blend lies between the two ends and is monotone like the originals
    assert ((scaled[mid] <= plain[mid]) & (scaled[mid] >= plain[mid] / 32.0)).all()
    assert (scaled[1:] <= scaled[:-1]).all()


def test_inv_freq_linear_and_freq_factors() -> None:
    c = ModelConfig.from_hf_config(QWEN2_CONFIG)
    lin = c.replace(rope_scaling={"rope_type": "linear", "factor": 4.0})
    torch.testing.assert_close(lin.inv_freq(), c.inv_freq() / 4.0)
    factors = tuple(float(i + 1) for i in range(32))
    ff = c.replace(rope_freq_factors=factors)
    torch.testing.assert_close(ff.inv_freq(), c.inv_freq() / torch.tensor(factors))


QWEN2_GGUF = {
    "general.architecture": "qwen2",
    "qwen2.block_count": 2,
    "qwen2.context_length": 4096,
    "qwen2.embedding_length": 128,
    "qwen2.feed_forward_length": 256,
    "qwen2.attention.head_count": 4,
    "qwen2.attention.head_count_kv": 2,
    "qwen2.rope.freq_base": 1e6,
    "qwen2.attention.layer_norm_rms_epsilon": 1e-6,
    "tokenizer.ggml.bos_token_id": 5,
    "tokenizer.ggml.eos_token_id": 6,
    "tokenizer.ggml.eot_token_id": 7,
}


def test_from_gguf_metadata() -> None:
    c = ModelConfig.from_gguf_metadata(QWEN2_GGUF, vocab_size=1000, attention_bias=True)
    assert c.architecture == "qwen2" and c.head_dim == 32 and c.num_kv_heads == 2
    assert c.vocab_size == 1000 and c.attention_bias and not c.tie_word_embeddings
    assert c.eos_token_ids == (6, 7) and c.bos_token_id == 5
    assert c.rope_theta == 1e6 and c.max_position_embeddings == 4096


def test_transformers_v5_rope_parameters_are_read() -> None:
    # transformers v5 moved rope_theta and rope_scaling into rope_parameters.
    old = dict(LLAMA_UNTIED_CONFIG)
    v5 = {k: v for k, v in old.items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = {"rope_theta": old["rope_theta"], **old["rope_scaling"]}
    a, b = ModelConfig.from_hf_config(old), ModelConfig.from_hf_config(v5)
    assert (b.rope_theta, b.rope_scaling) == (a.rope_theta, a.rope_scaling)
    yarn = dict(v5, rope_parameters={"rope_theta": 1e6, "rope_type": "yarn", "factor": 4.0})
    with pytest.raises(NotImplementedError, match="yarn"):
        ModelConfig.from_hf_config(yarn).inv_freq()


def test_rope_parameters_may_leave_theta_at_the_top_level() -> None:
    # transformers reads such a config as linear scaling with the top-level theta.
    cfg = dict(
        LLAMA_UNTIED_CONFIG, rope_theta=5e4, rope_parameters={"rope_type": "linear", "factor": 2.0}
    )
    del cfg["rope_scaling"]
    c = ModelConfig.from_hf_config(cfg)
    assert (c.rope_theta, c.rope_scaling) == (5e4, {"rope_type": "linear", "factor": 2.0})
    per_layer = dict(cfg, rope_parameters={"full_attention": {"rope_theta": 1e4}})
    with pytest.raises(NotImplementedError, match="per-layer"):
        ModelConfig.from_hf_config(per_layer)


def test_llama3_scaling_defaults_its_original_context_to_max_positions() -> None:
    # transformers takes max_position_embeddings when original_max_position_embeddings is
    # missing; Llama 3's 8192 had given a 256-position model other frequencies.
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
    }
    c = ModelConfig.from_hf_config(
        dict(LLAMA_UNTIED_CONFIG, rope_scaling=scaling, max_position_embeddings=256)
    )
    given = c.replace(rope_scaling={**scaling, "original_max_position_embeddings": 256})
    torch.testing.assert_close(c.inv_freq(), given.inv_freq(), rtol=0, atol=0)
    assert not torch.equal(c.inv_freq(), c.replace(max_position_embeddings=8192).inv_freq())
    with pytest.raises(ValueError, match="low_freq_factor, high_freq_factor"):
        c.replace(rope_scaling={"rope_type": "llama3", "factor": 8.0})


def test_gguf_rope_scaling_reads_as_llama_cpp_does() -> None:
    # No type means linear; the factor may sit under the old key rope.scale_linear.
    for extra in ({"qwen2.rope.scaling.factor": 4.0}, {"qwen2.rope.scale_linear": 4.0}):
        c = ModelConfig.from_gguf_metadata({**QWEN2_GGUF, **extra}, vocab_size=1000)
        assert c.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert ModelConfig.from_gguf_metadata(QWEN2_GGUF, vocab_size=1000).rope_scaling is None


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("qwen2.feed_forward_length", None, "lacks qwen2.feed_forward_length"),
        ("qwen2.attention.head_count", None, "lacks qwen2.attention.head_count"),
        ("qwen2.block_count", None, "lacks qwen2.block_count"),
        ("qwen2.attention.head_count_kv", 0, "num_kv_heads must be at least 1"),
        ("qwen2.attention.head_count_kv", [2, 4], "varies by layer"),
    ],
)
def test_gguf_metadata_gaps_get_a_clear_error(key: str, value: object, message: str) -> None:
    meta = dict(QWEN2_GGUF)
    if value is None:
        del meta[key]
    else:
        meta[key] = value
    with pytest.raises((ValueError, NotImplementedError), match=message):
        ModelConfig.from_gguf_metadata(meta, vocab_size=1000)
    uniform = dict(QWEN2_GGUF, **{"qwen2.attention.head_count_kv": [2, 2]})
    assert ModelConfig.from_gguf_metadata(uniform, vocab_size=1000).num_kv_heads == 2


def test_qwen3_head_dim_defaults_to_128_as_transformers() -> None:
    cfg = {"model_type": "qwen3", "vocab_size": 100, "hidden_size": 512, "intermediate_size": 64,
           "num_hidden_layers": 1, "num_attention_heads": 8, "num_key_value_heads": 8}  # fmt: skip
    assert ModelConfig.from_hf_config(cfg).head_dim == 128
    assert ModelConfig.from_hf_config({**cfg, "model_type": "qwen2"}).head_dim == 64


def test_smollm3_defaults_are_transformers_where_config_json_is_silent() -> None:
    """transformers leaves out keys equal to the class defaults: SmolLM3 is tied, theta 2e6,
    and a no_rope_layers list may be longer than the layers (its first entries count)."""
    cfg = {"model_type": "smollm3", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 96,
           "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
    c = ModelConfig.from_hf_config(cfg)
    assert c.tie_word_embeddings and c.rope_theta == 2e6 and c.nope_layers == (3,)
    c = ModelConfig.from_hf_config({**cfg, "no_rope_layers": [1, 0, 1, 1, 0, 0]})
    assert c.nope_layers == (1,)
    with pytest.raises(ValueError, match="entries"):
        ModelConfig.from_hf_config({**cfg, "no_rope_layers": [1, 0]})
