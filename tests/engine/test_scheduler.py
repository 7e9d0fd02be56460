"""Scheduler and KV cache manager unit tests, with a deterministic stand-in for the model's sampler.

The fake "model" picks the next token as a hash of the whole prefix, so any bookkeeping error
(wrong positions, lost tokens, recompute after preemption from the wrong place) changes the output.
"""

from __future__ import annotations

import hashlib

import pytest

from shm_engine.engine.config import EngineConfig
from shm_engine.engine.request import Request
from shm_engine.engine.scheduler import SampledTokens, Scheduler, SchedulerOutput
from shm_engine.sampling_params import SamplingParams

EOS = 0
VOCAB = 1000


def next_token(prefix: list[int]) -> int:
    digest = hashlib.blake2b(str(prefix).encode(), digest_size=4).digest()
    return 1 + int.from_bytes(digest, "little") % (VOCAB - 1)  # never EOS


def make_scheduler(
    num_blocks=64, block_size=4, budget=32, max_seqs=8, max_model_len=1024, **kw
) -> Scheduler:
    cfg = EngineConfig(
        block_size=block_size, max_num_batched_tokens=budget, max_num_seqs=max_seqs, **kw
    )
    return Scheduler(cfg, num_blocks=num_blocks, max_model_len=max_model_len)


def make_request(
    rid: str, prompt: list[int], max_tokens=8, priority=0, arrival=0.0, **sp
) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, **sp)
    return Request(rid, prompt, params, (EOS,), max_tokens, arrival_time=arrival, priority=priority)


def run_step(s: Scheduler, forced: dict[str, int] | None = None) -> tuple[SchedulerOutput, dict]:
    out = s.schedule()
    tokens = []
    for c in out.chunks:
        if c.samples:
            prefix = c.request.all_token_ids[: c.start + c.num_tokens]
            tokens.append((forced or {}).get(c.request.request_id, next_token(prefix)))
    return out, s.update_from_output(out, SampledTokens(tokens))


def run_to_completion(s: Scheduler, max_steps=1000) -> dict[str, list[int]]:
    results: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not s.has_requests():
            return results
        _, o = run_step(s)
        k = 0
        for rid, n in zip(o.request_ids, o.num_new_tokens, strict=True):
            results.setdefault(rid, []).extend(o.new_token_ids[k : k + n])
            k += n
    raise AssertionError("did not finish")


def reference_output(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(prompt) :]


def test_budget_is_shared_by_decodes_and_chunked_prefills():
    s = make_scheduler(budget=128, block_size=16, num_blocks=64)
    for i in range(3):
        s.add_request(make_request(f"r{i}", list(range(1 + i * 100, 101 + i * 100))))
    out, _ = run_step(s)
    assert [(c.request.request_id, c.num_tokens) for c in out.chunks] == [("r0", 100), ("r1", 28)]
    assert [c.samples for c in out.chunks] == [True, False]
    out, _ = run_step(s)
    assert [(c.request.request_id, c.num_tokens) for c in out.chunks] == [
        ("r0", 1),
        ("r1", 72),
        ("r2", 55),
    ]
    assert sum(c.num_tokens for c in out.chunks) == 128


def test_without_chunked_prefill_a_long_prompt_waits_for_a_whole_budget():
    s = make_scheduler(budget=128, block_size=16, max_model_len=128, enable_chunked_prefill=False)
    s.add_request(make_request("a", list(range(1, 101))))
    s.add_request(make_request("b", list(range(1, 101))))
    out, _ = run_step(s)
    assert [(c.request.request_id, c.num_tokens) for c in out.chunks] == [("a", 100)]
    results = run_to_completion(s)
    assert sorted(results) == ["a", "b"]  # b ran once a's budget was free


def test_without_chunked_prefill_the_budget_must_cover_the_context():
    # Otherwise a prompt (or a preempted sequence) longer than the budget would wait forever.
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        make_scheduler(budget=128, max_model_len=1024, enable_chunked_prefill=False)


