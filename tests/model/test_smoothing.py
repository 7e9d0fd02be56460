"""SmoothQuant folded into the weights (model/smoothing.py): exact in real numbers, calibrated
from the maxima the native layers record, and the smoothed int8 model still matches fp32."""

from __future__ import annotations

import pytest
import torch

from shm_engine.model import kernels as K
from shm_engine.model.int8_model import Int8Llama
from shm_engine.model.reference import ReferenceModel
from shm_engine.model.smoothing import LayerCalibrator, LayerWeights, smooth_layer

from .conftest import tiny_config, tiny_weights
from .test_int8_model import paged_logits, rel_err


def model(**overrides):
    base = dict(
        vocab_size=320, hidden_size=128, intermediate_size=352, num_layers=3, head_dim=32,
        num_heads=6, num_kv_heads=2, attention_bias=True,
    )  # fmt: skip
    config = tiny_config(**(base | overrides))
    return config, tiny_weights(config)


def layer_weights(w: dict[str, torch.Tensor], i: int) -> LayerWeights:
    """Copies (smooth_layer works in place)."""
    p = f"model.layers.{i}."
    return LayerWeights(
        input_norm=w[p + "input_layernorm.weight"].clone(),
        post_norm=w[p + "post_attention_layernorm.weight"].clone(),
        qkv=torch.cat([w[f"{p}self_attn.{n}_proj.weight"] for n in "qkv"]),
        qkv_bias=torch.cat([w[f"{p}self_attn.{n}_proj.bias"] for n in "qkv"]),
        o=w[p + "self_attn.o_proj.weight"].clone(),
        gate_up=torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]]),
        down=w[p + "mlp.down_proj.weight"].clone(),
    )


def unfuse(w: dict[str, torch.Tensor], i: int, lw: LayerWeights, config) -> None:
    p = f"model.layers.{i}."
    hqd, hkd = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    for name, rows in zip("qkv", lw.qkv.split([hqd, hkd, hkd]), strict=True):
        w[f"{p}self_attn.{name}_proj.weight"] = rows
    for name, b in zip("qkv", lw.qkv_bias.split([hqd, hkd, hkd]), strict=True):
        w[f"{p}self_attn.{name}_proj.bias"] = b
    gate, up = lw.gate_up.chunk(2)
    w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"] = gate, up
    w[p + "self_attn.o_proj.weight"], w[p + "mlp.down_proj.weight"] = lw.o, lw.down
    w[p + "input_layernorm.weight"] = lw.input_norm
    w[p + "post_attention_layernorm.weight"] = lw.post_norm


def test_smoothing_leaves_the_fp32_model_unchanged():
    """W diag(s) against inputs / s (folded into the norms, V and up): the same function."""
    config, weights = model()
    g = torch.Generator().manual_seed(1)
    smoothed = dict(weights)
    h, hqd, f = config.hidden_size, config.num_heads * config.head_dim, config.intermediate_size
    for i in range(config.num_layers):
        act_max = torch.rand(2 * h + hqd + f, generator=g) * 10 + 0.01
        lw = layer_weights(weights, i)
        smooth_layer(lw, act_max, config.num_heads, config.num_kv_heads, config.head_dim)
        unfuse(smoothed, i, lw, config)
    assert not torch.equal(smoothed["model.layers.0.self_attn.o_proj.weight"],
                           weights["model.layers.0.self_attn.o_proj.weight"])  # fmt: skip
    ids = torch.arange(3, 40)
    want = ReferenceModel(config, weights).forward(ids)
    got = ReferenceModel(config, smoothed).forward(ids)
    assert rel_err(got, want) < 1e-5


class Recorder(ReferenceModel):
    """The fp32 reference, recording max |x| per input channel of every linear."""

    def __init__(self, config, weights) -> None:  # noqa: ANN001 - as ReferenceModel
        super().__init__(config, weights)
        self.seen: dict[int, torch.Tensor] = {}

    def linear(self, x, weight, bias=None):  # noqa: ANN001, ANN201 - as ReferenceModel.linear
        m = x.reshape(-1, x.shape[-1]).abs().amax(0)
        key = weight.data_ptr()
        self.seen[key] = torch.maximum(self.seen[key], m) if key in self.seen else m
        return super().linear(x, weight, bias)


