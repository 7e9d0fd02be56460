"""GGUF loading: metadata -> ModelConfig + Tokenizer, tensors -> HF-named fp32 tensors.

Tensors are dequantized with `gguf.quants.dequantize` (every type the package supports); the
types of common files (F32, F16, BF16, Q8_0, Q4_0, Q4_1) go through an equivalent torch path that
is several times faster (tested bit-exact against the package). llama.cpp's converter permutes
the rows of Q and K for `llama`-architecture files (its interleaved-pair RoPE); we undo that so
the weights match Hugging Face's rotate_half convention.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize as gguf_dequantize

from .config import ModelConfig
from .gguf_metadata import FastGGUFReader, read_gguf_info
from .loader import LoadedModel, W4Grid, WeightSource, check_weights, file_fingerprint

log = logging.getLogger(__name__)

# architectures whose Q/K rows llama.cpp's converter permutes for interleaved RoPE
_PERMUTED_QK_ARCHS = {"llama", "smollm3"}  # the converter's SmolLM3 class is its Llama one

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
_IGNORED = {"rope_freqs.weight"}  # folded into ModelConfig.rope_freq_factors


def hf_name(gguf_name: str) -> str | None:
    """HF tensor name for a GGUF tensor name; None for tensors we do not use."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return None


def dequantize_tensor(t: ReaderTensor) -> torch.Tensor:
    """fp32 tensor in numpy/HF dimension order ([out, in] for matrices)."""
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    return dequantize_bytes(np.asarray(t.data), t.tensor_type, shape)


def dequantize_rows(t: ReaderTensor, start: int, end: int) -> torch.Tensor:
    """fp32 rows ``start .. end - 1`` of a matrix tensor, reading only their bytes (every
    GGML type packs a row into whole blocks, so a row is a contiguous run of bytes)."""
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    if end <= start:  # the package cannot dequantize nothing
        return torch.empty(0, *shape[1:])
    raw = np.asarray(t.data).reshape(-1).view(np.uint8)
    row_bytes = raw.size // shape[0]
    rows = raw[start * row_bytes : end * row_bytes].reshape(end - start, row_bytes)
    return dequantize_bytes(rows, t.tensor_type, (end - start, *shape[1:]))


def dequantize_bytes(data: np.ndarray, qtype: GGMLQuantizationType, shape) -> torch.Tensor:
    """fp32 tensor of ``shape`` from a tensor's data as the reader maps it, or its rows' bytes
    as uint8 [rows, bytes a row] (what `gguf.quants.dequantize` takes)."""
    fast = _FAST.get(qtype)
    if fast is not None:
        raw = torch.from_numpy(np.array(data, copy=True).reshape(-1).view(np.uint8))
        block_bytes = _BLOCK_BYTES.get(qtype)
        if block_bytes is None:
            return fast(raw).reshape(shape)
        # NOTE: chunked into a preallocated output: dequantizing a whole quantized tensor at once
        # holds ~3 fp32 temporaries of its size (340 MB for SmolLM2's embedding), which set the
        # process's peak RSS.
        nblocks = raw.numel() // block_bytes
        out = torch.empty(nblocks * 32, dtype=torch.float32)
        for start in range(0, nblocks, _CHUNK_BLOCKS):
            end = min(nblocks, start + _CHUNK_BLOCKS)
            out[start * 32 : end * 32] = fast(raw[start * block_bytes : end * block_bytes]).view(-1)
        return out.reshape(shape)
    out = gguf_dequantize(np.asarray(data), qtype)
    return torch.from_numpy(np.array(out, dtype=np.float32, copy=True)).reshape(shape)


def _half_at(blocks: torch.Tensor, start: int) -> torch.Tensor:
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _deq_f32(raw: torch.Tensor) -> torch.Tensor:
    return raw.view(torch.float32)


def _deq_f16(raw: torch.Tensor) -> torch.Tensor:
    return raw.view(torch.float16).float()


def _deq_bf16(raw: torch.Tensor) -> torch.Tensor:
    return raw.view(torch.bfloat16).float()


