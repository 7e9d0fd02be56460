"""Native sampler (sample_native, native/sampler/sample.c) against the torch reference.

The reference is sampler.filtered_probs + sample_inverse_cdf. Both are float code, so each case is
also run through a float64 oracle of the same semantics, which measures how close the case comes to
a decision that float rounding may legitimately take either way: a top-p cumulative mass or a min-p
ratio near its threshold, a distinct value near the top-p cut, u near a CDF boundary. Away from
those, everything must agree exactly (the kept tokens, the drawn token) and the probabilities within
float rounding. The native code (weights within 2.5e-7, sums in double) is held to margins of 2e-6;
the torch reference normalizes with a float sum (off by ~6e-6 at V = 49152), so it gets 3e-5.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from shm_engine.model import sample_native
from shm_engine.model.sample_native import best_path, sample_rows
from shm_engine.model.sampler import (
    Sampler,
    argmax_rows,
    filtered_probs,
    sample_inverse_cdf,
    seeded_uniform,
)
from shm_engine.sampling_params import SamplingParams as SP

PATHS = ["portable"] + (["avx2"] if best_path() == "avx2" else [])
TOL = 2e-6  # rounding margin of a native filter decision (relative)
REF_TOL = 3e-5  # the same for the torch reference
U_MARGIN = 1e-6  # rounding margin of a CDF boundary (native)
REF_U_MARGIN = 1e-5  # the same for the torch reference
TINY = 1e-25  # below this an oracle probability may be flushed to 0 by the native exp


@dataclass
class Case:
    logits: np.ndarray  # float32 [V]
    temperature: float
    top_k: int
    top_p: float
    min_p: float


def _make_logits(rng: np.random.Generator, v: int, kind: str) -> np.ndarray:
    if kind == "normal":
        x = rng.standard_normal(v) * rng.choice([0.01, 1.0, 3.0, 10.0])
    elif kind == "peaked":
        x = rng.standard_normal(v)
        x[rng.integers(v)] += 25.0
    elif kind == "ties":  # a handful of distinct values: ties everywhere, incl. at every cut
        x = rng.integers(0, 5, v).astype(np.float64)
    elif kind == "neg_inf":
        x = rng.standard_normal(v) * 2
        x[rng.random(v) < 0.4] = -np.inf
        x[rng.integers(v)] = 0.5  # at least one finite (rows without any: test_non_finite_rows)
    elif kind == "one_finite":
        x = np.full(v, -np.inf)
        x[rng.integers(v)] = 1.5
    else:  # "wide": most weights underflow float32
        x = rng.standard_normal(v) * 100
    return x.astype(np.float32)


def _random_cases(seed: int, n: int, sizes: list[int]) -> list[Case]:
    rng = np.random.default_rng(seed)
    kinds = ["normal", "normal", "peaked", "ties", "neg_inf", "one_finite", "wide"]
    cases = []
    for _ in range(n):
        v = int(rng.choice(sizes))
        logits = _make_logits(rng, v, str(rng.choice(kinds)))
        top_k = int(
            rng.choice([0, -1, 1, 2, 5, 40, v // 2, v - 1, v, v + 3, rng.integers(1, v + 1)])
        )
        cases.append(
            Case(
                logits,
                temperature=float(rng.choice([0.05, 0.7, 1.0, 1.5, 50.0])),
                top_k=top_k,
                top_p=float(rng.choice([1.0, 1.0, 0.95, 0.5, 0.1, 1e-4])),
                min_p=float(rng.choice([0.0, 0.0, 0.01, 0.2, 1.0])),
            )
        )
    return cases


def _oracle(c: Case) -> tuple[np.ndarray, float]:
    """float64 probabilities of the reference semantics (vLLM V1's order: temperature, min-p, then
    top-k among its survivors, then top-p on their renormalized mass), and the margin of its
    closest decision (relative to the threshold concerned; inf when no filter applies)."""
    v = c.logits.size
    t = max(np.float32(c.temperature), np.float32(1e-5))
    x = c.logits / t  # float32 division, as torch and the C code do
    d = (x - x.max()).astype(np.float64)  # x - max is float32 in both implementations
    q = np.exp(d)
    q /= q.sum()
    margin = np.inf
    # top-k's cut among all tokens: min-p and top-k both keep the largest logits, so top-k among
    # the min-p survivors keeps the intersection of the two; a min-p decision for a token top-k
    # drops anyway cannot matter
    in_top_k = x >= np.sort(x)[::-1][c.top_k - 1] if 0 < c.top_k < v else np.ones(v, bool)
    min_p = float(np.float32(c.min_p))
    if min_p > 0:
        thr = min_p * q.max()
        ratio_below_1 = (q > 0) & (q != q.max()) & in_top_k  # the maxima pass, even at min_p = 1
        if ratio_below_1.any():
            margin = min(margin, float(np.abs(q[ratio_below_1] - thr).min()) / thr)
        x = np.where(q >= thr, x, np.float32(-np.inf))
    if 0 < c.top_k < v:
        kth = np.sort(x)[::-1][c.top_k - 1]  # exact in every implementation; -inf: keep all
        x = np.where(x < kth, np.float32(-np.inf), x)
    q = np.where(x > -np.inf, q, 0.0)
    q /= q.sum()
    top_p = float(np.float32(c.top_p))
    if top_p < 1.0:
        vals = np.sort(q)[::-1]
        before = np.cumsum(vals) - vals
        cut = vals[max(int((before < top_p).sum()), 1) - 1]
        others = vals[vals != cut]
        # counting one token more or less inside a run of ties leaves the cut where it is
        first_of_run = np.r_[True, vals[1:] != vals[:-1]]
        margin = min(margin, float(np.abs(before[first_of_run] - top_p).min()) / top_p)
        if others.size:
            margin = min(margin, float(np.abs(others - cut).min()) / cut)
        q = np.where(q >= cut, q, 0.0)
        q /= q.sum()
    return q, margin


def _reference(c: Case, u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    probs = filtered_probs(
        torch.from_numpy(c.logits)[None],
        torch.tensor([c.temperature], dtype=torch.float32),
        torch.tensor([c.top_k]),
        torch.tensor([c.top_p], dtype=torch.float32),
        torch.tensor([c.min_p], dtype=torch.float32),
    )
    tokens = sample_inverse_cdf(probs.expand(len(u), -1), torch.from_numpy(u))
    return probs[0].numpy(), tokens.numpy()


def _native(c: Case, u: np.ndarray, path: str) -> tuple[np.ndarray, np.ndarray]:
    n = len(u)
    tokens, probs = sample_rows(
        torch.from_numpy(c.logits)[None].expand(n, -1),  # stride 0: n draws from one row
        [c.temperature] * n,
        [c.top_k] * n,
        [c.top_p] * n,
        [c.min_p] * n,
        u,
        path=path,
        return_probs=True,
    )
    return probs[0], tokens


def _oracle_tokens(q: np.ndarray, u: np.ndarray, margin: float = U_MARGIN) -> tuple:
    """Tokens by inverse CDF in float64, and whether u is clear of every boundary."""
    cdf = np.cumsum(q)
    cdf /= cdf[-1]
    idx = np.minimum(np.searchsorted(cdf, u, side="right"), len(q) - 1)
    lo = np.where(idx > 0, cdf[np.maximum(idx - 1, 0)], 0.0)
    clear = (u - lo > margin) & (cdf[idx] - u > margin)
    return idx, clear


def _check_support(name: str, probs: np.ndarray, q: np.ndarray) -> None:
    assert np.all(probs[q == 0] == 0), f"{name} keeps filtered tokens"
    assert np.all(probs[q > TINY] > 0), f"{name} drops kept tokens"


def _run_cases(cases: list[Case], paths: list[str], n_u: int = 16) -> None:
    rng = np.random.default_rng(1234)
    n_close = n_u_skipped = n_checked = 0
    for i, c in enumerate(cases):
        u = rng.random(n_u)
        u[:2] = [0.0, 1.0 - 1e-12]  # the first kept token; the last one (or the fallback)
        q, margin = _oracle(c)
        natives = {p: _native(c, u, p) for p in paths}
        for p, (nat_p, nat_t) in natives.items():
            assert abs(float(nat_p.sum(dtype=np.float64)) - 1.0) < 1e-5, (i, p)
            assert np.all(nat_p[nat_t] > 0), (p, i)  # even near a boundary: a kept token
            # within float rounding even when a filter decision is close (the kept sets may then
            # differ, so compare on the common support)
            both = (nat_p > 0) & (q > 0)
            np.testing.assert_allclose(
                nat_p[both] / nat_p[both].sum(), q[both] / q[both].sum(), rtol=1e-5, atol=1e-12
            )
        if margin >= REF_TOL:  # validates the oracle against the reference
            ref_p, ref_t = _reference(c, u)
            _check_support("reference", ref_p, q)
            np.testing.assert_allclose(ref_p, q, rtol=3e-5, atol=1e-12)
            want, clear = _oracle_tokens(q, u, REF_U_MARGIN)
            assert ref_t[clear].tolist() == want[clear].tolist(), (i, c)
        if margin < TOL:
            n_close += 1
            continue
        want, clear = _oracle_tokens(q, u)
        n_u_skipped += int((~clear[2:]).sum())  # u = 0 and 1 - 1e-12 sit on boundaries
        n_checked += int(clear.sum())
        for p, (nat_p, nat_t) in natives.items():
            _check_support(f"{p} (case {i})", nat_p, q)
            np.testing.assert_allclose(nat_p, q, rtol=1e-5, atol=1e-12, err_msg=f"{p} case {i}")
            assert nat_t[clear].tolist() == want[clear].tolist(), (p, i, c)
    assert n_close <= len(cases) // 10, f"{n_close} of {len(cases)} cases too close to call"
    assert n_u_skipped <= n_checked // 20, (n_u_skipped, n_checked)


@pytest.mark.parametrize("seed", [0, 1])
def test_matches_reference_on_random_rows(seed: int) -> None:
    _run_cases(_random_cases(seed, 150, [1, 2, 3, 7, 8, 31, 100, 257, 1000, 4099]), PATHS)


def test_matches_reference_full_vocab() -> None:
    _run_cases(_random_cases(7, 10, [49152]), PATHS, n_u=64)


def test_benchmark_shaped_rows() -> None:
    """The engine's usual settings on randn * 3 logits, V = 49152."""
    rng = np.random.default_rng(3)
    cases = [
        Case((rng.standard_normal(49152) * 3).astype(np.float32), t, k, p, 0.0)
        for t, k, p in [(1.0, 0, 1.0), (0.8, 0, 0.95), (1.0, 50, 1.0), (0.7, 20, 0.8)]
    ]
    _run_cases(cases, PATHS, n_u=256)


