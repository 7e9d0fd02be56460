"""Speculative decoding by n-gram lookup: the proposer, the scheduler's drafts (who gets them, how
many, what a right or wrong one does to the request) and the model runner's rows. The randomized
runs with drafts are in test_scheduler_stateful.py; greedy tokens with and without drafts on the
real model are compared in test_engine_e2e.py."""

from __future__ import annotations

import pytest

from shm_engine.engine.config import EngineConfig
from shm_engine.engine.model_runner import _split_draft_rows
from shm_engine.engine.ngram_proposer import propose_ngram
from shm_engine.engine.protocol import Logprobs
from shm_engine.engine.request import Request, RequestStatus
from shm_engine.engine.scheduler import SampledTokens, ScheduledChunk, Scheduler
from shm_engine.model.batch import BatchInputs
from shm_engine.sampling_params import SamplingParams

from .test_scheduler import EOS, make_request, make_scheduler


@pytest.mark.parametrize(
    ("tokens", "k", "lo", "hi", "want"),
    [
        ([1, 2, 3, 9, 1, 2, 3], 3, 1, 3, [9, 1, 2]),
        ([1, 2, 3, 9, 1, 2, 3], 1, 1, 3, [9]),
        ([5, 6, 7], 3, 1, 3, []),  # the last token never occurred before
        ([7, 1, 8, 1], 2, 1, 1, [8, 1]),
        ([7, 1, 8, 1], 2, 2, 3, []),  # "8 1" never occurred before
        ([3, 3, 3, 3], 2, 1, 3, [3]),  # the continuation may run into the end
        # the longest n-gram wins over a more recent shorter one
        ([4, 5, 6, 10, 9, 5, 6, 11, 4, 5, 6], 2, 1, 3, [10, 9]),
        # the most recent of several equal matches
        ([5, 6, 1, 5, 6, 2, 5, 6], 1, 2, 2, [2]),
        ([1, 2, 1, 2], 0, 1, 2, []),
        ([], 3, 1, 2, []),
    ],
)  # fmt: skip
def test_propose_ngram(tokens, k, lo, hi, want) -> None:
    assert propose_ngram(tokens, k, lo, hi) == want


def decoding(s: Scheduler, prompt: list[int], **kw):
    """A request past its prefill (one output token), so its next steps are decodes."""
    req = make_request("r", prompt, **kw)
    s.add_request(req)
    out = s.schedule()
    assert out.chunks[0].samples and not out.chunks[0].drafts
    s.update_from_output(out, SampledTokens([prompt[1]]))  # "copy": prompt[0], prompt[1]
    return req


def speculating(**kw) -> Scheduler:
    return make_scheduler(num_speculative_tokens=3, prompt_lookup_min=1, **kw)


def test_right_drafts_are_appended_with_the_models_next_token() -> None:
    s = speculating()
    req = decoding(s, [7, 8, 9, 7], max_tokens=10)  # context 7 8 9 7 8: drafts 9 7 8
    out = s.schedule()
    (chunk,) = out.chunks
    assert chunk.drafts == [9, 7, 8] and chunk.num_tokens == 4 and chunk.samples
    assert chunk.start == 4 and req.num_computed_tokens == 8
    res = s.update_from_output(out, SampledTokens([9], after_drafts={0: [7, 8, 9]}))
    assert res.num_new_tokens == [4] and res.new_token_ids == [9, 7, 8, 9]
    assert req.output_token_ids == [8, 9, 7, 8, 9]
    # every draft was right: all four rows' KV entries are the request's
    assert req.num_computed_tokens == req.num_tokens - 1 == 8
    assert (s.num_draft_tokens, s.num_accepted_tokens) == (3, 3)


def test_a_wrong_draft_ends_the_run_and_its_rows_are_taken_back() -> None:
    s = speculating()
    req = decoding(s, [7, 8, 9, 7], max_tokens=10)
    out = s.schedule()
    assert out.chunks[0].drafts == [9, 7, 8]
    # the model agrees with 9, then says 5 where the draft said 7: 9 and 5 are appended
    res = s.update_from_output(out, SampledTokens([9], after_drafts={0: [5, 1, 2]}))
    assert res.new_token_ids == [9, 5] and req.output_token_ids == [8, 9, 5]
    assert req.num_computed_tokens == req.num_tokens - 1 == 6
    assert (s.num_draft_tokens, s.num_accepted_tokens) == (3, 1)
    # the next step decodes from the first unknown position, over the same blocks
    blocks = s.kv.block_ids(req)
    nxt = s.schedule().chunks[0]
    assert nxt.start == 6 and nxt.block_ids[: len(blocks)] == blocks


def test_a_wrong_first_token_rejects_every_draft() -> None:
    s = speculating()
    req = decoding(s, [7, 8, 9, 7], max_tokens=10)
    out = s.schedule()
    res = s.update_from_output(out, SampledTokens([4], after_drafts={0: [7, 8, 9]}))
    assert res.new_token_ids == [4] and req.num_computed_tokens == 5 == req.num_tokens - 1


