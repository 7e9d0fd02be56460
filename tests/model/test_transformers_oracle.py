"""Differential tests with Hugging Face transformers as the oracle.

Tiny random models are built and saved by transformers itself (so config.json, tensor names,
dtypes, tying and sharding are exactly what it writes), loaded by our loader, and run through
the fp32 reference, the paged fp32 TorchLlama and the int8 Int8Llama; their logits must match
transformers' eager forward of the same files. The embedded SmolLM2 GGUF, weights and tokenizer,
is checked against transformers' own reading of the file.
"""

from __future__ import annotations

import os
from pathlib import Path

# Nothing may be downloaded: every model here is built locally, the tokenizer is the embedded GGUF.
os.environ["HF_HUB_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

# rope_parameters (the v5 config API) is how the Llama-3 scaling is given below.
transformers = pytest.importorskip("transformers", minversion="5.0")

from shm_engine.model.batch import BatchInputs  # noqa: E402
from shm_engine.model.config import ModelConfig  # noqa: E402
from shm_engine.model.int8_model import Int8Llama  # noqa: E402
from shm_engine.model.kv_cache import allocate_kv  # noqa: E402
from shm_engine.model.loader import LoadedModel, load_model  # noqa: E402
from shm_engine.model.reference import ReferenceModel  # noqa: E402
from shm_engine.model.tokenizer import Tokenizer  # noqa: E402
from shm_engine.model.torch_model import TorchLlama  # noqa: E402

# ---------------------------------------------------------------------- tiny random models
BLOCK = 16
VOCAB = 320
SEQ_LEN = 40
PREFILL = 20  # the paged models prefill this many tokens, then decode the rest one at a time
FP32_BOUND = 1e-4  # max |diff| / max |logit|; measured ~1e-6 (fp32 summation order only)
INT8_BOUND = 0.06  # ||diff|| / ||logits||, the bound test_int8_model.py uses against fp32

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
    "rope_theta": 500000.0,
}

# name -> (transformers model class, config overrides, dtype saved in, max_shard_size)
VARIANTS: dict[str, tuple[str, dict, torch.dtype, str | None]] = {
    "llama-gqa-untied-llama3rope": (
        "LlamaForCausalLM",
        {"rope_parameters": LLAMA3_ROPE},
        torch.float32,
        None,
    ),
    # One KV head (MQA) and the q/k/v biases; 30KB shards of bf16 make a model.safetensors.index.
    "qwen2-bias-tied-bf16-sharded": (
        "Qwen2ForCausalLM",
        {"tie_word_embeddings": True, "num_key_value_heads": 1},
        torch.bfloat16,
        "30KB",
    ),
    # Per-head q/k norms, and a head_dim other than hidden / heads (Qwen3-0.6B: 128, not 1024 / 16).
    "qwen3-qknorm-wide-heads-tied": (
        "Qwen3ForCausalLM",
        {"head_dim": 128, "tie_word_embeddings": True},
        torch.float32,
        None,
    ),
    # No RoPE in every second layer (SmolLM3-3B: every fourth), a 4:1 GQA.
    "smollm3-nope-tied": (
        "SmolLM3ForCausalLM",
        {
            "no_rope_layer_interval": 2,
            "num_key_value_heads": 1,
            "tie_word_embeddings": True,
            "pad_token_id": 0,
        },
        torch.float32,
        None,
    ),
    # A window smaller than SEQ_LEN, so the mask differs from causal past position 16.
    "mistral-sliding-window": (
        "MistralForCausalLM",
        {"sliding_window": 16, "head_dim": 32},
        torch.float32,
        None,
    ),
}


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights larger than transformers' init (std 0.02), so every block moves the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))