def test_long_prefill_threshold_caps_each_requests_chunk():
    """Each prompt advances by at most the threshold a step, so several share the budget."""
    s = make_scheduler(budget=128, block_size=16, long_prefill_token_threshold=48)
    for i in range(3):
        s.add_request(make_request(f"r{i}", list(range(1 + i * 100, 101 + i * 100))))
    out, _ = run_step(s)
    assert [(c.request.request_id, c.num_tokens) for c in out.chunks] == [
        ("r0", 48),
        ("r1", 48),
        ("r2", 32),
    ]
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        EngineConfig(long_prefill_token_threshold=-1)


def test_outputs_match_an_unbatched_reference():
    s = make_scheduler(budget=16, block_size=4)
    prompts = {f"r{i}": list(range(10 * i + 1, 10 * i + 1 + 5 + 3 * i)) for i in range(6)}
    for rid, p in prompts.items():
        s.add_request(make_request(rid, p, max_tokens=7))
    results = run_to_completion(s)
    for rid, p in prompts.items():
        assert results[rid] == reference_output(p, 7)
    assert s.kv.num_free_blocks == 64


def test_prefix_cache_hits_are_counted_and_reused():
    s = make_scheduler(block_size=4, budget=64)
    system = list(range(1, 21))  # 5 full blocks
    s.add_request(make_request("first", system + [50, 51], max_tokens=2))
    run_to_completion(s)
    s.add_request(make_request("second", system + [60, 61, 62], max_tokens=2))
    out, o = run_step(s)
    assert out.chunks[0].start == 20  # the shared system prompt is not recomputed
    assert out.chunks[0].num_tokens == 3
    assert o.num_cached_tokens == {0: 20}
    assert s.kv.pool.hits == 20
    # A fully cached prompt still recomputes its last token to get logits.
    s2 = make_scheduler(block_size=4, budget=64)
    s2.add_request(make_request("x", system, max_tokens=1))
    run_to_completion(s2)
    s2.add_request(make_request("y", system, max_tokens=1))
    out, _ = run_step(s2)
    assert (out.chunks[0].start, out.chunks[0].num_tokens) == (16, 4)


def test_prefix_cache_counts_only_lookups_that_happen():
    # As vLLM's: nothing without caching, nothing for prompt-logprobs requests (they compute
    # their prompt), so the hit rate is not diluted by lookups that never ran.
    prompt = list(range(1, 21))
    off = make_scheduler(enable_prefix_caching=False)
    for rid in "ab":
        off.add_request(make_request(rid, prompt, max_tokens=1))
        run_to_completion(off)
    assert (off.kv.pool.queries, off.kv.pool.hits) == (0, 0)
    on = make_scheduler()
    on.add_request(make_request("a", prompt, max_tokens=1))
    run_to_completion(on)
    on.add_request(make_request("b", prompt, max_tokens=1, prompt_logprobs=1))
    run_to_completion(on)
    assert (on.kv.pool.queries, on.kv.pool.hits) == (20, 0)


def test_cache_salt_isolates_prefixes():
    s = make_scheduler(block_size=4, budget=64)
    prompt = list(range(1, 21))
    r1 = make_request("a", prompt, max_tokens=1)
    r1.cache_salt = "tenant-1"
    s.add_request(r1)
    run_to_completion(s)
    r2 = make_request("b", prompt + [99], max_tokens=1)
    r2.cache_salt = "tenant-2"
    s.add_request(r2)
    out, _ = run_step(s)
    assert out.chunks[0].start == 0


def test_prompt_logprobs_survive_preemption_once_each():
    # Chunks of 4 in a cache of 4 blocks: "a" (prompt logprobs, 13 tokens) is preempted by the
    # running "b" mid-prefill and recomputed; each prompt token's logprob arrives exactly once,
    # in order, with the first output token.
    from shm_engine.engine.protocol import Logprobs

    s = make_scheduler(num_blocks=4, block_size=4, budget=4, max_seqs=2)
    s.add_request(make_request("b", [1, 2, 3], max_tokens=10))
    s.add_request(make_request("a", list(range(100, 113)), max_tokens=2, prompt_logprobs=0))
    delivered, preempted = [], 0
    for _ in range(100):
        if not s.has_requests():
            break
        out = s.schedule()
        preempted += len(out.preempted_ids)
        tokens, scored = [], {}
        for ci, c in enumerate(out.chunks):
            if c.samples:
                tokens.append(next_token(c.request.all_token_ids[: c.start + c.num_tokens]))
            if c.score is not None:
                j0, j1 = c.score
                ids = c.request.all_token_ids
                scored[ci] = [Logprobs([ids[j]], [-float(j)]) for j in range(j0, j1)]
        o = s.update_from_output(out, SampledTokens(tokens, prompt_logprobs=scored or None))
        delivered += [lps for lps in o.prompt_logprobs.values()]
    assert preempted > 0
    assert len(delivered) == 1
    assert [(lp.token_ids[0], lp.logprobs[0]) for lp in delivered[0]] == [
        (100 + j, -float(j)) for j in range(1, 13)
    ]


