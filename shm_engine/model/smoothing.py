"""SmoothQuant (Xiao et al., 2023) folded into a Llama layer's weights at load.

Each linear input channel j is divided by s_j = max|x_j|^a / max|W_:,j|^(1 - a) and the
weight's column j multiplied by it: exact in real numbers, but activation outliers move into
the weights, which quantise per 32 k and take them far better than a per-token (int16) or
per-16-k (int8) activation scale does. On SmolLM2 (alpha 0.5; tests/model/test_int8_model.py)
the mean KL divergence of next-token distributions from fp32 falls from 0.0012 to 0.0007 with
int16 activations, and int8 ones get 0.0011 instead of 0.0025. The engine smooths for its
opt-in int8 activations (docs/kernels.md has why not for int16).

The divisions cost nothing at run time: they fold into what produces each input. qkv and
gate_up read an RMSNorm output (its weight / s); o reads attention outputs, weighted sums of V
rows (v_proj's output channel / s, one s per KV head channel, shared by the query heads of a
group); down reads SiLU(gate) x up (up_proj's output channel / s). The maxima of x come from one
forward of a fixed calibration text (``LayerCalibrator``, model/eval_texts.py), layer by layer,
on the unsmoothed int16 kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from shm_engine.model import kernels

if TYPE_CHECKING:
    from shm_engine.model.loader import W4Grid

ALPHA = 0.5
_FLOOR = 1e-5  # maxima below this (dead channels) count as this


@dataclass(frozen=True)
class LayerWeights:
    """fp32 tensors of one decoder layer as Int8Llama packs them: qkv rows [q | k | v],
    gate_up rows [gate | up]; a 4-bit linear may come as the file's grids (never smoothed)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: torch.Tensor | W4Grid
    qkv_bias: torch.Tensor | None
    o: torch.Tensor | W4Grid
    gate_up: torch.Tensor | W4Grid
    down: torch.Tensor | W4Grid
    # Qwen3's per-head norms of q and k [head_dim]; smoothing leaves them (it scales no q or k
    # row, only v's and the input channels)
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None


def factors(xmax: torch.Tensor, wmax: torch.Tensor, alpha: float = ALPHA) -> torch.Tensor:
    """s = max|x|^alpha / max|W|^(1 - alpha), per input channel."""
    return xmax.clamp(min=_FLOOR) ** alpha / wmax.clamp(min=_FLOOR) ** (1 - alpha)


def smooth_layer(
    lw: LayerWeights,
    act_max: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    alpha: float = ALPHA,
) -> None:
    """Smooth each linear's input, given ``act_max`` = the max |x| per input channel of qkv, o,
    gate_up and down in one vector (LayerStep's act_max layout). In place: ``lw``'s tensors
    must be its own (the load's peak RSS has no room for a second copy of a layer in fp32)."""
    h = lw.input_norm.numel()
    hqd, hkd, ffn = num_heads * head_dim, num_kv_heads * head_dim, lw.down.shape[1]
    x_qkv, x_o, x_gu, x_down = act_max.split([h, hqd, h, ffn])
    s_qkv = factors(x_qkv, lw.qkv.abs().amax(0), alpha)
    s_gu = factors(x_gu, lw.gate_up.abs().amax(0), alpha)
    s_down = factors(x_down, lw.down.abs().amax(0), alpha)
    # o's input channel (query head, d) is a weighted sum of V channel (its KV head, d): one s
    # per KV channel, from the maxima over the query heads that share it
    group = num_heads // num_kv_heads

    def per_kv(v: torch.Tensor) -> torch.Tensor:
        return v.view(num_kv_heads, group, head_dim).amax(1).reshape(hkd)

    s_kv = factors(per_kv(x_o), per_kv(lw.o.abs().amax(0)), alpha)
    s_o = s_kv.view(num_kv_heads, 1, head_dim).expand(-1, group, -1).reshape(hqd)

    # NOTE: every s comes from the unmodified weights above; the products below compose
    # (qkv's v rows / s_kv and columns x s_qkv; gate_up's up rows / s_down and columns x s_gu).
    lw.input_norm.div_(s_qkv)
    lw.post_norm.div_(s_gu)
    lw.qkv.mul_(s_qkv[None, :])
    lw.qkv[hqd + hkd :].div_(s_kv[:, None])
    if lw.qkv_bias is not None:
        lw.qkv_bias[hqd + hkd :].div_(s_kv)
    lw.o.mul_(s_o[None, :])
    lw.gate_up.mul_(s_gu[None, :])
    lw.gate_up[ffn:].div_(s_down[:, None])
    lw.down.mul_(s_down[None, :])


class LayerCalibrator:
    """Runs the calibration text's hidden states through the layers one at a time: ``maxima``
    of a layer's linear inputs, then ``advance`` through the layer as it will be used."""

    def __init__(self, hidden: torch.Tensor, probe: kernels.LlamaLayer, cos_sin, scale: float):
        t = hidden.shape[0]
        self.hidden = hidden.contiguous()
        bs = 16
        blocks = -(-t // bs)
        hk, d = probe.num_kv_heads, probe.head_dim
        self.k = torch.zeros(blocks, hk, bs, d)
        self.v = torch.zeros(blocks, hk, bs, d)
        self.dims = probe.hidden, probe.num_heads * d, probe.ffn
        scratch = kernels.LayerScratch(probe, t)
        positions = torch.arange(t)

        def step(act_max: torch.Tensor | None) -> kernels.LayerStep:
            return kernels.LayerStep(
                positions=positions,
                slot_mapping=positions,
                block_table=torch.arange(blocks, dtype=torch.int32)[None, :],
                seq_lens=torch.tensor([t], dtype=torch.int32),
                query_start_loc=torch.tensor([0, t], dtype=torch.int32),
                cos_sin=cos_sin,
                num_blocks=blocks,
                block_size=bs,
                scale=scale,
                scratch=scratch,
                act_max=act_max,
            )

        self._step = step

    def maxima(self, layer: kernels.LlamaLayer) -> torch.Tensor:
        h, hqd, ffn = self.dims
        act_max = torch.zeros(2 * h + hqd + ffn)
        kernels.llama_layer_forward(layer, self._step(act_max), self.hidden.clone(), self.k, self.v)
        return act_max

    def advance(self, layer: kernels.LlamaLayer) -> None:
        kernels.llama_layer_forward(layer, self._step(None), self.hidden, self.k, self.v)
