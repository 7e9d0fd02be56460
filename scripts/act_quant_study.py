"""How accurate would cheaper activation formats be? A simulation on the fp32 reference.

The int8 kernels multiply int8 weights (a scale per channel and 32 k) by int16 activations
(`vpdpwssd`, 32 MACs an instruction). 8-bit activations (`vpdpbusd`, 64 MACs) would double the
compute-bound GEMMs (prefill, batched decode) but cost accuracy; this script measures how much,
per scheme, as the model tests do: teacher-forced top-1 agreement with fp32 and perplexity, on
several texts, plus the mean KL divergence of the scheme's next-token distributions from fp32's
(far less noisy than top-1 on ~130 tokens a text, where one token is 0.8 points). Each scheme
fake-quantises (quantise, dequantise, fp32 matmul) the inputs of every projection; the LM head
keeps int16 activations.

SmoothQuant (Xiao et al., 2023) divides each input channel j by
s_j = max|x_j|^a / max|W_:,j|^(1 - a) and multiplies the weights' column j by it (exact in real
numbers), moving activation outliers into the weights; the maxima of x come from a calibration
text that is not among the evaluated ones. Projections that share an input (q/k/v, gate/up)
share s, as they would in the fused kernels.

    python scripts/act_quant_study.py            # the default model, all schemes
    python scripts/act_quant_study.py --schemes a16,a8g32-sq0.5
"""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shm_engine.model.eval_texts import CALIBRATION_TEXT, EVAL_TEXTS
from shm_engine.model.kernels import hadamard
from shm_engine.model.loader import load_model
from shm_engine.model.reference import ReferenceModel


@dataclass(frozen=True)
class Scheme:
    """Activations: `bits` (7, 8 or 16), scaled per token or per `group` consecutive k; optional
    SmoothQuant strength `alpha` (with 16 bits too: what the int16 kernel would get from weights
    packed smoothed for an 8-bit one); `int16_down` keeps the down projection's input at 16
    bits; `reorder` sorts each input's channels by their calibrated max |x| (so outlier channels
    share groups); `only` gives 8 bits to one projection kind (qkv, o, gate_up, down); `rotate`
    multiplies each input's blocks of that many k, and the weights' columns alike, by the
    orthonormal Walsh-Hadamard matrix (QuaRot: exact in real numbers, it spreads an outlier over
    its block before the activations are rounded; the rotated weights are quantised again);
    `head8` gives the LM head 8 bits too (rotated like the layers, never smoothed)."""

    name: str
    bits: int
    group: int | None = None
    alpha: float | None = None
    int16_down: bool = False
    reorder: bool = False
    only: str | None = None
    rotate: int | None = None
    head8: bool = False


