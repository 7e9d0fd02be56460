"""W4 x A8 (gemm_w4a8.c): the activations' 8-bit quantisation per 16 k against a torch
transcription of its contract, and the GEMM against float64 math on those activations, bit
for bit across paths and row counts (threads: test_kernels_w4.py)."""

import pytest
import torch

from shm_engine.model import kernels as K
from shm_engine.model.loader import W4Grid

from .test_kernels_gemm import PATHS
from .test_kernels_w4 import grow, q4_1_weights


def quantize_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The contract in torch fp32: per 16 k (zero padded) s = max|x| / 127 (NaN ignored),
    q = rint(x * (127 / max|x|)) (NaN -> 0), zeros where max|x| < 2^-100; each group's sum
    fmaf(s_hi, sum_hi, s_lo sum_lo) (in float64, then rounded: exact for these magnitudes)."""
    m, k = x.shape
    kp = K.padded_k(k)
    xp = torch.zeros(m, kp)
    xp[:, :k] = x
    h = xp.view(m, kp // 16, 16)
    amax = torch.nan_to_num(h.abs(), nan=0.0, posinf=float("inf")).amax(-1, keepdim=True)
    live = amax >= 2.0**-100
    inv = torch.tensor(127.0) / torch.where(live, amax, torch.ones_like(amax))
    q = torch.nan_to_num(torch.round(h * inv), nan=0.0)
    q = torch.where(live, q, torch.zeros_like(q)).to(torch.int8)
    s = torch.where(live, amax / 127.0, torch.zeros_like(amax)).squeeze(-1)
    sums = q.long().sum(-1).view(m, -1, 2).double()
    sd = s.view(m, -1, 2).double()
    lo = (sd[..., 0] * sums[..., 0]).float().double()  # s_lo * sum_lo rounds to fp32 first
    return q.view(m, kp), s, (sd[..., 1] * sums[..., 1] + lo).float()


def w4a8_reference(x: torch.Tensor, p: K.PackedLinear, bias=None) -> torch.Tensor:
    """The GEMM's contract in float64 on the quantised activations: sum_g s_g (s_lo dot_lo +
    s_hi dot_hi) + xs_g m_g (+ bias), scale_mult included in the unpacked s and m."""
    xq, sx, xs = K.quantize_rows_w4a8(x)
    m, kp = xq.shape
    u, s, mins = p.unpack_w4(padded=True)
    xd = (xq.double().view(m, -1, 16) * sx.double()[..., None]).view(m, kp)
    y = xd @ (u.double() * grow(s.double(), kp)).T + xs.double() @ mins.double().T
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("path", PATHS)
def test_quantise_per_16_matches_the_contract(path):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 100, generator=g) * 5
    x[1, 3] = float("nan")  # ignored by its half's max, quantised to 0
    x[2] = 1e-29  # tiny, but above 2^-100 (7.9e-31): still scaled
    x[2, 50] = float("inf")  # its half: scale inf, every q 0 (inf * 0 is NaN), group sum NaN
    x[3, 32:48] = 1e-31  # a half below 2^-100: zeros, scale 0
    x[4, 40] = 1e4  # an outlier only costs its own half
    x[5, :] = 0.0
    K.set_path(path)
    got = K.quantize_rows_w4a8(x)
    want = quantize_reference(x)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(got[2][2, 1]) and int(got[0][2, 48:64].abs().max()) == 0
    assert int(got[0].abs().max()) == 127 and torch.equal(got[0][:, 100:], torch.zeros(6, 28))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    "m,n,k",
    [(1, 17, 7), (2, 50, 100), (3, 960, 576), (4, 40, 1536), (5, 33, 131), (6, 8, 32),
     (9, 64, 64), (13, 20, 48), (3, 40, 1536), (40, 50, 1536), (6, 700, 1536),
     (130, 300, 64)],
)  # fmt: skip
def test_w4a8_linear_matches_float64_contract_and_portable(path, m, n, k):
    g = torch.Generator().manual_seed(m * n + k)
    w, b = torch.randn(n, k, generator=g) * 0.05, torch.randn(n, generator=g)
    x = torch.randn(m, k, generator=g)
    x[0, k // 2] = 30.0  # an outlier: 8 bits per 16 k keep it from the rest of the row
    p = K.PackedLinear.from_float(w, b, w4=True, act8=True)
    K.set_path("portable")
    want = K.linear(x, p)
    K.set_path(path)
    y = K.linear(x, p)
    assert torch.equal(y, want)
    torch.testing.assert_close(y.double(), w4a8_reference(x, p, b), rtol=1e-5, atol=1e-5)
    # and near the float product of the weights it holds: 8-bit activations' error
    exact = x @ p.dequantized().T + b
    assert ((y - exact).abs().max() / (x @ w.T).abs().max()).item() < 0.02


def test_w4a8_rows_do_not_depend_on_their_batch():
    """Every row count takes this kernel, so a token's output is the same alone or batched."""
    g = torch.Generator().manual_seed(7)
    p = K.PackedLinear.from_float(torch.randn(70, 200, generator=g), w4=True, act8=True)
    x = torch.randn(11, 200, generator=g)
    batched = K.linear(x, p)
    for i in range(11):
        assert torch.equal(K.linear(x[i : i + 1], p)[0], batched[i])


def test_w4a8_on_gguf_grids_and_the_weight_is_packed_as_ever():
    w = q4_1_weights(48, 96, 5)
    plain = K.PackedLinear.from_float(w, w4=True)
    a8 = K.PackedLinear.from_float(w, w4=True, act8=True)
    grid = K.PackedLinear.from_w4_grid(*W4Grid.from_values(*plain.unpack_w4()), act8=True)
    assert a8.act8 and grid.act8 and "act8" in repr(a8)
    for p in (a8, grid):
        assert torch.equal(p.packed, plain.packed) and torch.equal(p.dequantized(), w)
        assert torch.equal(p.unpack()[0], plain.unpack()[0])
    x = torch.randn(3, 96)
    assert torch.equal(K.linear(x, a8), K.linear(x, grid))
    # a NaN activation is ignored by its half's max and quantises to 0: as a 0 would
    zero = x.clone()
    zero[1, 5] = 0.0
    x[1, 5] = float("nan")
    y = K.linear(x, a8)
    assert torch.isfinite(y).all() and torch.equal(y, K.linear(zero, a8))