def test_native_layers_record_their_linear_inputs():
    """LayerStep.act_max: what the fp32 reference sees entering q, o, gate and down of layer 0,
    up to the int8 model's rounding."""
    config, weights = model()
    ids = list(range(3, 60))
    rec = Recorder(config, weights)
    rec.forward(torch.tensor(ids))
    p = "model.layers.0."
    want = torch.cat([rec.seen[rec.w[p + n].data_ptr()] for n in (
        "self_attn.q_proj.weight", "self_attn.o_proj.weight", "mlp.gate_proj.weight",
        "mlp.down_proj.weight",
    )])  # fmt: skip
    int8 = Int8Llama(config, weights)
    probe = int8._pack_layer(int8._layer_weights(weights, 0), rope=True, probe=True)
    hidden = int8.embedding.lookup(torch.tensor(ids))
    got = LayerCalibrator(hidden, probe, int8.cos_sin, int8.scale).maxima(probe)
    assert got.shape == want.shape
    assert rel_err(got, want) < 0.02


@pytest.mark.parametrize("act", ["int16", "int8"])
def test_smoothed_int8_model_matches_reference(act):
    """Bounded as the unsmoothed model is (random weights have no outlier channels, so here
    smoothing neither helps nor hurts much: relative logit error 0.023 -> 0.023 with int16
    activations, 0.027 -> 0.029 with int8; SmolLM2's gains are in test_int8_model)."""
    config, weights = model()
    ref = ReferenceModel(config, weights)
    smoothed = Int8Llama(config, weights, activation_dtype=act, calibration_ids=list(range(5, 90)))
    plain = Int8Llama(config, weights, activation_dtype=act)
    assert smoothed.smoothed and not plain.smoothed
    seqs = [list(range(3, 3 + n)) for n in (40, 21)]
    chunks = [[32] + [1] * 8, [17] + [1] * 4]
    for m in (smoothed, plain):
        for s, o in zip(seqs, paged_logits(m, config, seqs, chunks), strict=True):
            e = ref.forward(torch.tensor(s))
            assert rel_err(o, e) < 0.04
            assert (o.argmax(-1) == e.argmax(-1)).float().mean() >= 0.85


def test_activation_dtype_marks_the_layer_weights():
    config, weights = model(num_layers=1)
    ids = list(range(5, 40))
    for act, calib in (("int16", None), ("int16", ids), ("int8", None), ("int8", ids)):
        m = Int8Llama(config, weights, activation_dtype=act, calibration_ids=calib)
        assert m.smoothed == (calib is not None)
        layer = m.layers[0]
        # NOTE: only path vnni has the 8-bit kernel; the others keep int16 (and plain weights)
        assert [lin.act8 for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)] == [
            act == "int8" and K.get_path() == "vnni"
        ] * 4
        assert not m.lm_head.act8


def test_calibration_text_longer_than_the_model_is_cut():
    """Calibration runs no position past the RoPE table (85 ids, 32 positions): the kernels
    would clamp such positions to the table's last row and record maxima of wrong rotations, so
    85 ids must smooth exactly as their first 32 do."""
    config, weights = model(num_layers=1, max_position_embeddings=32)
    ids = list(range(5, 90))
    long, cut = (Int8Llama(config, weights, calibration_ids=c) for c in (ids, ids[:32]))
    assert long.smoothed
    for a, b in zip(long.layers, cut.layers, strict=True):
        assert torch.equal(a.input_norm, b.input_norm) and torch.equal(a.post_norm, b.post_norm)
        for name in ("qkv", "o", "gate_up", "down"):
            assert torch.equal(getattr(a, name).packed, getattr(b, name).packed)