def _deq_q8_0(raw: torch.Tensor) -> torch.Tensor:
    blocks = raw.view(-1, 34)  # f16 scale, 32 x int8
    return _half_at(blocks, 0) * blocks[:, 2:].view(torch.int8).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    # element j < 16 is the low nibble of byte j, element 16 + j its high nibble
    return torch.cat([qs & 0x0F, qs >> 4], dim=1).float()


def _deq_q4_0(raw: torch.Tensor) -> torch.Tensor:
    blocks = raw.view(-1, 18)  # f16 scale, 16 bytes of nibbles, zero point 8
    return _half_at(blocks, 0) * (_nibbles(blocks[:, 2:]) - 8.0)


def _deq_q4_1(raw: torch.Tensor) -> torch.Tensor:
    blocks = raw.view(-1, 20)  # f16 scale, f16 min, 16 bytes of nibbles
    return _half_at(blocks, 0) * _nibbles(blocks[:, 4:]) + _half_at(blocks, 2)


_FAST = {
    GGMLQuantizationType.F32: _deq_f32,
    GGMLQuantizationType.F16: _deq_f16,
    GGMLQuantizationType.BF16: _deq_bf16,
    GGMLQuantizationType.Q8_0: _deq_q8_0,
    GGMLQuantizationType.Q4_0: _deq_q4_0,
    GGMLQuantizationType.Q4_1: _deq_q4_1,
}


_BLOCK_BYTES = {
    GGMLQuantizationType.Q8_0: 34,
    GGMLQuantizationType.Q4_0: 18,
    GGMLQuantizationType.Q4_1: 20,
}
_CHUNK_BLOCKS = 1 << 15  # 1 Mi weights (4 MB of fp32) per chunk


# Each grid reader gives a group of 32 a row: its 16 nibble bytes in W4Grid's order (Q4_0's
# and Q4_1's own), its scale and its minimum.


