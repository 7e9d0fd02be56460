"""scripts/act_quant_study.py: its fake quantiser, calibration and schemes on a tiny model."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

from shm_engine.model.reference import ReferenceModel

from .conftest import tiny_config, tiny_weights

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "act_quant_study.py"
_spec = importlib.util.spec_from_file_location("act_quant_study", _PATH)
study = importlib.util.module_from_spec(_spec)
sys.modules["act_quant_study"] = study  # dataclasses look their module up
_spec.loader.exec_module(study)


def test_fake_quant_rounds_to_the_grid_of_each_group():
    x = torch.randn(3, 40, generator=torch.Generator().manual_seed(0))
    for limit, group in [(127, None), (127, 16), (32767, 32)]:
        q = study.fake_quant(x, limit, group)
        g = group or 40
        for r in range(3):
            for a in range(0, 40, g):
                part, got = x[r, a : a + g], q[r, a : a + g]
                scale = part.abs().max() / limit
                assert (got - part).abs().max() <= scale / 2 + 1e-7
                assert torch.allclose(got / scale, torch.round(got / scale), atol=1e-3)


def test_schemes_on_a_tiny_model():
    """No scheme is fp32 exactly; calibration sees every projection's input group; 16-bit
    activations stay closer to fp32 than per-token 8-bit, and smoothing is applied."""
    config = tiny_config()
    weights = tiny_weights(config, seed=5)
    model = study.StudyModel(config, weights)
    ids = list(range(3, 40))
    want = ReferenceModel(config, weights).forward(ids)
    assert torch.equal(model.forward(ids), want)
    model.calibrate(list(range(50, 90)))
    groups = {k for k in model._xmax if k.startswith("model.layers.0.")}
    assert groups == {
        "model.layers.0.qkv",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.0.gate_up",
        "model.layers.0.mlp.down_proj.weight",
    }
    err = {}
    for name in ("a16", "a8", "a8g16-sq0.5"):
        model.scheme = study.SCHEMES[name]
        got = model.forward(ids)
        err[name] = ((got - want).norm() / want.norm()).item()
    assert 0 < err["a16"] < err["a8"] < 0.2
    assert 0 < err["a8g16-sq0.5"] < 0.2
