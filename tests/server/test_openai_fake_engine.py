"""The OpenAI server's protocol over a scripted engine: the real app (HotRoutes, FastAPI,
OpenAIServer) with a fake AsyncLLM whose outputs a test writes, and a tiny byte-level tokenizer.
No model: these cover what a live server cannot make deterministic (partial UTF-8 tokens, output
timing) and what needs no generation (errors, prompt limits)."""

from __future__ import annotations

import asyncio
import gc
import json
import threading
import time
import types
import warnings
from collections.abc import AsyncIterator

import jinja2
import pytest
from starlette.testclient import TestClient
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from shm_engine.engine.config import EngineConfig
from shm_engine.engine.output_processor import CompletionOutput, Logprob, RequestOutput
from shm_engine.entrypoints import api_server, openai_errors, openai_logprobs, openai_server
from shm_engine.entrypoints.async_engine import PromptTooLongError
from shm_engine.entrypoints.metrics import ServerMetrics
from shm_engine.model.tokenizer import IncrementalDetokenizer, Tokenizer
from shm_engine.sampling_params import SamplingParams, StructuredOutputsParams

EMOJI = "\U0001f600"  # F0 9F 98 80: two tokens of two bytes in the tiny vocabulary
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def tiny_tokenizer(chat_template: str = TEMPLATE) -> Tokenizer:
    """Byte-level BPE: one token per byte (id = byte), the emoji's byte pairs merged, a special."""
    to_char = {b: c for c, b in openai_logprobs._gpt2_byte_decoder().items()}
    vocab = {to_char[b]: b for b in range(256)}
    pairs = [(to_char[0xF0], to_char[0x9F]), (to_char[0x98], to_char[0x80])]
    for a, b in pairs:
        vocab[a + b] = len(vocab)
    backend = HFTokenizer(models.BPE(vocab, pairs))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken("<|end|>", special=True)])
    return Tokenizer(backend, eos_token_ids=[258], chat_template=chat_template)


class FakeHandle:
    def __init__(self, outputs: list[RequestOutput], delay: float) -> None:
        self._outputs, self._delay = outputs, delay
        self.stream = types.SimpleNamespace(fail=lambda e: None)

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        await asyncio.sleep(self._delay)
        for out in self._outputs:
            await asyncio.sleep(0)
            yield out

    def close(self) -> None:
        pass


class FakeEngine:
    """What OpenAIServer uses of AsyncLLM; ``script(ids, params)`` makes a request's outputs."""

    model_name = "tiny"
    sampling_defaults: dict = {}
    dead_reason = None
    is_dead = False
    on_finished = None

    def __init__(self, max_model_len: int = 64, tokenizer: Tokenizer | None = None) -> None:
        self.tokenizer = tokenizer or tiny_tokenizer()
        self.max_model_len = max_model_len
        ready = types.SimpleNamespace(
            num_kv_blocks=1, vocab_size=self.tokenizer.vocab_size, weights="fake weights"
        )
        self.client = types.SimpleNamespace(ready=ready)
        self.script = lambda ids, params: []
        self.first_output_delay = 0.0
        self.first_output_at: float | None = None

    def check_prompt(self, ids: list[int], params: SamplingParams) -> None:
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(f"maximum context length is {self.max_model_len} tokens")

    def add_request(self, text, ids, params, request_id, priority=0, cache_salt=None):
        engine = self
        self.last_request = types.SimpleNamespace(priority=priority, cache_salt=cache_salt)

        class Timed(FakeHandle):
            async def outputs(self):
                async for out in super().outputs():
                    engine.first_output_at = engine.first_output_at or time.monotonic()
                    yield out

        return Timed(self.script(ids, params), self.first_output_delay)

    async def shutdown(self) -> None:
        pass


def serve_fake(
    monkeypatch,
    engine: FakeEngine,
    chat: openai_server.ChatOptions | None = None,
    api_key: str | None = None,
) -> TestClient:
    """A TestClient of the real app over ``engine``; ``engine.sent`` records (time, body) of
    every body write (the TestClient hands the body over only once the response is complete)."""
    app = api_server.build_app(EngineConfig(), chat_options=chat, api_key=api_key)
    engine.sent = []

    async def create(
        config, served_model_name=None, data_parallel_size=1, model_info=None, launches=None
    ):
        return engine

    async def recording(scope, receive, send):
        async def record(msg):
            if msg["type"] == "http.response.body" and msg.get("body"):
                engine.sent.append((time.monotonic(), msg["body"]))
            await send(msg)

        await app(scope, receive, record)

    monkeypatch.setattr(openai_server.AsyncLLM, "create", staticmethod(create))
    client = TestClient(recording)
    client.server = lambda: app.app.state.server  # type: ignore[attr-defined]
    return client


@pytest.fixture
def fake(monkeypatch):
    """(TestClient of the real app over a FakeEngine, the engine)."""
    engine = FakeEngine()
    with serve_fake(monkeypatch, engine) as client:
        yield client, engine


def replay(tok: Tokenizer, text: str, stop: str | None, lp: bool) -> list[RequestOutput]:
    """Cumulative outputs of generating ``text`` token by token, as the OutputProcessor makes
    them: text completed by the incremental detokenizer, cut at ``stop``, logprobs per token."""
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    c = CompletionOutput(0, "", [], logprobs=[] if lp else None)
    outs = []
    for k, tid in enumerate(ids):
        c.token_ids.append(tid)
        if lp:
            c.logprobs.append({tid: Logprob(-0.5, 1), (tid + 1) % 256: Logprob(-1.0 - k, 2)})
        c.text += detok.add([tid])
        last = k == len(ids) - 1
        if last:
            c.text += detok.flush()
        if stop and stop in c.text:
            c.text, c.finish_reason, c.stop_reason = c.text[: c.text.index(stop)], "stop", stop
        elif last:
            c.finish_reason = "length"
        snap = CompletionOutput(0, c.text, list(c.token_ids), None,
                                list(c.logprobs) if lp else None, c.finish_reason, c.stop_reason)  # fmt: skip
        outs.append(RequestOutput("r", None, [1], [snap], finished=c.finish_reason is not None))
        if c.finish_reason:
            break
    return outs


def sse(r) -> list[dict]:
    events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


GEN = f"ab {EMOJI} cd{EMOJI}{EMOJI}ef STOP gh"


def test_streamed_completion_logprobs_match_the_non_streamed(fake) -> None:
    client, engine = fake
    engine.script = lambda ids, params: replay(engine.tokenizer, GEN, "STOP", lp=True)
    body = {"prompt": "hi", "max_tokens": 40, "logprobs": 1, "stop": "STOP"}
    whole = client.post("/v1/completions", json=body).json()["choices"][0]
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        chunks = [e["choices"][0] for e in sse(r)]
    assert "".join(c["text"] for c in chunks) == whole["text"] == GEN.split("STOP")[0]
    lps = [c["logprobs"] for c in chunks if c["logprobs"]]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for lp in lps for x in lp[key]] == whole["logprobs"][key], key
    lp = whole["logprobs"]
    # Offsets index the text, emoji halves included: both halves start at the emoji.
    assert lp["text_offset"][0] == 0 and whole["text"][lp["text_offset"][1]] == "b"
    halves = [i for i, t in enumerate(lp["tokens"]) if t.startswith("bytes:")]
    assert [lp["tokens"][i] for i in halves[:2]] == ["bytes:\\xf0\\x9f", "bytes:\\x98\\x80"]
    assert whole["text"][lp["text_offset"][halves[0]]] == EMOJI
    assert lp["text_offset"][halves[0]] == lp["text_offset"][halves[1]]
    # Distinct keys for the two halves: neither is lost to a shared U+FFFD key.
    assert all(t in top for t, top in zip(lp["tokens"], lp["top_logprobs"], strict=True))


