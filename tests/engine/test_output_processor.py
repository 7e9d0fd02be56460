"""OutputProcessor: streaming text, stop strings, n > 1 fan-out and errors, fed synthetic outputs."""

from __future__ import annotations

import pytest

from shm_engine.engine.output_processor import Logprob, OutputProcessor
from shm_engine.engine.protocol import EngineCoreOutputs, Logprobs, RequestError
from shm_engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer():
    from shm_engine.model.loader import load_model

    return load_model(None).tokenizer


def step(rows: dict[str, int], finished: dict[str, str] | None = None, **kw) -> EngineCoreOutputs:
    ids = list(rows)
    fin = {ids.index(r): reason for r, reason in (finished or {}).items()}
    return EngineCoreOutputs(
        request_ids=ids,
        num_new_tokens=[1] * len(ids),
        new_token_ids=list(rows.values()),
        finished=fin,
        **kw,
    )


def feed(proc: OutputProcessor, rid: str, token_ids: list[int], last_reason: str = "length"):
    """Stream tokens one step at a time; returns (last RequestOutput, engine ids to abort)."""
    aborts: list[str] = []
    out = None
    for i, t in enumerate(token_ids):
        fin = {rid: last_reason} if i == len(token_ids) - 1 else None
        results, ab = proc.process(step({rid: t}, fin))
        aborts += ab
        out = results[0] if results else out
        if out is not None and out.finished:
            break
    return out, aborts


def test_streamed_text_equals_full_decode(tokenizer):
    text = "Héllo wörld! 你好, emoji 🎉 and code: def f(x): return x**2\n"
    ids = tokenizer.encode(text, add_special_tokens=False)
    proc = OutputProcessor(tokenizer)
    proc.add_request("a", "p", [1, 2], SamplingParams(max_tokens=len(ids)))
    out, aborts = feed(proc, "a", ids)
    assert out.finished and not aborts
    assert out.outputs[0].text == tokenizer.decode(ids)
    assert out.outputs[0].token_ids == ids
    assert not proc.has_unfinished()


@pytest.mark.parametrize("include", [False, True])
def test_the_earliest_stop_string_wins_and_the_engine_request_is_aborted(tokenizer, include):
    ids = tokenizer.encode("one two three four five six", add_special_tokens=False)
    proc = OutputProcessor(tokenizer)
    params = SamplingParams(stop=["five", "three"], include_stop_str_in_output=include)
    proc.add_request("a", None, [1], params)
    out, aborts = feed(proc, "a", ids)
    comp = out.outputs[0]
    assert out.finished and comp.finish_reason == "stop" and comp.stop_reason == "three"
    assert comp.text == ("one two three" if include else "one two ")
    assert aborts == ["a"]
    # A late token of the stopped request is ignored.
    results, _ = proc.process(step({"a": ids[-1]}))
    assert results == []


@pytest.mark.parametrize("stop", [[], ["five", "three"]])
def test_several_tokens_a_step_give_what_one_a_step_gives(tokenizer, stop):
    """A speculative decode step delivers several tokens of a request at once: the text, token
    ids, finish and stop reason are those of one token a step."""
    ids = tokenizer.encode("one two three four five six seven", add_special_tokens=False)

    def run(per_step: int):
        proc = OutputProcessor(tokenizer)
        proc.add_request("a", None, [1], SamplingParams(stop=stop, max_tokens=len(ids), logprobs=0))
        out, aborts = None, []
        for i in range(0, len(ids), per_step):
            part = ids[i : i + per_step]
            last = i + per_step >= len(ids)
            results, ab = proc.process(
                EngineCoreOutputs(
                    request_ids=["a"], num_new_tokens=[len(part)], new_token_ids=part,
                    finished={0: "length"} if last else {},
                    logprobs={0: [Logprobs([t], [-0.5], 1) for t in part]},
                )
            )  # fmt: skip
            aborts += ab
            out = results[0] if results else out
            if out is not None and out.finished:
                break
        c = out.outputs[0]
        assert len(c.logprobs) == len(c.token_ids)
        return c.text, c.token_ids, c.finish_reason, c.stop_reason, aborts

    assert run(3) == run(1)
    assert run(len(ids)) == run(1)
    if stop:  # the token ids end at the token that completed the stop string
        assert len(run(1)[1]) < len(ids)


