"""W8 (group 32) x A16 packing, activation quantisation and GEMM against exact integer / numpy
references; every dispatch path against the portable one."""

import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from shm_engine.model import kernels as K

# the int16-activation paths (bit-identical to each other); "amx" has its own tests below
PATHS = [p for p in ("portable", "avx2", "vnni") if K.PATHS[p] <= K.PATHS[K.best_path()]]
HAS_AMX = K.best_path() == "amx"
SHAPES = [
    (1, 1),
    (3, 5),
    (16, 4),
    (17, 7),
    (33, 131),
    (96, 64),
    (100, 257),
    (960, 576),
    (576, 1536),
]


def ref_quant(x: np.ndarray):
    """numpy reference of the symmetric per-row int16 quantisation (fp32, round half to even)."""
    x = x.astype(np.float32)
    amax = np.abs(x).max(axis=1).astype(np.float32)
    inv = np.where(amax > 0, np.float32(32767) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.clip(np.rint(x * inv[:, None]), -32767, 32767).astype(np.int16)
    return q, (amax / np.float32(32767)).astype(np.float32)


def rand_w(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.1
    if n > 2:
        w[1] = 0.0  # an all-zero channel: scale 0, q 0
    if k > 40:
        w[0, 32:64] *= 1e-3  # a small group keeps its own scale
    return w


def ref_group_dots(xq: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Exact int64 reference: dots[i, j, g] = sum over k in group g of xq[i, k] * q[j, k]."""
    m, kp = xq.shape
    n, k = q.shape
    qp = torch.zeros(n, kp, dtype=torch.int64)
    qp[:, :k] = q
    return torch.einsum("igk,jgk->ijg", xq.long().view(m, -1, 32), qp.view(n, -1, 32))


@pytest.mark.parametrize("n,k", SHAPES)
def test_pack_matches_reference(n, k):
    w = rand_w(n, k, n * 1000 + k)
    p = K.PackedLinear.from_float(w)
    q, s = p.unpack()
    G = K.padded_k(k) // 32
    assert K.padded_k(k) % 32 == 0 and s.shape == (n, G)
    assert p.packed.numel() == -(-n // 16) * 16 * K.padded_k(k)
    assert p.scales.numel() == -(-n // 16) * 16 * G
    # every group scale is ~max|w| / 127 (fp16 rounding), and q = rint(w / s) in [-127, 127]
    wp = torch.zeros(n, G * 32)
    wp[:, :k] = w
    amax = wp.view(n, G, 32).abs().amax(-1)
    torch.testing.assert_close(s, amax / 127, rtol=1e-3, atol=0)
    s_k = s.repeat_interleave(32, dim=1)[:, :k]
    ref = torch.where(s_k > 0, torch.round(w / torch.where(s_k > 0, s_k, 1)), 0).clamp(-127, 127)
    assert torch.equal(q.float(), ref)
    assert bool((q.abs() <= 127).all()) and bool((s[1] == 0).all() if n > 2 else True)
    torch.testing.assert_close(p.dequantized(), w, rtol=0, atol=float(amax.max()) / 127 * 0.51)


def test_pack_rounds_ties_to_even_and_packs_nan_as_zero():
    """A group with max |w| 127 has scale exactly 1, so w / s lands on every kind of tie; NaN
    weights are left out of their group's max and pack as 0."""
    ties = [0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5, 3.4999998, 127.0]
    w = torch.zeros(2, 64)
    w[0, : len(ties)] = torch.tensor(ties)
    w[1, :4] = torch.tensor([float("nan"), 1.0, -127.0, float("nan")])
    w[1, 40] = float("nan")
    q, s = K.PackedLinear.from_float(w).unpack()
    assert s[0, 0] == 1 and s[1, 0] == 1 and s[1, 1] == 0
    assert q[0, : len(ties)].tolist() == [0, 2, 2, 0, -2, -2, 126, -126, 3, 127]
    assert q[1, :4].tolist() == [0, 1, -127, 0] and q[1, 40] == 0


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("m,k", [(1, 1), (1, 576), (3, 7), (5, 130), (13, 64), (64, 9), (67, 33)])
def test_quantize_rows_exact(path, m, k):
    K.set_path(path)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + k)) * 3
    if m > 2:
        x[2] = 0.0
    xq, s = K.quantize_rows(x)
    q_ref, s_ref = ref_quant(x.numpy())
    assert xq.shape == (m, K.padded_k(k)) and xq.dtype == torch.int16
    np.testing.assert_array_equal(xq[:, :k].numpy(), q_ref)
    assert bool((xq[:, k:] == 0).all())
    np.testing.assert_array_equal(s.numpy(), s_ref)


def _edge_rows(k: int) -> torch.Tensor:
    """Rows at the quantiser's edges: tiny (32767 / max|x| overflows), NaN, inf, zero."""
    nan, inf = float("nan"), float("inf")
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(k))
    x[0] = 0.0
    x[0, 0], x[0, k // 2] = 1e-36, -1e-36  # max|x| < 32767 / FLT_MAX, zeros beside
    x[1] *= 1e-36  # tiny, no zero
    x[2, 3] = nan  # NaN in the 8-wide part of the max
    x[3, k - 1] = nan  # NaN last (the scalar tail for most k)
    x[4] = nan  # only NaN
    x[5, k // 3] = -inf  # max inf: every element 0, scale inf
    x[6] = 0.0
    x[7] *= 2.0**-99  # just above the "tiny" limit: quantised as usual
    return x


@pytest.mark.parametrize("k", [9, 40, 67])
def test_quantize_edge_rows_same_on_every_path(k):
    """Tiny rows quantise to zeros with scale 0 (32767 / max|x| used to overflow to inf: signs
    flipped on AVX2, NaN cast to int16 in C); NaN elements never set the scale and quantise to
    0 (AVX2's max had taken the NaN as the row's max); bit-identical on every path."""
    x = _edge_rows(k)
    res = {}
    for path in PATHS:
        K.set_path(path)
        res[path] = K.quantize_rows(x)
    xq, s = res["portable"]
    for path in PATHS:
        assert torch.equal(res[path][0], xq), path
        assert torch.equal(res[path][1], s), path
    for r in (0, 1, 4, 5, 6):
        assert bool((xq[r] == 0).all()), r
    assert s[[0, 1, 4, 6]].tolist() == [0.0] * 4 and s[5].item() == float("inf")
    # NaN elements: 0, the rest as if they were 0; the last rows as the reference has them
    clean = torch.nan_to_num(x[[2, 3, 7, 8]], nan=0.0)
    q_ref, s_ref = ref_quant(clean.numpy())
    np.testing.assert_array_equal(xq[[2, 3, 7, 8], :k].numpy(), q_ref)
    np.testing.assert_array_equal(s[[2, 3, 7, 8]].numpy(), s_ref)
    assert bool((xq[:, k:] == 0).all())


def test_linear_edge_rows_same_on_every_path():
    x = _edge_rows(67)
    g = torch.Generator().manual_seed(3)
    p = K.PackedLinear.from_float(torch.randn(40, 67, generator=g), torch.randn(40, generator=g))
    K.set_path("portable")
    want = K.linear(x, p)
    assert torch.equal(want[[0, 1, 4, 6]], p.bias.expand(4, -1))  # zeros in: bias out
    assert bool(want[[2, 3, 7, 8]].isfinite().all()) and bool(want[5].isnan().all())
    for path in PATHS:
        K.set_path(path)
        torch.testing.assert_close(K.linear(x, p), want, rtol=0, atol=0, equal_nan=True)


def test_packed_linear_checks_its_buffers():
    """The constructor hands raw pointers to C: the buffers are checked against n and k."""
    n, k = 20, 40
    g = torch.Generator().manual_seed(9)
    good = K.PackedLinear.from_float(torch.randn(n, k, generator=g), torch.randn(n, generator=g))
    pk, sc, mult, b = good.packed, good.scales, good.scale_mult, good.bias
    x = torch.randn(3, k, generator=g)
    assert torch.equal(K.linear(x, K.PackedLinear(n, k, pk, sc, mult, b)), K.linear(x, good))
    args = dict(n=n, k=k, packed=pk, scales=sc, scale_mult=mult, bias=b)
    cases = [
        (dict(packed=pk[:16].clone()), ValueError, "packed must have shape"),
        (dict(packed=torch.cat([pk, pk[:1]])), ValueError, "packed must have shape"),
        (dict(packed=pk.view(torch.uint8)), TypeError, "packed must have dtype"),
        (dict(packed=pk.view(32, -1)), ValueError, "packed must be 1-D"),
        (dict(packed=pk.repeat_interleave(2)[::2]), ValueError, "packed must be contiguous"),
        (dict(packed=torch.empty_like(pk, device="meta")), ValueError, "packed must be a CPU"),
        (dict(packed=pk.tolist()), TypeError, "packed must be a torch.Tensor"),
        (dict(scales=sc[:4].clone()), ValueError, "scales must have shape"),
        (dict(scales=sc.view(torch.float16)), TypeError, "scales must have dtype"),
        (dict(bias=torch.zeros(3)), ValueError, "bias must have shape"),
        (dict(bias=b.double()), TypeError, "bias must have dtype"),
        (dict(n=n + 16), ValueError, "packed must have shape"),
        (dict(k=k + 32), ValueError, "packed must have shape"),
        (dict(n=0), ValueError, ">= 1"),
        (dict(scale_mult=float("nan")), ValueError, "scale_mult"),
    ]
    for change, err, match in cases:
        with pytest.raises(err, match=match):
            K.PackedLinear(**(args | change))
    assert K.PackedLinear(**(args | dict(bias=None))).bias is None


def _rand_int(shape, lim, seed, extreme=False):
    g = torch.Generator().manual_seed(seed)
    if extreme:  # largest products: every |value| at its limit
        return torch.randint(0, 2, shape, generator=g, dtype=torch.int64) * (2 * lim) - lim
    return torch.randint(-lim, lim + 1, shape, generator=g, dtype=torch.int64)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("extreme", [False, True])
@pytest.mark.parametrize("n,k", [(1, 1), (17, 7), (33, 131), (960, 576), (50, 1536)])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 9, 17, 70])
def test_group_dots_exact_int64(path, extreme, n, k, m):
    """Raw int32 group dot products equal an exact int64 reference on every path."""
    K.set_path(path)
    # build the weight so that its quantisation is exactly q: a +-127 in every group
    q = _rand_int((n, k), 127, n + k, extreme)
    q[:, ::32] = 127
    p = K.PackedLinear.from_float(q.float())
    assert torch.equal(p.unpack()[0].long(), q)
    xq = torch.zeros(m, K.padded_k(k), dtype=torch.int16)
    xq[:, :k] = _rand_int((m, k), 32767, 7 * m + k, extreme).to(torch.int16)
    assert torch.equal(K.group_dots(xq, p).long(), ref_group_dots(xq, q))