def spm_tokenizer() -> Tokenizer:
    """SentencePiece style: U+2581 for a space, prepended to the text, and a decoder that drops
    the first piece's leading space (so the text can start a byte short of the tokens)."""
    pieces = ["<unk>", "</s>", "\u2581", "a", "b", "ab", "\u2581a", "\u2581ab"]
    merges = [("a", "b"), ("\u2581", "a"), ("\u2581", "ab")]
    backend = HFTokenizer(
        models.BPE({p: i for i, p in enumerate(pieces)}, merges, unk_token="<unk>")
    )
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    backend.decoder = decoders.Metaspace(prepend_scheme="first")
    backend.add_special_tokens([AddedToken("</s>", special=True)])
    return Tokenizer(backend, eos_token_ids=[1], chat_template=TEMPLATE)


def test_logprobs_follow_text_whose_first_space_the_decoder_dropped(monkeypatch) -> None:
    engine = FakeEngine(tokenizer=spm_tokenizer())
    text = "ab a b ab"
    # No prompt text before the output: the decoder drops the first piece's space.
    engine.script = lambda ids, params: replay(engine.tokenizer, text, None, lp=True)
    body = {"prompt": "a", "max_tokens": 10, "logprobs": 0}
    with serve_fake(monkeypatch, engine) as client:
        whole = client.post("/v1/completions", json=body).json()["choices"][0]
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            chunks = [e["choices"][0] for e in sse(r)]
    lp = whole["logprobs"]
    assert whole["text"] == text
    assert lp["tokens"] == [" ab", " a", " ", "b", " ab"]
    assert lp["text_offset"] == [0, 2, 4, 5, 6]  # index the text, not the pieces' bytes
    # Each chunk carries the logprobs of the tokens its text is made of, the first one included.
    streamed = [(c["text"], c["logprobs"]["tokens"]) for c in chunks if c["text"]]
    assert streamed[:2] == [("ab", [" ab"]), (" a", [" a"])]
    assert [t for c in chunks if c["logprobs"] for t in c["logprobs"]["text_offset"]] == [
        0, 2, 4, 5, 6
    ]  # fmt: skip


def test_streamed_chat_logprobs_go_with_their_text(fake) -> None:
    client, engine = fake
    engine.script = lambda ids, params: replay(engine.tokenizer, GEN, "STOP", lp=True)
    body = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2,
            "stop": ["STOP"], "stream": True}  # fmt: skip
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        chunks = [e["choices"][0] for e in sse(r)]
    for c in chunks:
        if c["finish_reason"] is None and c["logprobs"]:
            # A chunk's logprobs are those of the tokens its text is made of, byte for byte.
            got = b"".join(bytes(e["bytes"]) for e in c["logprobs"]["content"])
            assert got == c["delta"].get("content", "").encode()
    assert (chunks[-1]["finish_reason"], chunks[-1]["stop_reason"]) == ("stop", "STOP")
    content = [e for c in chunks if c["logprobs"] for e in c["logprobs"]["content"]]
    assert len(content) == len(engine.tokenizer.encode(GEN.split("STOP")[0] + "STOP"))
    emoji = [e for e in content if e["token"].startswith("bytes:")]
    assert [e["bytes"] for e in emoji[:2]] == [[0xF0, 0x9F], [0x98, 0x80]]  # not U+FFFD's bytes


def test_null_fields_mean_their_defaults(fake) -> None:
    # The openai client sends null for an argument given as None (OpenAI's schema allows it).
    client, engine = fake
    engine.script = lambda ids, params: replay(engine.tokenizer, "ab", None, lp=False)
    nulls = {"n": None, "stream": None, "temperature": None, "stop": None, "seed": None}
    r = client.post("/v1/completions", json={"prompt": "hi", "echo": None, **nulls})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ab"
    body = {"messages": [{"role": "user", "content": "hi"}], "logprobs": None, **nulls}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ab"
    r = client.post("/v1/completions", json={"prompt": None})
    assert r.status_code == 400 and "prompt" in r.json()["error"]["message"]


def test_one_request_may_ask_for_at_most_1024_sequences(fake):
    """prompts x n: each sequence is an engine request, added and aborted on the event loop (a
    body of 100k one-token prompts had stalled every other request for seconds)."""
    client, engine = fake
    engine.script = lambda ids, params: replay(engine.tokenizer, "ab", None, lp=False)
    for body in ({"prompt": [[1]] * 100_000}, {"prompt": [[1]] * 9, "n": 128}):
        r = client.post("/v1/completions", json={**body, "max_tokens": 1})
        assert r.status_code == 400 and "at most 1024 sequences" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json={"prompt": [[1]] * 8, "n": 128, "max_tokens": 1})
    assert r.status_code == 200, r.text  # at the limit


@pytest.mark.parametrize(
    ("path", "extra", "field"),
    [
        ("/v1/completions", {"use_beam_search": True}, "use_beam_search"),
        ("/v1/completions", {"add_special_tokens": False}, "add_special_tokens"),
        ("/v1/chat/completions", {"structural_tag": "{}"}, "structural_tag"),
        ("/v1/chat/completions", {"chat_template_kwargs": {"messages": []}}, "may not set"),
        ("/v1/chat/completions", {"logits_processors": ["x"]}, "logits_processors"),
        ("/v1/chat/completions", {"cache_salt": ""}, "cache_salt"),
    ],
)
def test_vllm_fields_this_server_lacks_are_refused(fake, path, extra, field) -> None:
    """Ignoring them would change the result silently (as logit_bias would)."""
    client, engine = fake
    engine.script = lambda ids, params: replay(engine.tokenizer, "ab", None, lp=False)
    body = (
        {"prompt": "hi"}
        if "chat" not in path
        else {"messages": [{"role": "user", "content": "hi"}]}
    )
    r = client.post(path, json={**body, **extra})
    assert r.status_code == 400 and field in r.json()["error"]["message"], r.text


def test_a_models_default_max_tokens_is_cut_to_the_room_left(fake) -> None:
    """generation_config's max_new_tokens past what the context leaves is cut to it (vLLM's
    get_max_tokens), not a 400 for a request that never asked for it."""
    client, engine = fake  # a 64-token context
    engine.sampling_defaults = {"max_tokens": 100}
    seen = []

    def script(ids, params):
        seen.append((len(ids), params.max_tokens))
        return replay(engine.tokenizer, "ab", None, lp=False)

    engine.script = script
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert client.post("/v1/chat/completions", json=chat).status_code == 200
    assert client.post("/v1/completions", json={"prompt": ["hi", "hello"]}).status_code == 200
    assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5}).status_code == 200
    assert [n + m for n, m in seen[:3]] == [64, 64, 64] and seen[3] == (2, 5)