@pytest.mark.parametrize("path", PATHS)
def test_min_p_applies_before_top_p(path: str) -> None:
    """vLLM V1's order: min-p, then top-k / top-p on what it kept. p = [0.4, 0.3, 30 x 0.01]:
    min-p 0.1 keeps {0, 1}, renormalized .57 / .43, so top-p 0.5 keeps {0} (top-p first: {0, 1})."""
    x = torch.tensor([[0.4, 0.3] + [0.01] * 30]).log()
    n = 64
    u = np.linspace(0.0, 0.999, n)

    def run(top_k: int, top_p: float, min_p: float) -> tuple[set[int], np.ndarray]:
        t, p = sample_rows(
            x.expand(n, -1), [1.0] * n, [top_k] * n, [top_p] * n, [min_p] * n, u,
            path=path, return_probs=True,
        )  # fmt: skip
        return set(t.tolist()), p[0]

    tokens, probs = run(0, 0.5, 0.1)
    assert tokens == {0} and probs[0] == 1.0 and not probs[1:].any()
    assert run(0, 0.5, 0.0)[0] == run(0, 1.0, 0.1)[0] == {0, 1}  # each filter alone
    # top-k counts among the min-p survivors: top-k 5 keeps just the two of them
    tokens, probs = run(5, 1.0, 0.1)
    assert tokens == {0, 1} and np.count_nonzero(probs) == 2
    np.testing.assert_allclose(probs[:2], [4 / 7, 3 / 7], rtol=1e-6)
    assert run(5, 0.5, 0.1)[0] == {0}