def build_hf_model(
    path: Path,
    cls_name: str,
    overrides: dict,
    save_dtype: torch.dtype,
    shard: str | None,
    tokenizer: Tokenizer,
    seed: int = 0,
) -> torch.nn.Module:
    """Save a tiny random model with transformers; return it reloaded from disk in fp32, so the
    oracle runs on exactly the (possibly bf16-rounded) weights our loader reads."""
    cls = getattr(transformers, cls_name)
    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
    )
    config = cls.config_class(**(base | overrides))
    torch.manual_seed(seed)
    model = cls(config).eval()
    randomize(model, seed)
    if config.tie_word_embeddings:
        model.tie_weights()
    kwargs = {"max_shard_size": shard} if shard else {}
    model.to(save_dtype).save_pretrained(path, **kwargs)
    tokenizer.save_hf(path)  # our loader wants a tokenizer.json; the logits never use it
    return cls.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def paged_logits(
    model: TorchLlama | Int8Llama, config: ModelConfig, ids: list[int]
) -> torch.Tensor:
    """Logits of every token: one prefill chunk (PREFILL tokens, or half of a shorter
    sequence), then one-token decode steps against the paged cache."""
    n_blocks = -(-len(ids) // BLOCK)
    kv = allocate_kv(config, n_blocks + 1, BLOCK, model.kv_dtype)
    table = list(range(n_blocks))
    prefill = min(PREFILL, len(ids) // 2)
    chunks = [prefill] + [1] * (len(ids) - prefill)
    pos, out = 0, []
    for n in chunks:
        batch = BatchInputs.build([(ids, pos, n, table)], BLOCK, [True])
        batch.logits_indices = torch.arange(batch.num_tokens)
        out.append(model.forward(batch, kv).clone())
        pos += n
    return torch.cat(out)


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(
    variant: str, tmp_path: Path, tiny_hf_tokenizer: Tokenizer
) -> None:
    cls_name, overrides, save_dtype, shard = VARIANTS[variant]
    hf = build_hf_model(tmp_path, cls_name, overrides, save_dtype, shard, tiny_hf_tokenizer)
    if shard:
        assert (tmp_path / "model.safetensors.index.json").is_file()
        assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    ids = torch.randint(3, VOCAB, (SEQ_LEN,), generator=torch.Generator().manual_seed(100))
    with torch.no_grad():
        expected = hf(ids[None]).logits[0].float()

    m: LoadedModel = load_model(tmp_path)
    assert m.format == "hf"
    config = m.config
    assert config.tie_word_embeddings == hf.config.tie_word_embeddings
    assert config.sliding_window == getattr(hf.config, "sliding_window", None)
    weights = m.weights.materialize()
    errs = {
        "reference": max_rel(ReferenceModel(config, weights).forward(ids), expected),
        "torch_paged": max_rel(
            paged_logits(TorchLlama(config, weights), config, ids.tolist()), expected
        ),
    }
    for name, e in errs.items():
        assert e <= FP32_BOUND, (name, errs)

    # The native attention has no window: Int8Llama runs a sliding-window model only up to its
    # window (where attention is full anyway), so compare that prefix.
    n = min(SEQ_LEN, config.sliding_window or SEQ_LEN)
    int8 = paged_logits(Int8Llama(config, m.weights), config, ids[:n].tolist())
    e8 = rel_err(int8, expected[:n])
    assert e8 < INT8_BOUND, e8
    print(f"\n{variant}: fp32 max-rel {errs}, int8 rel {e8:.2e} over {n} tokens")


@pytest.mark.slow
def test_embedded_gguf_logits_match_transformers_reading_the_same_file(
    smollm: LoadedModel, smollm_ref: ReferenceModel, smollm_path: Path
) -> None:
    """transformers reads the embedded GGUF on its own (its dequantisation, its undoing of
    llama.cpp's Q/K permutation, its config mapping): our fp32 forward of the file agrees."""
    pytest.importorskip("accelerate")  # transformers loads GGUF models through it
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        smollm_path.parent, gguf_file=smollm_path.name, dtype=torch.float32
    ).eval()
    ids = smollm.tokenizer.encode(" ".join(TEXTS[:12]))
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
        ours = smollm_ref.forward(ids)
    assert len(ids) > 150 and max_rel(ours, expected) <= FP32_BOUND  # measured ~2e-6
    assert torch.equal(ours.argmax(-1), expected.argmax(-1))


# ---------------------------------------------------------------------- GGUF tokenizer
TEXTS = [
    "Hello, world!",
    "  two leading spaces",
    "trailing space ",
    "\n\nnewlines\n",
    "tabs\tand\t\ttabs",
    "multiple     spaces    here",
    "      ",
    "1234567890 3.14159 1,000,000 2024-01-01 0x1F 1e-5",
    "Ünïcödé façade naïve café, e\u0301 combining, ﬁ ligature, ＡＢＣ fullwidth",
    "Привет, как дела? ελληνικά العربية हिन्दी",
    "你好，世界！这是一个测试。日本語のテキスト",
    "emoji 🙂🎉👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷",
    "def f(x):\n    return x ** 2  # comment\n",
    "if (a && b) { return c; } else { x += 1; }",
    "x=1;y=2\r\nz=3\r\n",
    "don't won't it's I'm you're we've they'll he'd DON'T",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_end|>more<|endoftext|>",
    "\u00a0nbsp\u2003emspace a\u200bb zero width",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math ∑_{i=1}^n i² ≤ ∞",
    "",
]

MESSAGES = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Hello"}],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke. 🙂\n\n  spaces  "},
    ],
]