@pytest.mark.parametrize("path", [p for p in PATHS if p != "portable"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(
    "m,n,k",
    [(1, 17, 7), (2, 50, 100), (3, 960, 576), (9, 33, 131), (40, 50, 1536), (130, 3072, 64),
     (1024, 40, 33)],
)  # fmt: skip
def test_linear_paths_match_portable(path, bias, m, n, k):
    g = torch.Generator().manual_seed(m * n + k)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(m, k, generator=g)
    p = K.PackedLinear.from_float(w, b)
    K.set_path("portable")
    ref = K.linear(x, p)
    K.set_path(path)
    assert torch.equal(K.linear(x, p), ref)


@pytest.mark.parametrize("m,n,k", [(1, 576, 576), (7, 17, 5), (1024, 96, 200)])
def test_linear_dequant_reference(m, n, k):
    """y = sx * sum_g dot_g * s_g + bias, against float64 math on the exact group dots."""
    g = torch.Generator().manual_seed(m + n + k)
    w = torch.randn(n, k, generator=g) * 0.05
    b = torch.randn(n, generator=g)
    x = torch.randn(m, k, generator=g)
    p = K.PackedLinear.from_float(w, b)
    K.set_path(PATHS[-1])
    y = K.linear(x, p)
    xq, sx = K.quantize_rows(x)
    q, s = p.unpack()
    dots = ref_group_dots(xq, q).double()
    ref = (dots * s.double()[None]).sum(-1) * sx.double()[:, None] + b.double()
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    # and close to the fp32 product (int8 group-32 weights, int16 activations)
    exact = x @ w.T + b
    err = (y - exact).abs().max() / (x @ w.T).abs().max()
    assert err < 0.01


def bf16_reference(x: torch.Tensor, p: K.PackedLinear) -> torch.Tensor:
    """float64 math of the AMX contract: bf16(x) times the exact int8 weights per group, group
    scales applied per group, then scale_mult folded in by unpack(), plus bias."""
    q, s = p.unpack()
    xb = x.to(torch.bfloat16).double()
    kp = p.kp
    xp = torch.zeros(x.shape[0], kp, dtype=torch.float64)
    xp[:, : p.k] = xb
    qp = torch.zeros(p.n, kp, dtype=torch.float64)
    qp[:, : p.k] = q.double()
    dots = torch.einsum("igk,jgk->ijg", xp.view(x.shape[0], -1, 32), qp.view(p.n, -1, 32))
    y = (dots * s.double()[None]).sum(-1)
    return y + p.bias.double() if p.bias is not None else y


@pytest.mark.skipif(not HAS_AMX, reason="needs AMX-BF16")
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(
    "m,n,k", [(64, 17, 7), (65, 50, 100), (97, 960, 576), (64, 33, 131), (130, 3072, 64),
              (300, 576, 1536), (1024, 40, 33)],
)  # fmt: skip
def test_amx_linear_matches_bf16_reference(bias, m, n, k):
    g = torch.Generator().manual_seed(m * n + k)
    w = torch.randn(n, k, generator=g) * 0.05
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(m, k, generator=g)
    p = K.PackedLinear.from_float(w, b)
    K.set_path("amx")
    y = K.linear(x, p)
    torch.testing.assert_close(y.double(), bf16_reference(x, p), rtol=1e-5, atol=1e-5)
    # within bf16 rounding of the int16 paths' result
    K.set_path("vnni")
    y16 = K.linear(x, p)
    assert ((y - y16).norm() / y16.norm()).item() < 1e-2


INT8_TILE_SHAPES = [(9, 50, 100), (12, 960, 576), (16, 17, 7), (17, 50, 100), (23, 960, 576),
                    (31, 33, 131), (33, 3072, 64), (63, 50, 100), (130, 576, 1536),
                    (300, 40, 33)]  # fmt: skip


@pytest.mark.skipif(not HAS_AMX, reason="needs AMX")
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(
    "m,n,k,act_bf16",
    [(*s, False) for s in INT8_TILE_SHAPES]
    + [(*s, True) for s in INT8_TILE_SHAPES if s[0] < K.AMX_BF16_MIN_ROWS],
)
def test_amx_int8_tiles_match_vnni_bit_for_bit(bias, m, n, k, act_bf16):
    """Weights without act_bf16 take the AMX-INT8 kernel from 9 rows, the others from 9 to
    AMX_BF16_MIN_ROWS - 1; it promises path "vnni"'s exact numbers (the fused residual add: see
    test_fused_layer_int8_tiles_match_vnni)."""
    g = torch.Generator().manual_seed(m * n + k)
    w = torch.randn(n, k, generator=g) * 0.05
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(m, k, generator=g) * 4
    p = K.PackedLinear.from_float(w, b, act_bf16=act_bf16)
    with K.use_path("vnni"):
        want = K.linear(x, p)
    with K.use_path("amx"):
        assert torch.equal(K.linear(x, p), want)


@pytest.mark.skipif(not HAS_AMX, reason="needs AMX-BF16")
def test_amx_only_for_large_m_and_act_bf16_weights():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(64, 96, generator=g)
    exact = K.PackedLinear.from_float(w, act_bf16=False)
    fast = K.PackedLinear.from_float(w)
    lim = K.AMX_BF16_MIN_ROWS
    for m in (1, 16, 17, lim - 1, lim, 200):
        x = torch.randn(m, 96, generator=g)
        with K.use_path("vnni"):
            want = K.linear(x, exact)
        with K.use_path("amx"):
            assert torch.equal(K.linear(x, exact), want)  # int16 activations whatever m
            assert torch.equal(K.linear(x, fast), want) == (m < lim)


def test_linear_batched_leading_dims_and_out():
    w = torch.randn(40, 24)
    p = K.PackedLinear.from_float(w)
    x = torch.randn(2, 3, 24)
    out = torch.empty(2, 3, 40)
    assert K.linear(x, p, out) is out
    assert torch.equal(out.reshape(6, 40), K.linear(x.reshape(6, 24), p))
    assert K.linear(torch.empty(0, 24), p).shape == (0, 40)


@pytest.mark.parametrize("m", [1, 8, 16, 64, 300, 1024])
def test_threads_identical(m):
    g = torch.Generator().manual_seed(m)
    w, x = torch.randn(1000, 300, generator=g), torch.randn(m, 300, generator=g)
    p = K.PackedLinear.from_float(w, torch.randn(1000, generator=g))
    K.set_num_threads(1)
    y1 = K.linear(x, p)
    K.set_num_threads(2)
    assert torch.equal(K.linear(x, p), y1)
    K.set_num_threads(3)
    assert torch.equal(K.linear(x, p), y1)


def test_pool_held_nests_releases_on_errors_and_changes_no_result():
    g = torch.Generator().manual_seed(5)
    p = K.PackedLinear.from_float(torch.randn(200, 96, generator=g))
    x = torch.randn(16, 96, generator=g)
    K.set_num_threads(2)
    want = K.linear(x, p)
    assert K.lib.shmk_pool_holds() == 0
    with K.pool_held():
        with K.pool_held():
            assert K.lib.shmk_pool_holds() == 2
            assert torch.equal(K.linear(x, p), want)
        assert K.lib.shmk_pool_holds() == 1
    assert K.lib.shmk_pool_holds() == 0
    with pytest.raises(RuntimeError, match="boom"), K.pool_held():
        raise RuntimeError("boom")
    assert K.lib.shmk_pool_holds() == 0


def test_validation_errors():
    p = K.PackedLinear.from_float(torch.randn(8, 16))
    with pytest.raises(ValueError, match="features"):
        K.linear(torch.randn(2, 15), p)
    with pytest.raises(TypeError, match="float32"):
        K.linear(torch.randn(2, 16, dtype=torch.float64), p)
    with pytest.raises(ValueError, match="contiguous"):
        K.linear(torch.randn(16, 2).t(), p)
    with pytest.raises(ValueError, match="shape"):
        K.linear(torch.randn(2, 16), p, out=torch.empty(2, 9))
    with pytest.raises(ValueError, match="columns"):
        K.group_dots(torch.zeros(2, 15, dtype=torch.int16), p)
    with pytest.raises(ValueError, match="unknown"):
        K.set_path("sse9")
    with pytest.raises(ValueError):
        K.PackedLinear.from_float(torch.randn(8, 16), bias=torch.randn(9))


def test_paths_reported():
    assert K.best_path() in K.PATHS
    for p in PATHS:
        with K.use_path(p):
            assert K.get_path() == p
    if "vnni" not in PATHS:
        with pytest.raises(ValueError, match="not supported"):
            K.set_path("vnni")
    if HAS_AMX:
        with K.use_path("amx"):
            assert K.get_path() == "amx"
    else:
        with pytest.raises(ValueError, match="not supported"):
            K.set_path("amx")


def test_pool_survives_fork():
    import os

    p = K.PackedLinear.from_float(torch.randn(512, 256))
    x = torch.randn(64, 256)
    y = K.linear(x, p)
    pid = os.fork()
    if pid == 0:  # child: fresh pool, same results
        os._exit(0 if torch.equal(K.linear(x, p), y) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def blocked_signals(tid: int) -> int:
    """The SigBlk mask of one of this process's threads."""
    status = Path(f"/proc/self/task/{tid}/status").read_text()
    return int(next(x for x in status.splitlines() if x.startswith("SigBlk:")).split()[1], 16)


def test_pool_workers_leave_signals_to_python_threads():
    # A SIGINT taken by a worker would not interrupt a blocking call of Python's main thread.
    K.set_num_threads(3)
    K.linear(torch.randn(4, 96), K.PackedLinear.from_float(torch.randn(64, 96)))
    tasks = Path("/proc/self/task")
    workers = [
        int(t.name) for t in tasks.iterdir() if (t / "comm").read_text().strip() == "shmk-worker"
    ]
    assert len(workers) == 2
    for tid in workers:
        # NOTE: glibc creates a thread with every signal blocked (32 and 33 included) until the
        # thread itself installs its creator's mask; a worker not yet scheduled shows that one.
        deadline = time.monotonic() + 5
        while (mask := blocked_signals(tid)) >> 31 & 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            assert mask >> (sig - 1) & 1, (tid, sig)
        assert not mask >> (signal.SIGSEGV - 1) & 1  # a fault still reaches faulthandler
    assert not blocked_signals(threading.get_native_id()) >> (signal.SIGINT - 1) & 1


@pytest.mark.parametrize("n,k,chunk", [(1, 5, 16), (50, 64, 16), (100, 45, 17), (333, 97, 4096)])
def test_packing_in_row_chunks_is_packing_whole(n, k, chunk):
    """from_row_chunks (a vocabulary-sized matrix read a chunk of rows at a time) packs the
    same bytes, scales and scale_mult as from_float, also with the largest |w| in a late chunk
    and NaN / huge elements; a chunk of the wrong shape is refused."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n * k))
    w[-1, -1] = 40.0  # the matrix's max |w| sits in the last chunk
    w[0, 0] = float("nan")
    whole = K.PackedLinear.from_float(w)
    reads = []

    def rows(a, b):
        reads.append((a, b))
        return w[a:b]

    chunked = K.PackedLinear.from_row_chunks(n, k, rows, chunk_rows=chunk)
    assert torch.equal(chunked.packed, whole.packed)
    assert torch.equal(chunked.scales, whole.scales)
    assert chunked.scale_mult == whole.scale_mult
    assert all(a % 16 == 0 for a, _ in reads) and max(b for _, b in reads) == n
    with pytest.raises(ValueError, match="rows"):
        K.PackedLinear.from_row_chunks(
            n, k, lambda a, b: torch.zeros(b - a + 1, k), chunk_rows=chunk
        )
