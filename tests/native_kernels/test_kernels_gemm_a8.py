"""W8 x A8 GEMM on rotated groups of 32 k (gemm_a8.c): the 8-bit activation quantiser and the GEMM
against exact integer / numpy references; VNNI against portable bit for bit; the rotation undone
(an act8 weight gives x W^T); which calls the dispatcher sends to it."""

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
    return K.PackedLinear.from_float(w, b, act8=True)


def activations(m: int, k: int, seed: int) -> torch.Tensor:
    """Rows with a few large channels, as a model's are."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[:, torch.randint(0, k, (max(1, k // 50),), generator=g)] *= 30
    return x


def ref_rotate(x: np.ndarray) -> np.ndarray:
    """Each group of 32 columns times the unnormalised Walsh-Hadamard matrix, in fp32
    butterflies of h = 1, 2, 4, 8, 16 (lower a + b, upper a - b): the kernel's order."""
    m, kp = x.shape
    v = x.astype(np.float32).reshape(m, kp // 32, 32)
    h = 1
    with np.errstate(invalid="ignore", over="ignore"):
        while h < 32:
            pairs = v.reshape(m, kp // 32, 32 // (2 * h), 2, h)
            a, b = pairs[..., 0, :], pairs[..., 1, :]
            v = np.stack([a + b, a - b], axis=-2).reshape(m, kp // 32, 32)
            h *= 2
    return v.reshape(m, kp)


def test_ref_rotate_is_the_hadamard_product():
    x = torch.randn(3, 64)
    want = (x.view(3, 2, 32) @ K.hadamard(32)).view(3, 64)
    assert np.allclose(ref_rotate(x.numpy()), want.numpy(), atol=1e-5)


def ref_quant_a8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """numpy reference: each group of 32 k (zero padded) rotated, then int8 per group (fp32,
    round half to even, NaN -> 0, groups with max < 2^-100 zero with scale 0)."""
    m, k = x.shape
    kp = -(-k // 32) * 32
    xs = np.zeros((m, kp), np.float32)
    xs[:, :k] = x
    spans = ref_rotate(xs).reshape(m, kp // 32, 32)
    amax = np.nanmax(np.abs(spans), axis=-1, initial=0.0).astype(np.float32)
    live = amax >= np.float32(2.0**-100)
    safe = np.where(live, amax, np.float32(1))
    with np.errstate(invalid="ignore", over="ignore"):
        q = np.rint(spans * (np.float32(127) / safe)[..., None])
    q = np.where(np.isnan(q) | ~live[..., None], 0, q).astype(np.int64)
    scales = np.where(live, amax / np.float32(127), np.float32(0)).astype(np.float32)
    return q.reshape(m, kp).astype(np.int8), scales


def exact_reference(x: torch.Tensor, p: K.PackedLinear) -> torch.Tensor:
    """float64 from exact int64 dots per group (the padding included: rotated, it is not
    zero), each times its weight and activation scales."""
    xq, sx = K.quantize_rows_a8(x)
    xq = xq.to(torch.int64)
    q, gscale = p.unpack(padded=True)
    q = q.to(torch.int64)
    y = torch.zeros(x.shape[0], p.n, dtype=torch.float64)
    for g in range(p.groups):
        a, b = 32 * g, 32 * g + 32
        dots = (xq[:, a:b] @ q[:, a:b].T).double()
        y += dots * sx[:, g].double()[:, None] * gscale[:, g].double()[None, :]
    return y + (p.bias.double() if p.bias is not None else 0)


def _edge_rows(k: int) -> torch.Tensor:
    x = activations(7, k, seed=k)
    x[0] = 0  # zeros
    x[1] = 1e-35  # below the smallest usable max
    x[2, ::3] = float("nan")  # NaN elements are skipped by the max and quantise to 0
    x[3, 0] = float("inf")  # its group: inf and NaN, scale inf, every element 0
    x[4, : min(k, 32)] = 2.5  # rotated: one 80 (or 2.5 k), the rest 0
    x[6, : min(k, 32)] = torch.arange(min(k, 32)) % 3 - 1.0  # ties after the rotation
    x[5] = -x[5]
    return x


@pytest.mark.parametrize("path", A8_PATHS)
@pytest.mark.parametrize("k", [1, 9, 16, 40, 67, 576])
def test_quantize_a8_exact(path, k):
    K.set_path(path)
    x = _edge_rows(k)
    xq, sx = K.quantize_rows_a8(x)
    want_q, want_s = ref_quant_a8(x.numpy())
    assert np.array_equal(xq.numpy(), want_q)
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


@pytest.mark.parametrize("path", A8_PATHS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m,n,k", [(1, 16, 32), (5, 17, 7), (33, 960, 576), (9, 50, 131)])
def test_act8_weight_undoes_the_rotation(path, bias, m, n, k):
    """W is packed as W H / 32 and the kernel rotates x by H: the product is x W^T, to 8-bit
    rounding (on rows with a few large channels: the rotation spreads them over their group)."""
    K.set_path(path)
    g = torch.Generator().manual_seed(m + n + k)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    x = activations(m, k, seed=k)
    want = torch.nn.functional.linear(x, w, b)
    got = K.linear_a8(x, K.PackedLinear.from_float(w, b, act8=True))
    assert (got - want).abs().max() <= 0.03 * want.abs().max()


@pytest.mark.parametrize("path", ["portable", "avx2", "vnni", "amx"])
def test_dispatch_takes_a8_for_act8_weights(path):
    """act8 weights: 8-bit activations at every row count on every path (the weights are
    packed rotated; weight sums made inline up to 4 rows, once per unit and task above: the
    same bits); other weights never."""
    if K.PATHS[path] > K.PATHS[K.best_path()]:
        pytest.skip(f"CPU lacks {path}")
    K.set_path(path)
    w = torch.randn(96, 200)
    plain = K.PackedLinear.from_float(w, act_bf16=False)
    a8 = K.PackedLinear.from_float(w, act_bf16=False, act8=True)
    assert a8.act8 and a8._c.act8 == 1 and not plain.act8
    # stored rotated and + 128: what reads channels or group dots refuses it
    with pytest.raises(ValueError, match="act8"):
        a8.lookup(torch.tensor([0]))
    with pytest.raises(ValueError, match="act8"):
        K.group_dots(torch.zeros(1, a8.kp, dtype=torch.int16), a8)
    q, _ = a8.unpack(padded=True)
    assert q.abs().max() <= 127  # the offset taken back
    rows = activations(64, 200, seed=3)
    for m in (1, 2, 4, 5, 16, 64):
        x = rows[:m].contiguous()
        got = K.linear(x, a8)
        assert torch.equal(got, K.linear_a8(x, a8))
        assert torch.equal(got, K.linear(rows, a8)[:m])  # independent of the batch
        want = K.linear(x, plain)
        assert not torch.equal(got, want)
        assert (got - want).abs().max() <= 0.03 * want.abs().max()


def test_linear_a8_checks_k_and_takes_no_rows():
    p = K.PackedLinear.from_float(torch.randn(16, 32), act8=True)
    with pytest.raises(ValueError, match="features"):
        K.linear_a8(torch.randn(2, 31), p)
    assert K.linear_a8(torch.randn(0, 32), p).shape == (0, 16)