def test_min_p_with_top_p_full_vocab() -> None:
    """Settings where min-p's renormalization moves top-p's cut on most rows, V = 49152."""
    rng = np.random.default_rng(12)
    cases = [
        Case((rng.standard_normal(49152) * 3).astype(np.float32), t, k, p, mp)
        for t, k, p, mp in [(1.0, 0, 0.9, 0.05), (1.5, 0, 0.9, 0.1), (0.8, 100, 0.95, 0.02)]
    ]
    for c in cases:  # top-p first (on the full distribution), then min-p, would keep more
        q, _ = _oracle(c)
        top_p_only, _ = _oracle(Case(c.logits, c.temperature, c.top_k, c.top_p, 0.0))
        min_p_only, _ = _oracle(Case(c.logits, c.temperature, c.top_k, 1.0, c.min_p))
        top_p_first = (top_p_only > 0) & (min_p_only > 0)  # min-p's ratio test commutes with it
        assert np.all(top_p_first[q > 0])
        assert np.count_nonzero(q) < np.count_nonzero(top_p_first)
    _run_cases(cases, PATHS, n_u=128)


@pytest.mark.skipif(len(PATHS) < 2, reason="the CPU has no AVX2")
def test_portable_and_avx2_agree() -> None:
    rng = np.random.default_rng(11)
    cases = _random_cases(5, 200, [5, 8, 9, 33, 255, 256, 257, 1000, 3000])
    for i, c in enumerate(cases):
        u = rng.random(32)
        p0, t0 = _native(c, u, "portable")
        p1, t1 = _native(c, u, "avx2")
        np.testing.assert_allclose(p0, p1, rtol=1e-5, atol=1e-12, err_msg=str(i))
        if _oracle(c)[1] >= TOL:
            assert np.array_equal(p0 > 0, p1 > 0), i
            same, clear = _oracle_tokens(p0.astype(np.float64), u)
            assert t0[clear].tolist() == t1[clear].tolist() == same[clear].tolist(), i


