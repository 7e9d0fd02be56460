"""W8 (group 32) x A8 (group 16) GEMM (gemm_a8.c): the 8-bit activation quantiser and the GEMM
against exact integer / numpy references; VNNI against portable bit for bit; which calls the
dispatcher sends to it."""

import numpy as np
import pytest
import torch

from shm_engine.model import kernels as K

HAS_VNNI = K.PATHS[K.best_path()] >= K.PATHS["vnni"]
# the a8 kernels: portable, and VNNI where the CPU has it (paths vnni and amx run it)
A8_PATHS = ["portable"] + (["vnni"] if HAS_VNNI else [])


def packed(n: int, k: int, seed: int, bias: bool = False) -> K.PackedLinear:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(1, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    return K.PackedLinear.from_float(w, b).enable_act8()


def activations(m: int, k: int, seed: int) -> torch.Tensor:
    """Rows with a few large channels, as a model's are."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[:, torch.randint(0, k, (max(1, k // 50),), generator=g)] *= 30
    return x


def ref_quant_a8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """numpy reference: int8 per span of 16 k (fp32, round half to even, NaN -> 0, spans with
    max < 2^-100 zero with scale 0), stored + 128."""
    m, k = x.shape
    kp = -(-k // 32) * 32
    xs = np.zeros((m, kp), np.float32)
    xs[:, :k] = x
    spans = xs.reshape(m, kp // 16, 16)
    amax = np.nanmax(np.abs(spans), axis=-1, initial=0.0).astype(np.float32)
    live = amax >= np.float32(2.0**-100)
    safe = np.where(live, amax, np.float32(1))
    with np.errstate(invalid="ignore", over="ignore"):
        q = np.rint(spans * (np.float32(127) / safe)[..., None])
    q = np.where(np.isnan(q) | ~live[..., None], 0, q).astype(np.int64)
    scales = np.where(live, amax / np.float32(127), np.float32(0)).astype(np.float32)
    return (q + 128).reshape(m, kp).astype(np.uint8), scales


def exact_reference(x: torch.Tensor, p: K.PackedLinear) -> torch.Tensor:
    """float64 from exact int64 dots per span, each times its weight and activation scales."""
    xu, sx = K.quantize_rows_a8(x)
    xq = xu.to(torch.int64)[:, : p.k] - 128
    q, gscale = p.unpack()
    q = q.to(torch.int64)
    y = torch.zeros(x.shape[0], p.n, dtype=torch.float64)
    for s in range(-(-p.k // 16)):
        a, b = 16 * s, min(16 * s + 16, p.k)
        dots = (xq[:, a:b] @ q[:, a:b].T).double()
        y += dots * sx[:, s].double()[:, None] * gscale[:, s // 2].double()[None, :]
    return y + (p.bias.double() if p.bias is not None else 0)


def _edge_rows(k: int) -> torch.Tensor:
    x = activations(7, k, seed=k)
    x[0] = 0  # zeros
    x[1] = 1e-35  # below the smallest usable max
    x[2, ::3] = float("nan")  # NaN elements are skipped by the max and quantise to 0
    x[3, 0] = float("inf")  # its span: scale inf, every element 0
    x[4, : min(k, 16)] = 2.5  # ties: 127 / 2.5 * 2.5 exactly
    x[5] = -x[5]
    return x


@pytest.mark.parametrize("path", A8_PATHS)
@pytest.mark.parametrize("k", [1, 9, 16, 40, 67, 576])
def test_quantize_a8_exact(path, k):
    K.set_path(path)
    x = _edge_rows(k)
    xu, sx = K.quantize_rows_a8(x)
    want_u, want_s = ref_quant_a8(x.numpy())
    assert np.array_equal(xu.numpy(), want_u)
    assert np.array_equal(sx.numpy(), want_s)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(
    "m,n,k", [(1, 16, 32), (3, 17, 7), (9, 40, 70), (33, 960, 576), (70, 50, 1536), (130, 33, 131)]
)
def test_linear_a8_portable_matches_exact_dots(bias, m, n, k):
    K.set_path("portable")
    p = packed(n, k, seed=m * n + k, bias=bias)
    x = activations(m, k, seed=m + n)
    got = K.linear_a8(x, p).double()
    want = exact_reference(x, p)
    # fp32 folds of exact int32 dots: relative error a few ulp of the largest output
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.skipif(not HAS_VNNI, reason="needs AVX512-VNNI")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 16, 17, 24, 25, 70])
@pytest.mark.parametrize("n,k", [(16, 32), (17, 7), (33, 131), (960, 576), (50, 1536)])
def test_linear_a8_vnni_matches_portable_bit_for_bit(threads, bias, m, n, k):
    K.set_num_threads(threads)
    p = packed(n, k, seed=n * k + m, bias=bias)
    x = _edge_rows(k).repeat(-(-m // 7), 1)[:m].contiguous()
    K.set_path("portable")
    want = K.linear_a8(x, p)
    K.set_path("vnni")
    # bits, not values: the inf row's outputs are NaN (scale inf x 0)
    assert torch.equal(K.linear_a8(x, p).view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("path", ["portable", "avx2", "vnni", "amx"])
def test_dispatch_takes_a8_on_vnni_only(path):
    """act8 weights: 8-bit activations at every row count on path vnni (weight sums made inline
    up to 4 rows, once per unit and task above: the same bits); int16 elsewhere."""
    if K.PATHS[path] > K.PATHS[K.best_path()]:
        pytest.skip(f"CPU lacks {path}")
    K.set_path(path)
    plain = K.PackedLinear.from_float(torch.randn(96, 200), act_bf16=False)
    a8 = K.PackedLinear.from_float(plain.dequantized(), act_bf16=False).enable_act8()
    assert torch.equal(a8.packed, plain.packed)
    rows = activations(64, 200, seed=3)
    for m in (1, 2, 4, 5, 16, 64):
        x = rows[:m].contiguous()
        got = K.linear(x, a8)
        if path == "vnni":
            assert torch.equal(got, K.linear_a8(x, a8))
            assert torch.equal(got, K.linear(rows, a8)[:m])  # independent of the batch
            assert not torch.equal(got, K.linear(x, plain))
        else:  # int16 activations: the weight without sums gives the same bits
            assert torch.equal(got, K.linear(x, plain))


def test_linear_a8_checks_k_and_takes_no_rows():
    p = K.PackedLinear.from_float(torch.randn(16, 32))
    with pytest.raises(ValueError, match="features"):
        K.linear_a8(torch.randn(2, 31), p)
    assert K.linear_a8(torch.randn(0, 32), p).shape == (0, 16)
    assert not p.act8 and p.enable_act8() is p and p.act8 and p._c.act8 == 1