@pytest.fixture(scope="module")
def hf_gguf_tokenizer(smollm_path: Path) -> transformers.PreTrainedTokenizerBase:
    """transformers' conversion of the same GGUF vocabulary (~5 s: it rebuilds the BPE)."""
    return transformers.AutoTokenizer.from_pretrained(
        smollm_path.parent, gguf_file=smollm_path.name
    )


@pytest.mark.slow
def test_gguf_tokenizer_matches_transformers(
    smollm: LoadedModel, hf_gguf_tokenizer: transformers.PreTrainedTokenizerBase
) -> None:
    tok, hf = smollm.tokenizer, hf_gguf_tokenizer
    for text in TEXTS:
        assert tok.encode(text) == hf.encode(text), text
        ids = hf.encode(text, add_special_tokens=False)
        assert tok.encode(text, add_special_tokens=False) == ids, text
        assert tok.decode(ids, skip_special_tokens=False) == hf.decode(ids), text
        assert tok.decode(ids, skip_special_tokens=True) == hf.decode(
            ids, skip_special_tokens=True
        ), text
    for messages in MESSAGES:
        expected = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert tok.apply_chat_template(messages, add_generation_prompt=True) == expected
    assert tok.eos_token_ids[0] == hf.eos_token_id
    assert tok.bos_token_id == hf.bos_token_id


@pytest.mark.slow
def test_llm_get_tokenizer_answers_as_the_hf_tokenizer(
    smollm: LoadedModel, hf_gguf_tokenizer: transformers.PreTrainedTokenizerBase
) -> None:
    """vLLM's get_tokenizer() is the HF tokenizer, and scripts call it with HF's defaults:
    chat templates give ids without a generation prompt, decode keeps special tokens, and
    continue_final_message ends the text inside the last message."""
    from shm_engine.entrypoints.hf_tokenizer import HFStyleTokenizer

    tok, hf = HFStyleTokenizer(smollm.tokenizer), hf_gguf_tokenizer
    for messages in MESSAGES:
        ids = hf.apply_chat_template(messages, return_dict=False)
        assert tok.apply_chat_template(messages) == ids
        assert tok.apply_chat_template(messages, return_dict=True).input_ids == ids
        gen = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert gen == hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    partial = [{"role": "user", "content": "Say hello"}, {"role": "assistant", "content": "Hel"}]
    want = hf.apply_chat_template(partial, continue_final_message=True, tokenize=False)
    assert tok.apply_chat_template(partial, continue_final_message=True, tokenize=False) == want
    ids = hf.encode("<|im_start|>user\nHi<|im_end|>\n", add_special_tokens=False)
    assert tok.decode(ids) == hf.decode(ids) and tok.batch_decode([ids]) == hf.batch_decode([ids])
    assert tok("Hi there").input_ids == hf("Hi there").input_ids
    assert (tok.eos_token_id, len(tok)) == (hf.eos_token_id, len(hf))
    assert (tok.pad_token_id, tok.unk_token_id) == (hf.pad_token_id, hf.unk_token_id) == (2, 0)
    # tensors, padding and batched conversations as HF gives them
    texts = ["Hi there", "Hello"]
    for kind in ("pt", "np"):
        got, want = (
            tok(texts, padding=True, return_tensors=kind),
            hf(texts, padding=True, return_tensors=kind),
        )
        assert got.input_ids.tolist() == want.input_ids.tolist()
        assert got.attention_mask.tolist() == want.attention_mask.tolist()
        assert str(got.input_ids.dtype) == str(want.input_ids.dtype)
        assert (
            tok("Hi", return_tensors=kind).input_ids.tolist()
            == hf("Hi", return_tensors=kind).input_ids.tolist()
        )
    with pytest.raises(ValueError, match="padding=True"):
        tok(texts, return_tensors="pt")
    assert tok(texts, padding=True).input_ids == hf(texts, padding=True).input_ids
    convs = [MESSAGES[0], [{"role": "user", "content": "hello there"}]]
    assert tok.apply_chat_template(convs) == hf.apply_chat_template(convs, return_dict=False)
    one = tok.apply_chat_template(MESSAGES[0], return_tensors="pt")
    assert (
        one.tolist()
        == hf.apply_chat_template(MESSAGES[0], return_tensors="pt", return_dict=False).tolist()
    )
    assert tok.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