def _grid_q4_0(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    d = _half_at(blocks, 0)[:, 0]  # w = d (q - 8)
    return blocks[:, 2:], d, -8.0 * d


def _grid_q4_1(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return blocks[:, 4:], _half_at(blocks, 0)[:, 0], _half_at(blocks, 2)[:, 0]


def _grid_q4_k(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_K super-block (256 weights) as 8 grids of 32: w = d sc_j q - dmin m_j, the 6-bit
    sc_j and m_j packed in 12 bytes as llama.cpp's get_scale_min_k4 reads them."""
    n = blocks.shape[0]
    d, dmin = _half_at(blocks, 0), _half_at(blocks, 2)
    sb = blocks[:, 4:16].long()
    lo, hi = sb[:, 0:4], sb[:, 4:8]
    sc = torch.cat([lo & 63, (sb[:, 8:12] & 15) | ((lo >> 6) << 4)], dim=1)
    mn = torch.cat([hi & 63, (sb[:, 8:12] >> 4) | ((hi >> 6) << 4)], dim=1)
    qs = blocks[:, 16:].view(n, 4, 32)  # 64 weights a chunk: low nibbles, then high ones
    u = torch.stack([qs & 15, qs >> 4], dim=2).view(n * 8, 2, 16)
    q = u[:, 0] | (u[:, 1] << 4)  # W4Grid's order: k i and 16 + i in byte i
    return q, (d * sc.float()).reshape(-1), (-(dmin * mn.float())).reshape(-1)


# Block bytes and grid readers of the types W4 holds (w4_grid)
_GRIDS = {
    GGMLQuantizationType.Q4_0: (18, 32, _grid_q4_0),
    GGMLQuantizationType.Q4_1: (20, 32, _grid_q4_1),
    GGMLQuantizationType.Q4_K: (144, 256, _grid_q4_k),
}


def w4_grid_of(t: ReaderTensor) -> W4Grid:
    """A Q4_0 / Q4_1 / Q4_K matrix tensor's grids in the HF layout (rows [out, in])."""
    block_bytes, block_len, read = _GRIDS[t.tensor_type]
    rows, cols = (int(x) for x in reversed(t.shape.tolist()))
    raw = torch.from_numpy(np.array(t.data, copy=True).reshape(-1).view(np.uint8))
    if cols % block_len:  # ggml keeps rows whole blocks: a file that does not is broken
        raise ValueError(f"{t.name}: rows of {cols} are not whole {t.tensor_type.name} blocks")
    q, s, m = read(raw.view(-1, block_bytes))
    groups = cols // 32
    return W4Grid(q.reshape(rows, cols // 2), s.reshape(rows, groups), m.reshape(rows, groups))


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's `permute`: rows (head, dim/2, 2) -> (head, 2, dim/2)."""
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


class GGUFWeights(WeightSource):
    def __init__(self, reader: GGUFReader, config: ModelConfig) -> None:
        self.reader = reader
        self.config = config
        self._tensors: dict[str, ReaderTensor] = {}
        unknown = []
        for t in reader.tensors:
            name = hf_name(t.name)
            if name is None:
                if t.name not in _IGNORED:
                    unknown.append(t.name)
                continue
            if name == "lm_head.weight" and config.tie_word_embeddings:
                continue
            self._tensors[name] = t
        from .loader import check_unused_tensors, expected_weight_names

        order = expected_weight_names(config)
        check_unused_tensors([*unknown, *self._tensors], order, config)
        super().__init__([n for n in order if n in self._tensors])
        self._permute = config.architecture in _PERMUTED_QK_ARCHS

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(d) for d in reversed(self._tensors[name].shape.tolist()))

    def gguf_type(self, name: str) -> GGMLQuantizationType:
        return self._tensors[name].tensor_type

    def stored_in_4bit_groups(self, name: str) -> bool:
        return self.gguf_type(name) in _GRIDS

    def q8_0_rows(self, name: str, start: int, end: int) -> torch.Tensor | None:
        t = self._tensors[name]
        if t.tensor_type != GGMLQuantizationType.Q8_0 or self._permuted_heads(name) is not None:
            return None
        raw = np.asarray(t.data).reshape(-1).view(np.uint8)
        row_bytes = raw.size // self.shape(name)[0]
        part = np.array(raw[start * row_bytes : end * row_bytes], copy=True)
        if isinstance(self.reader, FastGGUFReader):
            self.reader.release(int(t.data_offset) + start * row_bytes, (end - start) * row_bytes)
        return torch.from_numpy(part).view(end - start, row_bytes)

    def w4_grid(self, name: str) -> W4Grid:
        if not self.stored_in_4bit_groups(name):
            return super().w4_grid(name)
        t = self._tensors[name]
        g = w4_grid_of(t)
        if isinstance(self.reader, FastGGUFReader):
            self.reader.release(int(t.data_offset), int(t.n_bytes))
        heads = self._permuted_heads(name)
        return g if heads is None else W4Grid(*(unpermute_qk(x, heads) for x in g))

    def _permuted_heads(self, name: str) -> int | None:
        """The head count whose rows llama.cpp permuted in this tensor (Q, K), else None."""
        if not self._permute:
            return None
        if ".self_attn.q_proj." in name:
            return self.config.num_heads
        if ".self_attn.k_proj." in name:
            return self.config.num_kv_heads
        return None

    def rows(self, name: str, start: int, end: int) -> torch.Tensor:
        t = self._tensors[name]
        if self._permuted_heads(name) is not None:
            return super().rows(name, start, end)  # permuted within heads: whole
        w = dequantize_rows(t, start, end)
        if isinstance(self.reader, FastGGUFReader):
            row_bytes = int(t.n_bytes) // self.shape(name)[0]
            self.reader.release(int(t.data_offset) + start * row_bytes, (end - start) * row_bytes)
        return w

    def _load(self, name: str) -> torch.Tensor:
        t = self._tensors[name]
        w = dequantize_tensor(t)
        if isinstance(self.reader, FastGGUFReader):
            self.reader.release(int(t.data_offset), int(t.n_bytes))
        heads = self._permuted_heads(name)
        return w if heads is None else unpermute_qk(w, heads)


def load_gguf(path: str | Path) -> LoadedModel:
    path = Path(path)
    reader, config, tokenizer, _ = read_gguf_info(path)
    weights = GGUFWeights(reader, config)
    check_weights(config, weights, str(path))
    return LoadedModel(
        config=config,
        weights=weights,
        tokenizer=tokenizer,
        fingerprint=file_fingerprint([path]),
        path=path,
        format="gguf",
    )
