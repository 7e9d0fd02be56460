"""A GGUF's 4-bit matrices read as grids (Q4_0, Q4_1, Q4_K) and packed as they are: the values
the loader's floats hold, in 4 bits, with the Q/K rows un-permuted as the floats are; and Q8_0
vocabulary matrices packed from their bytes."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize

from shm_engine.model import kernels
from shm_engine.model.gguf_loader import w4_grid_of
from shm_engine.model.gguf_metadata import read_gguf
from shm_engine.model.int8_model import Int8Llama
from shm_engine.model.loader import W4Grid, load_model
from shm_engine.model.reference import ReferenceModel

from . import conftest
from .conftest import tiny_config, tiny_weights, write_tiny_gguf
from .test_int8_model import paged_logits, rel_err

Q = gguf.GGMLQuantizationType


def q4_k_blocks(rows: int, cols: int, seed: int) -> np.ndarray:
    """Valid Q4_K data for a [rows, cols] matrix (cols a multiple of 256): random fp16 d and
    dmin of a weight-like size, random 6-bit scales and minimums, random nibbles."""
    rng = np.random.default_rng(seed)
    n = rows * cols // 256
    blocks = rng.integers(0, 256, size=(n, 144), dtype=np.uint8)
    blocks[:, 0:2] = (rng.random(n) * 2e-3 + 1e-4).astype(np.float16).view(np.uint8).reshape(n, 2)
    blocks[:, 2:4] = (rng.random(n) * 4e-3).astype(np.float16).view(np.uint8).reshape(n, 2)
    return blocks.reshape(rows, cols // 256 * 144)


def gguf_tensor(tmp_path: Path, data: np.ndarray, qtype: Q):
    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    w.add_tensor("t", data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return read_gguf(tmp_path / "t.gguf").tensors[0]


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K])
def test_grids_hold_what_the_gguf_package_dequantizes(tmp_path: Path, qtype: Q) -> None:
    rows, cols = 24, 512
    if qtype == Q.Q4_K:
        data = q4_k_blocks(rows, cols, 0)
    else:
        a = np.random.default_rng(1).standard_normal((rows, cols)).astype(np.float32)
        data = quantize(a, qtype)
    t = gguf_tensor(tmp_path, data, qtype)
    g = w4_grid_of(t)
    assert g.q.dtype == torch.uint8 and g.q.shape == (rows, cols // 2)
    assert g.scales.shape == g.mins.shape == (rows, cols // 32)
    ref = torch.from_numpy(dequantize(np.asarray(t.data), qtype).reshape(rows, cols).copy())
    grow = lambda x: x.repeat_interleave(32, dim=1)  # noqa: E731
    u = g.values()
    assert u.shape == (rows, cols) and int(u.max()) <= 15
    assert torch.equal(u.float() * grow(g.scales) + grow(g.mins), ref)
    assert torch.equal(W4Grid.from_values(u, g.scales, g.mins).q, g.q)
    # packed as they are: exact for Q4_0 / Q4_1 (fp16 scales), Q4_K's d x sc rounded to fp16
    p = kernels.PackedLinear.from_w4_grid(*g)
    tol = 0 if qtype != Q.Q4_K else float((grow(g.scales).abs() * 15 + grow(g.mins).abs()).max())
    assert float((p.dequantized() - ref).abs().max()) <= tol * 2**-11


def test_from_w4_grid_checks_its_input():
    u = torch.zeros(4, 64, dtype=torch.uint8)
    s = torch.ones(4, 2)
    with pytest.raises(ValueError, match="u must lie in"):
        W4Grid.from_values(u + 16, s, s)
    with pytest.raises(ValueError, match="whole groups of 32"):
        W4Grid.from_values(u[:, :40], s, s)
    q = W4Grid.from_values(u, s, s).q
    with pytest.raises(ValueError, match="scales must have shape"):
        kernels.PackedLinear.from_w4_grid(q, s[:, :1].contiguous(), s)
    with pytest.raises(ValueError, match="mins must be finite"):
        kernels.PackedLinear.from_w4_grid(q, s, s * float("inf"))
    with pytest.raises(TypeError, match="q must have dtype"):
        kernels.PackedLinear.from_w4_grid(q.to(torch.int16), s, s)
    with pytest.raises(ValueError, match="whole groups of 32 nibbles"):
        kernels.PackedLinear.from_w4_grid(q[:, :24].contiguous(), s, s)


def test_a_grid_packs_as_from_float_packs_it():
    """W4Grid's bytes, moved in words of 4, give w4.c's layout: the same packed bytes and
    dequantized weights as from_float(w4=True), at ragged row counts."""
    torch.manual_seed(0)
    for n, k in ((37, 64), (16, 576), (5, 1536), (1, 32)):
        p = kernels.PackedLinear.from_float(torch.randn(n, k), w4=True)
        g = W4Grid.from_values(*p.unpack_w4())
        assert torch.equal(g.values(), p.unpack_w4()[0])
        again = kernels.PackedLinear.from_w4_grid(*g)
        assert torch.equal(again.packed, p.packed)
        assert torch.equal(again.dequantized(), p.dequantized())


@pytest.fixture(scope="module")
def q4_k_model(tmp_path_factory):
    """A tiny Llama GGUF whose matrices are Q4_K, as llama.cpp's converter lays it out (Q/K
    rows permuted); the blocks are random, so the model is what they decode to."""
    config = tiny_config(hidden_size=256, intermediate_size=512, head_dim=64, num_layers=2)
    weights = tiny_weights(config)
    seeds = iter(range(1000))
    original = conftest.quantize
    conftest.quantize = lambda a, qtype: q4_k_blocks(*a.shape, next(seeds))
    try:
        path = write_tiny_gguf(tmp_path_factory.mktemp("q4k") / "m.gguf", config, weights, Q.Q4_K)
    finally:
        conftest.quantize = original
    return load_model(path)


def test_q4_k_layers_run_in_4_bits_on_the_files_grids(q4_k_model):
    m = q4_k_model
    with kernels.use_path("avx2" if kernels.best_path() != "portable" else "portable"):
        model = Int8Llama(m.config, m.weights, weight_dtype="auto")
    assert all(s == {"qkv", "o", "gate_up", "down"} for s in model.w4_linears)
    want = torch.cat([m.weights[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv"])
    got = model.layers[1].qkv.dequantized()  # q and k rows un-permuted as the floats are
    assert float((got - want).abs().max()) <= float(want.abs().max()) * 2**-10
    ref = ReferenceModel(m.config, m.weights.materialize())
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, m.config.vocab_size, (n,), generator=g).tolist() for n in (21, 6)]
    got = paged_logits(model, m.config, seqs, [[10, 1, 10], [5, 1]])
    for s, o in zip(seqs, got, strict=True):
        assert rel_err(o, ref.forward(torch.tensor(s))) < 0.06


# ------------------------------------------------------------- Q8_0 vocabulary matrices


def _q8_0(blocks: torch.Tensor, chunk_rows: int = 16) -> kernels.PackedLinear | None:
    n, k = blocks.shape[0], blocks.shape[1] // 34 * 32
    return kernels.PackedLinear.from_q8_0(n, k, lambda a, b: blocks[a:b], chunk_rows=chunk_rows)


def test_q8_0_blocks_pack_as_the_floats_do() -> None:
    """A Q8_0 matrix packed from the file's bytes (from_q8_0, in chunks of 16 rows here): its
    values exactly, and the same packed bytes and scales as packing its dequantized floats, at
    ragged row counts."""
    rng = np.random.default_rng(2)
    for n, k in ((37, 64), (16, 576), (5, 96), (1, 32)):
        a = (rng.standard_normal((n, k)) * 0.1).astype(np.float32)
        blocks = torch.from_numpy(quantize(a, Q.Q8_0).copy())
        want = torch.from_numpy(dequantize(blocks.numpy(), Q.Q8_0).reshape(n, k).copy())
        got = _q8_0(blocks)
        floats = kernels.PackedLinear.from_float(want)
        assert torch.equal(got.dequantized(), want)
        assert torch.equal(got.packed, floats.packed) and torch.equal(got.scales, floats.scales)
        x = torch.randn(3, k)
        assert torch.equal(kernels.linear(x, got), kernels.linear(x, floats))


def test_q8_0_blocks_the_kernels_cannot_hold_are_left_to_the_float_path() -> None:
    blocks = torch.from_numpy(quantize(np.ones((20, 32), np.float32), Q.Q8_0).copy())
    assert _q8_0(blocks) is not None
    blocks[17, 7] = 0x80  # a q of -128, in the second chunk
    assert _q8_0(blocks) is None
    # a negative scale (ggml writes none): the layout's scales are magnitudes (the lookup and
    # unpack read them so, and had given the row's sign flipped)
    blocks = torch.from_numpy(quantize(np.ones((20, 32), np.float32), Q.Q8_0).copy())
    blocks[3, 1] |= 0x80  # the fp16 d's sign bit
    assert _q8_0(blocks) is None
    with pytest.raises(ValueError, match="blocks must have shape"):
        kernels.PackedLinear.from_q8_0(20, 32, lambda a, b: blocks[a:b, :30].contiguous())
    with pytest.raises(ValueError, match="multiple of 32"):
        kernels.PackedLinear.from_q8_0(20, 40, lambda a, b: blocks[a:b])


def test_the_default_models_embedding_is_packed_from_its_q8_0_bytes(smollm) -> None:
    """SmolLM2's tied embedding is Q8_0: the bytes path and the float path give the same
    packed LM head."""
    name = "model.embed_tokens.weight"
    w = smollm.weights
    n, k = w.shape(name)
    assert w.q8_0_rows(name, 5, 7).shape == (2, k // 32 * 34)
    assert w.q8_0_rows("model.layers.0.mlp.down_proj.weight", 0, 1) is None  # Q4_1
    floats = kernels.PackedLinear.from_row_chunks(n, k, lambda a, b: w.rows(name, a, b))
    got = kernels.PackedLinear.from_q8_0(n, k, lambda a, b: w.q8_0_rows(name, a, b))
    assert torch.equal(got.packed, floats.packed) and torch.equal(got.scales, floats.scales)