SCHEMES = {
    s.name: s
    for s in [
        Scheme("a16", 16),
        Scheme("a8", 8),
        Scheme("a8g32", 8, 32),
        Scheme("a8g16", 8, 16),
        Scheme("a8-sq0.5", 8, None, 0.5),
        Scheme("a8g32-sq0.5", 8, 32, 0.5),
        Scheme("a8g32-sq0.6", 8, 32, 0.6),
        Scheme("a8g16-sq0.5", 8, 16, 0.5),
        Scheme("a8g32-sq0.5-down16", 8, 32, 0.5, True),
        Scheme("a8g16-down16", 8, 16, None, True),
        Scheme("a8g16-sq0.5-down16", 8, 16, 0.5, True),
        Scheme("a16-sq0.5", 16, None, 0.5),
        Scheme("a16-perm", 16, None, None, False, True),
        Scheme("a8g16-perm", 8, 16, None, False, True),
        Scheme("a8g16-perm-down16", 8, 16, None, True, True),
        Scheme("a8g32-perm", 8, 32, None, False, True),
        *[Scheme(f"a8g16-{k}-only", 8, 16, only=k) for k in ("qkv", "o", "gate_up", "down")],
        Scheme("a16-sq0.5-rot32", 16, None, 0.5, rotate=32),
        Scheme("a8g16-sq0.5-rot16", 8, 16, 0.5, rotate=16),
        Scheme("a8g32-sq0.5-rot32", 8, 32, 0.5, rotate=32),
        Scheme("a8g32-sq0.4-rot32", 8, 32, 0.4, rotate=32),
        Scheme("a8g32-sq0.6-rot32", 8, 32, 0.6, rotate=32),
        Scheme("a8g32-sq0.5-rot32-down16", 8, 32, 0.5, True, rotate=32),
        Scheme("a8g32-sq0.5-rot32-head8", 8, 32, 0.5, rotate=32, head8=True),
        Scheme("a8g32-rot32", 8, 32, rotate=32),
        Scheme("a8g64-sq0.5-rot64", 8, 64, 0.5, rotate=64),
        Scheme("a8g32-sq0.5-rot64", 8, 32, 0.5, rotate=64),
        Scheme("a8-sq0.5-rot64", 8, None, 0.5, rotate=64),
        # 7 bits: what AVX2's vpmaddubsw takes without saturating (u7 x s8, as fbgemm's
        # reduce_range), 3 vector ops per 32 products against int16's ~4.7
        Scheme("a7g32-sq0.5-rot32", 7, 32, 0.5, rotate=32),
        Scheme("a7g32-rot32", 7, 32, rotate=32),
        Scheme("a7g16-sq0.5-rot16", 7, 16, 0.5, rotate=16),
        Scheme("a7g16-sq0.5-rot32", 7, 16, 0.5, rotate=32),
        Scheme("a7g32-sq0.6-rot32", 7, 32, 0.6, rotate=32),
        Scheme("a7g32-sq0.4-rot32", 7, 32, 0.4, rotate=32),
        Scheme("a7g32-sq0.5-rot32-down16", 7, 32, 0.5, True, rotate=32),
    ]
}


def quantize_weight(w: torch.Tensor) -> torch.Tensor:
    """W8 with a scale per (channel, 32 k), dequantised: what PackedLinear stores."""
    return fake_quant(w, 127, 32)