def test_chat_template_kwargs_reach_the_template(monkeypatch) -> None:
    """vLLM's chat_template_kwargs (Qwen3 clients send enable_thinking) are template variables."""
    template = (
        TEMPLATE + "{% if enable_thinking is defined and not enable_thinking %}/no{% endif %}"
    )
    engine = FakeEngine(tokenizer=tiny_tokenizer(template))
    prompts = []

    def script(ids, params):
        prompts.append(engine.tokenizer.decode(ids))
        return replay(engine.tokenizer, "ab", None, lp=False)

    engine.script = script
    with serve_fake(monkeypatch, engine) as client:
        chat = {"messages": [{"role": "user", "content": "hi"}]}
        assert client.post("/v1/chat/completions", json=chat).status_code == 200
        off = {**chat, "chat_template_kwargs": {"enable_thinking": False}}
        assert client.post("/v1/chat/completions", json=off).status_code == 200
    assert prompts == ["user: hi\nassistant: ", "user: hi\nassistant: /no"]


def test_large_lists_are_counted_and_refused_before_validation(fake) -> None:
    client, engine = fake
    engine.script = lambda ids, params: replay(engine.tokenizer, "ab", None, lp=False)
    for field, value in [
        ("allowed_token_ids", [0] * 600_000),  # bodies over 1 MiB are screened
        ("stop_token_ids", [1] * 600_000),
        ("bad_words", ["w"] * 300_000),
        ("logit_bias", {str(i): 1 for i in range(150_000)}),
    ]:
        t0 = time.perf_counter()
        r = client.post("/v1/completions", json={"prompt": "hi", field: value})
        assert r.status_code == 400, r.text
        assert f"{field} takes at most" in r.json()["error"]["message"]
        assert time.perf_counter() - t0 < 2


def test_a_large_body_nested_too_deeply_is_a_400(fake) -> None:
    """The screen of bodies over 1 MiB leaves a body msgspec cannot nest into (RecursionError)
    to validation: a 400, not uvicorn's plain-text 500 with a traceback."""
    client, engine = fake
    engine.script = lambda ids, params: replay(engine.tokenizer, "ab", None, lp=False)
    pad = "a" * 1_100_000
    deep = "[" * 5000 + "]" * 5000
    for path, head in [
        ("/v1/completions", '{"prompt": "hi", "max_tokens": 1'),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}]'),
    ]:
        body = f'{head}, "pad": "{pad}", "zz": {deep}}}'
        r = client.post(path, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"], r.text[:200]


def test_stream_options_need_stream(fake) -> None:
    client, engine = fake
    engine.script = lambda ids, params: replay(engine.tokenizer, "ab", None, lp=False)
    body = {"prompt": "hi", "max_tokens": 2, "stream_options": {"include_usage": True}}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 400 and "stream_options" in r.json()["error"]["message"]
    assert client.post("/v1/completions", json={**body, "stream_options": None}).status_code == 200


def test_logit_bias_allowed_token_ids_and_bad_words_reach_the_engine(fake) -> None:
    client, engine = fake
    seen = []

    def script(ids, params):
        seen.append((params.logit_bias, params.allowed_token_ids, params.bad_words))
        return replay(engine.tokenizer, "ab", None, lp=False)

    engine.script = script
    body = {"prompt": "hi", "logit_bias": {"5": -100, "7": 2.5}, "allowed_token_ids": [5, 7, 9]}
    body["bad_words"] = ["darn it"]
    assert client.post("/v1/completions", json=body).status_code == 200
    chat = {"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"3": 1}}
    assert client.post("/v1/chat/completions", json=chat).status_code == 200
    assert seen == [({5: -100.0, 7: 2.5}, [5, 7, 9], ["darn it"]), ({3: 1.0}, None, [])]
    for bad, needle in [
        ({"logit_bias": {"x": 1}}, "logit_bias keys"),
        ({"logit_bias": {"5": 101}}, "[-100, 100]"),
        ({"logit_bias": {"-1": 1}}, "logit_bias keys"),
        ({"allowed_token_ids": [-3]}, "allowed_token_ids"),
        ({"bad_words": ["  "]}, "bad_words"),
    ]:
        r = client.post("/v1/completions", json={"prompt": "hi", **bad})
        assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def test_vllm_fields_at_their_defaults_pass_and_priority_reaches_the_engine(fake) -> None:
    client, engine = fake
    engine.script = lambda ids, params: replay(engine.tokenizer, "ab", None, lp=False)
    harmless = {"use_beam_search": False, "length_penalty": 1.0, "allowed_token_ids": []}
    harmless |= {"spaces_between_special_tokens": False, "a_future_openai_field": {"x": 1}}
    body = {"prompt": "hi", "priority": 3, "cache_salt": "tenant-7", **harmless}
    r = client.post("/v1/completions", json={**body, "add_special_tokens": True})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ab", r.text
    assert (engine.last_request.priority, engine.last_request.cache_salt) == (3, "tenant-7")
    chat = {"messages": [{"role": "user", "content": "hi"}], "add_special_tokens": False}
    r = client.post("/v1/chat/completions", json={**chat, "echo": False, **harmless})
    assert r.status_code == 200, r.text
    assert (engine.last_request.priority, engine.last_request.cache_salt) == (0, None)


def test_the_models_sampling_defaults_fill_what_a_request_leaves_unset(fake) -> None:
    """As vLLM's generation_config="auto": the model's values replace the API defaults, and
    a request's own values (0 included) win."""
    client, engine = fake
    engine.sampling_defaults = {
        "temperature": 0.6,
        "top_k": 20,
        "repetition_penalty": 1.05,
        "max_tokens": 7,  # max_new_tokens
    }
    seen = []

    def script(ids, params):
        seen.append(params)
        return replay(engine.tokenizer, "ab", None, lp=False)

    engine.script = script
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert client.post("/v1/chat/completions", json=chat).status_code == 200
    body = {"prompt": "hi", "temperature": 0, "top_k": 0, "top_p": 0.5}
    assert client.post("/v1/completions", json=body).status_code == 200
    assert client.post("/v1/completions", json={"prompt": "hi"}).status_code == 200
    assert (
        client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 16}).status_code == 200
    )
    got = [(p.temperature, p.top_k, p.top_p, p.repetition_penalty, p.max_tokens) for p in seen]
    assert got == [
        (0.6, 20, 1.0, 1.05, 7),
        (0.0, 0, 0.5, 1.05, 7),
        (0.6, 20, 1.0, 1.05, 7),
        (0.6, 20, 1.0, 1.05, 16),  # given, even at OpenAI's default value
    ]


def test_a_failed_prompt_cancels_the_other_prompts_consumers(monkeypatch) -> None:
    # A list of prompts, not streamed: one fails; the others' handles are closed (aborted), so
    # their consumers must be cancelled too, or they wait for outputs forever.
    class Stuck(FakeHandle):
        async def outputs(self) -> AsyncIterator[RequestOutput]:
            if self.fails:
                raise ValueError("engine rejected the request")
            await asyncio.Event().wait()  # a closed handle: nothing wakes it
            yield None  # type: ignore[misc]

    def add_request(text, ids, params, rid, *_) -> FakeHandle:
        handle = Stuck([], 0.0)
        handle.fails = rid.endswith("-0")
        return handle

    engine = FakeEngine()
    engine.add_request = add_request

    async def consumers() -> list[str]:
        return [t.get_coro().__qualname__ for t in asyncio.all_tasks()]

    with serve_fake(monkeypatch, engine) as client:
        r = client.post("/v1/completions", json={"prompt": ["first", "second", "third"]})
        assert r.status_code == 400 and "rejected" in r.json()["error"]["message"]
        assert not [q for q in client.portal.call(consumers) if "_collect" in q]


