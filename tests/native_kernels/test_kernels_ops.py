"""RMSNorm, RoPE, SiLU*mul, KV writes, paged attention and the fused layer vs torch references."""

import math

import pytest
import torch
import torch.nn.functional as F

from shm_engine.model import kernels as K
from shm_engine.model.kv_cache import check_kv_dtype, kv_slab_rows

PATHS = [p for p in ("portable", "avx2", "vnni") if K.PATHS[p] <= K.PATHS[K.best_path()]]


def gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("m,h", [(1, 576), (5, 7), (33, 100), (300, 576)])
def test_rmsnorm(path, m, h):
    K.set_path(path)
    g = gen(m * h)
    x, r, w = (
        torch.randn(m, h, generator=g),
        torch.randn(m, h, generator=g),
        torch.randn(h, generator=g),
    )

    def ref(x):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))

    torch.testing.assert_close(K.rmsnorm(x, w, 1e-5), ref(x), rtol=1e-5, atol=1e-5)
    x2 = x.clone()
    out = K.rmsnorm(x2, w, 1e-5, residual=r)
    assert torch.equal(x2, x + r)  # residual stream updated in place
    torch.testing.assert_close(out, ref(x + r), rtol=1e-5, atol=1e-5)


def hf_rope(x, pos, cos_sin):
    d = x.shape[-1]
    cos = cos_sin[pos, : d // 2].repeat(1, 2)[:, None, :]
    sin = cos_sin[pos, d // 2 :].repeat(1, 2)[:, None, :]
    rot = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], dim=-1)
    return x * cos + rot * sin