def _draw_counts(c: Case, u: np.ndarray) -> np.ndarray:
    tokens = sample_rows(
        torch.from_numpy(c.logits)[None].expand(len(u), -1),
        [c.temperature] * len(u),
        [c.top_k] * len(u),
        [c.top_p] * len(u),
        [c.min_p] * len(u),
        u,
    )
    return np.bincount(tokens, minlength=c.logits.size)


def test_stratified_u_reproduces_the_distribution() -> None:
    """u = (i + 0.5) / N: each token is drawn round(p * N) times, give or take one."""
    rng = np.random.default_rng(8)
    c = Case((rng.standard_normal(1000) * 2).astype(np.float32), 0.9, 300, 0.9, 0.001)
    q, margin = _oracle(c)
    assert margin > TOL
    n = 100_000
    counts = _draw_counts(c, (np.arange(n) + 0.5) / n)
    assert np.abs(counts - q * n).max() <= 1.5
    assert set(np.nonzero(counts)[0]) <= set(np.nonzero(q)[0])


def test_random_u_chi_square() -> None:
    rng = np.random.default_rng(9)
    c = Case(rng.standard_normal(60).astype(np.float32), 1.2, 40, 0.97, 0.02)
    q, _ = _oracle(c)
    kept = np.nonzero(q)[0]
    assert 15 < len(kept) <= 40
    n = 40_000
    counts = _draw_counts(c, rng.random(n))
    assert counts.sum() == counts[kept].sum() == n
    expected = q[kept] * n
    chi2 = float(((counts[kept] - expected) ** 2 / expected).sum())
    df = len(kept) - 1
    assert chi2 < df + 6 * np.sqrt(2 * df), (chi2, df)  # P(false alarm) ~ 1e-5


# ------------------------------------------------------------------------------ edge cases