def test_stop_string_across_token_boundaries(tokenizer):
    ids = tokenizer.encode("abc<|stop|>def", add_special_tokens=False)
    assert len(ids) > 3
    proc = OutputProcessor(tokenizer)
    proc.add_request("a", None, [1], SamplingParams(stop=["<|stop|>"]))
    out, aborts = feed(proc, "a", ids)
    assert out.outputs[0].text == "abc" and aborts == ["a"]


def test_n_completions_fan_out_with_derived_seeds_and_merge_back(tokenizer):
    proc = OutputProcessor(tokenizer)
    children = proc.add_request("r", "p", [1], SamplingParams(n=3, seed=7, temperature=1.0))
    assert [eid for eid, _ in children] == ["0_r", "1_r", "2_r"]
    assert [p.seed for _, p in children] == [7, 8, 9] and all(p.n == 1 for _, p in children)
    a, b = (
        tokenizer.encode("A", add_special_tokens=False)[0],
        tokenizer.encode("B", add_special_tokens=False)[0],
    )
    results, _ = proc.process(step({"0_r": a, "1_r": b, "2_r": a}, {"0_r": "length"}))
    assert not results[0].finished
    results, _ = proc.process(step({"1_r": a, "2_r": b}, {"1_r": "stop", "2_r": "length"}))
    out = results[0]
    # 1_r's last token ended it as a stop token: its text is not output.
    assert out.finished and [c.text for c in out.outputs] == ["A", "B", "AB"]
    assert [c.finish_reason for c in out.outputs] == ["length", "stop", "length"]
    with pytest.raises(ValueError, match="duplicate"):
        proc.add_request("x", None, [1], SamplingParams())
        proc.add_request("x", None, [1], SamplingParams())


def test_a_user_id_reused_after_its_request_ended_runs_under_a_new_engine_id(tokenizer):
    """The engine may still send tokens of an aborted (or stop-string-ended) request: a new
    request reusing the user's id must not take them (4 of 20 AsyncLLM reuses had)."""
    proc = OutputProcessor(tokenizer)
    assert [eid for eid, _ in proc.add_request("same", "p", [1], SamplingParams())] == ["same"]
    proc.abort("same")
    ((eid, _),) = proc.add_request("same", "p", [1], SamplingParams(max_tokens=4))
    assert eid != "same"
    results, _ = proc.process(step({"same": 7}))  # the old request's late token
    assert results == []
    results, _ = proc.process(step({eid: 9}, {eid: "length"}))
    assert results[0].request_id == "same" and results[0].outputs[0].token_ids == [9]


@pytest.mark.parametrize(("first", "second"), [(("x", 2), ("0_x", 1)), (("0_x", 1), ("x", 2))])
def test_user_ids_whose_engine_ids_collide_are_refused(tokenizer, first, second):
    # "x" with n = 2 runs as "0_x" and "1_x": a lone "0_x" must not take one of them over.
    proc = OutputProcessor(tokenizer)
    proc.add_request(first[0], None, [1], SamplingParams(n=first[1]))
    with pytest.raises(ValueError, match="another request's"):
        proc.add_request(second[0], None, [1], SamplingParams(n=second[1]))
    assert sorted(proc.states) == (["0_x", "1_x"] if first[1] == 2 else ["0_x"])
    assert list(proc.parents) == [first[0]]


def test_engine_errors_finish_the_request_and_abort_its_siblings(tokenizer):
    proc = OutputProcessor(tokenizer)
    proc.add_request("r", None, [1], SamplingParams(n=2))
    results, aborts = proc.process(
        EngineCoreOutputs(errors=[RequestError("0_r", "prompt too long")])
    )
    assert results[0].finished and results[0].error == "prompt too long"
    assert aborts == ["1_r"]
    # a finished request says why for every completion
    assert [c.finish_reason for c in results[0].outputs] == ["error", "abort"]
    assert not proc.has_unfinished()


def test_an_output_handed_out_is_not_changed_by_later_steps(tokenizer):
    proc = OutputProcessor(tokenizer)
    ids = tokenizer.encode("one two three", add_special_tokens=False)
    proc.add_request("r", None, [1], SamplingParams(max_tokens=len(ids)))
    first = proc.process(step({"r": ids[0]}))[0][0]
    text = first.outputs[0].text
    feed(proc, "r", ids[1:])
    assert first.outputs[0].text == text and first.outputs[0].finish_reason is None
    assert not first.finished


