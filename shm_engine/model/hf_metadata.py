"""Hugging Face directory metadata: config.json and the tokenizer files, without torch.

Frontends need only this (their tokenizer and the model's limits); `hf_loader` adds the weights.
"""

from __future__ import annotations

import json
from pathlib import Path

from .config import ModelConfig
from .tokenizer import Tokenizer


def read_hf_info(path: Path) -> tuple[ModelConfig, Tokenizer]:
    """The config and tokenizer of a Hugging Face model directory."""
    config = ModelConfig.from_hf_config(json.loads((path / "config.json").read_text()))
    tokenizer = Tokenizer.from_hf_dir(path, extra_eos_ids=config.eos_token_ids)
    if tokenizer.bos_token_id is None and config.bos_token_id is not None:
        tokenizer.bos_token_id = config.bos_token_id
    return config, tokenizer
