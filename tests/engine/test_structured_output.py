"""Structured outputs: constraint parameters, grammar compilation, and EngineCore runs on a tiny
random-weight model with a byte-level tokenizer, where only the mask keeps the output in shape."""

from __future__ import annotations

import json
import re
import time
import types
from typing import Any

import msgspec
import numpy as np
import pytest
from model.conftest import tiny_config, tiny_weights
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from shm_engine.engine.config import EngineConfig
from shm_engine.engine.core import EngineCore
from shm_engine.engine.model_runner import ModelRunner
from shm_engine.engine.protocol import EngineCoreRequest
from shm_engine.engine.structured_output import (
    GrammarCompiler,
    MaskFiller,
    allowed_tokens,
    grammar_source,
)
from shm_engine.model.tokenizer import Tokenizer
from shm_engine.model.torch_model import TorchLlama
from shm_engine.sampling_params import SamplingParams, StructuredOutputsParams

VOCAB = 320
EOS = 257
CONFIG = tiny_config(vocab_size=VOCAB, max_position_embeddings=512)
WEIGHTS = tiny_weights(CONFIG, seed=3)


def _byte_level_tokenizer() -> Tokenizer:
    """256 byte tokens, one merge ('":' -> 256) and an EOS (257): any text encodes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in printable}
    chars.update({b: chr(256 + i) for i, b in enumerate(b for b in range(256) if b not in chars)})
    vocab = {chars[b]: b for b in range(256)}
    vocab[chars[ord('"')] + chars[ord(":")]] = 256
    backend = HFTokenizer(models.BPE(vocab, [(chars[ord('"')], chars[ord(":")])]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<eos>"])
    return Tokenizer(backend, eos_token_ids=[EOS])


TOKENIZER = _byte_level_tokenizer()


def make_core(**overrides: Any) -> EngineCore:
    args = dict(block_size=4, num_kv_blocks=256, max_num_batched_tokens=64, num_threads=1)
    cfg = EngineConfig(**{**args, **overrides}, dtype="float32")
    loaded = types.SimpleNamespace(config=CONFIG, tokenizer=TOKENIZER)
    return EngineCore(cfg, ModelRunner(cfg, loaded, TorchLlama(CONFIG, WEIGHTS)))


def submit(core: EngineCore, rid: str, so: StructuredOutputsParams | None, **sp: Any) -> None:
    params = SamplingParams(**{"max_tokens": 60, **sp}, structured_outputs=so)
    prompt = np.array(TOKENIZER.encode("Answer: "), dtype=np.int32)
    core.add_request(
        EngineCoreRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=params)
    )


def run(core: EngineCore) -> dict[str, dict[str, Any]]:
    got: dict[str, dict[str, Any]] = {}
    step = core.step if core.batch_queue_size == 1 else core.step_with_batch_queue
    while core.has_work():
        out = step()
        if out is None:
            continue
        k = 0
        for row, (rid, n) in enumerate(zip(out.request_ids, out.num_new_tokens, strict=True)):
            r = got.setdefault(rid, {"ids": [], "logprobs": [], "finish": None, "stop": None})
            r["ids"] += out.new_token_ids[k : k + n]
            k += n
            r["logprobs"] += out.logprobs.get(row, [])
            r["finish"] = out.finished.get(row, r["finish"])
            r["stop"] = out.stop_reasons.get(row, r["stop"])
    return got


def text(ids: list[int]) -> str:
    return TOKENIZER.decode([t for t in ids if t != EOS])


# ---------------------------------------------------------------------------- parameters


@pytest.mark.parametrize(
    "fields, message",
    [
        ({}, "exactly one"),
        ({"regex": "a", "choice": ["b"]}, "exactly one"),
        ({"choice": []}, "1 to"),
        ({"choice": "yes"}, "list of strings"),
        ({"choice": ["a", ""]}, "non-empty"),
        ({"json": 3}, "JSON schema"),
        ({"json_object": "yes"}, "true or false"),
        ({"regex": "a" * (1 << 20 + 1)}, "at most"),
    ],
)
def test_a_malformed_constraint_is_refused_with_its_reason(fields, message) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(structured_outputs=StructuredOutputsParams(**fields))


def test_grammar_sources_for_every_kind() -> None:
    assert "json_schema" in grammar_source(StructuredOutputsParams(json='{"type": "integer"}'))
    assert "json_schema" in grammar_source(StructuredOutputsParams(json_object=True))
    with pytest.raises(ValueError, match="not valid JSON"):
        grammar_source(StructuredOutputsParams(json="{type: integer}"))
    with pytest.raises(ValueError, match="must be an object"):
        grammar_source(StructuredOutputsParams(json="[1]"))
    lark = grammar_source(StructuredOutputsParams(grammar='root ::= "a" | "b"'))
    assert "start" in lark  # GBNF became Lark


def test_compile_refuses_a_bad_grammar_and_copies_a_cached_one() -> None:
    compiler = GrammarCompiler(TOKENIZER, VOCAB, [EOS])
    with pytest.raises(ValueError, match="unclosed group"):
        compiler.compile(StructuredOutputsParams(regex="(ab"))
    with pytest.raises(ValueError, match="invalid structured output"):
        compiler.compile(StructuredOutputsParams(grammar="start: undefined_rule"))
    a = compiler.compile(StructuredOutputsParams(regex="ab|ac"))
    b = compiler.compile(StructuredOutputsParams(regex="ab|ac"))  # the cached one, copied
    assert a.consume_token(ord("a")) and a.consume_token(ord("b")) and a.is_stopped()
    assert not b.is_stopped()
    assert b.consume_token(ord("a")) and b.consume_token(ord("c")) and b.is_stopped()
    no_eos = GrammarCompiler(TOKENIZER, VOCAB, [])
    with pytest.raises(ValueError, match="EOS"):
        no_eos.compile(StructuredOutputsParams(regex="a"))


def ref_chain(n: int) -> dict:
    """A schema of n chained $refs: llguidance recurses ~20 kB of stack a link."""
    defs = {
        f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}}
        for i in range(n)
    }
    defs[f"d{n}"] = {"type": "integer"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def test_deep_chains_compile_on_a_big_stack_and_too_large_ones_are_refused() -> None:
    # On a default 8 MiB thread stack a chain of 1,000 $refs killed the process (SIGSEGV).
    compiler = GrammarCompiler(TOKENIZER, VOCAB, [EOS])
    deep = compiler.compile(StructuredOutputsParams(json=ref_chain(3000)))
    assert deep.consume_token(ord("{")) and not deep.is_error()
    lark = "start: r0\n" + "".join(f'r{i}: "a" r{i + 1}\n' for i in range(10_000)) + 'r10000: "b"\n'
    assert not compiler.compile(StructuredOutputsParams(grammar=lark)).is_error()
    with pytest.raises(ValueError, match="too large"):
        compiler.compile(StructuredOutputsParams(json=ref_chain(20_000)))
    compiler.shutdown()


def test_a_constraint_too_slow_to_follow_ends_its_request_alone() -> None:
    # Each token of this ambiguous grammar costs more than the one before (up to ~0.5 s a mask
    # here under llguidance's default limits, on the busy loop every request waits for).
    core = make_core(max_num_batched_tokens=400)
    grammar = 'start: s\ns: s s | s s s | s s s s | "a" | "b" | "ab" | ""'
    submit(core, "slow", StructuredOutputsParams(grammar=grammar), temperature=0.0, max_tokens=300)
    submit(core, "plain", None, temperature=0.0, max_tokens=300, ignore_eos=True)
    t0 = time.perf_counter()
    got = run(core)
    assert got["slow"]["finish"] == "error" and len(got["slow"]["ids"]) < 300
    assert got["plain"]["finish"] == "length" and len(got["plain"]["ids"]) == 300
    assert time.perf_counter() - t0 < 30
    core.shutdown()


def test_a_mask_or_token_over_the_time_cap_ends_only_its_request(monkeypatch) -> None:
    # The cap (50 ms of the thread's CPU time) as if every call exceeded it: masks and tokens.
    import shm_engine.engine.structured_output as so

    monkeypatch.setattr(so, "MAX_CALL_SECONDS", -1.0)
    matcher = GrammarCompiler(TOKENIZER, VOCAB, [EOS]).compile(StructuredOutputsParams(regex="a+"))
    _, errors = MaskFiller(VOCAB).fill([matcher])
    assert "too costly to follow" in errors[0]
    assert "too costly to follow" in so.consume(matcher, ord("a"))
    core = make_core()
    submit(core, "slow", StructuredOutputsParams(regex="[ab]{5}"), temperature=0.0)
    submit(core, "plain", None, temperature=0.0, max_tokens=5)
    got = run(core)
    assert got["slow"]["finish"] == "error" and len(got["slow"]["ids"]) == 1
    assert got["plain"]["finish"] == "length" and len(got["plain"]["ids"]) == 5
    core.shutdown()


def test_masks_mark_exactly_the_allowed_tokens() -> None:
    compiler = GrammarCompiler(TOKENIZER, VOCAB, [EOS])
    S = StructuredOutputsParams
    matchers = [compiler.compile(S(regex="[b-d]x")), compiler.compile(S(choice=["q", "zz"]))]
    filler = MaskFiller(VOCAB)
    one, _ = filler.fill(matchers[:1])
    both, errors = filler.fill(matchers)
    assert errors == [None, None]
    assert one.shape == (1, 10) and both.shape == (2, 10) and both.dtype == np.int32
    assert np.array_equal(one[0], both[0])
    assert np.flatnonzero(allowed_tokens(both[0], VOCAB)).tolist() == [ord(c) for c in "bcd"]
    assert np.flatnonzero(allowed_tokens(both[1], VOCAB)).tolist() == [ord("q"), ord("z")]
    assert matchers[0].consume_token(ord("c")) and matchers[0].consume_token(ord("x"))
    assert np.flatnonzero(allowed_tokens(filler.fill(matchers[:1])[0][0], VOCAB)).tolist() == [EOS]


# ---------------------------------------------------------------------------- in the engine

SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["cat", "dog"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
        "ok": {"type": "boolean"},
    },
    "required": ["kind", "n", "ok"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("batch_queue_size", [1, 2])
@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 1.0, "seed": 7}])
def test_random_weights_follow_every_kind_of_constraint(batch_queue_size, sampling) -> None:
    core = make_core(batch_queue_size=batch_queue_size)
    S = StructuredOutputsParams
    choices = ['say "yes"', "a\\b", "no"]
    submit(core, "regex", S(regex=r"[0-9]{3}-[a-c]{2,4}x"), **sampling)
    submit(core, "choice", S(choice=choices), **sampling)
    submit(core, "json", S(json=SCHEMA, disable_any_whitespace=True), **sampling)
    submit(core, "lark", S(grammar='start: ("ab" | "cd")+ "."'), max_tokens=200, **sampling)
    got = run(core)
    for rid, r in got.items():
        assert r["finish"] == "stop", rid
        assert r["ids"][-1] == EOS and EOS not in r["ids"][:-1], rid
    assert re.fullmatch(r"[0-9]{3}-[a-c]{2,4}x", text(got["regex"]["ids"]))
    assert text(got["choice"]["ids"]) in choices
    obj = json.loads(text(got["json"]["ids"]))
    assert obj["kind"] in ("cat", "dog") and 0 <= obj["n"] <= 9 and isinstance(obj["ok"], bool)
    assert re.fullmatch(r"(ab|cd)+\.", text(got["lark"]["ids"]))
    core.shutdown()


def test_unconstrained_requests_are_untouched_by_a_constrained_neighbour() -> None:
    alone = make_core()
    submit(alone, "plain", None, temperature=0.0, max_tokens=12)
    expected = run(alone)["plain"]["ids"]
    alone.shutdown()
    core = make_core()
    submit(core, "plain", None, temperature=0.0, max_tokens=12)
    submit(core, "regex", StructuredOutputsParams(regex="[xyz]{20}"), temperature=0.0)
    got = run(core)
    assert got["plain"]["ids"] == expected
    assert re.fullmatch("[xyz]{20}", text(got["regex"]["ids"]))
    core.shutdown()


def test_length_min_tokens_and_logprobs_under_a_constraint() -> None:
    core = make_core()
    S = StructuredOutputsParams
    submit(core, "short", S(regex="[a-z]{10}"), temperature=0.0, max_tokens=4)
    # the constraint is complete after 2 tokens: it ends the request, min_tokens gives way
    submit(core, "min", S(regex="[a-z]{2}"), temperature=0.0, min_tokens=5, max_tokens=8)
    submit(core, "lp", S(choice=["hello"]), temperature=0.0, logprobs=2)
    got = run(core)
    assert got["short"]["finish"] == "length" and len(got["short"]["ids"]) == 4
    assert EOS not in got["short"]["ids"]
    assert got["min"]["finish"] == "stop" and got["min"]["ids"][-1] == EOS
    assert len(got["min"]["ids"]) == 3
    lps = got["lp"]["logprobs"]
    assert len(lps) == len(got["lp"]["ids"]) == 6  # h e l l o + EOS
    # the only allowed token is certain (the masked ones are -inf)
    assert all(
        lp.token_ids[0] == t and lp.logprobs[0] == 0.0
        for lp, t in zip(lps, got["lp"]["ids"], strict=True)
    )
    assert all(lp.token_ids[1] == lp.token_ids[0] for lp in lps)
    core.shutdown()


def test_a_stop_token_that_completes_the_constraint_is_a_stop_token() -> None:
    # As without a constraint: the stop id ends the request and says so, no EOS follows.
    core = make_core()
    submit(core, "s", StructuredOutputsParams(choice=["ab"]), temperature=0.0, stop_token_ids=[98])
    got = run(core)["s"]
    assert got["ids"] == [ord("a"), ord("b")] and got["finish"] == "stop" and got["stop"] == 98
    core.shutdown()


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.8, "top_p": 0.9}])
def test_a_constraint_left_no_token_by_min_tokens_ends_in_an_error_alone(sampling) -> None:
    # The regex allows only digits first, and the digits are stop ids masked during min_tokens:
    # the row has no token left; that request fails, the engine and its neighbour go on.
    core = make_core()
    digits = list(range(ord("0"), ord("9") + 1))
    S = StructuredOutputsParams
    submit(core, "bad", S(regex="[0-9]x"), stop_token_ids=digits, min_tokens=3, **sampling)
    submit(core, "good", S(regex="[0-9]x"), **sampling)
    got = run(core)
    assert got["bad"]["finish"] == "error"
    assert got["good"]["finish"] == "stop" and re.fullmatch("[0-9]x", text(got["good"]["ids"]))
    core.shutdown()


def test_constrained_requests_get_no_drafts_and_keep_their_shape() -> None:
    core = make_core(num_speculative_tokens=3)
    submit(core, "plain", None, temperature=0.0, max_tokens=30)
    submit(core, "regex", StructuredOutputsParams(regex="(ab){12}"), temperature=0.0)
    got = run(core)
    assert text(got["regex"]["ids"]) == "ab" * 12
    assert len(got["plain"]["ids"]) == 30
    core.shutdown()


def test_an_invalid_constraint_is_refused_at_add_and_the_engine_serves_on() -> None:
    core = make_core()
    with pytest.raises(ValueError, match="unclosed"):
        submit(core, "bad", StructuredOutputsParams(regex="[0-9"))
    submit(core, "ok", StructuredOutputsParams(choice=["fine"]), temperature=0.0)
    assert text(run(core)["ok"]["ids"]) == "fine"
    core.shutdown()


def test_bad_words_never_appear_as_the_model_tokenizes_them() -> None:
    core = make_core()
    submit(core, "free", None, temperature=0.0, max_tokens=60)
    free = run(core)["free"]["ids"]
    printable = [33 <= t <= 126 and t != ord('"') for t in free]  # one byte-token a character
    i = next(i for i in range(len(free) - 1) if printable[i] and printable[i + 1])
    word = chr(free[i]) + chr(free[i + 1])  # two tokens the model writes unprompted
    submit(core, "banned", None, temperature=0.0, max_tokens=60, bad_words=[word])
    got = run(core)["banned"]["ids"]
    assert got[: i + 1] == free[: i + 1] and got[i + 1] != free[i + 1]
    assert all(got[j : j + 2] != free[i : i + 2] for j in range(len(got) - 1))
    core.shutdown()


def test_allowed_tokens_that_min_tokens_would_all_mask_are_refused_at_add() -> None:
    # Sampling would have had no token left and drawn token 0, which is not allowed.
    core = make_core()
    with pytest.raises(ValueError, match="min_tokens masks"):
        submit(core, "r", None, allowed_token_ids=[EOS, 7], stop_token_ids=[7], min_tokens=3)
    submit(core, "ok", None, temperature=0.0, allowed_token_ids=[7, 9, 9], max_tokens=5)
    got = run(core)["ok"]["ids"]
    assert set(got) <= {7, 9} and len(got) == 5
    core.shutdown()


def test_required_tool_calls_keep_each_tools_own_references() -> None:
    """Each tool's schema is nested in the array of calls: its "#" (recursion),
    "#/definitions/..." and "#/$defs/..." still point into it, and two tools may define the
    same $defs name differently."""
    from shm_engine.entrypoints.tool_calls import ToolUse

    def item(kind: str) -> dict:
        return {"type": "object", "properties": {"i": {"$ref": "#/$defs/Item"}},
                "$defs": {"Item": {"type": kind}}, "required": ["i"]}  # fmt: skip

    tree = {"type": "object", "required": ["v"], "additionalProperties": False,
            "properties": {"v": {"type": "integer"}, "child": {"$ref": "#"}}}  # fmt: skip
    draft7 = {"type": "object", "properties": {"a": {"$ref": "#/definitions/A"}},
              "definitions": {"A": {"type": "string"}}, "required": ["a"], "$id": "urn:x"}  # fmt: skip
    named = {"tree": tree, "d7": draft7, "ints": item("integer"), "strs": item("string")}
    tools = [
        {"type": "function", "function": {"name": n, "parameters": p}} for n, p in named.items()
    ]
    schema = ToolUse("required", tools).constraint()
    compiler = GrammarCompiler(TOKENIZER, TOKENIZER.vocab_size, [EOS])

    def accepts(text: str) -> bool:
        matcher = compiler.compile(schema)
        ids = TOKENIZER.encode(text, add_special_tokens=False)
        return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()

    def call(name: str, params: str) -> str:
        return f'[{{"name":"{name}","parameters":{params}}}]'

    try:
        assert accepts(call("tree", '{"v":1,"child":{"v":2,"child":{"v":3}}}'))
        assert not accepts(call("tree", '{"v":1,"child":[{"name":"tree","parameters":{"v":1}}]}'))
        assert accepts(call("d7", '{"a":"x"}')) and not accepts(call("d7", '{"a":1}'))
        assert accepts(call("ints", '{"i":1}')) and not accepts(call("ints", '{"i":"s"}'))
        assert accepts(call("strs", '{"i":"s"}')) and not accepts(call("strs", '{"i":1}'))
    finally:
        compiler.shutdown()


@pytest.mark.parametrize("parallel", [True, False])
def test_a_required_tool_choice_gives_calls_the_server_reads(parallel: bool) -> None:
    """The chat API's tool_choice "required" constraint (tool_calls.py) compiles, and what
    random weights write under it reads back as calls of the given tools."""
    from shm_engine.entrypoints.tool_calls import ToolUse, whole_calls

    tools = [
        {"type": "function", "function": {"name": "pick", "parameters": SCHEMA}},
        {"type": "function", "function": {"name": "now"}},
    ]
    use = ToolUse("required", tools, parallel=parallel)
    # (random weights wander through JSON's optional whitespace: none, to finish in time)
    so = msgspec.structs.replace(use.constraint(), disable_any_whitespace=True)
    core = make_core()
    for seed in range(3):
        submit(core, f"r{seed}", so, max_tokens=300, temperature=1.0, seed=seed)
    got = run(core)
    core.shutdown()
    for r in got.values():
        content, deltas = use.reader().feed(text(r["ids"]), finished=True)  # type: ignore[union-attr]
        calls = whole_calls(deltas)
        assert len(calls) >= 1 and (parallel or len(calls) == 1)
        # an array of calls may go on to the length limit: the call it cut stays content
        assert content == "" if r["finish"] == "stop" else content[:1] in ("", "{")
        for call in calls:
            args = json.loads(call["function"]["arguments"])
            if call["function"]["name"] == "pick":
                assert set(args) == {"kind", "n", "ok"}
            else:
                assert call["function"]["name"] == "now" and args == {}