@pytest.mark.parametrize("d", [64, 6])
def test_rope_matches_hf(d):
    g = gen(d)
    t, hq, hk = 11, 9, 3
    q, k = torch.randn(t, hq, d, generator=g), torch.randn(t, hk, d, generator=g)
    pos = torch.tensor([0, 1, 2, 5, 100, 7, 3, 3, 511, 40, 9])
    inv = K.rope_inv_freq(d, 1e5)
    cs = K.rope_cos_sin(inv, 512)
    # the table holds cos / sin of HF's fp32 arguments, accurate to 1e-6
    freqs = pos.float()[:, None] * inv[None, :]
    torch.testing.assert_close(cs[pos, : d // 2].double(), freqs.double().cos(), rtol=0, atol=1e-6)
    torch.testing.assert_close(cs[pos, d // 2 :].double(), freqs.double().sin(), rtol=0, atol=1e-6)
    q2, k2 = q.clone(), k.clone()
    K.rope(q2, k2, pos.to(torch.int32), cs)
    torch.testing.assert_close(q2, hf_rope(q, pos, cs), rtol=0, atol=1e-6)
    torch.testing.assert_close(k2, hf_rope(k, pos, cs), rtol=0, atol=1e-6)
    q3 = q.clone()
    K.rope(q3, None, pos, cs)
    assert torch.equal(q3, q2)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("m,f", [(1, 1536), (3, 13), (70, 1000)])
def test_silu_mul(path, m, f):
    K.set_path(path)
    gu = torch.randn(m, 2 * f, generator=gen(f)) * 4
    gu[0, :3] = torch.tensor([-100.0, 100.0, 0.0])
    ref = F.silu(gu[:, :f]) * gu[:, f:]
    torch.testing.assert_close(K.silu_mul(gu), ref, rtol=2e-6, atol=1e-6)


@pytest.mark.skipif("vnni" not in PATHS, reason="needs AVX-512")
@pytest.mark.parametrize("m,f", [(16, 1536), (3, 1000), (2, 4099)])  # parallel; zmm tails
def test_silu_mul_zmm_equals_avx2(m, f):
    """The AVX-512 loop repeats the AVX2 one's operations lane for lane: same bits."""
    gu = torch.randn(m, 2 * f, generator=gen(f)) * 8
    outs = []
    for path in ("avx2", "vnni"):
        with K.use_path(path):
            outs.append(K.silu_mul(gu))
    assert torch.equal(outs[0], outs[1])


KV_DTYPES = [torch.float32, torch.float16, torch.int8]


def hadamard(d: int) -> torch.Tensor:
    """The unnormalised Sylvester Hadamard matrix (H H = d I) the int8 cache rotates keys by."""
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h


def empty_cache(nb, hk, bs, d, dtype):
    return torch.zeros(nb, hk, kv_slab_rows(bs, d, dtype), d, dtype=dtype)


def cached_rows(cache, slots, bs, is_key):
    """fp32 [len(slots), hk, d] of what the cache holds at the slots: int8 rows times their
    scales, keys rotated back (H^T / d)."""
    blocks, offs = slots // bs, slots % bs
    if cache.dtype != torch.int8:
        return cache[blocks, :, offs].float()
    d = cache.shape[-1]
    scales = cache[:, :, bs:].contiguous().view(torch.float32).flatten(2)[:, :, :bs]
    rows = cache[blocks, :, offs].float() * scales[blocks, :, offs][..., None]
    return rows @ hadamard(d) / d if is_key else rows


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", KV_DTYPES[:2])
def test_write_kv_slots(path, dtype):
    K.set_path(path)
    nb, bs, hk, d = 5, 4, 3, 24
    kc, vc = torch.zeros(nb, hk, bs, d, dtype=dtype), torch.zeros(nb, hk, bs, d, dtype=dtype)
    k, v = torch.randn(4, hk, d), torch.randn(4, hk, d)
    # fp16 edge cases: subnormals, ties, the largest finite value, overflow to inf, -0
    k[0, 0, :8] = torch.tensor([1e-6, 3e-8, 6.1e-5, 1 + 2**-11, 65504.0, 65520.0, -0.0, 1e-9])
    slots = torch.tensor([7, 0, -1, 19])
    K.write_kv(k, v, slots, kc, vc)
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            # torch's float -> half conversion rounds to nearest even, like the kernel's
            assert torch.equal(kc[s // bs, :, s % bs], k[i].to(dtype))
            assert torch.equal(vc[s // bs, :, s % bs], v[i].to(dtype))
    assert int((kc.abs().float().sum(-1) > 0).sum()) == 3 * hk
    with pytest.raises(ValueError, match="slot"):
        K.write_kv(k, v, torch.tensor([0, 1, 2, 20]), kc, vc)


@pytest.mark.parametrize("bs,d", [(4, 16), (16, 64), (16, 128), (5, 8)])
def test_write_kv_int8_rows(bs, d):
    """Keys come back (rotated back) and values within half a quantisation step of the row's
    largest value; every path writes the same bytes; zero rows get scale 0."""
    nb, hk = 6, 3
    g = gen(d + bs)
    k, v = torch.randn(5, hk, d, generator=g) * 4, torch.randn(5, hk, d, generator=g)
    k[2], v[2] = 0.0, 0.0
    slots = torch.tensor([7, 0, 19, -1, nb * bs - 1])
    live = slots >= 0
    written = []
    for path in PATHS:
        K.set_path(path)
        kc, vc = empty_cache(nb, hk, bs, d, torch.int8), empty_cache(nb, hk, bs, d, torch.int8)
        K.write_kv(k, v, slots, kc, vc)
        written.append((kc, vc))
    for kc, vc in written[1:]:
        assert torch.equal(kc, written[0][0]) and torch.equal(vc, written[0][1])
    kc, vc = written[0]
    got_k, got_v = cached_rows(kc, slots[live], bs, True), cached_rows(vc, slots[live], bs, False)
    # the rotated row y = H k is stored within half a step (max|y| / 127) an element, and
    # H^T / d maps an error e to one of norm |e| / sqrt(d)
    k_tol = (k[live] @ hadamard(d)).abs().amax(-1, keepdim=True) / 254
    assert ((got_k - k[live]).norm(dim=-1, keepdim=True) <= k_tol * 1.0001 + 1e-6).all()
    v_step = v[live].abs().amax(-1, keepdim=True) / 127
    assert ((got_v - v[live]).abs() <= v_step / 2 + 1e-6).all()
    assert torch.equal(got_k[2], torch.zeros(hk, d)) and torch.equal(got_v[2], torch.zeros(hk, d))
    with pytest.raises(ValueError, match="power-of-two"):
        K.write_kv(torch.randn(1, 1, 24), torch.randn(1, 1, 24), torch.tensor([0]),
                   *(torch.zeros(1, 1, 5, 24, dtype=torch.int8),) * 2)  # fmt: skip


def new_positions_and_slots(seqs, block_table, bs):
    """Positions of each sequence's new tokens (the last ql of s) and their cache slots."""
    pos = [torch.arange(s - ql, s) for s, ql in seqs]
    slots = [block_table[b, p // bs].long() * bs + p % bs for b, p in enumerate(pos)]
    return torch.cat(pos), torch.cat(slots)


def make_batch(seqs, hq, hk, d, bs, seed, dtype=torch.float32):
    """seqs: list of (seq_len, q_len).  Returns q, caches, metadata and per-seq full k/v (as the
    cache holds them: rounded to ``dtype``, returned in fp32)."""
    g = gen(seed)
    max_blocks = max(-(-s // bs) for s, _ in seqs)
    nblocks = sum(-(-s // bs) for s, _ in seqs) + 3
    perm = torch.randperm(nblocks, generator=g).to(torch.int32)
    kc, vc = empty_cache(nblocks, hk, bs, d, dtype), empty_cache(nblocks, hk, bs, d, dtype)
    bt = torch.full((len(seqs), max_blocks), -1, dtype=torch.int32)
    qs, ks, vs, qsl, used = [], [], [], [0], 0
    for b, (s, ql) in enumerate(seqs):
        nbk = -(-s // bs)
        bt[b, :nbk] = perm[used : used + nbk]
        used += nbk
        kf, vf = torch.randn(s, hk, d, generator=g), torch.randn(s, hk, d, generator=g)
        slots = (bt[b, torch.arange(s) // bs].long() * bs + torch.arange(s) % bs).long()
        K.write_kv(kf, vf, slots, kc, vc)
        ks.append(cached_rows(kc, slots, bs, True))
        vs.append(cached_rows(vc, slots, bs, False))
        qs.append(torch.randn(ql, hq, d, generator=g))
        qsl.append(qsl[-1] + ql)
    meta = dict(
        block_table=bt,
        seq_lens=torch.tensor([s for s, _ in seqs], dtype=torch.int32),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
    )
    return torch.cat(qs), kc, vc, meta, ks, vs


def ref_attention(q, ks, vs, seqs, hq, hk, scale):
    outs, start = [], 0
    for (s, ql), kf, vf in zip(seqs, ks, vs, strict=True):
        qb = q[start : start + ql].transpose(0, 1)[None]  # [1, hq, ql, d]
        kb = kf.repeat_interleave(hq // hk, dim=1).transpose(0, 1)[None]
        vb = vf.repeat_interleave(hq // hk, dim=1).transpose(0, 1)[None]
        pos = torch.arange(ql)[:, None] + (s - ql)
        mask = torch.arange(s)[None, :] <= pos
        o = F.scaled_dot_product_attention(
            qb.double(), kb.double(), vb.double(), attn_mask=mask, scale=scale
        )
        outs.append(o[0].transpose(0, 1).float())
        start += ql
    return torch.cat(outs)


MIXED = [(37, 1), (20, 20), (50, 13), (1, 1), (130, 1), (70, 33)]  # decode, prefill, prefix...


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", KV_DTYPES)
@pytest.mark.parametrize(
    "seqs,hq,hk,d,bs",
    [
        (MIXED, 9, 3, 64, 16),
        (MIXED, 9, 3, 64, 32),  # two chunks a block (rows contiguous within each)
        (MIXED, 4, 4, 32, 5),
        ([(300, 300)], 9, 3, 64, 16),
        ([(17, 1)] * 5, 8, 2, 16, 4),
        ([(40, 7), (9, 9)], 2, 1, 24, 8),
        # the AVX-512 prefill path (>= 16 query rows a task): head_dim 128, G = 1, G = 8
        ([(40, 40), (70, 17)], 8, 2, 128, 16),
        ([(33, 33), (5, 5)], 2, 2, 64, 16),
        ([(50, 20)], 16, 2, 64, 8),
        # decode with G = 8 and 4: with an fp16 cache on AVX-512, the in-place decode kernel's
        # row passes of 3, 3, 2 / 3, 1
        ([(37, 1), (20, 1), (5, 1)], 16, 2, 64, 16),
        ([(33, 1)] * 3, 8, 2, 64, 16),
        ([(37, 1), (20, 1)], 8, 2, 128, 16),  # head_dim 128: two column blocks
    ],
)
def test_paged_attention_vs_sdpa(path, dtype, seqs, hq, hk, d, bs):
    if dtype == torch.int8 and d & (d - 1):
        pytest.skip("int8 caches need a power-of-two head_dim")
    K.set_path(path)
    q, kc, vc, meta, ks, vs = make_batch(seqs, hq, hk, d, bs, seed=hq * d + len(seqs), dtype=dtype)
    scale = 1 / math.sqrt(d)
    out = K.paged_attention(q, kc, vc, scale=scale, **meta)
    ref = ref_attention(q, ks, vs, seqs, hq, hk, scale)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


# Decode contexts past one 512-position segment (DEC_SEG in attention.c): 513 (a one-position
# last segment), 1030, 1600; alone (segments as tasks), two (likewise) and eight (a task a token).
LONG_DECODE = [[(1600, 1)], [(513, 1), (1030, 1)], [(1030, 1), (40, 1)] * 4]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", KV_DTYPES[1:])
@pytest.mark.parametrize("seqs", LONG_DECODE)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_long_decode_contexts_vs_sdpa(path, dtype, seqs, threads):
    K.set_path(path)
    K.set_num_threads(threads)
    q, kc, vc, meta, ks, vs = make_batch(seqs, 9, 3, 64, 16, seed=len(seqs), dtype=dtype)
    out = K.paged_attention(q, kc, vc, scale=0.125, **meta)
    torch.testing.assert_close(
        out, ref_attention(q, ks, vs, seqs, 9, 3, 0.125), rtol=1e-4, atol=1e-5
    )


@pytest.mark.parametrize("dtype", KV_DTYPES[1:])
def test_a_decode_token_is_computed_alike_in_any_batch_and_thread_count(dtype):
    """Long contexts are split at fixed positions, so a token's result is bit-identical alone,
    beside other tokens (each split into tasks), in a batch big enough for a task a token, and
    on any thread count: greedy decoding stays batch-invariant."""
    seqs = [(1600, 1)] + [(700 + 37 * i, 1) for i in range(7)]
    q, kc, vc, meta, _, _ = make_batch(seqs, 9, 3, 64, 16, seed=5, dtype=dtype)
    results = []
    for threads in (1, 2, 3):
        K.set_num_threads(threads)
        for b in (1, 2, 8):  # the first token with b - 1 others
            sub = {
                "block_table": meta["block_table"][:b],
                "seq_lens": meta["seq_lens"][:b],
                "query_start_loc": meta["query_start_loc"][: b + 1],
            }
            results.append(K.paged_attention(q[:b], kc, vc, scale=0.125, **sub)[0])
    for r in results[1:]:
        assert torch.equal(r, results[0])


@pytest.mark.skipif("avx2" not in PATHS, reason="needs AVX2")
@pytest.mark.parametrize("dtype", KV_DTYPES[1:])
@pytest.mark.parametrize("seq", [(300, 40), (530, 40), (1100, 24)])
def test_a_token_is_computed_alike_as_a_decode_or_a_prefill_row(dtype, seq):
    """On the AVX2 path a token's attention is the same bits whether it is a one-token decode
    step or a row of a prefill chunk, across the 512-position segments and with int8 scales:
    preemption (recompute), chunk and prefix-cache boundaries leave greedy output unchanged.
    (The AVX-512 prefill tiles sum in another order.)"""
    K.set_path("avx2")
    s, ql = seq
    q, kc, vc, meta, ks, vs = make_batch([seq], 9, 3, 64, 16, seed=s, dtype=dtype)
    chunk = K.paged_attention(q, kc, vc, scale=0.125, **meta)
    ref = ref_attention(q, ks, vs, [seq], 9, 3, 0.125)
    torch.testing.assert_close(chunk, ref, rtol=1e-4, atol=1e-5)
    for i in (0, ql // 2, ql - 1):
        one = dict(
            block_table=meta["block_table"],
            seq_lens=torch.tensor([s - ql + i + 1], dtype=torch.int32),
            query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        )
        decode = K.paged_attention(q[i : i + 1], kc, vc, scale=0.125, **one)
        assert torch.equal(decode[0], chunk[i]), (i, (decode[0] - chunk[i]).abs().max())


@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_attention_threads_identical_and_paths_close(dtype):
    q, kc, vc, meta, ks, vs = make_batch(MIXED, 9, 3, 64, 16, seed=3, dtype=dtype)
    K.set_num_threads(1)
    o1 = K.paged_attention(q, kc, vc, scale=0.125, **meta)
    K.set_num_threads(2)
    assert torch.equal(K.paged_attention(q, kc, vc, scale=0.125, **meta), o1)
    K.set_path("portable")
    torch.testing.assert_close(
        K.paged_attention(q, kc, vc, scale=0.125, **meta), o1, rtol=1e-5, atol=1e-6
    )


def test_attention_validation():
    q, kc, vc, meta, _, _ = make_batch([(10, 4)], 4, 2, 8, 4, seed=1)
    with pytest.raises(ValueError, match="query_start_loc"):
        K.paged_attention(
            q,
            kc,
            vc,
            scale=1.0,
            **{**meta, "query_start_loc": torch.tensor([0, 3], dtype=torch.int32)},
        )
    with pytest.raises(ValueError, match="multiple"):
        K.paged_attention(torch.randn(4, 3, 8), kc, vc, scale=1.0, **meta)
    bad = meta["block_table"].clone()
    bad[0, 0] = 999
    with pytest.raises(ValueError, match="block"):
        K.paged_attention(q, kc, vc, scale=1.0, **{**meta, "block_table": bad})
    # int64 metadata beyond int32 is refused, not narrowed into a valid-looking value
    wide = meta["block_table"].to(torch.int64) + 2**32
    with pytest.raises(ValueError, match="beyond int32"):
        K.paged_attention(q, kc, vc, scale=1.0, **{**meta, "block_table": wide})


def test_attention_refuses_tokens_without_sequences():
    """t > 0 query rows that no sequence owns (b = 0) are refused: nothing would write them
    (the output came back uninitialised); t = 0 with b = 0 is an empty call."""
    q, kc, vc, _, _, _ = make_batch([(10, 4)], 4, 2, 8, 4, seed=1)
    none = dict(
        block_table=torch.zeros(0, 3, dtype=torch.int32),
        seq_lens=torch.zeros(0, dtype=torch.int32),
        query_start_loc=torch.tensor([0], dtype=torch.int32),
    )
    for qsl in ([0], [4], [7]):
        with pytest.raises(ValueError, match="query_start_loc"):
            K.paged_attention(
                q, kc, vc, scale=1.0, **(none | {"query_start_loc": torch.tensor(qsl)})
            )
    assert K.paged_attention(q[:0], kc, vc, scale=1.0, **none).shape == (0, 4, 8)


def test_int8_cache_needs_head_dim_of_at_least_4():
    """With head_dim 1 or 2 a slab's fp32 scales would sit at misaligned addresses: refused;
    head_dim 4 (the smallest) works."""
    for d in (1, 2):
        with pytest.raises(ValueError, match="power-of-two head_dim from 4"):
            check_kv_dtype(torch.int8, d)
        kc = empty_cache(2, 1, 4, d, torch.int8)
        with pytest.raises(ValueError, match="power-of-two head_dim from 4"):
            K.write_kv(torch.randn(1, 1, d), torch.randn(1, 1, d), torch.tensor([0]), kc, kc)
        check_kv_dtype(torch.float16, d)  # other cache types take any head_dim
    check_kv_dtype(torch.int8, 4)
    seqs = [(7, 7), (9, 1)]
    q, kc, vc, meta, ks, vs = make_batch(seqs, 2, 1, 4, 3, seed=4, dtype=torch.int8)
    out = K.paged_attention(q, kc, vc, scale=0.5, **meta)
    ref = ref_attention(q, ks, vs, seqs, 2, 1, 0.5)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_rope_refuses_an_empty_table():
    # Positions clamp into the table: an empty one would have been read before its start.
    with pytest.raises(ValueError, match="max_pos >= 1"):
        K.rope(torch.ones(1, 1, 8), None, torch.tensor([0]), torch.empty(0, 8))


# ---------------------------------------------------------------------------- fused layer
def make_layer(seed, hidden=64, hq=4, hk=2, d=16, ffn=96, bias=False, act_bf16=True):
    g = gen(seed)

    def lin(n, k):
        return torch.randn(n, k, generator=g) / math.sqrt(k)

    w = dict(
        q=lin(hq * d, hidden), k=lin(hk * d, hidden), v=lin(hk * d, hidden), o=lin(hidden, hq * d),
        gate=lin(ffn, hidden), up=lin(ffn, hidden), down=lin(hidden, ffn),
        ln1=1 + 0.1 * torch.randn(hidden, generator=g), ln2=1 + 0.1 * torch.randn(hidden, generator=g),
    )  # fmt: skip
    qkv_b = torch.randn((hq + 2 * hk) * d, generator=g) if bias else None
    layer = K.LlamaLayer(
        hidden=hidden, num_heads=hq, num_kv_heads=hk, head_dim=d, ffn=ffn, eps=1e-5,
        input_norm=w["ln1"], post_norm=w["ln2"],
        qkv=K.PackedLinear.from_float(torch.cat([w["q"], w["k"], w["v"]]), qkv_b, act_bf16),
        o=K.PackedLinear.from_float(w["o"], act_bf16=act_bf16),
        gate_up=K.PackedLinear.from_float(torch.cat([w["gate"], w["up"]]), act_bf16=act_bf16),
        down=K.PackedLinear.from_float(w["down"], act_bf16=act_bf16),
    )  # fmt: skip
    return layer


def primitive_layer(layer, hidden, kc, vc, pos, slots, meta, cs, scale):
    """The same layer built from the primitive kernels (must match the fused call bit for bit)."""
    t = hidden.shape[0]
    hq, hk, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
    x = K.rmsnorm(hidden, layer.input_norm, layer.eps)
    qkv = K.linear(x, layer.qkv)
    q = qkv[:, : hq * d].reshape(t, hq, d).contiguous()
    k = qkv[:, hq * d : (hq + hk) * d].reshape(t, hk, d).contiguous()
    v = qkv[:, (hq + hk) * d :].reshape(t, hk, d).contiguous()
    K.rope(q, k, pos, cs)
    K.write_kv(k, v, slots, kc, vc)
    a = K.paged_attention(q, kc, vc, scale=scale, **meta)
    hidden = hidden + K.linear(a.reshape(t, hq * d), layer.o)
    x = K.rmsnorm(hidden, layer.post_norm, layer.eps)
    return hidden + K.linear(K.silu_mul(K.linear(x, layer.gate_up)), layer.down)


@pytest.mark.parametrize("bias,dtype", [(False, torch.float32), (True, torch.float16)])
def test_fused_layer_matches_primitives(bias, dtype):
    layer = make_layer(5, bias=bias)
    hq, hk, d, bs = 4, 2, 16, 8
    seqs = [(21, 1), (12, 12), (30, 9)]  # decode, prefill, prefill with a cached prefix
    _, kc, vc, meta, _, _ = make_batch(seqs, hq, hk, d, bs, seed=11, dtype=dtype)
    t = sum(ql for _, ql in seqs)
    pos, slots = new_positions_and_slots(seqs, meta["block_table"], bs)
    cs = K.rope_cos_sin(K.rope_inv_freq(d, 1e4), 64)
    hidden = torch.randn(t, 64, generator=gen(2))
    kc2, vc2 = kc.clone(), vc.clone()
    ref = primitive_layer(layer, hidden.clone(), kc2, vc2, pos, slots, meta, cs, d**-0.5)
    scratch = K.LayerScratch(layer, max_tokens=64)
    step = K.LayerStep(
        positions=pos, slot_mapping=slots, cos_sin=cs, num_blocks=kc.shape[0], block_size=bs,
        scale=d**-0.5, scratch=scratch, **meta,
    )  # fmt: skip
    h = hidden.clone()
    K.llama_layer_forward(layer, step, h, kc, vc)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    assert torch.equal(h, ref)
    with pytest.raises(ValueError, match="hidden"):
        K.llama_layer_forward(layer, step, h[:-1].contiguous(), kc, vc)


@pytest.mark.parametrize("dtype", [torch.float16, torch.int8])
def test_fused_layer_long_prefill_same_bits_on_any_thread_count(dtype):
    """A prefill long enough that the row-wise ops (norms, RoPE, KV writes) split over the pool:
    two threads give one thread's bits, and those are the primitives' (run on one thread)."""
    layer = make_layer(6)
    hq, hk, d, bs = 4, 2, 16, 8
    seqs = [(300, 300), (40, 1)]
    _, kc, vc, meta, _, _ = make_batch(seqs, hq, hk, d, bs, seed=13, dtype=dtype)
    pos, slots = new_positions_and_slots(seqs, meta["block_table"], bs)
    cs = K.rope_cos_sin(K.rope_inv_freq(d, 1e4), 512)
    hidden = torch.randn(len(pos), 64, generator=gen(4))
    step = K.LayerStep(
        positions=pos, slot_mapping=slots, cos_sin=cs, num_blocks=kc.shape[0], block_size=bs,
        scale=d**-0.5, scratch=K.LayerScratch(layer, max_tokens=512), **meta,
    )  # fmt: skip
    outs = []
    for threads in (1, 2):
        K.set_num_threads(threads)
        h, kc2, vc2 = hidden.clone(), kc.clone(), vc.clone()
        K.llama_layer_forward(layer, step, h, kc2, vc2)
        outs.append((h, kc2, vc2))
    assert all(torch.equal(a, b) for a, b in zip(outs[0], outs[1], strict=True))
    K.set_num_threads(1)
    kc3, vc3 = kc.clone(), vc.clone()
    ref = primitive_layer(layer, hidden.clone(), kc3, vc3, pos, slots, meta, cs, d**-0.5)
    assert torch.equal(outs[0][1], kc3) and torch.equal(outs[0][2], vc3)
    assert torch.equal(outs[0][0], ref)


@pytest.mark.skipif(K.best_path() != "amx", reason="needs AMX")
def test_fused_layer_int8_tiles_match_vnni():
    """With int16-activation weights the AMX path's linears (22 rows: int8 tiles, including the
    residual adds fused into o and down) give path "vnni"'s layer output bit for bit."""
    layer = make_layer(9, act_bf16=False)
    hq, hk, d, bs = 4, 2, 16, 8
    seqs = [(21, 1), (12, 12), (30, 9)]
    _, kc, vc, meta, _, _ = make_batch(seqs, hq, hk, d, bs, seed=12)
    pos, slots = new_positions_and_slots(seqs, meta["block_table"], bs)
    step = K.LayerStep(
        positions=pos, slot_mapping=slots, cos_sin=K.rope_cos_sin(K.rope_inv_freq(d, 1e4), 64),
        num_blocks=kc.shape[0], block_size=bs, scale=d**-0.5,
        scratch=K.LayerScratch(layer, max_tokens=64), **meta,
    )  # fmt: skip
    hidden = torch.randn(len(pos), 64, generator=gen(3))
    outs = []
    for path in ("vnni", "amx"):
        with K.use_path(path):
            h = hidden.clone()
            K.llama_layer_forward(layer, step, h, kc.clone(), vc.clone())
            outs.append(h)
    assert torch.equal(outs[0], outs[1])


def make_stack(layer_seeds, cache_seed):
    """Layers of make_layer's shape, a KV cache pair each for a decode and a prefill-with-prefix
    sequence, and the step over them: (layers, caches, step, token count)."""
    layers = [make_layer(s) for s in layer_seeds]
    hq, hk, d, bs = 4, 2, 16, 8
    seqs = [(21, 1), (30, 9)]
    caches, meta = [], None
    for i in range(len(layers)):
        _, kc, vc, meta, _, _ = make_batch(seqs, hq, hk, d, bs, seed=cache_seed + i)
        caches.append((kc, vc))
    pos, slots = new_positions_and_slots(seqs, meta["block_table"], bs)
    step = K.LayerStep(
        positions=pos, slot_mapping=slots, cos_sin=K.rope_cos_sin(K.rope_inv_freq(d, 1e4), 64),
        num_blocks=caches[0][0].shape[0], block_size=bs, scale=d**-0.5,
        scratch=K.LayerScratch(layers[0], max_tokens=16), **meta,
    )  # fmt: skip
    return layers, caches, step, len(pos)


def test_llama_forward_is_the_layers_in_order():
    """One native call for a stack of layers == llama_layer_forward layer by layer."""
    layers, caches, step, t = make_stack((5, 6, 7), 20)
    hidden = torch.randn(t, 64, generator=gen(3))
    copies = [(kc.clone(), vc.clone()) for kc, vc in caches]
    want = hidden.clone()
    for layer, (kc, vc) in zip(layers, copies, strict=True):
        K.llama_layer_forward(layer, step, want, kc, vc)
    got = hidden.clone()
    K.llama_forward(K.LlamaStack(layers, caches), step, got)
    assert torch.equal(got, want)
    for (kc, vc), (kc2, vc2) in zip(caches, copies, strict=True):
        assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    with pytest.raises(ValueError, match="cache pairs"):
        K.LlamaStack(layers, caches[:2])
    with pytest.raises(ValueError, match="hidden"):
        K.llama_forward(K.LlamaStack(layers, caches), step, got[:-1].contiguous())


def test_model_forward_is_embedding_layers_norm_and_head():
    """The one-call step == the embedding looked up in torch, llama_forward, then rmsnorm and
    the LM head on the sampled rows, bit for bit; bad ids and rows are refused."""
    layers, caches, step, t = make_stack((5, 6), 30)
    h, vocab = 64, 50
    g = gen(4)
    head = K.PackedLinear.from_float(torch.randn(vocab, h, generator=g))
    norm = 1 + 0.1 * torch.randn(h, generator=g)
    ends = K.ModelEnds(head, norm, 1e-5, head)  # tied: the head is the embedding
    ids = torch.randint(0, vocab, (t,), generator=g)
    rows = torch.tensor([0, t - 1])
    copies = [(kc.clone(), vc.clone()) for kc, vc in caches]
    q, s = head.unpack()
    hidden = q[ids].float() * s[ids].repeat_interleave(32, dim=1)[:, :h]
    K.llama_forward(K.LlamaStack(layers, copies), step, hidden)
    want = K.linear(K.rmsnorm(hidden[rows].contiguous(), norm, 1e-5), head)
    stack = K.LlamaStack(layers, caches)
    assert torch.equal(K.model_forward(ends, stack, step, ids, rows), want)
    top = torch.empty(2, dtype=torch.int64)
    K.model_forward(ends, K.LlamaStack(layers, copies), step, ids, rows, top)
    assert torch.equal(top, K.argmax_rows(want))
    with pytest.raises(ValueError, match="input_ids"):
        K.model_forward(ends, stack, step, torch.full((t,), vocab), rows)
    with pytest.raises(ValueError, match="logits_rows"):
        K.model_forward(ends, stack, step, ids, torch.tensor([t]))
    with pytest.raises(ValueError, match="capacity"):
        K.model_forward(ends, stack, step, ids, torch.zeros(17, dtype=torch.int64))
    # untied: the embedding is its own packed weight
    embedding = K.PackedLinear.from_float(torch.randn(vocab + 3, h, generator=g))
    q, s = embedding.unpack()
    hidden = q[ids].float() * s[ids].repeat_interleave(32, dim=1)[:, :h]
    copies = [(kc.clone(), vc.clone()) for kc, vc in caches]
    K.llama_forward(K.LlamaStack(layers, copies), step, hidden)
    want = K.linear(K.rmsnorm(hidden[rows].contiguous(), norm, 1e-5), head)
    untied = K.ModelEnds(embedding, norm, 1e-5, head)
    assert torch.equal(K.model_forward(untied, K.LlamaStack(layers, caches), step, ids, rows), want)


@pytest.mark.parametrize("n,k", [(1, 1), (17, 45), (50, 64), (33, 97)])
def test_lookup_is_unpack_times_scales(n, k):
    """A packed weight's channels looked up == its unpacked int8 rows times their group scales
    (ragged last group, a partial last block), bit for bit; ids out of range are refused."""
    w = K.PackedLinear.from_float(3 * torch.randn(n, k, generator=gen(n + k)))
    q, s = w.unpack()
    ids = torch.tensor([n - 1, 0, n // 2, n - 1])
    want = q[ids].float() * s[ids].repeat_interleave(32, dim=1)[:, :k]
    assert torch.equal(w.lookup(ids), want)
    assert w.lookup(torch.tensor([], dtype=torch.int64)).shape == (0, k)
    with pytest.raises(ValueError, match="ids"):
        w.lookup(torch.tensor([n]))


def test_layer_step_validates_the_batch_in_c():
    layer = make_layer(5)
    seqs = [(21, 1), (30, 9)]
    _, kc, _, meta, _, _ = make_batch(seqs, 4, 2, 16, 8, seed=40)
    pos, slots = new_positions_and_slots(seqs, meta["block_table"], 8)
    args = dict(
        positions=pos, slot_mapping=slots, cos_sin=K.rope_cos_sin(K.rope_inv_freq(16, 1e4), 64),
        num_blocks=kc.shape[0], block_size=8, scale=0.25,
        scratch=K.LayerScratch(layer, max_tokens=16), **meta,
    )  # fmt: skip
    K.LayerStep(**args)
    bad_slots = slots.clone()
    bad_slots[0] = kc.shape[0] * 8
    bad_table = meta["block_table"].clone()
    bad_table[1, 0] = -1
    cases = {
        "slot": dict(slot_mapping=bad_slots),
        "block": dict(block_table=bad_table),
        "query_start_loc": dict(query_start_loc=torch.tensor([0, 1, 9], dtype=torch.int32)),
        "q_len": dict(seq_lens=torch.tensor([21, 8], dtype=torch.int32)),
        "capacity": dict(seq_lens=torch.tensor([21, 1000], dtype=torch.int32)),
    }
    no_seqs = dict(
        block_table=torch.zeros(0, 4, dtype=torch.int32),
        seq_lens=torch.zeros(0, dtype=torch.int32),
        query_start_loc=torch.zeros(1, dtype=torch.int32),
    )
    for match, change in [*cases.items(), ("query_start_loc", no_seqs)]:
        with pytest.raises(ValueError, match=match):
            K.LayerStep(**(args | change))
    # no sequences and no tokens is an empty step
    empty = torch.zeros(0, dtype=torch.int64)
    assert K.LayerStep(**(args | no_seqs | dict(positions=empty, slot_mapping=empty))).t == 0


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("m,n", [(1, 1), (3, 17), (16, 49152), (2, 100003)])
def test_argmax_rows(path, m, n):
    K.set_path(path)
    x = torch.randn(m, n, generator=gen(n))
    assert torch.equal(K.argmax_rows(x), x.argmax(-1))
    # ties: the first index; NaN counts as -inf; nothing above -inf: 0
    x[0] = -torch.inf
    if n > 5:
        x[0, 2] = x[0, 5] = 3.0
        x[0, 1] = x[0, n - 1] = torch.nan
        want = 2
    else:
        want = 0
    if m > 1:
        x[-1] = torch.nan
    got = K.argmax_rows(x)
    assert got[0].item() == want
    assert m == 1 or got[-1].item() == 0


def test_a_cache_with_an_empty_dimension_is_refused():
    """Block size 0 had divided by zero in the step check (SIGFPE), not raised."""
    empty = torch.zeros(2, 1, 0, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match="empty dimension"):
        K.paged_attention(
            torch.zeros(1, 1, 8), empty, empty.clone(), torch.zeros(1, 1, dtype=torch.int32),
            torch.ones(1, dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), 1.0,
        )  # fmt: skip


def test_argmax_rows_rejects_bad_input():
    with pytest.raises(ValueError, match="columns"):
        K.argmax_rows(torch.empty(2, 0))
    with pytest.raises(TypeError, match="dtype"):
        K.argmax_rows(torch.zeros(2, 3, dtype=torch.float64))