@pytest.mark.parametrize("path", PATHS)
def test_non_finite_rows(path: str) -> None:
    inf, nan = float("inf"), float("nan")
    rows = torch.tensor(
        [
            [-inf] * 11,  # nothing to draw: token 0, like argmax
            [nan, -inf, nan, -inf, nan, -inf, nan, -inf, nan, -inf, nan],
            [0.0, inf, 3.0, inf, -inf, nan, 1.0, 2.0, 0.0, 0.0, 0.0],  # uniform over the +inf
            [nan, 0.0, nan, 1.0, nan, 2.0, nan, 3.0, nan, 4.0, nan],  # NaN weighs 0
        ]
    )
    u = np.linspace(0, 0.999, 50)
    for r, want in [(0, {0}), (1, {0}), (2, {1, 3}), (3, {1, 3, 5, 7, 9})]:
        for params in [(1.0, 0, 1.0, 0.0), (0.7, 3, 0.9, 0.1)]:
            t, p = sample_rows(
                rows[r : r + 1].expand(50, -1),
                *([x] * 50 for x in params),
                u,
                path=path,
                return_probs=True,
            )
            assert set(t.tolist()) <= want, (r, params, t)
            assert np.isfinite(p).all() and abs(p[0].sum() - 1) < 1e-6
    _, p = sample_rows(rows[2:3], [1.0], [0], [1.0], [0.0], [0.5], path=path, return_probs=True)
    assert p[0, 1] == p[0, 3] == 0.5


@pytest.mark.parametrize("path", PATHS)
def test_logits_overflowing_at_small_temperature(path: str) -> None:
    """Finite logits whose quotient by T overflows float32 (|logit| / T > 3.4e38): the weights
    are exp((logit - max) / T), so the row's max takes all the mass (ties share it), as any small
    T would give; not NaN probabilities and token 0 (max / T = -inf), nor a uniform draw among
    the logits that overflow to +inf (max / T = +inf)."""
    inf = float("inf")
    rows = np.array(
        [
            [-2e34, -1e34, -3e34, -1.5e34, -inf],  # max / T = -inf
            [1e34, 2e34, 1.5e34, -2e34, 0.0],  # max / T = +inf
            [-1e34, -3e34, -2e34, -1e34, -5e34],  # tied maxima 0 and 3
            [1e34, inf, -inf, 2e34, 3.0],  # a real +inf: only it, not the overflowing 1e34s
        ],
        dtype=np.float32,
    )
    want = [{1}, {1}, {0, 3}, {1}]
    probs_want = np.zeros(rows.shape, dtype=np.float32)
    probs_want[[0, 1, 3], 1] = 1.0
    probs_want[2, [0, 3]] = 0.5
    u = np.linspace(0.0, 0.999, 12)
    for r in range(len(rows)):
        for t, k, top_p, min_p in [(0.0, 0, 1.0, 0.0), (1e-5, 2, 0.9, 0.0), (1e-4, 0, 0.5, 0.1),
                                   (1e-6, 4, 1.0, 0.5)]:  # fmt: skip
            toks, p = sample_rows(
                np.broadcast_to(rows[r], (len(u), rows.shape[1])),
                [t] * len(u), [k] * len(u), [top_p] * len(u), [min_p] * len(u), u,
                path=path, return_probs=True,
            )  # fmt: skip
            assert set(toks.tolist()) == want[r], (r, t, toks)
            np.testing.assert_array_equal(p, np.broadcast_to(probs_want[r], p.shape))


@pytest.mark.parametrize("path", PATHS)
def test_nan_is_minus_inf(path: str) -> None:
    """NaN logits behave exactly like -inf, for top-k too (both ranking directions)."""
    rng = np.random.default_rng(17)
    for v in (11, 40, 301):
        x = (rng.standard_normal(v) * 2).astype(np.float32)
        x[rng.random(v) < 0.5] = np.nan
        x_inf = np.where(np.isnan(x), -np.inf, x).astype(np.float32)
        for k in (0, 1, 3, v // 2, v // 2 + 1, v - 2, v - 1):
            for top_p, min_p in ((1.0, 0.0), (0.8, 0.05)):
                args = ([0.9] * 20, [k] * 20, [top_p] * 20, [min_p] * 20, rng.random(20))
                t_nan, p_nan = sample_rows(
                    np.broadcast_to(x, (20, v)), *args, path=path, return_probs=True
                )
                t_inf, p_inf = sample_rows(
                    np.broadcast_to(x_inf, (20, v)), *args, path=path, return_probs=True
                )
                assert np.array_equal(t_nan, t_inf) and np.array_equal(p_nan, p_inf), (v, k)


@pytest.mark.parametrize("path", PATHS)
def test_extremes_of_u_and_params(path: str) -> None:
    x = torch.tensor([[1.0, 5.0, 5.0, 2.0, 0.0, 5.0, -1.0]])

    def draw(u: float, **kw: float) -> int:
        args = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0} | kw
        return int(sample_rows(x, *([a] for a in args.values()), [u], path=path)[0])

    assert draw(0.0) == 0  # the first token with any weight
    assert draw(1.0 - 1e-16) == 6  # the last
    # tiny top_p, top_k 1 and min_p 1 keep exactly the tied maxima 1, 2, 5
    for kw in [{"top_p": 1e-6}, {"top_k": 1}, {"min_p": 1.0}, {"temperature": 0.0}]:
        assert [draw(u, **kw) for u in (0.0, 0.3, 0.5, 0.9, 0.999)] == [1, 1, 2, 5, 5], kw
    assert draw(0.999, top_k=2) == 5  # ties with the k-th are kept
    assert draw(0.66, top_k=3) == 2  # weights 1, 1, 1 at tokens 1, 2, 5
    assert draw(0.66, top_k=4) == 3  # plus e^-3 at token 3
    assert draw(0.0, top_k=-1) == draw(0.0, top_k=7) == draw(0.0, top_k=10**12) == 0
    v1 = sample_rows(torch.tensor([[3.0]]), [0.5], [1], [0.5], [0.5], [0.7], path=path)
    assert v1.tolist() == [0]


