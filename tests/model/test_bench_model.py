"""The benchmarks' --json output: `bench_model` (the figures issue 3 asks for) and `bench_startup`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_model_json_keys(tmp_path: Path) -> None:
    out = tmp_path / "model.json"
    cmd = [sys.executable, "-m", "benchmarks.bench_model", "--quick", "--skip-fp32"]
    cmd += ["--gemm-ms", "10", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(out.read_text())

    assert r["prefill_tok_s"] > 0
    assert set(r["decode_tok_s"]) == {"1", "8", "16", "32"}
    assert all(v > 0 for v in r["decode_tok_s"].values())
    # a process holding the 135M-parameter model: at least its int8 weights, far under 4 GB
    assert 135 < r["peak_rss_mb"] < 4096
    shapes = {(g["n"], g["k"]) for g in r["gemm"]}
    assert shapes == {(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)}
    assert {g["m"] for g in r["gemm"]} == {1, 8, 32, 256}
    impls = {g["impl"] for g in r["gemm"]}
    assert {"ours", "torch_fp32", "torch_int8_dyn"} <= impls
    # the 8-bit kernel where its VNNI code runs (the portable twin is not timed)
    assert ("ours_a8" in impls) == (r["machine"]["kernel_path"] in {"vnni", "amx"})
    # the 4-bit layers' default kernel (W4 x A8) from path avx2 up
    assert ("ours_w4a8" in impls) == (r["machine"]["kernel_path"] != "portable")
    assert all(g["gops"] > 0 for g in r["gemm"])
    assert r["machine"]["kernel_path"] in {"portable", "avx2", "vnni", "amx"}
    # weight_dtype "auto": SmolLM2's Q4_1 layers in W4 on every path but amx, the all-W8
    # model measured beside them (w8_ keys)
    w4 = r["machine"]["kernel_path"] != "amx"
    assert r["weight_dtype"] == "auto" and ("120 of 120 layer matrices int4" in r["weights"]) == w4
    assert ("w8_prefill_tok_s" in r) == w4
    # the other activation formats side by side: the opt-in W8 x A8 on path vnni, and the
    # exact W4 x A16 where the default runs the 4-bit layers on 8-bit activations
    assert r["activation_dtype"] == "auto"
    for key, runs in (("a8", r["machine"]["kernel_path"] == "vnni"), ("a16", w4)):
        if runs:
            assert r[f"{key}_prefill_tok_s"] > 0
            assert set(r[f"{key}_decode_tok_s"]) == {"1", "8", "16", "32"}
        else:
            assert f"{key}_prefill_tok_s" not in r


@pytest.mark.slow
def test_bench_startup_json(tmp_path: Path) -> None:
    """`bench_startup` times fresh starts of LLM() and of `serve`, and finds the frontend free
    of torch."""
    out = tmp_path / "startup.json"
    cmd = [sys.executable, "-m", "benchmarks.bench_startup", "--runs", "1", "--serve",
           "--json", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(out.read_text())
    assert len(r["runs"]) == 1 and r["runs"][0]["torch_in_frontend"] is False
    m = r["median"]
    assert 0 < m["llm_init_s"] < 120 and 0 < m["first_generate_s"] < 60
    assert 0 < m["serve_ready_s"] < 120
    # the frontend holds a tokenizer and rings, not torch (~230 MB) or the weights
    assert 20 < m["frontend_peak_rss_mb"] < 250


def test_random_model_presets_have_the_published_shapes(tmp_path: Path) -> None:
    """The presets' parameter counts are the checkpoints' published ones; a written model
    loads with the shapes the loader expects."""
    from benchmarks.random_model import PRESETS, random_weights
    from shm_engine.model.config import ModelConfig
    from shm_engine.model.hf_loader import save_hf_model
    from shm_engine.model.loader import expected_weight_shapes, load_model, load_model_info

    millions = {name: ModelConfig(**p).num_parameters() / 1e6 for name, p in PRESETS.items()}
    assert millions["qwen3-0.6b"] == pytest.approx(596, abs=1)
    assert millions["qwen2.5-0.5b"] == pytest.approx(494, abs=1)
    assert millions["llama-3.2-1b"] == pytest.approx(1236, abs=1)
    assert millions["smollm3-3b"] == pytest.approx(3075, abs=1)
    small = ModelConfig(**{**PRESETS["qwen3-0.6b"], "vocab_size": 300, "num_layers": 1,
                           "hidden_size": 64, "intermediate_size": 96, "head_dim": 32})  # fmt: skip
    weights = random_weights(small)
    assert {n: tuple(t.shape) for n, t in weights.items()} == expected_weight_shapes(small)
    save_hf_model(tmp_path, small, weights, load_model_info(None).tokenizer)
    assert load_model(tmp_path).config == small
