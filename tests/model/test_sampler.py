"""Sampler: greedy, exact filter masks, distributions, penalties, seeds, logprobs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from shm_engine.model.sampler import (
    Sampler,
    SamplingState,
    filtered_probs,
    sample_inverse_cdf,
    seeded_uniform,
)
from shm_engine.sampling_params import SamplingParams as SP

PROBS = [0.05, 0.4, 0.1, 0.3, 0.15]  # order scrambled on purpose; ranks: 1, 3, 4, 2, 0
LOGITS = torch.tensor([PROBS]).log()


def _states(sampler: Sampler, params: list[SP], prompts=None) -> list[SamplingState]:  # noqa: ANN001
    prompts = prompts or [[] for _ in params]
    return [
        sampler.new_state(p, pr, eos_token_ids=[0]) for p, pr in zip(params, prompts, strict=True)
    ]


def _filter(**kw) -> torch.Tensor:  # noqa: ANN003
    args = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0} | kw
    return filtered_probs(
        LOGITS,
        torch.tensor([args["temperature"]]),
        torch.tensor([args["top_k"]]),
        torch.tensor([args["top_p"]]),
        torch.tensor([args["min_p"]]),
    )[0]


def _kept(probs: torch.Tensor) -> set[int]:
    return set(torch.nonzero(probs).flatten().tolist())


def test_greedy_is_argmax() -> None:
    s = Sampler(0)
    logits = torch.randn(6, 1000, generator=torch.Generator().manual_seed(1))
    states = _states(s, [SP(temperature=0.0)] * 3 + [SP(top_k=1)] * 3)
    out = s.sample(logits, states, [[]] * 6)
    assert out.token_ids.dtype == np.int32 and out.logprobs is None
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()
    # the non-fast path (a row wants logprobs) gives the same tokens
    states[0] = s.new_state(SP(temperature=0.0, logprobs=2))
    assert s.sample(logits, states, [[]] * 6).token_ids.tolist() == logits.argmax(-1).tolist()


def test_top_k_mask() -> None:
    assert _kept(_filter(top_k=2)) == {1, 3}
    torch.testing.assert_close(_filter(top_k=2)[[1, 3]], torch.tensor([0.4, 0.3]) / 0.7)
    assert _kept(_filter(top_k=0)) == _kept(_filter(top_k=-1)) == set(range(5))
    assert _kept(_filter(top_k=50)) == set(range(5))


def test_top_p_mask() -> None:
    assert _kept(_filter(top_p=0.3)) == {1}  # the top token alone already exceeds 0.3
    assert _kept(_filter(top_p=0.65)) == {1, 3}
    assert _kept(_filter(top_p=0.75)) == {1, 3, 4}
    assert _kept(_filter(top_p=0.9)) == {1, 3, 4, 2}
    torch.testing.assert_close(_filter(top_p=0.65)[[1, 3]], torch.tensor([0.4, 0.3]) / 0.7)


def test_min_p_mask() -> None:
    assert _kept(_filter(min_p=0.3)) == {1, 3, 4}  # p >= 0.12
    assert _kept(_filter(min_p=0.5)) == {1, 3}  # p >= 0.2
    assert _kept(_filter(min_p=1.0)) == {1}


# p = [0.4, 0.3, 30 x 0.01]: min-p 0.1 keeps {0, 1} (p >= 0.04), renormalized .57 / .43, so
# top-p 0.5 then keeps {0} alone (vLLM V1); top-p first, on the full distribution, keeps {0, 1}
REPRO = torch.tensor([[0.4, 0.3] + [0.01] * 30]).log()


def _filter_repro(top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
    return filtered_probs(
        REPRO, torch.tensor([1.0]), torch.tensor([top_k]), torch.tensor([top_p]),
        torch.tensor([min_p]),
    )[0]  # fmt: skip


def _vllm_v1_probs(
    logits: torch.Tensor, temp: float, k: int, p: float, min_p: float
) -> torch.Tensor:
    """vLLM V1's filter chain transcribed (vllm/v1/sample/sampler.py Sampler.sample: temperature,
    then the argmax-invariant logits processors, i.e. MinPLogitsProcessor.apply, then
    topk_topp_sampler.apply_top_k_top_p), with one full sort: the readable spec."""
    x = logits / max(temp, 1e-5)
    if min_p > 0:
        probs = torch.softmax(x, dim=-1)
        x = x.masked_fill(probs < probs.amax(dim=-1, keepdim=True) * min_p, float("-inf"))
    x_sort, idx = x.sort(dim=-1, descending=False)
    if 0 < k < x.shape[1]:
        kth = x_sort.gather(1, torch.full((x.shape[0], 1), x.shape[1] - k))
        x_sort = x_sort.masked_fill(x_sort < kth, float("-inf"))
    if p < 1.0:
        cum = x_sort.softmax(dim=-1).cumsum(dim=-1)
        mask = cum <= 1 - p
        mask[:, -1] = False
        x_sort = x_sort.masked_fill(mask, float("-inf"))
    return torch.softmax(x_sort.scatter(-1, idx, x_sort), dim=-1)


def test_min_p_applies_before_top_p_like_vllm_v1() -> None:
    assert _kept(_filter_repro(top_p=0.5, min_p=0.1)) == {0}
    assert _kept(_vllm_v1_probs(REPRO, 1.0, 0, 0.5, 0.1)[0]) == {0}
    assert _kept(_filter_repro(top_p=0.5)) == _kept(_filter_repro(min_p=0.1)) == {0, 1}
    # top-k counts among the min-p survivors (two here)
    assert _kept(_filter_repro(top_k=5, min_p=0.1)) == {0, 1}
    assert _kept(_filter_repro(top_k=5, top_p=0.5, min_p=0.1)) == {0}
    # token 1 (p = 0.3) is never drawn, whatever u
    n = 400
    s = Sampler(0)
    out = s.sample(REPRO.expand(n, -1), _states(s, [SP(top_p=0.5, min_p=0.1)] * n), [[]] * n)
    assert set(out.token_ids.tolist()) == {0}
    # PROBS: min-p 0.3 keeps {1, 3, 4} (p >= .12), renormalized .47, .35, .18: top-p .8 keeps two
    # (on the full distribution top-p .8 keeps three, which min-p would leave alone)
    assert _kept(_filter(min_p=0.3, top_p=0.8)) == {1, 3}
    assert _kept(_filter(top_p=0.8)) == {1, 3, 4}


def test_top_k_counts_among_min_p_survivors() -> None:
    # min-p 0.5 keeps {1, 3}: top-k 3 or more then keeps just those, top-k 1 the top token
    assert _kept(_filter(min_p=0.5, top_k=3)) == _kept(_filter(min_p=0.5, top_k=50)) == {1, 3}
    assert _kept(_filter(min_p=0.5, top_k=1)) == {1}
    # the two filters commute (both keep the largest logits): the result is their intersection
    assert _kept(_filter(min_p=0.3, top_k=2)) == {1, 3}
    torch.testing.assert_close(_filter(min_p=0.3, top_k=2), _filter(top_k=2))
    torch.testing.assert_close(_filter(min_p=0.5, top_k=4), _filter(min_p=0.5))


@pytest.mark.parametrize(
    ("temp", "k", "p", "min_p"),
    [
        (1.0, 0, 0.9, 0.05),
        (0.7, 0, 0.5, 0.2),
        (1.5, 40, 0.95, 0.02),
        (1.3, 8, 0.7, 0.1),
        (0.9, 300, 0.99, 0.001),
        (2.0, 0, 1.0, 0.1),
        (1.0, 20, 1.0, 0.3),
    ],
)
def test_filtered_probs_match_vllm_v1_transcription(
    temp: float, k: int, p: float, min_p: float
) -> None:
    logits = torch.randn(6, 1000, generator=torch.Generator().manual_seed(k + int(100 * p))) * 3
    b = logits.shape[0]
    got = filtered_probs(
        logits,
        torch.full((b,), temp),
        torch.full((b,), k),
        torch.full((b,), p),
        torch.full((b,), min_p),
    )
    want = _vllm_v1_probs(logits, temp, k, p, min_p)
    assert torch.equal(got > 0, want > 0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_combined_masks_and_temperature() -> None:
    # after top-k=3 the mass is renormalized: .47, .35, .18 -> top_p .8 drops the third
    assert _kept(_filter(top_k=3, top_p=0.8)) == {1, 3}
    hot = _filter(temperature=2.0)
    want = torch.tensor(PROBS).sqrt()
    torch.testing.assert_close(hot, want / want.sum())


def test_inverse_cdf_never_picks_zero_probability() -> None:
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 4)
    u = torch.tensor([0.0, 0.4999, 0.5, 1.0 - 1e-16], dtype=torch.float64)
    assert sample_inverse_cdf(probs, u).tolist() == [1, 1, 3, 3]


def _chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("seeded", [False, True])
def test_temperature_distribution(seeded: bool) -> None:
    n, temp = 20000, 0.7
    s = Sampler(123)
    params = [SP(temperature=temp, seed=i if seeded else None) for i in range(n)]
    out = s.sample(LOGITS.expand(n, -1), _states(s, params), [[]] * n)
    counts = np.bincount(out.token_ids, minlength=5)
    probs = torch.softmax(LOGITS[0] / temp, -1).numpy()
    # 4 degrees of freedom: P(chi2 > 25) < 1e-4
    assert _chi_square(counts, probs) < 25.0, (counts, probs * n)


def test_filtered_sampling_respects_masks() -> None:
    n = 3000
    s = Sampler(5)
    # T=1.3 flattens to .44, .35, .21 over the top 3: top_p .7 keeps two
    params = [SP(temperature=1.3, top_k=3, top_p=0.7, min_p=0.05)] * n
    out = s.sample(LOGITS.expand(n, -1), _states(s, params), [[]] * n)
    counts = np.bincount(out.token_ids, minlength=5)
    assert set(np.nonzero(counts)[0].tolist()) == {1, 3}


def test_penalties_on_crafted_logits() -> None:
    s = Sampler(0)
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0, 3.0]])
    params = SP(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    states = _states(s, [params], prompts=[[0]])
    x = s.process_logits(logits, states, [[1, 2, 2]])
    # repetition over prompt+output {0, 1, 2}: 2/2, -1*2, 0.5/2; then output counts {1: 1, 2: 2}
    want = [1.0, -2.0 - 0.5 - 0.25, 0.25 - 1.0 - 0.25, 1.0, 3.0]
    torch.testing.assert_close(x[0], torch.tensor(want))
    assert torch.equal(logits, torch.tensor([[2.0, -1.0, 0.5, 1.0, 3.0]]))  # input untouched
    # incremental counting gives the same as a fresh state
    x2 = s.process_logits(logits, states, [[1, 2, 2, 4]])
    fresh = s.process_logits(logits, _states(s, [params], prompts=[[0]]), [[1, 2, 2, 4]])
    torch.testing.assert_close(x2, fresh)
    assert x2[0, 4] == 3.0 / 2.0 - 0.5 - 0.25


def test_penalties_change_greedy_choice() -> None:
    s = Sampler(0)
    logits = torch.tensor([[0.0, 1.0, 0.9]])
    plain = s.new_state(SP(temperature=0.0))
    pen = s.new_state(SP(temperature=0.0, frequency_penalty=1.0))
    out = s.sample(logits.expand(2, -1), [plain, pen], [[1], [1]])
    assert out.token_ids.tolist() == [1, 2]


def test_logit_bias_and_allowed_token_ids() -> None:
    s = Sampler(0)
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0, -1.0]])
    plain = s.new_state(SP(temperature=0.0))
    ban = s.new_state(SP(temperature=0.0, logit_bias={1: -100.0}))
    boost = s.new_state(SP(temperature=0.0, logit_bias={4: 5.0, 1: 0.5}))
    allowed = s.new_state(SP(temperature=0.0, allowed_token_ids=[3, 0]))
    both = s.new_state(SP(temperature=0.0, allowed_token_ids=[3, 0], logit_bias={0: 1.5}))
    assert not ban.plain_greedy and not allowed.plain_greedy and plain.plain_greedy
    states = [plain, ban, boost, allowed, both]
    out = s.sample(logits.expand(5, -1), states, [[]] * 5)
    assert out.token_ids.tolist() == [1, 2, 4, 3, 0]
    # sampled rows draw only allowed tokens, and a bias shifts the odds; logprobs stay the
    # model's (vLLM's raw logprobs)
    hot = s.new_state(SP(temperature=1.0, allowed_token_ids=[2, 4], logprobs=0))
    draws = [s.sample(logits, [hot], [[]]) for _ in range(200)]
    assert {int(d.token_ids[0]) for d in draws} == {2, 4}
    lp = draws[0].logprobs[0]
    raw = torch.log_softmax(logits[0], -1)
    assert lp.logprobs[0] == pytest.approx(float(raw[lp.token_ids[0]]))
    wide = torch.zeros(1, 5)
    tilt = s.new_state(SP(temperature=1.0, logit_bias={3: math.log(9.0)}))  # p(3) = 9 / 13
    n3 = sum(int(s.sample(wide, [tilt], [[]]).token_ids[0]) == 3 for _ in range(2000))
    assert abs(n3 / 2000 - 9 / 13) < 0.04


def test_bad_words_ban_a_words_last_token_after_the_rest() -> None:
    s = Sampler(0)
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0]])  # 1 > 2 > 3 > 0
    st = s.new_state(SP(temperature=0.0, bad_words=["w"]), bad_words=[[1], [2, 3, 2]])
    assert not st.plain_greedy
    assert s.sample(logits, [st], [[]]).token_ids.tolist() == [2]  # [1] always banned
    assert s.sample(logits, [st], [[0, 2, 3]]).token_ids.tolist() == [3]  # 2 3 | 2 banned
    assert s.sample(logits, [st], [[2, 0, 3]]).token_ids.tolist() == [2]  # not after 2 3
    assert st.banned([3]) == [1] and st.banned([2, 3]) == [1, 2]


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    s = Sampler(0)
    logits = torch.tensor([[5.0, 1.0, 4.0, 0.0]])  # eos (0) then stop id 2 are the top two
    st = s.new_state(SP(temperature=0.0, min_tokens=2, stop_token_ids=[2]), [], eos_token_ids=[0])
    assert s.sample(logits, [st], [[]]).token_ids.tolist() == [1]
    assert s.sample(logits, [st], [[3]]).token_ids.tolist() == [1]
    assert s.sample(logits, [st], [[3, 3]]).token_ids.tolist() == [0]
    # ignore_eos keeps EOS from ending the request, not from being masked (vLLM's min_tokens)
    ign = s.new_state(SP(temperature=0.0, min_tokens=2, ignore_eos=True), [], eos_token_ids=[0])
    assert s.sample(logits, [ign], [[]]).token_ids.tolist() == [2]
    assert s.sample(logits, [ign], [[3, 3]]).token_ids.tolist() == [0]


def _run(seed_params: SP, others: list[SP], position: int, steps: int, v: int = 1000) -> list[int]:
    """Sample `steps` tokens for one seeded request placed among `others` in the batch."""
    s = Sampler()  # unseeded shared generator: other rows differ from run to run
    g = torch.Generator().manual_seed(99)
    target = s.new_state(seed_params)
    other_states = _states(s, others)
    outputs: list[int] = []
    for _ in range(steps):
        logits = torch.randn(1, v, generator=g)  # the request's own logits, fixed per step
        rows = [torch.randn(1, v) for _ in others]
        rows.insert(position, logits)
        states = list(other_states)
        states.insert(position, target)
        outs = [[] for _ in others]
        outs.insert(position, outputs)
        res = s.sample(torch.cat(rows), states, outs)
        outputs = outputs + [int(res.token_ids[position])]
    return outputs


def test_seed_reproducible_across_runs_and_batches() -> None:
    p = SP(temperature=1.0, top_p=0.95, seed=1234)
    alone = _run(p, [], 0, 12)
    assert _run(p, [], 0, 12) == alone
    crowd = [SP(temperature=0.9), SP(temperature=0.0), SP(temperature=1.0, seed=7, top_k=5)]
    assert _run(p, crowd, 2, 12) == alone
    assert _run(p, crowd[:1], 0, 12) == alone
    assert len(set(alone)) > 6  # it does sample
    assert _run(SP(temperature=1.0, top_p=0.95, seed=1235), [], 0, 12) != alone


def test_seeded_uniform_is_pinned() -> None:
    """Counter-based streams must not change across releases (users rely on seeds)."""
    assert seeded_uniform(42, 0) == pytest.approx(0.7834694117994531, abs=0)
    assert seeded_uniform(42, 1) == pytest.approx(0.0819684217563379, abs=0)
    assert seeded_uniform(0, 0) == pytest.approx(0.852601299231752, abs=0)


def test_logprobs_are_raw_and_ranked() -> None:
    s = Sampler(3)
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(4))
    params = [
        SP(temperature=0.0, logprobs=3),
        SP(temperature=0.8, top_k=10, logprobs=0, repetition_penalty=1.5),
        SP(temperature=0.0),
    ]
    out = s.sample(logits, _states(s, params, prompts=[[1], [1, 2], []]), [[], [5], []])
    assert out.logprobs is not None and out.logprobs[2] is None
    ref = torch.log_softmax(logits, -1)
    lp0 = out.logprobs[0]
    assert lp0.token_ids[0] == out.token_ids[0] == int(logits[0].argmax())
    assert lp0.sampled_rank == 1 and len(lp0.token_ids) == 4
    assert lp0.token_ids[1:] == ref[0].topk(3).indices.tolist()
    np.testing.assert_allclose(lp0.logprobs, ref[0, lp0.token_ids].numpy(), rtol=1e-6)
    lp1 = out.logprobs[1]
    tok = int(out.token_ids[1])
    assert lp1.token_ids == [tok]
    assert lp1.logprobs[0] == pytest.approx(float(ref[1, tok]), rel=1e-6)  # raw, not penalized
    assert lp1.sampled_rank == int((ref[1] >= ref[1, tok]).sum())
    assert math.isfinite(lp1.logprobs[0])


def test_a_tied_sampled_token_is_ranked_below_every_token_as_likely() -> None:
    """vLLM's rank counts the tokens at least as likely: a two-way tie for the top is rank 2."""
    s = Sampler(0)
    logits = torch.tensor([[3.0, 1.0, 3.0, 0.0]])
    out = s.sample(logits, _states(s, [SP(temperature=0.0, logprobs=1)]), [[]])
    assert out.logprobs[0].sampled_rank == 2


def test_more_logprobs_than_the_vocabulary_has_returns_all_of_them() -> None:
    s = Sampler(0)
    out = s.sample(torch.randn(1, 10), _states(s, [SP(temperature=0.0, logprobs=20)]), [[]])
    assert out.logprobs is not None and sorted(out.logprobs[0].token_ids[1:]) == list(range(10))