@pytest.mark.parametrize("route", ["completions", "chat", "completions x2"])
def test_a_stream_ends_in_one_write(fake, route) -> None:
    """Every token event leaves as it comes, except the one that ends the stream: it goes in
    one write with the usage event and [DONE] (the server ends the chunked body there too), so
    a stream costs one socket write per engine output and no extra ones at its end."""
    client, engine = fake
    engine.script = lambda ids, params: replay(engine.tokenizer, "abcd", None, lp=False)
    opts = {"stream": True, "stream_options": {"include_usage": True}, "max_tokens": 10}
    if route == "chat":
        url, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}
    else:
        prompts = ["hi", "ho"] if route == "completions x2" else "hi"
        url, body = "/v1/completions", {"prompt": prompts}
    with client.stream("POST", url, json={**body, **opts}) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    writes = [b for _, b in engine.sent]
    *before, last = writes
    assert events[-1] == "[DONE]" and last.endswith(b"data: [DONE]\n\n")
    # the last write: the final text event (finish_reason set), the usage event, [DONE]
    assert last.count(b"data: ") == 3 and b'"finish_reason":"length"' in last
    assert b'"usage":{"prompt_tokens"' in last and b'"choices":[]' in last
    # the others: one event each (chat's first: the role with the first text; two prompts:
    # one's finish comes before the stream's end)
    counts = [w.count(b"data: ") for w in writes]
    assert counts[:-1] == [2 if route == "chat" and i == 0 else 1 for i in range(len(before))]
    assert sum(counts) == len(events)
    finishes = sum(b'"finish_reason":"length"' in w for w in before)
    assert finishes == (1 if route == "completions x2" else 0)


def test_chat_role_chunk_waits_for_the_first_engine_output(fake) -> None:
    client, engine = fake
    engine.first_output_delay = 0.3
    engine.script = lambda ids, params: replay(engine.tokenizer, "Hello", None, lp=False)
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        rest = b"".join(r.iter_raw())
    (at, first), *_ = engine.sent
    assert engine.first_output_at is not None and at >= engine.first_output_at
    # The role and the first text leave in one write.
    assert b'"role":"assistant"' in first and b'"content":"H' in first
    events = [json.loads(x[6:]) for x in rest.split(b"\n\n") if x.startswith(b"data: {")]
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == "Hello"


