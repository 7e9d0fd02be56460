"""Random-weight models in the shapes of popular small checkpoints, for speed measurements of
shapes this machine cannot download (nothing comes from a model hub here).

    python -m benchmarks.random_model qwen3-0.6b /tmp/qwen3-0.6b
    python -m benchmarks.bench_model --model /tmp/qwen3-0.6b --skip-gemm --skip-fp32

The weights are random, so the text is noise; the shapes, and so the time of every kernel, are
the real model's. The tokenizer is the embedded SmolLM2's (its ids are a subset of the vocab).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from shm_engine.model.config import ModelConfig
from shm_engine.model.hf_loader import save_hf_model
from shm_engine.model.loader import expected_weight_shapes, load_model_info

# The published config.json values of each checkpoint (shapes and RoPE).
PRESETS: dict[str, dict] = {
    "qwen3-0.6b": dict(
        architecture="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
        num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6,
        rope_theta=1e6, max_position_embeddings=40960, tie_word_embeddings=True,
    ),
    "qwen2.5-0.5b": dict(
        architecture="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
        num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6,
        rope_theta=1e6, max_position_embeddings=32768, tie_word_embeddings=True,
        attention_bias=True,
    ),
    "smollm3-3b": dict(
        architecture="smollm3", vocab_size=128256, hidden_size=2048, intermediate_size=11008,
        num_layers=36, num_heads=16, num_kv_heads=4, head_dim=128, rms_norm_eps=1e-6,
        rope_theta=5e6, max_position_embeddings=65536, tie_word_embeddings=True,
        nope_layers=tuple(range(3, 36, 4)),
    ),
    "llama-3.2-1b": dict(
        architecture="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
        num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5,
        rope_theta=5e5, max_position_embeddings=131072, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    ),
}  # fmt: skip


def random_weights(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Weights scaled as trained ones roughly are (norms near 1, matrices ~1/sqrt(fan-in))."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in expected_weight_shapes(config).items():
        if name.endswith("norm.weight"):
            out[name] = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif name.endswith(".bias"):
            out[name] = 0.1 * torch.randn(shape, generator=g)
        else:
            out[name] = (torch.randn(shape, generator=g) / shape[-1] ** 0.5).to(torch.bfloat16)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("preset", choices=sorted(PRESETS))
    ap.add_argument("path", type=Path, help="the HF directory to write")
    args = ap.parse_args(argv)
    config = ModelConfig(**PRESETS[args.preset])
    tokenizer = load_model_info(None).tokenizer
    save_hf_model(args.path, config, random_weights(config), tokenizer, dtype=torch.bfloat16,
                  max_shard_bytes=1 << 30)  # fmt: skip
    print(f"{args.preset}: {config.num_parameters() / 1e6:.0f}M parameters in {args.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