def rotate_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """x's rows times blockdiag(H, H, ...): each run of `block` k rotated on its own."""
    rows, k = x.shape
    h = hadamard(block) / math.sqrt(block)  # orthonormal: symmetric, h h = I
    return (x.reshape(rows, k // block, block) @ h).reshape(rows, k)


def fake_quant(x: torch.Tensor, limit: int, group: int | None) -> torch.Tensor:
    """Symmetric round-to-nearest to [-limit, limit] per row (or per `group` k of a row)."""
    rows, k = x.shape
    g = group or k
    kp = -(-k // g) * g
    xp = F.pad(x, (0, kp - k)).view(rows, kp // g, g)
    scale = xp.abs().amax(-1, keepdim=True) / limit
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (torch.round(xp / safe) * scale).view(rows, kp)[:, :k]


_SIBLINGS = re.compile(r"^(model\.layers\.\d+)\.(self_attn\.[qkv]_proj|mlp\.(gate|up)_proj)\.")


def input_group(name: str) -> str:
    """Projections that read the same input (q/k/v, gate/up) share one smoothing vector."""
    m = _SIBLINGS.match(name)
    if m is None:
        return name
    return f"{m.group(1)}.{'qkv' if 'attn' in m.group(2) else 'gate_up'}"


class StudyModel(ReferenceModel):
    """The fp32 reference with fake-quantised projections (`scheme`; None: fp32), which can
    record the max |x| per input channel of each projection (`calibrate`)."""

    def __init__(self, config, weights) -> None:  # noqa: ANN001 - as ReferenceModel
        super().__init__(config, weights)
        self.scheme: Scheme | None = None
        self._calibrating = False
        self._group = {w.data_ptr(): input_group(n) for n, w in self.w.items() if w.dim() == 2}
        self._xmax: dict[str, torch.Tensor] = {}
        self._wmax: dict[str, torch.Tensor] = {}
        for w in self.w.values():
            g = self._group.get(w.data_ptr())
            if g is not None and w.shape[0] != config.vocab_size:
                m = w.abs().amax(0)
                self._wmax[g] = torch.maximum(self._wmax[g], m) if g in self._wmax else m
        self._packed: dict[tuple, torch.Tensor] = {}

    def linear(self, x, weight, bias=None):  # noqa: ANN001, ANN201 - as ReferenceModel.linear
        flat = x.reshape(-1, x.shape[-1])
        key = self._group.get(weight.data_ptr())
        if self.scheme is None:
            if self._calibrating:
                m = flat.abs().amax(0)
                self._xmax[key] = torch.maximum(self._xmax[key], m) if key in self._xmax else m
            return F.linear(x, weight, bias)
        s = self.scheme
        head = weight.shape[0] == self.config.vocab_size
        down = weight.shape[1] == self.config.intermediate_size
        bits = 16 if (head and not s.head8) or (down and s.int16_down) else s.bits
        if s.only is not None and not key.endswith(("." + s.only, f".{s.only}_proj.weight")):
            bits = 16
        smooth = ones = torch.ones(weight.shape[1])
        if s.alpha is not None and not head and (bits < 16 or s.bits == 16):
            smooth = self._xmax[key].clamp(min=1e-5) ** s.alpha
            smooth = smooth / self._wmax[key].clamp(min=1e-5) ** (1 - s.alpha)
        perm = None
        if s.reorder and not head:
            perm = torch.argsort(self._xmax[key], descending=True)
        # NOTE: keyed by what was applied: a16-sq's smoothed down projection must not serve a
        # scheme that keeps the down projection unsmoothed at 16 bits
        smoothed = s.alpha if smooth is not ones else None
        rotate = s.rotate if not head or s.head8 else None
        cache_key = (weight.data_ptr(), bits, smoothed, s.reorder, rotate)
        if cache_key not in self._packed:
            w = weight * smooth
            if perm is not None:
                w = w[:, perm]
            if rotate:
                w = rotate_blocks(w, rotate)
            self._packed[cache_key] = quantize_weight(w)
        xs = flat / smooth
        if perm is not None:
            xs = xs[:, perm]
        if rotate:
            xs = rotate_blocks(xs, rotate)
        xq = fake_quant(xs, 2 ** (bits - 1) - 1, s.group if bits < 16 else None)
        y = F.linear(xq, self._packed[cache_key], bias)
        return y.reshape(*x.shape[:-1], -1)

    def calibrate(self, ids: list[int]) -> None:
        self.scheme, self._calibrating = None, True
        self.forward(ids)
        self._calibrating = False


def perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    return math.exp(F.cross_entropy(logits[:-1], torch.tensor(ids[1:])).item())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2)")
    ap.add_argument("--schemes", default=",".join(SCHEMES), help="comma-separated scheme names")
    args = ap.parse_args()
    schemes = [SCHEMES[n] for n in args.schemes.split(",")]
    loaded = load_model(args.model)
    model = StudyModel(loaded.config, loaded.weights)
    tok = loaded.tokenizer
    texts = [tok.encode(t) for t in EVAL_TEXTS]
    model.calibrate(tok.encode(CALIBRATION_TEXT))
    expected = [model.forward(ids) for ids in texts]
    print(f"{len(texts)} texts, {sum(len(t) - 1 for t in texts)} predicted tokens")
    print(f"{'scheme':22s} {'top-1 (pooled)':>14s}  per text                      ppl ratio")
    for s in schemes:
        model.scheme = s
        agree, total, per_text, ratios, kl = 0, 0, [], [], 0.0
        for ids, want in zip(texts, expected, strict=True):
            got = model.forward(ids)
            same = int((got.argmax(-1) == want.argmax(-1)).sum())
            agree, total = agree + same, total + len(ids)
            per_text.append(same / len(ids))
            ratios.append(perplexity(got, ids) / perplexity(want, ids))
            kl += float(
                F.kl_div(
                    got.log_softmax(-1), want.log_softmax(-1), log_target=True, reduction="sum"
                )
            )
        texts_s = " ".join(f"{a:.3f}" for a in per_text)
        ratio_s = " ".join(f"{r:.3f}" for r in ratios)
        print(f"{s.name:22s} {agree / total:14.4f}  {texts_s}   {ratio_s}  KL {kl / total:.5f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