@pytest.mark.parametrize("path", PATHS)
def test_rounding_past_the_end_takes_the_last_kept_token(path: str) -> None:
    """Weights of 1e-17 next to a 1 vanish in a sequential double sum but not in the vectorised
    total, so u just below 1 runs past the end of the walk: like sample_inverse_cdf, the draw
    then takes the last kept token, not the first."""
    x = np.full((1, 200), -39.1, dtype=np.float32)
    x[0, 0] = 0.0
    x[0, -10:] = -np.inf
    u = [1.0 - 1e-16]
    assert sample_rows(x, [1.0], [0], [1.0], [0.0], u, path=path).tolist() == [189]
    ref = sample_inverse_cdf(
        filtered_probs(torch.from_numpy(x), *map(torch.tensor, ([1.0], [0], [1.0], [0.0]))),
        torch.tensor(u, dtype=torch.float64),
    )
    assert ref.tolist() == [189]


def test_temperature_zero_is_clamped_like_the_reference() -> None:
    x = torch.tensor([[0.0, -1e-4, -3e-4]])  # T = 1e-5 spreads these by 10 and 30
    _, probs = sample_rows(x, [0.0], [0], [1.0], [0.0], [0.5], return_probs=True)
    want = filtered_probs(x, *map(torch.tensor, ([0.0], [0], [1.0], [0.0])))
    np.testing.assert_allclose(probs, want.numpy(), rtol=1e-4, atol=1e-12)
    assert probs[0, 1] > 1e-5


def test_row_is_a_pure_function_of_its_inputs() -> None:
    """Same row, params and u: same token and probabilities, whatever else is in the batch
    (the scratch buffer is reused row after row) and whichever row index it has."""
    rng = np.random.default_rng(21)
    target = torch.from_numpy((rng.standard_normal(5000) * 3).astype(np.float32))
    params = (0.9, 100, 0.9, 0.01)
    alone_t, alone_p = sample_rows(target[None], *([x] for x in params), [0.37], return_probs=True)
    for pos in (0, 3, 6):
        others = torch.from_numpy((rng.standard_normal((6, 5000)) * 10).astype(np.float32))
        batch = torch.cat([others[:pos], target[None], others[pos:]])
        n = batch.shape[0]
        mixed = [(1.0, 0, 1.0, 0.0), (0.3, 2, 0.5, 0.5), (5.0, 4000, 0.99, 0.0)]
        ps = [mixed[j % 3] if j != pos else params for j in range(n)]
        u = rng.random(n)
        u[pos] = 0.37
        t, p = sample_rows(batch, *map(list, zip(*ps, strict=True)), u, return_probs=True)
        assert t[pos] == alone_t[0] and np.array_equal(p[pos], alone_p[0])


