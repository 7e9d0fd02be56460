"""W4 (group-32, affine) weights: packing against the Q4_0 / Q4_1 grids it must reproduce, and
the GEMM against float64 math on exact integer dots, bit for bit across paths and threads."""

import pytest
import torch

from shm_engine.model import kernels as K

from .test_kernels_gemm import PATHS, ref_group_dots


def grow(t: torch.Tensor, k: int) -> torch.Tensor:
    """[n, groups] -> [n, k]: each group's value over its 32 k."""
    return t.repeat_interleave(32, dim=1)[:, :k]


def q4_1_weights(n: int, k: int, seed: int) -> torch.Tensor:
    """Weights on llama.cpp Q4_1 grids (fp16 d and m; u 0 and 15 in every group, as its
    quantiser makes them): w = d u + m, computed in fp32 as the gguf package dequantises."""
    g = torch.Generator().manual_seed(seed)
    groups = (k + 31) // 32
    u = torch.randint(0, 16, (n, groups * 32), generator=g)
    u[:, ::32], u[:, 1::32] = 0, 15
    d = (torch.rand(n, groups, generator=g) * 0.02 + 1e-3).half().float()
    m = (-torch.rand(n, groups, generator=g) * 0.2).half().float()
    return (u[:, :k].float() * grow(d, k) + grow(m, k)).contiguous()


def q4_0_weights(n: int, k: int, seed: int) -> torch.Tensor:
    """Weights on Q4_0 grids: w = d (q - 8), q in [0, 15] with 0 in every group (the element
    of largest |w|, d = that element / -8); d of either sign."""
    g = torch.Generator().manual_seed(seed)
    groups = (k + 31) // 32
    q = torch.randint(1, 16, (n, groups * 32), generator=g)
    q[:, ::32] = 0
    d = ((torch.rand(n, groups, generator=g) - 0.5) * 0.04).half().float()
    return ((q[:, :k].float() - 8) * grow(d, k)).contiguous()


@pytest.mark.parametrize("n,k", [(1, 1), (16, 32), (17, 7), (40, 70), (96, 576), (33, 1536)])
def test_w4_packs_gguf_q4_grids_back_exactly(n, k):
    for w in (q4_1_weights(n, k, n + k), q4_0_weights(n, k, n * k)):
        p = K.PackedLinear.from_float(w, w4=True)
        assert torch.equal(p.dequantized(), w)
        u, s, m = p.unpack_w4()
        assert u.dtype == torch.uint8 and int(u.max()) <= 15


def test_w4_error_on_gaussian_weights_and_edge_groups():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 200, generator=g)
    w[1] = 0.0  # a zero channel: scale 0, minimum 0
    w[2] = 0.37  # a constant channel: its minimum alone, exact
    w[3, :32] = float("nan")  # NaN packs as 0, as W8 does
    p = K.PackedLinear.from_float(w, w4=True)
    d = p.dequantized()
    assert torch.equal(d[1], w[1]) and torch.allclose(d[2], w[2], rtol=1e-3)
    assert torch.equal(d[3, :32], torch.zeros(32))
    rows = slice(4, None)
    # 16 levels over each group's range: ~8 % relative RMS on Gaussian groups (Q4_1's error)
    assert ((d[rows] - w[rows]).norm() / w[rows].norm()).item() < 0.1
    assert p.nbytes == p.packed.numel() + 4 * p.scales.numel()
    assert p.packed.numel() == 64 * 224 // 2