def test_eos_among_the_right_drafts_ends_the_request_there() -> None:
    s = speculating()
    req = decoding(s, [7, 8, 9, 7], max_tokens=10)
    out = s.schedule()
    res = s.update_from_output(out, SampledTokens([9], after_drafts={0: [EOS, 8, 9]}))
    # 9 right, then the model's token after it is EOS: nothing after it is output
    assert res.new_token_ids == [9, EOS] and res.finished == {0: "stop"}
    assert (s.num_draft_tokens, s.num_accepted_tokens) == (3, 1)  # 8 was right, not output
    assert req.status == RequestStatus.FINISHED_STOPPED
    assert s.kv.num_free_blocks == s.kv.pool.num_blocks


def test_drafts_never_pass_max_tokens_or_the_context() -> None:
    s = speculating()
    decoding(s, [7, 8, 9, 7], max_tokens=3)  # one output token so far: room for two more
    assert s.schedule().chunks[0].drafts == [9]  # one draft and the model's next token
    s = speculating(max_model_len=7)
    decoding(s, [7, 8, 9, 7], max_tokens=10)  # 5 tokens of 7
    assert s.schedule().chunks[0].drafts == [9]


@pytest.mark.parametrize(
    ("params", "drafts"),
    [
        ({}, True),
        ({"temperature": 0.7, "seed": 3}, True),  # each row sampled as its position would be
        ({"temperature": 0.7, "top_p": 0.9}, True),
        ({"logprobs": 2}, True),
        ({"repetition_penalty": 1.1}, True),  # each row's counts fold in its drafts
        ({"frequency_penalty": 0.5}, True),
        ({"presence_penalty": 0.5}, True),
        ({"min_tokens": 3}, True),  # each row masks EOS by its own output length
    ],
)  # fmt: skip
def test_which_requests_get_drafts(params: dict, drafts: bool) -> None:
    s = speculating()
    sp = SamplingParams(**{"temperature": 0.0, "max_tokens": 10, **params})
    s.add_request(Request("r", [7, 8, 9, 7], sp, (EOS,), 10))
    s.update_from_output(s.schedule(), SampledTokens([8]))
    assert bool(s.schedule().chunks[0].drafts) == drafts


def test_the_logprobs_of_each_appended_token() -> None:
    s = speculating()
    req = decoding(s, [7, 8, 9, 7], max_tokens=10, logprobs=1)
    out = s.schedule()
    lp = [Logprobs([t], [-0.5 * t], 1) for t in (9, 7, 5, 1)]
    res = s.update_from_output(
        out,
        SampledTokens([9], [lp[0]], after_drafts={0: [7, 5, 1]},
                      after_drafts_logprobs={0: lp[1:]}),
    )  # fmt: skip
    # 9 and 7 were right, 5 was sampled where the draft said 8: three tokens, three logprobs
    assert res.new_token_ids == [9, 7, 5] and req.output_token_ids[-3:] == [9, 7, 5]
    assert res.logprobs == {0: lp[:3]}


def test_drafts_take_only_the_blocks_left_after_every_other_request() -> None:
    """A decode with drafts first in line, then a prompt whose admission needs every free
    block: the prompt gets them, the decode's drafts what is left (a first version gave the
    drafts two of the blocks first, and the prompt had to wait)."""
    s = speculating(num_blocks=7, block_size=2, budget=16)
    decoding(s, [7, 8, 9, 7], max_tokens=10)  # 5 tokens, 2 blocks held
    s.add_request(make_request("b", list(range(100, 108)), max_tokens=2))
    out = s.schedule()
    assert not out.preempted_ids and s.kv.num_free_blocks == 0
    # one draft: the rest of the block the decode's own token opened
    assert [(c.request.request_id, c.num_tokens, c.drafts) for c in out.chunks] == [
        ("r", 2, [9]), ("b", 8, []),
    ]  # fmt: skip


def test_drafts_are_cut_to_the_free_blocks_past_a_reserve() -> None:
    """Drafts leave a free block a running request (each may need one next step)."""
    s = speculating(num_blocks=6, block_size=2)
    req = decoding(s, [7, 8, 9, 7, 8, 9, 7], max_tokens=10)  # 7 computed: 4 blocks, 2 free
    chunk = s.schedule().chunks[0]
    # drafts 9 7 8 would take two new blocks; one is free past the reserve
    assert chunk.drafts == [9, 7] and req.num_computed_tokens == 10
    assert s.kv.num_free_blocks == 1