def test_rows_strides_and_numpy_input() -> None:
    rng = np.random.default_rng(4)
    wide = torch.from_numpy((rng.standard_normal((5, 700)) * 2).astype(np.float32))
    x = wide[:, 50:650]  # row stride 700, rows contiguous
    params = ([0.8] * 3, [20] * 3, [0.9] * 3, [0.0] * 3)
    u = rng.random(3)
    want, want_p = sample_rows(
        x[[4, 0, 2]].contiguous(), *params, u, return_probs=True, path=PATHS[-1]
    )
    got, got_p = sample_rows(x, *params, u, rows=[4, 0, 2], return_probs=True, path=PATHS[-1])
    assert got.tolist() == want.tolist() and np.array_equal(got_p, want_p)
    got_np = sample_rows(x.numpy(), *params, u, rows=np.array([4, 0, 2]), path=PATHS[-1])
    assert got_np.tolist() == want.tolist()
    before = x.clone()
    sample_rows(x, *params, u, rows=[4, 0, 2])
    assert torch.equal(x, before)  # logits are not modified
    assert sample_rows(x, [], [], [], [], [], rows=[]).shape == (0,)


def test_threads_share_nothing() -> None:
    rng = np.random.default_rng(6)
    x = torch.from_numpy((rng.standard_normal((64, 3000)) * 3).astype(np.float32))
    args = ([0.9] * 64, [50] * 64, [0.95] * 64, [0.0] * 64, rng.random(64))
    want = sample_rows(x, *args)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: sample_rows(x, *args), range(16)))
    assert all(r.tolist() == want.tolist() for r in results)


def test_sampler_uses_native_draw_with_reference_semantics() -> None:
    """Sampler.sample (seeded rows, so u is known) draws what the torch reference draws."""
    rng = np.random.default_rng(13)
    s = Sampler(0)
    params = [
        SP(temperature=0.8, top_p=0.95, seed=1),
        SP(temperature=1.0, seed=2),
        SP(temperature=0.0),  # greedy rows mixed in: the native call gets row indices
        SP(temperature=1.3, top_k=30, min_p=0.05, seed=3),
    ]
    states = [s.new_state(p) for p in params]
    outputs: list[list[int]] = [[] for _ in params]
    for _ in range(10):
        logits = torch.from_numpy((rng.standard_normal((4, 2000)) * 3).astype(np.float32))
        got = s.sample(logits, states, outputs).token_ids
        for i, p in enumerate(params):
            if p.greedy:
                assert got[i] == int(logits[i].argmax())
                continue
            u = np.array([seeded_uniform(p.seed, len(outputs[i]))])
            c = Case(logits[i].numpy(), p.temperature, p.top_k, p.top_p, p.min_p)
            q, margin = _oracle(c)
            want, clear = _oracle_tokens(q, u, REF_U_MARGIN)
            if margin > REF_TOL and clear[0]:
                assert got[i] == want[0] == _reference(c, u)[1][0]
        outputs = [o + [int(t)] for o, t in zip(outputs, got, strict=True)]


# ------------------------------------------------------------------------------ bad input


def _good() -> dict:
    return {
        "logits": torch.zeros(2, 10),
        "temperature": [1.0, 0.5],
        "top_k": [0, 3],
        "top_p": [1.0, 0.9],
        "min_p": [0.0, 0.1],
        "u": [0.1, 0.9],
    }


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"logits": torch.zeros(2, 10, dtype=torch.float64)}, "float32"),
        ({"logits": torch.zeros(10)}, "2-D"),
        ({"logits": torch.zeros(2, 0)}, "at least one column"),
        ({"logits": torch.zeros(10, 2).t()}, "contiguous"),
        ({"logits": [[0.0] * 10] * 2}, "torch.Tensor or np.ndarray"),
        ({"logits": np.zeros((2, 10))}, "float32"),
        ({"temperature": [1.0]}, "shape"),
        ({"temperature": [1.0, -0.1]}, "temperature"),
        ({"temperature": [float("nan"), 1.0]}, "temperature"),
        ({"temperature": [float("inf"), 1.0]}, "temperature"),
        ({"top_k": [0, -2]}, "top_k"),
        ({"top_k": [0, 2**70]}, "top_k"),
        ({"top_p": [0.0, 1.0]}, "top_p"),
        ({"top_p": [1.0, 1.5]}, "top_p"),
        ({"top_p": [float("nan"), 1.0]}, "top_p"),
        ({"min_p": [-0.1, 0.0]}, "min_p"),
        ({"min_p": [0.0, 1.01]}, "min_p"),
        ({"u": [0.1, 1.0]}, "u must be"),
        ({"u": [-0.1, 0.5]}, "u must be"),
        ({"u": [[0.1, 0.2]]}, "shape"),
        ({"rows": [0, 2]}, "rows"),
        ({"rows": [[0, 1]]}, "rows"),
        ({"rows": [-1, 0]}, "rows"),
        ({"path": "avx512"}, "unknown path"),
    ],
)
def test_bad_inputs_raise_value_error(change: dict, message: str) -> None:
    kwargs = _good() | change
    with pytest.raises(ValueError, match=message):
        sample_rows(**kwargs)