def test_a_salt_never_hashes_like_a_parent_block():
    from shm_engine.engine.kv_cache_manager import hash_block

    salt = "0123456789abcdef"  # 16 bytes, a digest's length
    tokens = [1, 2, 3, 4]
    assert hash_block(None, tokens, salt) != hash_block(salt.encode(), tokens, None)
    assert hash_block(None, tokens, None) != hash_block(None, tokens, salt)


def test_preemption_and_resume_give_the_same_tokens():
    # 10 blocks of 4 tokens: three requests of 8-token prompts growing by 12 tokens cannot all fit.
    s = make_scheduler(num_blocks=10, block_size=4, budget=64)
    prompts = {f"r{i}": list(range(20 * i + 1, 20 * i + 9)) for i in range(3)}
    for rid, p in prompts.items():
        s.add_request(make_request(rid, p, max_tokens=12))
    results = run_to_completion(s)
    assert s.num_preemptions > 0
    for rid, p in prompts.items():
        assert results[rid] == reference_output(p, 12), rid
    assert s.kv.num_free_blocks == 10


def test_abort_frees_blocks_at_once():
    s = make_scheduler(block_size=4)
    s.add_request(make_request("a", list(range(1, 30)), max_tokens=100))
    s.add_request(make_request("b", list(range(1, 30)), max_tokens=100))
    run_step(s)
    run_step(s)
    assert s.kv.num_free_blocks < 64
    assert s.abort_requests(["a", "b", "missing"]) == ["a", "b"]
    assert s.kv.num_free_blocks == 64
    assert not s.has_requests()
    out = s.schedule()
    assert out.empty and sorted(out.finished_ids) == ["a", "b"]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_aborting_waiting_requests_one_by_one_keeps_the_order_of_the_rest(policy):
    """Waiting requests are removed lazily (O(1) each: 100k prompts of a client that went away
    had taken minutes one by one); the rest keep their order, counts and admission."""
    s = make_scheduler(max_seqs=2, budget=8, scheduling_policy=policy)
    for i in range(2000):
        s.add_request(make_request(f"r{i}", [1, 2, 3], priority=-i, arrival=float(i)))
    keep = {"r5", "r1500", "r1999"}
    for i in range(2000):
        if f"r{i}" not in keep:
            assert s.abort_requests([f"r{i}"]) == [f"r{i}"]
    assert len(s.waiting) == 3
    want = ["r5", "r1500", "r1999"] if policy == "fcfs" else ["r1999", "r1500", "r5"]
    assert [r.request_id for r in s.waiting] == want
    out = s.schedule()
    assert [c.request.request_id for c in out.chunks] == want[:2]
    assert len(s.waiting) == 1 and s.waiting.peek().request_id == want[2]


def test_abort_of_a_request_in_flight_drops_its_result():
    s = make_scheduler(block_size=4)
    s.add_request(make_request("a", [1, 2, 3], max_tokens=5))
    s.add_request(make_request("b", [4, 5, 6], max_tokens=5))
    out = s.schedule()
    s.abort_requests(["a"])
    o = s.update_from_output(out, SampledTokens([7, 8]))
    assert o.request_ids == ["b"] and o.new_token_ids == [8]