def test_rejected_drafts_give_their_blocks_back() -> None:
    s = speculating(num_blocks=8, block_size=2)
    req = decoding(s, [7, 8, 9, 7], max_tokens=10)  # 5 tokens, 3 blocks
    out = s.schedule()
    assert out.chunks[0].drafts == [9, 7, 8] and len(s.kv.block_ids(req)) == 4
    s.update_from_output(out, SampledTokens([1], after_drafts={0: [2, 3, 4]}))
    # no draft was right: 5 tokens computed, 6 known; the fourth block goes back
    assert req.num_computed_tokens == 5 and len(s.kv.block_ids(req)) == 3
    assert s.kv.num_free_blocks == 5


def test_every_running_request_gets_its_token_before_any_draft() -> None:
    s = speculating(budget=16)
    for rid in "abc":
        s.add_request(make_request(rid, [7, 8, 9, 7], max_tokens=10))
    out = s.schedule()
    s.update_from_output(out, SampledTokens([8, 8, 8]))
    s.config.max_num_batched_tokens = 3
    chunks = s.schedule().chunks
    assert [(c.num_tokens, c.drafts) for c in chunks] == [(1, []), (1, []), (1, [])]


def test_drafts_count_against_the_step_budget() -> None:
    s = speculating()
    decoding(s, [7, 8, 9, 7], max_tokens=10)
    s.config.max_num_batched_tokens = 2
    chunk = s.schedule().chunks[0]
    assert chunk.drafts == [9] and chunk.num_tokens == 2


def test_a_request_with_drafts_in_flight_is_not_scheduled_again() -> None:
    s = speculating(batch_queue_size=2)
    req = decoding(s, [7, 8, 9, 7], max_tokens=10)
    first = s.schedule()
    assert first.chunks[0].drafts
    assert s.schedule().empty  # its rows are in flight
    s.update_from_output(first, SampledTokens([9], after_drafts={0: [7, 2, 2]}))
    assert req.output_token_ids == [8, 9, 7, 2]
    assert s.schedule().chunks[0].start == req.num_tokens - 1


def test_vllm_speculative_config_is_understood() -> None:
    from shm_engine.engine.config import speculative_args

    assert speculative_args(None) == {}
    assert speculative_args({"method": "ngram", "num_speculative_tokens": 3}) == {
        "num_speculative_tokens": 3
    }
    for bad, why in [
        ({"model": "draft", "num_speculative_tokens": 3}, "unsupported keys"),
        ({"method": "eagle", "num_speculative_tokens": 3}, "only method 'ngram'"),
        ({"method": "ngram"}, "num_speculative_tokens is required"),
    ]:
        with pytest.raises(ValueError, match=why):
            speculative_args(bad)


def test_speculation_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(num_speculative_tokens=17)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        EngineConfig(prompt_lookup_min=3, prompt_lookup_max=2)


def test_batch_rows_of_a_chunk_with_drafts() -> None:
    """A chunk with drafts asks for the logits of every row, each laid out as a decode (its own
    one-token sequence over the same blocks, so its attention has a decode step's bits); the
    runner's argmaxes split back into the sampled token and the tokens after each draft."""
    batch = BatchInputs.build(
        [([1, 2, 3, 4], 0, 4, [0]), ([5, 6, 7, 9, 9], 2, 3, [1, 2])], 4, [1, 3]
    )
    assert batch.input_ids.tolist() == [1, 2, 3, 4, 7, 9, 9]
    assert batch.positions.tolist() == [0, 1, 2, 3, 2, 3, 4]
    assert batch.slot_mapping.tolist() == [0, 1, 2, 3, 6, 7, 8]
    assert batch.logits_indices.tolist() == [3, 4, 5, 6]
    assert batch.query_start_loc.tolist() == [0, 4, 5, 6, 7]
    assert batch.seq_lens.tolist() == [4, 3, 4, 5]
    assert batch.block_table.tolist() == [[0, 0], [1, 2], [1, 2], [1, 2]]
    a = make_request("a", [1, 2, 3, 4])
    b = make_request("b", [5, 6, 7])
    chunks = [ScheduledChunk(a, 0, 4, [0], True), ScheduledChunk(b, 2, 3, [1], True, drafts=[9, 9])]
    out = _split_draft_rows(chunks, [40, 41, 42, 43])
    assert out.token_ids == [40, 41] and out.after_drafts == {1: [42, 43]}
    assert out.logprobs is None
    lps = [Logprobs([t], [-1.0], 1) for t in (40, 41, 42, 43)]
    out = _split_draft_rows(chunks, [40, 41, 42, 43], lps)
    assert out.logprobs == lps[:2] and out.after_drafts_logprobs == {1: lps[2:]}
    with pytest.raises(ValueError, match="logit_rows"):
        BatchInputs.build([([1, 2, 3], 0, 3, [0])], 4, [2])


def test_bench_speculative_configs() -> None:
    from benchmarks.bench_speculative import parse_config

    assert parse_config("0") == (0, 2, 4)
    assert parse_config("3:1") == (3, 1, 4)
    assert parse_config("4:3:5") == (4, 3, 5)