def test_a_huge_prompt_is_refused_before_it_is_tokenized(fake, monkeypatch) -> None:
    client, engine = fake
    server = client.server()
    assert server.max_prompt_chars == 64 * len("<|end|>")  # the longest token, 7 bytes

    encode, encode_batch = engine.tokenizer.encode, engine.tokenizer.encode_batch

    def guard(text: str) -> None:
        assert len(text) < 1000, "a prompt that cannot fit was tokenized"

    def checked_encode(text, add_special_tokens=True):
        guard(text)
        return encode(text, add_special_tokens)

    def checked_batch(texts, add_special_tokens=True):
        for t in texts:
            guard(t)
        return encode_batch(texts, add_special_tokens)

    monkeypatch.setattr(engine.tokenizer, "encode", checked_encode)
    monkeypatch.setattr(engine.tokenizer, "encode_batch", checked_batch)
    huge = "x" * (8 << 20)
    for path, body in (
        ("/v1/completions", {"prompt": huge}),
        ("/v1/completions", {"prompt": ["ok", huge]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]}),
    ):
        t0 = time.monotonic()
        r = client.post(path, json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert "maximum context length" in err["message"], err
        assert err["type"] == "invalid_request_error"
        assert time.monotonic() - t0 < 5.0


def test_a_conversation_with_more_messages_than_tokens_is_refused_unvalidated(
    fake, monkeypatch
) -> None:
    # Validating 300k messages held the event loop for 2 s; they are counted first instead.
    client, engine = fake
    validated = []
    real = openai_server.ChatCompletionRequest.model_validate_json

    def spy(body, *args, **kwargs):
        validated.append(len(body))
        return real(body, *args, **kwargs)

    monkeypatch.setattr(openai_server.ChatCompletionRequest, "model_validate_json", spy)
    messages = [{"role": "user", "content": "hi"}] * 100_000  # 3.5 MB, max_model_len 64
    r = client.post("/v1/chat/completions", json={"messages": messages})
    assert r.status_code == 400 and "100000 messages" in r.json()["error"]["message"]
    assert validated == []
    # A large body of another shape is left to validation, which names what is wrong.
    r = client.post("/v1/chat/completions", json={"messages": ["hi"] * 300_000})
    assert r.status_code == 400 and "messages.0" in r.json()["error"]["message"]
    assert len(validated) == 1


def test_a_large_body_of_many_stop_strings_is_refused_before_validation(fake, monkeypatch) -> None:
    # 2.5M stop strings (31 MB) held the event loop for 15 s in validation.
    client, _ = fake
    validated = []
    for model in (openai_server.ChatCompletionRequest, openai_server.CompletionRequest):

        def spy(body, *args, _real=model.model_validate_json, **kwargs):
            validated.append(len(body))
            return _real(body, *args, **kwargs)

        monkeypatch.setattr(model, "model_validate_json", spy)
    stop = ["ab"] * 300_000  # 1.8 MB
    chat = {"messages": [{"role": "user", "content": "hi"}], "stop": stop}
    for path, body in (
        ("/v1/chat/completions", chat),
        ("/v1/completions", {"prompt": "hi", "stop": stop}),
    ):
        r = client.post(path, json=body)
        assert r.status_code == 400, r.text
        assert "at most 128 entries, got 300000" in r.json()["error"]["message"]
    assert validated == []
    # Under the screen's size, SamplingParams gives the same answer.
    r = client.post("/v1/completions", json={"prompt": "hi", "stop": ["ab"] * 129})
    assert r.status_code == 400 and "at most 128 strings, got 129" in r.json()["error"]["message"]
    assert len(validated) == 1


def test_long_prompts_are_tokenized_off_the_event_loop() -> None:
    engine = FakeEngine(max_model_len=1 << 20)
    server = openai_server.OpenAIServer(engine, ServerMetrics("m"), "m")
    tok = engine.tokenizer
    threads: list[int] = []
    encode, encode_batch = tok.encode, tok.encode_batch

    def slow_batch(texts, add_special_tokens=True):
        threads.append(threading.get_ident())
        time.sleep(0.3)  # releases the GIL, as the Rust encode_batch does
        return encode_batch(texts, add_special_tokens)

    def fast(text, add_special_tokens=True):
        threads.append(threading.get_ident())
        return encode(text, add_special_tokens)

    tok.encode, tok.encode_batch = fast, slow_batch

    async def go() -> int:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        t = asyncio.create_task(ticker())
        limit = openai_server.INLINE_TOKENIZE_CHARS
        [short] = await server._encode(["a" * limit])
        assert threads == [threading.get_ident()] and len(short) > 0  # inline: no thread hop
        [ids] = await server._encode(["b" * (limit + 1)])
        assert threads[1] != threading.get_ident() and ids == encode("b" * (limit + 1))
        # Many prompts each under the limit: their total decides (one hop for all of them).
        many = await server._encode(["c" * (limit // 2)] * 3)
        assert len(threads) == 3 and threads[2] != threading.get_ident()
        assert many == [encode("c" * (limit // 2))] * 3
        t.cancel()
        return ticks

    assert asyncio.run(go()) >= 20  # the loop kept running while the long prompts were encoded


def test_a_too_long_prompt_is_refused_before_the_others_are_encoded() -> None:
    engine = FakeEngine(max_model_len=64)
    server = openai_server.OpenAIServer(engine, ServerMetrics("m"), "m")
    encoded: list[str] = []
    encode_batch = engine.tokenizer.encode_batch

    def recording(texts, add_special_tokens=True):
        encoded.extend(texts)
        return encode_batch(texts, add_special_tokens)

    engine.tokenizer.encode_batch = recording
    texts = ["a" * 60] * 40 + ["b" * 100_000]
    with pytest.raises(PromptTooLongError):
        asyncio.run(server._encode(texts))
    assert encoded == []


def test_chat_template_errors_are_400(monkeypatch) -> None:
    template = (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system messages') }}"
        "{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    with serve_fake(monkeypatch, FakeEngine(tokenizer=tiny_tokenizer(template))) as client:
        for stream in (False, True):
            body = {"messages": [{"role": "system", "content": "x"}], "stream": stream}
            r = client.post("/v1/chat/completions", json=body)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert "no system messages" in err["message"] and err["param"] == "messages"
    broken = openai_errors.to_api_error(jinja2.TemplateSyntaxError("unexpected end", 1))
    assert broken.status == 500  # the server's template is broken: not the client's fault


@pytest.mark.parametrize(
    "method,path,status",
    [("GET", "/nope", 404), ("POST", "/v1/nope", 404), ("GET", "/v1/completions", 405),
     ("DELETE", "/v1/models", 405), ("POST", "/health", 405)],
)  # fmt: skip
def test_unknown_routes_and_methods_are_openai_errors(fake, method, path, status) -> None:
    client, _ = fake
    r = client.request(method, path)
    assert r.status_code == status
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    assert path in err["message"] and err["type"] == "invalid_request_error"
    if status == 405:
        assert r.headers["allow"]


def test_health_answers_head_probes(fake) -> None:
    client, engine = fake
    assert client.head("/health").status_code == 200
    engine.is_dead, engine.dead_reason = True, "engine died"
    assert client.head("/health").status_code == client.get("/health").status_code == 503


def test_openapi_schema_documents_the_statuses_the_server_answers(fake) -> None:
    client, _ = fake
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. FastAPI's duplicate operation id
        schema = client.get("/openapi.json").json()
    operations = [op for ops in schema["paths"].values() for op in ops.values()]
    assert len({op["operationId"] for op in operations}) == len(operations)
    for op in operations:
        assert "422" not in op["responses"]  # invalid requests get 400, as OpenAI's
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = schema["paths"][path]["post"]["responses"]
        assert {"200", "400", "404", "503"} <= set(responses)
        ref = responses["400"]["content"]["application/json"]["schema"]["$ref"]
        assert ref.endswith("/ErrorResponse")
    for path in ("/tokenize", "/detokenize"):
        assert {"200", "400", "404", "413"} <= set(schema["paths"][path]["post"]["responses"])
    # /health's 200 has no body (a schemathesis run had flagged the JSON it documented)
    for method in ("get", "head"):
        health = schema["paths"]["/health"][method]["responses"]
        assert "content" not in health["200"] and "503" in health
    assert client.get("/health").content == b""
    metrics = schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert set(metrics) == {"text/plain"}  # Prometheus text, not JSON
    error = schema["components"]["schemas"]["ErrorInfo"]
    assert set(error["properties"]) == {"message", "type", "param", "code"}
    assert "HTTPValidationError" not in schema["components"]["schemas"]


def test_only_json_bodies_start_generations(fake) -> None:
    # A browser posts text/plain or a form across origins without a preflight (CVE-2021-32677).
    client, engine = fake
    engine.script = lambda ids, params: replay(engine.tokenizer, "ab", None, lp=False)
    body = json.dumps({"prompt": "hi", "max_tokens": 2})
    for path in ("/v1/completions", "/v1/chat/completions"):
        for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data"):
            r = client.post(path, content=body, headers={"content-type": kind})
            assert r.status_code == 400 and "application/json" in r.json()["error"]["message"]
    for kind in ("application/json; charset=utf-8", "application/vnd.api+json", None):
        headers = {"content-type": kind} if kind else {}
        r = client.post("/v1/completions", content=body, headers=headers)
        assert r.status_code == 200, (kind, r.text)


def test_serving_lifespan_freezes_the_startup_heap(monkeypatch) -> None:
    """Once the engine is up, the server's startup heap leaves the collector's generations, so a
    full collection no longer walks it (a 75-135 ms stall for every stream, see build_app)."""
    gc.unfreeze()
    try:
        with serve_fake(monkeypatch, FakeEngine()):
            assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(
    ("path", "extra", "expected"),
    [
        (
            "/v1/chat/completions",
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": SCHEMA},
                }
            },
            {"json": SCHEMA},
        ),
        (
            "/v1/chat/completions",
            {"response_format": {"type": "json_object"}},
            {"json_object": True},
        ),
        ("/v1/completions", {"response_format": {"type": "text"}}, None),
        (
            "/v1/completions",
            {"guided_json": '{"type": "integer"}'},
            {"json": '{"type": "integer"}'},
        ),
        ("/v1/completions", {"guided_regex": "[0-9]+"}, {"regex": "[0-9]+"}),
        ("/v1/completions", {"guided_choice": ["yes", "no"]}, {"choice": ["yes", "no"]}),
        ("/v1/completions", {"guided_grammar": 'root ::= "a"'}, {"grammar": 'root ::= "a"'}),
        (
            "/v1/chat/completions",
            {"structured_outputs": {"regex": "a+", "disable_any_whitespace": True}},
            {"regex": "a+", "disable_any_whitespace": True},
        ),
        (  # what vLLM's client sends: every field, most of them null or off
            "/v1/completions",
            {
                "structured_outputs": {
                    "json": None,
                    "regex": None,
                    "choice": ["x", "y"],
                    "grammar": None,
                    "json_object": None,
                    "disable_fallback": False,
                    "disable_any_whitespace": False,
                    "disable_additional_properties": False,
                    "whitespace_pattern": None,
                    "structural_tag": None,
                    "backend": "xgrammar",
                }
            },
            {"choice": ["x", "y"]},
        ),
    ],
)
def test_every_spelling_of_a_constraint_reaches_the_engine(fake, path, extra, expected) -> None:
    client, engine = fake
    seen = []

    def script(ids, params):
        seen.append(params.structured_outputs)
        return replay(engine.tokenizer, "ab", None, lp=False)

    engine.script = script
    body = (
        {"prompt": "hi"}
        if "chat" not in path
        else {"messages": [{"role": "user", "content": "hi"}]}
    )
    r = client.post(path, json={**body, **extra})
    assert r.status_code == 200, r.text
    want = None if expected is None else StructuredOutputsParams(**expected)
    assert seen == [want]


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"response_format": {"type": "xml"}}, "response_format type"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "json_schema.schema",
        ),
        ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_regex, guided_choice"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
        ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "whitespace_pattern"),
        (
            {"structured_outputs": {"regex": "a", "disable_additional_properties": True}},
            "disable_additional_properties",
        ),
        ({"guided_choice": []}, "1 to"),
    ],
)
def test_a_malformed_constraint_is_a_400(fake, extra, needle) -> None:
    client, engine = fake
    engine.script = lambda ids, params: replay(engine.tokenizer, "ab", None, lp=False)
    r = client.post("/v1/completions", json={"prompt": "hi", **extra})
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


# ---------------------------------------------------------------------------- tool calls

TOOLS_TEMPLATE = (
    "{% if tools %}tools: {{ tools | map(attribute='function') | map(attribute='name') "
    "| join(',') }}\n{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
    "{% for c in m.tool_calls or [] %}call {{ c.function.name }} "
    "{{ c.function.arguments | tojson }}{% endfor %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
ASK = [{"role": "user", "content": "Paris?"}]


def tool_engine(answer: str) -> tuple[FakeEngine, list]:
    """A fake engine over TOOLS_TEMPLATE that answers ``answer`` (finishing with "stop") and
    records each request's (prompt text, params)."""
    engine = FakeEngine(max_model_len=512, tokenizer=tiny_tokenizer(TOOLS_TEMPLATE))
    seen = []

    def script(ids, params):
        seen.append((engine.tokenizer.decode(ids), params))
        outs = replay(engine.tokenizer, answer, None, lp=False)
        outs[-1].outputs[0].finish_reason = "stop"  # the EOS (or the constraint's end)
        return outs

    engine.script = script
    return engine, seen


def streamed_calls(r) -> tuple[str, list[dict], str]:
    """(content, calls joined from their deltas, finish reason) of a streamed chat."""
    content, calls, finish = "", [], None
    for event in sse(r):
        choice = event["choices"][0]
        content += choice["delta"].get("content") or ""
        for d in choice["delta"].get("tool_calls", []):
            if "id" in d:
                calls.append({"id": d["id"], "name": d["function"]["name"], "arguments": ""})
            calls[d["index"]]["arguments"] += d["function"]["arguments"]
        finish = choice["finish_reason"] or finish
    return content, calls, finish


def test_a_named_tool_choice_answers_with_one_call_of_it(monkeypatch) -> None:
    engine, seen = tool_engine('{"city": "Paris"}')
    choice = {"type": "function", "function": {"name": "get_weather"}}
    body = {"messages": ASK, "tools": [WEATHER], "tool_choice": choice}
    with serve_fake(monkeypatch, engine) as client:
        r = client.post("/v1/chat/completions", json=body).json()["choices"][0]
        with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
            content, calls, finish = streamed_calls(s)
    prompt, params = seen[0]
    assert prompt.startswith("tools: get_weather\nuser: Paris?")
    assert params.structured_outputs.json == WEATHER["function"]["parameters"]
    (call,) = r["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert r["message"]["content"] is None and r["finish_reason"] == "stop"
    assert content == "" and finish == "stop"
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", '{"city": "Paris"}')]


def test_required_tool_calls_stream_whole_and_finish_as_tool_calls(monkeypatch) -> None:
    call = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    engine, seen = tool_engine(f"[{call}, {call}]")
    body = {"messages": ASK, "tools": [WEATHER], "tool_choice": "required"}
    with serve_fake(monkeypatch, engine) as client:
        r = client.post("/v1/chat/completions", json=body).json()["choices"][0]
        with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
            content, calls, finish = streamed_calls(s)
    assert seen[0][1].structured_outputs.json["type"] == "array"
    whole = [
        (c["function"]["name"], c["function"]["arguments"]) for c in r["message"]["tool_calls"]
    ]
    assert (
        whole
        == [("get_weather", '{"city": "Paris"}')] * 2
        == [(c["name"], c["arguments"]) for c in calls]
    )
    assert r["finish_reason"] == finish == "tool_calls" and content == ""


def test_auto_tool_calls_are_read_by_the_servers_parser(monkeypatch) -> None:
    answer = (
        'Checking. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    )
    engine, seen = tool_engine(answer)
    body = {"messages": ASK, "tools": [WEATHER]}
    with serve_fake(monkeypatch, engine) as client:
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and "--enable-auto-tool-choice" in r.json()["error"]["message"]
        # "none": the tools are shown, the answer stays text
        r = client.post("/v1/chat/completions", json={**body, "tool_choice": "none"}).json()
        assert r["choices"][0]["message"] == {"role": "assistant", "content": answer}
    hermes = openai_server.ChatOptions(tool_call_parser="hermes")
    with serve_fake(monkeypatch, engine, hermes) as client:
        r = client.post("/v1/chat/completions", json=body).json()["choices"][0]
        with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
            content, calls, finish = streamed_calls(s)
    # the tiny vocabulary has no <tool_call> token: special tokens stay skipped
    assert seen[0][0].startswith("tools: get_weather\n") and seen[-1][1].skip_special_tokens
    assert r["message"]["content"] == content == "Checking."
    (call,) = r["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", '{"city": "Paris"}')]
    assert r["finish_reason"] == finish == "tool_calls"


def test_earlier_calls_and_continued_messages_reach_the_template(monkeypatch) -> None:
    engine, seen = tool_engine("ok")
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    turns = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
             {"role": "assistant", "content": "It is 18"}]  # fmt: skip
    own = "{% for m in messages %}<{{ m.role }}|{{ m.content }}>{% endfor %}"
    with serve_fake(monkeypatch, engine) as client:
        body = {"messages": turns, "tools": [WEATHER], "tool_choice": "none"}
        assert client.post("/v1/chat/completions", json=body).status_code == 200
        body["continue_final_message"] = True
        assert client.post("/v1/chat/completions", json=body).status_code == 200
        both = {**body, "add_generation_prompt": True}
        assert client.post("/v1/chat/completions", json=both).status_code == 400
    with serve_fake(monkeypatch, engine, openai_server.ChatOptions(chat_template=own)) as client:
        assert client.post("/v1/chat/completions", json={"messages": ASK}).status_code == 200
    # (the template environment trims the newline after a block, as transformers')
    assert 'assistant: call get_weather {"city": "Paris"}tool: 18 C' in seen[0][0]
    assert seen[0][0].endswith("assistant: It is 18assistant: ")
    assert seen[1][0].endswith("tool: 18 Cassistant: It is 18")
    assert seen[2][0] == "<user|Paris?>"


# ---------------------------------------------------------------------------- tokenizer endpoints


def test_tokenize_counts_a_prompt_or_a_rendered_chat_of_any_length(monkeypatch) -> None:
    engine = FakeEngine(max_model_len=16, tokenizer=tiny_tokenizer(TOOLS_TEMPLATE))
    tok = engine.tokenizer
    with serve_fake(monkeypatch, engine) as client:
        long = f"{EMOJI} tokens past the context<|end|>" * 3
        r = client.post("/tokenize", json={"prompt": long, "return_token_strs": True}).json()
        assert r["tokens"] == tok.encode(long) and r["count"] == len(r["tokens"]) > 16
        assert r["max_model_len"] == 16 and r["token_strs"][:2] == [
            "ðŁ",
            "ĺĢ",
        ]  # the emoji's byte pairs
        chat = {"messages": ASK, "tools": [WEATHER]}
        r = client.post("/tokenize", json=chat).json()
        text = "tools: get_weather\nuser: Paris?assistant: "
        assert r["tokens"] == tok.encode(text, add_special_tokens=False) and r["token_strs"] is None
        for bad in ({}, {"prompt": "a", "messages": ASK}):
            r = client.post("/tokenize", json=bad)
            assert r.status_code == 400 and "either prompt or messages" in r.text
        r = client.post("/tokenize", json={**chat, "chat_template": "{{ 'X' }}"})
        assert r.status_code == 400 and "chat_template is not supported" in r.text
        # more messages than the context holds, in a body the server screens: still counted
        many = {"messages": [{"role": "user", "content": "y" * 16_000}] * 70}
        r = client.post("/tokenize", json=many)
        assert r.status_code == 200 and r.json()["count"] > 70 * 16_000
        assert client.post("/tokenize", json={"prompt": "a", "model": "x"}).status_code == 404


def test_detokenize_gives_the_text_with_special_tokens(fake) -> None:
    client, engine = fake
    ids = engine.tokenizer.encode(f"a{EMOJI}<|end|>b", add_special_tokens=False)
    r = client.post("/detokenize", json={"tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": f"a{EMOJI}<|end|>b"}
    r = client.post("/detokenize", json={"tokens": [1, 10**6]})
    assert r.status_code == 400 and "token id 1000000 is not in the tokenizer's" in r.text
    # an id of the model's padded vocabulary that the tokenizer lacks is refused, not dropped
    engine.client.ready.vocab_size = engine.tokenizer.vocab_size + 64
    r = client.post("/detokenize", json={"tokens": [97, engine.tokenizer.vocab_size]})
    assert r.status_code == 400
    assert client.post("/detokenize", json={"tokens": "ab"}).status_code == 400


@pytest.mark.parametrize("bad", [True, 2.0, "7", -3])
def test_token_ids_are_integers_not_what_pydantic_would_coerce(fake, bad) -> None:
    """A bool, float or string among token ids is a client's mistake: 400, not ids 1, 2, 7
    (a schemathesis run found /detokenize answering `[false]` with the text of token 0); a
    negative one is refused by the schema's own bound."""
    client, engine = fake
    engine.script = lambda ids, params: replay(engine.tokenizer, "ab", None, lp=False)
    r = client.post("/detokenize", json={"tokens": [97, bad]})
    assert r.status_code == 400, r.text
    for body in (
        {"prompt": [97, bad], "max_tokens": 2},
        {"prompt": [[97], [97, bad]], "max_tokens": 2},
        {"prompt": "hi", "max_tokens": 2, "stop_token_ids": [bad]},
        {"prompt": "hi", "max_tokens": 2, "allowed_token_ids": [97, bad]},
    ):
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", body
    assert client.post("/v1/completions", json={"prompt": [97, 98], "max_tokens": 2}).is_success


# ---------------------------------------------------------------------------- reasoning


def test_a_reasoning_parser_sends_thinking_to_reasoning(monkeypatch) -> None:
    engine, seen = tool_engine("<think>Paris, surely.</think>\n\nParis.")
    qwen3 = openai_server.ChatOptions(reasoning_parser="qwen3")
    body = {"messages": ASK, "max_tokens": 40}
    with serve_fake(monkeypatch, engine, qwen3) as client:
        m = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
            deltas = [e["choices"][0]["delta"] for e in sse(s) if e["choices"]]
        # a constraint shapes the whole answer: nothing is split off
        fmt = {**body, "response_format": {"type": "json_object"}}
        whole = client.post("/v1/chat/completions", json=fmt).json()["choices"][0]["message"]
        # earlier thinking reaches the template under both names
        turns = [*ASK, {"role": "assistant", "content": "Paris.", "reasoning_content": "hm"}]
        assert client.post("/v1/chat/completions", json={"messages": turns}).status_code == 200
    assert m["reasoning"] == m["reasoning_content"] == "Paris, surely."
    assert m["content"] == "Paris."
    assert "".join(d.get("reasoning", "") for d in deltas) == "Paris, surely."
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Paris, surely."
    assert "".join(d.get("content") or "" for d in deltas) == "Paris."
    assert whole["content"].startswith("<think>") and "reasoning" not in whole
    assert not seen[0][1].structured_outputs and seen[2][1].structured_outputs


def test_reasoning_comes_before_the_tool_calls_read_from_the_answer(monkeypatch) -> None:
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    engine, _ = tool_engine(f"<think>I should look.</think>{call}")
    chat = openai_server.ChatOptions(tool_call_parser="hermes", reasoning_parser="qwen3")
    body = {"messages": ASK, "tools": [WEATHER]}
    with serve_fake(monkeypatch, engine, chat) as client:
        r = client.post("/v1/chat/completions", json=body).json()["choices"][0]
        with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
            content, calls, finish = streamed_calls(s)
    assert r["message"]["reasoning"] == "I should look." and r["message"]["content"] is None
    assert r["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert r["finish_reason"] == finish == "tool_calls" and content == ""
    assert [c["name"] for c in calls] == ["get_weather"]


# ---------------------------------------------------------------------------- truncation


def test_truncate_prompt_tokens_keeps_the_prompts_end(fake) -> None:
    client, engine = fake  # max_model_len 64, one token a byte
    seen = []

    def script(ids, params):
        seen.append(engine.tokenizer.decode(ids))
        return replay(engine.tokenizer, "ok", None, lp=False)

    engine.script = script
    body = {"prompt": "0123456789", "max_tokens": 2, "truncate_prompt_tokens": 4, "echo": True}
    r = client.post("/v1/completions", json=body).json()
    assert seen[-1] == "6789" and r["choices"][0]["text"] == "6789ok"
    assert r["usage"]["prompt_tokens"] == 4
    # past the context: kept to what fits (-1: room for max_tokens), never a 400
    long = {"prompt": "x" * 500, "max_tokens": 4, "truncate_prompt_tokens": -1}
    assert client.post("/v1/completions", json=long).status_code == 200 and len(seen[-1]) == 60
    ids = {"prompt": list(range(65, 91)), "max_tokens": 2, "truncate_prompt_tokens": 3}
    assert client.post("/v1/completions", json=ids).status_code == 200 and seen[-1] == "XYZ"
    chat = {"messages": [{"role": "user", "content": "hello"}], "truncate_prompt_tokens": 8}
    assert client.post("/v1/chat/completions", json=chat).status_code == 200
    assert seen[-1] == "\nassistant: "[-8:]
    for k, needle in ((65, "larger than the context"), (0, "-1 or at least 1"), (-2, "")):
        r = client.post("/v1/completions", json={**body, "truncate_prompt_tokens": k})
        assert r.status_code == 400 and needle in r.json()["error"]["message"]


def test_a_prompt_left_thinking_sends_the_answers_start_to_reasoning(monkeypatch) -> None:
    """Qwen3's Thinking-2507 templates open <think> in the prompt: the answer starts inside."""
    engine = FakeEngine(tokenizer=tiny_tokenizer(TEMPLATE + "<think>\n"))
    engine.script = lambda ids, params: replay(engine.tokenizer, "plan</think>Paris.", None, False)
    qwen3 = openai_server.ChatOptions(reasoning_parser="qwen3")
    with serve_fake(monkeypatch, engine, qwen3) as client:
        r = client.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 30})
    m = r.json()["choices"][0]["message"]
    assert (m["reasoning"], m["content"]) == ("plan", "Paris.")


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(fake) -> None:
    client, engine = fake
    engine.script = lambda ids, params: replay(engine.tokenizer, "abcd", None, lp=False)
    for path, body in (
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        options = {"include_usage": True, "continuous_usage_stats": True}
        body = {**body, "max_tokens": 4, "stream": True, "stream_options": options}
        with client.stream("POST", path, json=body) as r:
            events = sse(r)
        counted = [e["usage"]["completion_tokens"] for e in events if e["choices"]]
        assert counted == sorted(counted) and counted[-1] == 4, (path, counted)
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 4
        # without the flag, only the last chunk has the usage
        body["stream_options"] = {"include_usage": True}
        with client.stream("POST", path, json=body) as r:
            assert [("usage" in e) for e in sse(r)][-2:] == [False, True]


def test_truncation_keeps_a_bos_reads_only_a_prompts_tail_and_leaves_fitting_prompts(
    monkeypatch,
) -> None:
    from tokenizers import processors

    tok = tiny_tokenizer()
    tok.backend.post_processor = processors.TemplateProcessing(
        single="<|end|> $A", special_tokens=[("<|end|>", 258)]
    )
    engine = FakeEngine(max_model_len=64, tokenizer=tok)
    engine.sampling_defaults = {"max_tokens": 64}  # a model default, cut to the room left
    seen, encoded = [], []
    encode = tok.encode

    def recording_encode(text, add_special_tokens=True):
        encoded.append(len(text))
        return encode(text, add_special_tokens=add_special_tokens)

    monkeypatch.setattr(tok, "encode", recording_encode)

    def script(ids, params):
        seen.append(list(ids))
        return replay(tok, "ok", None, lp=False)

    engine.script = script
    with serve_fake(monkeypatch, engine) as client:
        # transformers truncates from the left after the BOS it adds (vLLM's result)
        body = {"prompt": "0123456789", "max_tokens": 2, "truncate_prompt_tokens": 4}
        assert client.post("/v1/completions", json=body).status_code == 200
        assert seen[-1] == [258, *b"789"]
        # -1 under a model-default max_tokens: a prompt that fits is left whole
        short = {"prompt": "short", "truncate_prompt_tokens": -1}
        assert client.post("/v1/completions", json=short).status_code == 200
        assert seen[-1] == [258, *b"short"]
        # a huge prompt: only its tail is tokenized
        encoded.clear()
        huge = {"prompt": "y" * 1_500, "max_tokens": 2, "truncate_prompt_tokens": 4}
        assert client.post("/v1/completions", json=huge).status_code == 200
        assert len(seen[-1]) == 4 and max(encoded) < 1_500


def test_continuous_usage_is_the_chunks_own_prompt_and_choices(fake) -> None:
    client, engine = fake
    engine.script = lambda ids, params: replay(engine.tokenizer, "abcd", None, lp=False)
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {"prompt": ["hi", "hello there"], "max_tokens": 4, "stream": True, "echo": True,
            "stream_options": options}  # fmt: skip
    with client.stream("POST", "/v1/completions", json=body) as r:
        events = sse(r)
    for e in events[:-1]:
        (choice,) = e["choices"]
        prompt_tokens = 2 if choice["index"] == 0 else 11
        assert e["usage"]["prompt_tokens"] == prompt_tokens, e
        if choice["text"] in ("hi", "hello there"):  # the echo
            assert e["usage"]["completion_tokens"] == 0
    assert events[-1]["usage"]["prompt_tokens"] == 13
    # null stream options mean their defaults
    null = {"prompt": "hi", "stream": True, "stream_options": {"continuous_usage_stats": None}}
    with client.stream("POST", "/v1/completions", json=null) as r:
        assert r.status_code == 200 and sse(r)


def test_a_large_chat_body_that_truncation_serves_is_not_refused(fake) -> None:
    client, engine = fake  # max_model_len 64
    engine.script = lambda ids, params: replay(engine.tokenizer, "ok", None, lp=False)
    many = [{"role": "user", "content": "z" * 16_000}] * 70  # > 1 MB: screened
    body = {"messages": many, "max_tokens": 2, "truncate_prompt_tokens": 8}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    body.pop("truncate_prompt_tokens")
    assert client.post("/v1/chat/completions", json=body).status_code == 400


def test_api_key_guards_the_v1_routes_only(monkeypatch) -> None:
    """As vLLM's --api-key: /v1 requests need 'Authorization: Bearer KEY' (401 in the OpenAI
    error shape otherwise, before any body is read); probes, metrics and the tokenizer
    endpoints stay open, and CORS preflights pass."""
    engine = FakeEngine()
    engine.script = lambda ids, params: replay(engine.tokenizer, "ab", None, lp=False)
    with serve_fake(monkeypatch, engine, api_key="s3cret") as client:
        body = {"model": "tiny", "prompt": "x", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                        {"Authorization": "Bearer s3cret "}):  # fmt: skip
            for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models")):
                r = client.request(method, path, json=body, headers=headers)
                assert r.status_code == 401, (headers, path)
                assert r.headers["www-authenticate"] == "Bearer"
                assert "API key" in r.json()["error"]["message"]
        ok = {"Authorization": "Bearer s3cret"}
        assert client.post("/v1/completions", json=body, headers=ok).status_code == 200
        assert client.get("/v1/models", headers=ok).status_code == 200
        assert client.get("/health").status_code == 200
        assert client.post("/tokenize", json={"prompt": "x"}).status_code == 200
        assert client.options("/v1/completions").status_code != 401


def test_api_key_scope_and_comparison() -> None:
    from shm_engine.entrypoints.api_key import check_api_key, has_key, needs_key

    def scope(path, method="GET", headers=()):
        return {"type": "http", "path": path, "method": method, "headers": list(headers)}

    assert needs_key(scope("/v1/completions", "POST")) and needs_key(scope("/v1"))
    for path in ("/health", "/metrics", "/tokenize", "/v1x", "/docs"):
        assert not needs_key(scope(path))
    assert not needs_key(scope("/v1/models", "OPTIONS"))
    assert not needs_key({"type": "websocket", "path": "/v1/x"})
    auth = [(b"authorization", b"Bearer k")]
    assert has_key(scope("/v1", headers=auth), b"k")
    assert has_key(scope("/v1", headers=[(b"Authorization", b"bearer k")]), b"k")  # RFC 7235
    assert not has_key(scope("/v1", headers=auth * 2), b"k")  # two headers: ambiguous
    for value in (b"Bearer kk", b"Basic k", b"Bearerk", b"k", b"Bearer  k"):
        assert not has_key(scope("/v1", headers=[(b"authorization", value)]), b"k"), value
    # keys no request could present are refused once, at start-up
    assert check_api_key("s3cret-Key_1") == b"s3cret-Key_1"
    for bad in ("", "k ", " k", "k\r", "k\u00e9", "\udcff"):
        with pytest.raises(ValueError, match="API key"):
            check_api_key(bad)
    with pytest.raises(ValueError, match="API key"):
        api_server.build_app(EngineConfig(), api_key="bad key")