def w4_reference(x: torch.Tensor, p: K.PackedLinear, bias=None) -> torch.Tensor:
    """The GEMM's contract in float64: sx (sum_g dot_g s_g + xsum_g m_g) (+ bias)."""
    xq, sx = K.quantize_rows(x)
    u, s, m = p.unpack_w4()
    dots = ref_group_dots(xq, u.long()).double()
    xsum = xq.long().view(x.shape[0], -1, 32).sum(-1).double()
    acc = (dots * s.double()[None]).sum(-1) + xsum @ m.double().T
    y = acc * sx.double()[:, None]
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    "m,n,k",
    [(1, 17, 7), (2, 50, 100), (3, 960, 576), (4, 40, 1536), (5, 33, 131), (9, 64, 64),
     (40, 50, 1536), (130, 300, 64)],
)  # fmt: skip
def test_w4_linear_matches_float64_contract_and_portable(path, m, n, k):
    g = torch.Generator().manual_seed(m * n + k)
    w, b = torch.randn(n, k, generator=g) * 0.05, torch.randn(n, generator=g)
    x = torch.randn(m, k, generator=g)
    p = K.PackedLinear.from_float(w, b, w4=True)
    K.set_path("portable")
    want = K.linear(x, p)
    K.set_path(path)
    y = K.linear(x, p)
    assert torch.equal(y, want)
    torch.testing.assert_close(y.double(), w4_reference(x, p, b), rtol=1e-5, atol=1e-5)
    # and near the float product of the weights it holds
    exact = x @ p.dequantized().T + b
    assert ((y - exact).abs().max() / (x @ w.T).abs().max()).item() < 1e-3


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("m", [1, 2, 3, 5, 17])
def test_w4_group_dots_are_exact_on_u(path, m):
    g = torch.Generator().manual_seed(m)
    p = K.PackedLinear.from_float(torch.randn(40, 100, generator=g), w4=True)
    xq = torch.randint(-32767, 32768, (m, p.kp), generator=g, dtype=torch.int16)
    xq[:, 100:] = 0
    K.set_path(path)
    u, _, _ = p.unpack_w4()
    assert torch.equal(K.group_dots(xq, p).long(), ref_group_dots(xq, u.long()))


@pytest.mark.parametrize("act8", [False, True])  # int16 activations, or gemm_w4a8.c
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 64, 300])
def test_w4_threads_identical(m, act8):
    g = torch.Generator().manual_seed(m)
    w, x = torch.randn(1000, 300, generator=g), torch.randn(m, 300, generator=g)
    p = K.PackedLinear.from_float(w, w4=True, act8=act8)
    K.set_num_threads(1)
    y1 = K.linear(x, p)
    for threads in (2, 3):
        K.set_num_threads(threads)
        assert torch.equal(K.linear(x, p), y1)


def test_w4_refuses_what_it_cannot_serve():
    w = torch.randn(32, 64)
    p = K.PackedLinear.from_float(w, w4=True)
    with pytest.raises(ValueError, match="W8 weights only"):
        p.lookup(torch.tensor([0]))
    with pytest.raises(ValueError, match="packed must have shape"):
        K.PackedLinear(32, 64, torch.zeros(32 * 64, dtype=torch.int8), p.scales, 1.0, mins=p.mins)
    with pytest.raises(ValueError, match="mins must have shape"):
        K.PackedLinear(32, 64, p.packed, p.scales, 1.0, mins=p.mins[:-1].contiguous())
    with pytest.raises(ValueError, match="not a W4 weight"):
        K.PackedLinear.from_float(w).unpack_w4()
    # the readers of plain W8 bytes refuse W4 buffers (half as long: they read past them)
    with pytest.raises(ValueError, match="W8 weights only"):
        K.linear_a8(torch.randn(2, 64), p)
    norm = torch.ones(64)
    with pytest.raises(ValueError, match="plain W8 weight"):
        K.ModelEnds(p, norm, 1e-5, p)
    act8 = K.PackedLinear.from_float(w, act8=True)
    with pytest.raises(ValueError, match="plain W8 weight"):
        K.ModelEnds(act8, norm, 1e-5, K.PackedLinear.from_float(w))
    K.ModelEnds(K.PackedLinear.from_float(w), norm, 1e-5, p)  # a W4 LM head is a plain linear
