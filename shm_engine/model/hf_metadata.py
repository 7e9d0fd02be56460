"""Hugging Face directory metadata: config.json and the tokenizer files, without torch.

Frontends need only this (their tokenizer and the model's limits); `hf_loader` adds the weights.
"""

from __future__ import annotations

import json
from pathlib import Path

from shm_engine.sampling_params import checked_defaults

from .config import ModelConfig
from .tokenizer import Tokenizer

# generation_config.json keys vLLM takes as the defaults of requests that leave them unset
# (its generation_config="auto"), with max_new_tokens as max_tokens; do_sample is not one of
# them, as in vLLM.
SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def read_sampling_defaults(path: Path) -> dict[str, float | int]:
    """The sampling defaults in a model's generation_config.json (e.g. Qwen2.5-Instruct's
    temperature 0.7, top_p 0.8, top_k 20, repetition_penalty 1.05); {} without the file."""
    file = path / "generation_config.json"
    if not file.is_file():
        return {}
    gen = json.loads(file.read_text())
    out: dict[str, float | int] = {}
    for key in SAMPLING_DEFAULT_KEYS:
        value = gen.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{file}: {key} must be a number, got {value!r}")
        out[key] = int(value) if key == "top_k" else float(value)
    max_new = gen.get("max_new_tokens")  # HF's name for max_tokens (vLLM maps it so)
    if max_new is not None:
        if isinstance(max_new, bool) or not isinstance(max_new, int):
            raise ValueError(f"{file}: max_new_tokens must be an integer, got {max_new!r}")
        out["max_tokens"] = max_new
    return checked_defaults(out, file)


def read_hf_info(path: Path) -> tuple[ModelConfig, Tokenizer]:
    """The config and tokenizer of a Hugging Face model directory."""
    config = ModelConfig.from_hf_config(json.loads((path / "config.json").read_text()))
    tokenizer = Tokenizer.from_hf_dir(path, extra_eos_ids=config.eos_token_ids)
    if tokenizer.bos_token_id is None and config.bos_token_id is not None:
        tokenizer.bos_token_id = config.bos_token_id
    return config, tokenizer
