"""One entry point for every model source: `load_model(path_or_none) -> LoadedModel`, and
`load_model_info` for a frontend (config and tokenizer only, without importing torch).

Weights come back as a lazy, read-only mapping from Hugging Face tensor names to fp32 tensors in
the HF layout: a tensor is read (and dequantized) from the memory-mapped file when it is asked
for and not kept, so a consumer that takes one tensor at a time (the int8 packer) peaks at the
largest tensor in fp32 (the 113 MB embedding of SmolLM2) plus the file mapping, not the 540 MB of
a full fp32 copy. `materialize()` builds the full dict for the fp32 reference.
"""

from __future__ import annotations

import hashlib
import os
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from .config import ModelConfig
from .default_model import default_model_path
from .tokenizer import Tokenizer

if TYPE_CHECKING:
    import torch

_FINGERPRINT_SAMPLE = 1 << 20  # bytes hashed at each end of every file


class W4Grid(NamedTuple):
    """A matrix as a file holds it on 4-bit grids of 32 along its rows:
    w[j, k] = scales[j, k // 32] * u[j, k] + mins[j, k // 32], u in 0 .. 15 two to a byte as
    GGUF's Q4_0 / Q4_1 blocks hold them: byte 16 g + i of row j (i < 16) has u[j, 32 g + i] in
    its low nibble and u[j, 32 g + 16 + i] in its high one.

    NOTE: the file's own bytes, so a Q4_0 / Q4_1 matrix reaches the W4 packing with no unpacking
    (``PackedLinear.from_w4_grid`` only moves them in words of 4)."""

    q: torch.Tensor  # uint8 [n, k / 2], k a multiple of 32
    scales: torch.Tensor  # fp32 [n, k / 32]
    mins: torch.Tensor  # fp32 [n, k / 32]

    @classmethod
    def from_values(cls, u: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> W4Grid:
        """The grid of values u (uint8 [n, k], 0 .. 15, k a multiple of 32)."""
        import torch  # here: the frontend imports this module without torch

        n, k = u.shape
        if u.dtype != torch.uint8 or k % 32:
            raise ValueError(f"u must be uint8 rows of whole groups of 32, got {u.dtype} {k}")
        if int(u.max()) > 15:
            raise ValueError("u must lie in [0, 15]")
        g = u.reshape(n, k // 32, 2, 16)
        return cls((g[:, :, 0] | (g[:, :, 1] << 4)).reshape(n, k // 2), scales, mins)

    def values(self) -> torch.Tensor:
        """u (uint8 [n, k])."""
        import torch

        g = self.q.reshape(self.q.shape[0], -1, 1, 16)
        return torch.cat([g & 15, g >> 4], dim=2).reshape(self.q.shape[0], -1)


class WeightSource(Mapping[str, "torch.Tensor"], ABC):
    """Lazy name -> fp32 tensor mapping; each access reads the tensor anew (nothing is cached)."""

    def __init__(self, names: Sequence[str]) -> None:
        self._names = list(names)
        self._index = set(self._names)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._index:
            raise KeyError(name)
        return self._load(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._index

    @abstractmethod
    def _load(self, name: str) -> torch.Tensor:
        """Read one tensor as a fresh, contiguous fp32 tensor in the HF layout."""

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self[name].shape)

    def stored_in_4bit_groups(self, name: str) -> bool:
        """Whether the file holds the tensor on 4-bit grids of 32 (``w4_grid`` reads them; an
        ``Int8Llama(weight_dtype="auto")`` keeps those in 4 bits)."""
        return False

    def w4_grid(self, name: str) -> W4Grid:
        """The tensor's 4-bit grids, where ``stored_in_4bit_groups(name)``."""
        raise ValueError(f"{name} is not stored on 4-bit grids")

    def q8_0_rows(self, name: str, start: int, end: int) -> torch.Tensor | None:
        """Rows ``start .. end - 1`` of a matrix as the file's GGUF Q8_0 blocks (uint8 [rows,
        row bytes]: per 32 weights an fp16 scale and 32 int8), where it holds them so and its
        rows need no reordering; else None. ``PackedLinear.from_q8_0`` packs them without a
        float pass."""
        return None

    def rows(self, name: str, start: int, end: int) -> torch.Tensor:
        """fp32 rows ``start .. end - 1`` of a matrix (what ``self[name][start:end]`` holds).

        Sources override this to read only those rows, so a vocabulary-sized matrix can be
        packed in chunks without ever being whole in fp32."""
        if name not in self._index:
            raise KeyError(name)
        return self._load(name)[start:end].contiguous()

    def materialize(self) -> dict[str, torch.Tensor]:
        """Every tensor in fp32 (4 bytes/parameter: ~540 MB for SmolLM2-135M)."""
        return {name: self._load(name) for name in self._names}


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: WeightSource
    tokenizer: Tokenizer
    fingerprint: (
        str  # stable across runs and copies of the same files; keys caches of packed weights
    )
    path: Path
    format: str  # "gguf" or "hf"


@dataclass
class ModelInfo:
    """What a frontend needs of a model: read without its weights and without importing torch."""

    config: ModelConfig
    tokenizer: Tokenizer
    path: Path
    format: str  # "gguf" or "hf"
    # SamplingParams fields a request that leaves them unset takes (generation_config.json)
    sampling_defaults: dict[str, float | int] = field(default_factory=dict)


def resolve_model_path(path: str | os.PathLike[str] | None) -> tuple[Path, str]:
    """The GGUF file or HF directory a model argument names, and its format."""
    p = default_model_path() if path is None else Path(path)
    if not p.exists():
        raise FileNotFoundError(f"model path {p} does not exist")
    if not p.is_dir():
        return p, "gguf"
    if (p / "config.json").is_file():
        return p, "hf"
    ggufs = sorted(p.glob("*.gguf"))
    if len(ggufs) != 1:
        raise ValueError(
            f"{p} is neither a Hugging Face directory (config.json) nor holds exactly one .gguf"
        )
    return ggufs[0], "gguf"


def load_model_info(path: str | os.PathLike[str] | None = None) -> ModelInfo:
    """The config and tokenizer of a GGUF file or HF directory (None: the embedded SmolLM2)."""
    p, fmt = resolve_model_path(path)
    if fmt == "hf":
        from .hf_metadata import read_hf_info, read_sampling_defaults

        config, tokenizer = read_hf_info(p)
        return ModelInfo(config, tokenizer, p, fmt, read_sampling_defaults(p))
    from .gguf_metadata import read_gguf_info

    _, config, tokenizer, defaults = read_gguf_info(p)
    return ModelInfo(config, tokenizer, p, fmt, defaults)


def load_model(path: str | os.PathLike[str] | None = None) -> LoadedModel:
    """Load a GGUF file or a Hugging Face directory; None means the embedded SmolLM2 GGUF."""
    p, fmt = resolve_model_path(path)
    if fmt == "hf":
        from .hf_loader import load_hf_dir

        return load_hf_dir(p)
    from .gguf_loader import load_gguf

    return load_gguf(p)


def expected_weight_names(config: ModelConfig) -> list[str]:
    """Canonical HF tensor names in a fixed order (embedding, layer by layer, norm, lm_head)."""
    names = ["model.embed_tokens.weight"]
    for i in range(config.num_layers):
        pre = f"model.layers.{i}."
        names.append(pre + "input_layernorm.weight")
        for proj in ("q_proj", "k_proj", "v_proj"):
            names.append(f"{pre}self_attn.{proj}.weight")
            if config.attention_bias:
                names.append(f"{pre}self_attn.{proj}.bias")
        if config.qk_norm:
            names += [pre + "self_attn.q_norm.weight", pre + "self_attn.k_norm.weight"]
        names.append(pre + "self_attn.o_proj.weight")
        names.append(pre + "post_attention_layernorm.weight")
        for proj in ("gate_proj", "up_proj", "down_proj"):
            names.append(f"{pre}mlp.{proj}.weight")
    names.append("model.norm.weight")
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


_HARMLESS_SUFFIXES = (".rotary_emb.inv_freq",)  # recomputed from the config


def check_unused_tensors(
    names: Iterable[str], expected: Sequence[str], config: ModelConfig
) -> None:
    """Raise if a checkpoint holds tensors the forward would not read.

    Why: an unread tensor means the checkpoint computes something this model does not (an
    o_proj or MLP bias, an extra norm), so its outputs would silently differ.
    """
    wanted = set(expected)
    unused = [
        n
        for n in names
        if n not in wanted
        and not n.endswith(_HARMLESS_SUFFIXES)
        and not (n == "lm_head.weight" and config.tie_word_embeddings)  # a copy of the embedding
    ]
    if unused:
        shown = ", ".join(sorted(unused)[:5]) + (" ..." if len(unused) > 5 else "")
        raise NotImplementedError(
            f"the checkpoint has {len(unused)} tensors this model does not use: {shown}"
        )


def file_fingerprint(paths: Sequence[Path]) -> str:
    """Hash of names, sizes and the first and last MiB of each file.

    Content-based (survives copies and touch) yet costs a few ms even for multi-GB files; any
    re-quantization or conversion changes the header (tensor table) or the tail.
    """
    h = hashlib.sha256()
    for p in sorted(paths, key=lambda q: q.name):
        size = p.stat().st_size
        h.update(f"{p.name}\0{size}\0".encode())
        with open(p, "rb") as f:
            h.update(f.read(_FINGERPRINT_SAMPLE))
            if size > 2 * _FINGERPRINT_SAMPLE:
                f.seek(size - _FINGERPRINT_SAMPLE)
                h.update(f.read(_FINGERPRINT_SAMPLE))
    return h.hexdigest()[:32]


def check_weights(config: ModelConfig, weights: WeightSource, source: str) -> None:
    """Every tensor the forward reads is there, in the shape the config gives.

    Why: a config.json that disagrees with its tensors (a vocab_size past the embedding's rows)
    would otherwise load, and the native embedding lookup would read past the table.
    """
    expected = expected_weight_shapes(config)
    missing = [n for n in expected if n not in weights]
    if missing:
        more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"{source}: missing tensors {missing[:5]}{more}")
    for name, shape in expected.items():
        if weights.shape(name) != shape:
            raise ValueError(
                f"{source}: {name} has shape {list(weights.shape(name))}, the config says "
                f"{list(shape)}"
            )


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape ([out, in] for projections), in expected_weight_names' order."""
    h, q, kv, inter = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    by_suffix = {
        "embed_tokens.weight": (config.vocab_size, h),
        "lm_head.weight": (config.vocab_size, h),
        "norm.weight": (h,),  # the layer norms and the final one
        "q_norm.weight": (config.head_dim,),
        "k_norm.weight": (config.head_dim,),
        "q_proj.weight": (q, h),
        "k_proj.weight": (kv, h),
        "v_proj.weight": (kv, h),
        "q_proj.bias": (q,),
        "k_proj.bias": (kv,),
        "v_proj.bias": (kv,),
        "o_proj.weight": (h, q),
        "gate_proj.weight": (inter, h),
        "up_proj.weight": (inter, h),
        "down_proj.weight": (h, inter),
    }
    shapes = {}
    for name in expected_weight_names(config):
        key = ".".join(name.split(".")[-2:])  # e.g. "q_proj.weight", "input_layernorm.weight"
        if key not in by_suffix and key.endswith("norm.weight"):
            key = "norm.weight"
        shapes[name] = by_suffix[key]
    return shapes