def test_scratch_is_per_thread_and_grows() -> None:
    small = sample_native._work(10)
    big = sample_native._work(100_000)
    assert big.nbytes >= sample_native.lib.shms_work_bytes(100_000) > small.nbytes
    assert sample_native._work(10) is big  # reused, never shrunk


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("v", [1, 31, 32, 33, 320, 49152])
def test_mask_rows_sets_exactly_the_refused_tokens_to_minus_inf(v: int, path: str) -> None:
    rng = np.random.default_rng(v)
    words = (v + 31) // 32 + 1  # llguidance's rows may be wider than the vocabulary needs
    masks = rng.integers(-(2**31), 2**31, size=(3, words), dtype=np.int64).astype(np.int32)
    masks[1, :] = -1  # all allowed
    masks[2, : max(1, words // 2)] = 0  # a run refused
    logits = torch.randn(5, v + 7)[:, :v]  # a row stride wider than v
    before = logits.clone()
    rows = [4, 0, 2]
    argmax = sample_native.mask_rows(logits, rows, masks, path)
    bits = np.unpackbits(masks.view(np.uint8), axis=1, bitorder="little")[:, :v].astype(bool)
    for j, r in enumerate(rows):
        want = torch.where(torch.from_numpy(bits[j]), before[r], torch.tensor(float("-inf")))
        assert torch.equal(logits[r], want)
        assert argmax[j] == int(argmax_rows(logits[r : r + 1].contiguous())[0])
    for r in (1, 3):
        assert torch.equal(logits[r], before[r])


@pytest.mark.parametrize("path", PATHS)
def test_mask_rows_argmax_takes_the_first_largest_and_nan_as_minus_inf(path: str) -> None:
    inf, nan = float("inf"), float("nan")
    cases = [
        ([nan, -inf, -inf], 0),
        ([-inf] * 20, 0),
        ([1.0, 3.0, nan, 3.0] * 5, 1),
        ([0.0] * 17 + [2.0] + [nan] * 3 + [2.0], 17),
        ([-1.0] * 9 + [inf] + [0.0] * 9 + [inf], 9),
        ([nan] * 12 + [-5.0], 12),
    ]
    for row, want in cases:
        logits = torch.tensor([row], dtype=torch.float32)
        ones = np.full((1, (len(row) + 31) // 32), -1, dtype=np.int32)
        assert sample_native.mask_rows(logits, [0], ones, path)[0] == want, row
        assert int(argmax_rows(logits)[0]) == want, row


def test_mask_rows_refuses_bad_shapes() -> None:
    logits = torch.zeros(2, 64)
    with pytest.raises(ValueError, match="masks must be"):
        sample_native.mask_rows(logits, [0], np.zeros((1, 1), dtype=np.int32))
    with pytest.raises(ValueError, match="rows must be"):
        sample_native.mask_rows(logits, [2], np.zeros((1, 2), dtype=np.int32))
    with pytest.raises(ValueError, match="masks must be"):
        sample_native.mask_rows(logits, [0, 1], np.zeros((1, 2), dtype=np.int32))
    base = torch.zeros(64)
    with pytest.raises(ValueError, match="overlap"):  # stride 0: rows share memory
        sample_native.mask_rows(base[:8].expand(4, -1), [3], np.zeros((1, 1), dtype=np.int32))
    assert not base.isinf().any()
    frozen = np.frombuffer(b"\0" * 256, dtype=np.float32).reshape(1, 64)
    with pytest.raises(ValueError, match="writable"):  # it had written -inf into the bytes
        sample_native.mask_rows(frozen, [0], np.zeros((1, 2), dtype=np.int32))