def test_cached_tokens_logprobs_and_metrics(tokenizer):
    proc = OutputProcessor(tokenizer)
    proc.add_request("r", None, [1, 2, 3], SamplingParams(logprobs=1))
    lp = Logprobs(token_ids=[42, 7], logprobs=[-0.5, -0.25], sampled_rank=2)
    results, _ = proc.process(
        step({"r": 42}, {"r": "length"}, num_cached_tokens={0: 16}, logprobs={0: [lp]})
    )
    out = results[0]
    assert out.num_cached_tokens == 16
    # vLLM's Logprob entries: the sampled token's rank from the engine, the top-n ranked 1..n,
    # each token decoded alone (special tokens included)
    dec = [tokenizer.decode([t], skip_special_tokens=False) for t in (42, 7)]
    assert out.outputs[0].logprobs == [{42: Logprob(-0.5, 2, dec[0]), 7: Logprob(-0.25, 1, dec[1])}]
    assert list(out.outputs[0].logprobs[0]) == [42, 7]  # the sampled token first
    assert out.outputs[0].cumulative_logprob == -0.5
    m = out.metrics
    assert m.first_token_time is not None and m.finished_time >= m.arrival_time


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_tokens_text_is_left_out_unless_asked_for(tokenizer, include):
    ids = tokenizer.encode("one two", add_special_tokens=False)
    proc = OutputProcessor(tokenizer)
    params = SamplingParams(stop_token_ids=[ids[-1]], include_stop_str_in_output=include)
    proc.add_request("a", None, [1], params)
    out, _ = feed(proc, "a", ids, last_reason="stop")
    comp = out.outputs[0]
    assert comp.token_ids == ids  # the token itself is still reported
    assert comp.text == (tokenizer.decode(ids) if include else tokenizer.decode(ids[:-1]))


def test_stop_strings_count_only_past_min_tokens(tokenizer):
    ids = tokenizer.encode("one two one two one", add_special_tokens=False)
    proc = OutputProcessor(tokenizer)
    proc.add_request("a", None, [1], SamplingParams(stop=["one"], min_tokens=3))
    out, aborts = feed(proc, "a", ids)
    # "one" as tokens 1 and 3 is within min_tokens; the one at token 5, past it, stops.
    assert aborts == ["a"] and out.outputs[0].text == "one two one two "


def test_a_longer_stop_string_does_not_widen_the_search_for_a_shorter_one(tokenizer):
    # "," ended before min_tokens; once stops count, only a "," in new text may stop (vLLM).
    ids = tokenizer.encode(" 4, 5, 6, 7", add_special_tokens=False)
    texts = []
    for stop in ([","], [",", "zzzzzzzzzzzz"]):
        proc = OutputProcessor(tokenizer)
        proc.add_request("a", None, [1], SamplingParams(stop=stop, min_tokens=len(ids) - 3))
        out, _ = feed(proc, "a", ids)
        texts.append(out.outputs[0].text)
    assert texts[0] == texts[1] == " 4, 5, 6"


def test_a_request_that_fails_to_register_leaves_nothing_behind(tokenizer, monkeypatch):
    proc = OutputProcessor(tokenizer)
    params = SamplingParams(n=2)
    params.temperature = -1.0  # assigned after construction: caught before it is sent
    with pytest.raises(ValueError, match="temperature"):
        proc.add_request("r", None, [1], params)
    assert not proc.has_unfinished() and not proc.states
    # A failure while building the second child (here: injected) registers neither child.
    from shm_engine.engine import output_processor

    real = output_processor.IncrementalDetokenizer
    built: list[int] = []

    def second_fails(*args, **kwargs):
        built.append(1)
        if len(built) == 2:
            raise MemoryError("injected")
        return real(*args, **kwargs)

    monkeypatch.setattr(output_processor, "IncrementalDetokenizer", second_fails)
    with pytest.raises(MemoryError):
        proc.add_request("r", None, [1], SamplingParams(n=2))
    assert len(built) == 2 and not proc.has_unfinished() and not proc.states
    monkeypatch.setattr(output_processor, "IncrementalDetokenizer", real)
    # Derived seeds are vLLM's seed + i, kept in the int64 range (the sampler reads them mod
    # 2^64): child 0 of a negative seed draws as the request with n=1 does; -1 ("no seed") is
    # not made.
    for seed, seeds in [
        ((1 << 63) - 1, [(1 << 63) - 1, -(1 << 63)]),
        (-5, [-5, -4]),
        (-2, [-2, (1 << 63) - 1]),
    ]:
        children = proc.add_request(f"r{seed}", None, [1], SamplingParams(n=2, seed=seed))
        assert [p.seed for _, p in children] == seeds
