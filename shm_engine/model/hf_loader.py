"""Hugging Face directories: config.json, *.safetensors (single or sharded), tokenizer files.

Also writes such a directory (`save_hf_model`), which the tests use to check that a GGUF and its
safetensors conversion load to the same weights, and which converts a GGUF for other tools.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .config import ModelConfig
from .hf_metadata import read_hf_info
from .loader import (
    LoadedModel,
    WeightSource,
    check_unused_tensors,
    check_weights,
    expected_weight_names,
    file_fingerprint,
)
from .tokenizer import Tokenizer

_INDEX = "model.safetensors.index.json"


class SafetensorsWeights(WeightSource):
    """Reads each tensor from its (memory-mapped) shard on access and casts it to fp32.

    NOTE: a shard is opened for each read and closed after it, which unmaps it: a handle kept
    open left every page read in the process's RSS (file-backed) until the end of the load, a
    1.2 GB peak on top of the packed weights for a Qwen3-0.6B of bf16 shards (the GGUF loader
    drops its pages with madvise). Opening parses the shard's header again: ~0.1 ms a tensor.
    """

    def __init__(self, files: dict[str, Path], config: ModelConfig) -> None:
        self._files = files  # tensor name -> shard
        names = expected_weight_names(config)
        check_unused_tensors(files, names, config)
        super().__init__([n for n in names if n in files])

    def _open(self, name: str):  # noqa: ANN202 - safetensors has no public handle type
        return safe_open(str(self._files[name]), framework="pt")

    def shape(self, name: str) -> tuple[int, ...]:
        with self._open(name) as f:
            return tuple(f.get_slice(name).get_shape())

    def _load(self, name: str) -> torch.Tensor:
        with self._open(name) as f:
            t = f.get_tensor(name)
        return t.to(torch.float32).contiguous()

    def rows(self, name: str, start: int, end: int) -> torch.Tensor:
        if name not in self._index:
            raise KeyError(name)
        with self._open(name) as f:
            t = f.get_slice(name)[start:end]
        return t.to(torch.float32).contiguous()


def _tensor_files(path: Path) -> dict[str, Path]:
    index = path / _INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / shard for name, shard in weight_map.items()}
    files: dict[str, Path] = {}
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"{path}: no *.safetensors files (only safetensors is supported)")
    for shard in shards:
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                files[name] = shard
    return files


def load_hf_dir(path: str | Path) -> LoadedModel:
    path = Path(path)
    config, tokenizer = read_hf_info(path)
    files = _tensor_files(path)
    if config.tie_word_embeddings:
        files.pop("lm_head.weight", None)
    elif "lm_head.weight" not in files and "model.embed_tokens.weight" in files:
        raise ValueError(f"{path}: tie_word_embeddings is false but there is no lm_head.weight")
    weights = SafetensorsWeights(files, config)
    check_weights(config, weights, str(path))
    fingerprinted = sorted(set(files.values())) + [path / "config.json"]
    fingerprinted += [
        p for p in (path / "tokenizer.json", path / "tokenizer_config.json") if p.is_file()
    ]
    return LoadedModel(
        config=config,
        weights=weights,
        tokenizer=tokenizer,
        fingerprint=file_fingerprint(fingerprinted),
        path=path,
        format="hf",
    )


def save_hf_model(
    path: str | Path,
    config: ModelConfig,
    weights: Mapping[str, torch.Tensor],
    tokenizer: Tokenizer | None = None,
    *,
    max_shard_bytes: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write config.json, safetensors (sharded with an index if max_shard_bytes) and tokenizer.

    Tensors are pulled from `weights` one shard at a time, so a lazy source is never fully
    materialized when sharding."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config.to_hf_config(), indent=2))
    if tokenizer is not None:
        tokenizer.save_hf(path)
    names = [n for n in expected_weight_names(config) if n in weights]
    shards: list[list[str]] = [[]]
    size = 0
    for name in names:
        nbytes = _numel(weights, name) * torch.empty((), dtype=dtype).element_size()
        if max_shard_bytes and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    if len(shards) == 1:
        tensors = {n: weights[n].to(dtype).contiguous() for n in shards[0]}
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        return path
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {n: weights[n].to(dtype).contiguous() for n in shard}
        save_file(tensors, str(path / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
        del tensors
    index = {"metadata": {}, "weight_map": weight_map}
    (path / _INDEX).write_text(json.dumps(index, indent=2))
    return path


def _numel(weights: Mapping[str, torch.Tensor], name: str) -> int:
    shape = weights.shape(name) if isinstance(weights, WeightSource) else weights[name].shape
    n = 1
    for d in shape:
        n *= int(d)
    return n