def test_a_result_from_before_a_preemption_is_dropped_after_readmission():
    # Three steps in flight (batch_queue_size 3): "r" samples in step A, is preempted in step B
    # and readmitted in step C before A's result arrives. A's token must not be appended: C
    # samples that position again.
    s = make_scheduler(num_blocks=2, block_size=4, budget=8, long_prefill_token_threshold=4)
    s.add_request(make_request("big", list(range(1, 10)), max_tokens=5))
    s.add_request(make_request("r", [11, 12, 13, 14], max_tokens=5))
    step_a = s.schedule()
    assert [(c.request.request_id, c.samples) for c in step_a.chunks] == [
        ("big", False), ("r", True)
    ]  # fmt: skip
    step_b = s.schedule()  # "big" needs a third block: "r" is preempted
    assert step_b.preempted_ids == ["r"]
    s.abort_requests(["big"])
    step_c = s.schedule()  # "r" again, from the start
    assert [(c.request.request_id, c.start, c.samples) for c in step_c.chunks] == [("r", 0, True)]
    assert s.update_from_output(step_a, SampledTokens([500])).request_ids == []
    assert s.update_from_output(step_b, SampledTokens([])).request_ids == []
    o = s.update_from_output(step_c, SampledTokens([600]))
    assert o.request_ids == ["r"] and o.new_token_ids == [600]
    assert s.requests["r"].all_token_ids == [11, 12, 13, 14, 600]


@pytest.mark.parametrize(
    ("kwargs", "forced", "expect_len", "reason"),
    [
        ({}, [5, EOS], 2, "stop"),
        ({"ignore_eos": True}, [5, EOS, 6, 7], 4, "length"),
        ({"min_tokens": 3}, [EOS, EOS, EOS, EOS], 3, "stop"),  # (the sampler masks EOS before)
        ({"stop_token_ids": [42]}, [5, 42], 2, "stop"),
        ({}, [5, 6, 7, 8], 4, "length"),
    ],
)
def test_stop_conditions(kwargs, forced, expect_len, reason):
    s = make_scheduler(block_size=4)
    s.add_request(make_request("a", [1, 2, 3], max_tokens=4, **kwargs))
    got, finish = [], None
    for tok in forced:
        _, o = run_step(s, {"a": tok})
        got += o.new_token_ids
        if o.finished:
            finish = o.finished[0]
            break
    assert len(got) == expect_len and finish == reason
    if "stop_token_ids" in kwargs:
        assert o.stop_reasons == {0: 42}
    assert not s.has_requests()


def test_prompts_that_cannot_fit_are_rejected():
    s = make_scheduler(num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="context length"):
        s.check_fits(1024)
    with pytest.raises(ValueError, match="KV cache"):
        s.check_fits(16)
    with pytest.raises(ValueError, match="empty"):
        s.check_fits(0)
    s.check_fits(15)


def test_a_sequence_ends_when_it_fills_the_whole_cache():
    # max_model_len beyond the cache: the request used to preempt itself once it needed every
    # block and more, and then never fit again (schedule() returned empty batches forever).
    s = make_scheduler(num_blocks=4, block_size=4, max_model_len=1024)
    s.add_request(make_request("a", list(range(1, 11)), max_tokens=100, ignore_eos=True))
    got = []
    for _ in range(50):
        _, o = run_step(s)
        got += o.new_token_ids
        if o.finished:
            break
    assert o.finished == {0: "length"} and len(got) == 16 - 10  # the cache's 16 positions
    assert not s.has_requests() and s.kv.num_free_blocks == 4


def test_priority_policy_admits_and_preempts_by_priority():
    s = make_scheduler(budget=4, block_size=4, scheduling_policy="priority")
    s.add_request(make_request("low", [1, 2, 3, 4], priority=5, arrival=1.0))
    s.add_request(make_request("high", [5, 6, 7, 8], priority=0, arrival=2.0))
    out, _ = run_step(s)
    assert [c.request.request_id for c in out.chunks] == ["high"]


def test_max_num_seqs_caps_the_running_set():
    s = make_scheduler(budget=64, max_seqs=2)
    for i in range(4):
        s.add_request(make_request(f"r{i}", [i + 1] * 3))
    out, _ = run_step(s)
    assert len(out.chunks) == 2 and len(s.waiting) == 2
