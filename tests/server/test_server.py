"""The OpenAI-compatible server, live: the official ``openai`` client, errors, disconnects,
metrics, ``bench serve`` and a clean shutdown. One server per module (the model loads once);
the shutdown test runs last and stops it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time

import httpx
import openai
import psutil
import pytest

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 512  # what conftest starts the server with
DTYPE = os.environ.get("SHM_ENGINE_TEST_DTYPE", "int8")


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def wait_idle(server, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        running = server.metric("num_requests_running")
        waiting = server.metric("num_requests_waiting")
        inflight = server.metric("frontend_requests_in_flight")
        if running == waiting == inflight == 0:
            return
        assert time.monotonic() < deadline, f"still busy: {running=} {waiting=} {inflight=}"
        time.sleep(0.2)


def test_models_and_health(server, model: str) -> None:
    assert model == "SmolLM2-135M-Instruct"
    assert httpx.get(server.url + "/health").status_code == 200
    info = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert info["max_model_len"] == MAX_MODEL_LEN


def test_completion(client: openai.OpenAI, model: str) -> None:
    prompt = "The capital of France is"
    r = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
    c = r.choices[0]
    assert c.text.strip() and c.finish_reason in ("length", "stop")
    assert r.usage.completion_tokens <= 8 and r.usage.prompt_tokens > 0
    # Greedy is deterministic, and a repeated long prompt is served from the prefix cache.
    long_prompt = "Once upon a time, in a land far away, " * 8
    a = client.completions.create(model=model, prompt=long_prompt, max_tokens=4, temperature=0)
    b = client.completions.create(model=model, prompt=long_prompt, max_tokens=4, temperature=0)
    assert a.choices[0].text == b.choices[0].text
    assert b.usage.prompt_tokens_details.cached_tokens >= 16


def test_completion_stream(client: openai.OpenAI, model: str) -> None:
    kw = dict(model=model, prompt="Count: one, two,", max_tokens=12, temperature=0)
    full = client.completions.create(**kw).choices[0].text
    chunks = list(
        client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("length", "stop")
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12


def test_chat(client: openai.OpenAI, model: str) -> None:
    messages = [{"role": "user", "content": "What is 2 + 2? Answer with a number."}]
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert "4" in r.choices[0].message.content
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=16, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == r.choices[0].message.content


def test_tokenize_counts_what_generation_bills(server, client: openai.OpenAI, model: str) -> None:
    """vLLM's /tokenize and /detokenize agree with the prompt tokens a request is billed."""
    messages = [{"role": "user", "content": "Count me."}]
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=1)
    counted = httpx.post(server.url + "/tokenize", json={"messages": messages}, timeout=30).json()
    assert counted["count"] == r.usage.prompt_tokens == len(counted["tokens"])
    c = client.completions.create(model=model, prompt="Count me too.", max_tokens=1)
    counted = httpx.post(server.url + "/tokenize", json={"prompt": "Count me too."}, timeout=30)
    assert counted.json()["count"] == c.usage.prompt_tokens
    back = httpx.post(server.url + "/detokenize", json={"tokens": counted.json()["tokens"]})
    assert back.json()["prompt"].endswith("Count me too.")


def test_structured_outputs(client: openai.OpenAI, model: str) -> None:
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 24},
            "population": {"type": "integer", "minimum": 0, "maximum": 99_999_999},
        },
        "required": ["city", "population"],
        "additionalProperties": False,
    }
    ask = [{"role": "user", "content": "The capital of France and its population, as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}
    r = client.chat.completions.create(
        model=model, messages=ask, max_tokens=80, temperature=0, response_format=fmt
    )
    assert r.choices[0].finish_reason == "stop"
    obj = json.loads(r.choices[0].message.content)
    assert set(obj) == {"city", "population"} and "Paris" in obj["city"]
    assert 0 <= obj["population"] <= 99_999_999
    # streamed, vLLM's guided_choice
    q = [{"role": "user", "content": "Which city is the capital of France?"}]
    stream = client.chat.completions.create(
        model=model,
        messages=q,
        max_tokens=10,
        temperature=0.7,
        seed=3,
        stream=True,
        extra_body={"guided_choice": ["Paris", "London", "Rome"]},
    )
    chunks = [c.choices[0] for c in stream if c.choices]
    assert "".join(c.delta.content or "" for c in chunks) in ("Paris", "London", "Rome")
    assert chunks[-1].finish_reason == "stop"
    # completions, vLLM's structured_outputs
    c = client.completions.create(
        model=model,
        prompt="My phone number is",
        max_tokens=20,
        temperature=0,
        extra_body={"structured_outputs": {"regex": r" [0-9]{3}-[0-9]{4}"}},
    )
    assert re.fullmatch(r" [0-9]{3}-[0-9]{4}", c.choices[0].text)
    assert c.usage.completion_tokens >= 3  # the digits' tokens and the EOS
    # logprobs: the refused tokens' -inf is written as vLLM's floor (JSON has no -inf)
    c = client.completions.create(
        model=model,
        prompt="Colour:",
        max_tokens=5,
        temperature=0,
        logprobs=5,
        extra_body={"guided_choice": ["red", "blue"]},
    )
    assert c.choices[0].text in ("red", "blue")
    tops = [v for top in c.choices[0].logprobs.top_logprobs for v in top.values()]
    assert min(tops) == -9999.0 and all(v <= 0 for v in tops)
    r = client.chat.completions.create(
        model=model,
        messages=q,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=5,
        extra_body={"guided_choice": ["Paris", "Rome"]},
    )
    assert r.choices[0].message.content in ("Paris", "Rome")
    assert all(t.logprob >= -9999.0 for e in r.choices[0].logprobs.content for t in e.top_logprobs)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 24},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {"type": "function", "function": {"name": "get_time", "description": "The time now"}},
]


def test_tool_calls(client: openai.OpenAI, model: str) -> None:
    """A named and a required tool_choice give calls the official client parses (SmolLM2's
    template does not show tools: the constraint alone shapes the calls)."""
    ask = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(
        model=model, messages=ask, max_tokens=60, temperature=0, tools=TOOLS, tool_choice=named
    )
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and r.choices[0].finish_reason == "stop"
    args = json.loads(call.function.arguments)
    assert set(args) == {"city", "unit"} and "Paris" in args["city"]
    stream = client.chat.completions.create(
        model=model, messages=ask, max_tokens=60, temperature=0, tools=TOOLS, tool_choice=named,
        stream=True,
    )  # fmt: skip
    deltas = [d for c in stream if c.choices for d in c.choices[0].delta.tool_calls or ()]
    assert deltas[0].id and deltas[0].function.name == "get_weather"
    assert "".join(d.function.arguments for d in deltas) == call.function.arguments
    r = client.chat.completions.create(
        model=model,
        messages=ask,
        max_tokens=60,
        temperature=0,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
    )
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name in ("get_weather", "get_time")
    assert isinstance(json.loads(call.function.arguments), dict)
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    # the conversation goes on with the call and its result
    turns = [*ask, r.choices[0].message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}]  # fmt: skip
    r = client.chat.completions.create(
        model=model, messages=turns, max_tokens=8, temperature=0, tools=TOOLS, tool_choice="none"
    )
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls


def test_logit_bias_allowed_token_ids_and_bad_words(client: openai.OpenAI, model: str) -> None:
    kw = dict(model=model, prompt="The capital of France is", max_tokens=4, temperature=0)
    plain = client.completions.create(**kw)
    text = plain.choices[0].text
    assert "Paris" in text
    from shm_engine.model.loader import load_model_info

    tok = load_model_info(None).tokenizer
    paris = tok.encode(" Paris", add_special_tokens=False)
    banned = client.completions.create(**kw, logit_bias={str(paris[0]): -100})
    assert "Paris" not in banned.choices[0].text
    # vLLM's bad_words: the word as the model tokenizes it, inside text too (" Paris")
    r = client.completions.create(**kw, extra_body={"bad_words": ["Paris"]})
    assert "Paris" not in r.choices[0].text
    # vLLM's allowed_token_ids: only these tokens can come
    digits = [tok.encode(d, add_special_tokens=False)[0] for d in "0123456789"]
    r = client.completions.create(**kw, extra_body={"allowed_token_ids": digits})
    assert r.choices[0].text.isdigit() and len(r.choices[0].text) >= 4


def test_streamed_logprobs_match_non_streamed(server, model: str) -> None:
    """Streamed logprobs add up to the non-streamed ones, text_offset included (echo with the
    prompt's logprobs, a stop string that holds text back while streaming)."""
    url = server.url + "/v1/completions"
    body = {"model": model, "prompt": "The three primary colours are", "max_tokens": 16,
            "temperature": 0}  # fmt: skip
    base = httpx.post(url, json=body, timeout=60).json()["choices"][0]["text"]
    stop = base[len(base) // 2 :][:3]  # inside the greedy text: it stops the request
    body = {**body, "logprobs": 2, "stop": [stop], "echo": True}
    whole = httpx.post(url, json=body, timeout=60).json()["choices"][0]
    assert whole["finish_reason"] == "stop" and whole["stop_reason"] == stop
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
        events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    chunks = [e["choices"][0] for e in events]
    assert "".join(c["text"] for c in chunks) == whole["text"]
    assert (chunks[-1]["finish_reason"], chunks[-1]["stop_reason"]) == ("stop", stop)  # as vLLM's
    streamed = {k: [x for c in chunks if c["logprobs"] for x in c["logprobs"][k]]
                for k in ("tokens", "text_offset", "token_logprobs")}  # fmt: skip
    lp = whole["logprobs"]
    assert streamed["tokens"] == lp["tokens"] and streamed["text_offset"] == lp["text_offset"]
    assert streamed["token_logprobs"] == pytest.approx(lp["token_logprobs"], abs=1e-3)
    # The echoed prompt's tokens first (the first has no logprob), then the completion's.
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    k = next(i for i, o in enumerate(lp["text_offset"]) if o >= len(body["prompt"]))
    assert "".join(lp["tokens"][:k]) == body["prompt"]
    assert all(x is not None and x <= 0 for x in lp["token_logprobs"][1:])
    assert all(len(t) >= 2 for t in lp["top_logprobs"][1:])


def test_echo_with_max_tokens_0_scores_the_prompt_only(server, model: str) -> None:
    """lm-eval's log-likelihood request: the prompt and its logprobs back, nothing generated."""
    url = server.url + "/v1/completions"
    prompt = "The three primary colours are red, yellow and blue"
    body = {"model": model, "prompt": prompt, "echo": True, "logprobs": 1, "temperature": 0}
    scored = httpx.post(url, json={**body, "max_tokens": 1}, timeout=60).json()["choices"][0]
    r = httpx.post(url, json={**body, "max_tokens": 0}, timeout=60).json()
    only = r["choices"][0]
    assert only["text"] == prompt and only["finish_reason"] == "length"
    assert r["usage"]["completion_tokens"] == 0 and r["usage"]["prompt_tokens"] > 0
    k = len(only["logprobs"]["tokens"])
    assert only["logprobs"]["tokens"] == scored["logprobs"]["tokens"][:k]
    assert "".join(only["logprobs"]["tokens"]) == prompt
    got, want = only["logprobs"]["token_logprobs"], scored["logprobs"]["token_logprobs"][:k]
    assert got[0] is None and got[1:] == pytest.approx(want[1:], abs=1e-3)
    with httpx.stream("POST", url, json={**body, "max_tokens": 0, "stream": True}) as s:
        events = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
    chunks = [e["choices"][0] for e in events]
    assert "".join(c["text"] for c in chunks) == prompt
    assert [c["finish_reason"] for c in chunks][-1] == "length"
    streamed = [t for c in chunks if c["logprobs"] for t in c["logprobs"]["tokens"]]
    assert streamed == only["logprobs"]["tokens"]
    r = httpx.post(url, json={**body, "max_tokens": 0, "min_tokens": 1}, timeout=60)
    assert r.status_code == 400 and "min_tokens" in r.json()["error"]["message"]


def test_vllm_prompt_logprobs_field(server, model: str) -> None:
    """vLLM's prompt_logprobs: per prompt token None (the first) or {id: {logprob, rank,
    decoded_token}}, the prompt token among them; the echo shape agrees; no streaming."""
    prompt = "The three primary colours are"
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    url = server.url + "/v1/completions"
    r = httpx.post(url, json={**body, "prompt_logprobs": 2, "echo": True, "logprobs": 1})
    choice = r.json()["choices"][0]
    plain = httpx.post(url, json={**body, "echo": True, "logprobs": 1}).json()["choices"][0]
    assert choice["logprobs"] == plain["logprobs"]  # echo's own width, whatever prompt_logprobs
    echoed = choice["logprobs"]["token_logprobs"][: len(choice["prompt_logprobs"])]
    plp = choice["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(echoed) > 3
    # echo with logprobs wider than prompt_logprobs: the field keeps the width asked for
    wide = httpx.post(url, json={**body, "prompt_logprobs": 1, "echo": True, "logprobs": 4})
    wide = wide.json()["choices"][0]
    assert all(1 <= len(e) <= 2 for e in wide["prompt_logprobs"][1:])
    assert all(len(t) >= 4 for t in wide["logprobs"]["top_logprobs"][1:])
    ids = httpx.post(url, json={**body, "prompt_logprobs": 0}).json()["choices"][0]
    for j, entry in enumerate(plp[1:], 1):
        assert 2 <= len(entry) <= 3 and all(e["rank"] >= 1 for e in entry.values())
        own = [e for e in entry.values() if e["logprob"] == pytest.approx(echoed[j], abs=1e-4)]
        assert own and isinstance(own[0]["decoded_token"], str)
        assert len(ids["prompt_logprobs"][j]) == 1  # prompt_logprobs 0: the token's own only
    chat = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    r = httpx.post(server.url + "/v1/chat/completions", json={**chat, "prompt_logprobs": 1})
    assert r.json()["prompt_logprobs"][0] is None and len(r.json()["prompt_logprobs"]) > 2
    r = httpx.post(url, json={**body, "prompt_logprobs": 1, "stream": True})
    assert r.status_code == 400 and "prompt_logprobs" in r.json()["error"]["message"]


def test_echoed_prompt_offsets_index_the_echoed_text(server, model: str) -> None:
    """text[offset_i:offset_i+1] is prompt token i's text, special tokens included, for a text
    prompt (echoed as given) and for token ids (decoded as skip_special_tokens says)."""
    url = server.url + "/v1/completions"
    body = {"model": model, "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True}
    text_prompt = "<|im_start|>user\nHi<|im_end|>"
    ids = [1, 4093, 198, 26843]  # <|im_start|> user \n Hi
    for prompt, skip, echoed in [
        (text_prompt, True, text_prompt),
        (ids, False, "<|im_start|>user\nHi"),
        (ids, True, "user\nHi"),
    ]:
        r = httpx.post(url, json={**body, "prompt": prompt, "skip_special_tokens": skip})
        choice = r.json()["choices"][0]
        assert choice["text"].startswith(echoed)
        lp, text = choice["logprobs"], choice["text"]
        n = len(lp["tokens"]) - 1  # the last is the sampled token
        ends = lp["text_offset"][1:]
        pieces = [text[a:b] for a, b in zip(lp["text_offset"][:n], ends, strict=True)]
        want = lp["tokens"][:n]
        if skip and isinstance(prompt, list):  # a text prompt is echoed with its specials' text
            want = ["" if t in ("<|im_start|>", "<|im_end|>") else t for t in want]
        assert pieces == want, (prompt, skip)


def test_chat_logprob_bytes_are_the_tokens_own(client: openai.OpenAI, model: str) -> None:
    messages = [{"role": "user", "content": "Reply with only emojis: \U0001f600\U0001f389"}]
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=8,
                                       temperature=0, logprobs=True, top_logprobs=2)  # fmt: skip
    content = r.choices[0].logprobs.content
    assert any(e.token.startswith("bytes:") for e in content), "no partial UTF-8 token"
    assert all(e.bytes != [239, 191, 189] for e in content)  # U+FFFD's bytes, once for all
    text = b"".join(bytes(e.bytes) for e in content if not e.token.startswith("<|"))
    assert text.decode("utf-8", "replace") == r.choices[0].message.content


def test_huge_prompt_is_refused_quickly(server, model: str) -> None:
    """Refused for its length before it is tokenized: encoding 12 MB took 13 s, every other
    stream and /health frozen meanwhile."""
    huge = "word " * ((12 << 20) // 5)
    for path, body in (
        ("/v1/completions", {"prompt": huge, "max_tokens": 4}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]}),
    ):
        t0 = time.monotonic()
        r = httpx.post(server.url + path, json={"model": model, **body}, timeout=60)
        assert r.status_code == 400 and "context length" in r.json()["error"]["message"]
        assert time.monotonic() - t0 < 5.0
    assert httpx.get(server.url + "/health").status_code == 200


def test_n_seed_stop_logprobs(client: openai.OpenAI, model: str) -> None:
    kw = dict(model=model, prompt="My favourite colour is", max_tokens=8, temperature=1.0, seed=7)
    a = client.completions.create(**kw, n=3)
    b = client.completions.create(**kw, n=3)
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded
    # stop: the text ends before the stop string, in streaming and not
    base = client.completions.create(model=model, prompt="1, 2, 3,", max_tokens=12, temperature=0)
    stop = base.choices[0].text.strip()[:2] or ","
    s = client.completions.create(
        model=model, prompt="1, 2, 3,", max_tokens=12, temperature=0, stop=[stop]
    )
    assert stop not in s.choices[0].text and s.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model=model, prompt="1, 2, 3,", max_tokens=12, temperature=0, stop=[stop], stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == s.choices[0].text
    # logprobs, completions and chat
    lp = (
        client.completions.create(
            model=model, prompt="Hello", max_tokens=4, temperature=0, logprobs=2
        )
        .choices[0]
        .logprobs
    )
    assert len(lp.tokens) == len(lp.token_logprobs) == 4
    assert all(v <= 0 for v in lp.token_logprobs) and all(len(t) >= 2 for t in lp.top_logprobs)
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)


@pytest.mark.parametrize(
    "path,body,needle",
    [
        ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 500}}, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"99999999": 1}}, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "stop_token_ids": [10**6]}, "stop token id"),
        ("/v1/completions", {"prompt": "x", "priority": 1}, "priority scheduling policy"),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "x"}],
                "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}},
            },
            "invalid structured output",
        ),
        ("/v1/completions", {"prompt": "x", "guided_regex": "[0-9"}, "unclosed"),
        (
            "/v1/completions",
            {"prompt": "x", "guided_choice": ["a"], "response_format": {"type": "json_object"}},
            "one structured output constraint",
        ),
        ("/v1/completions", {"max_tokens": 3}, "prompt"),
        ("/v1/completions", {"prompt": "hi " * 600}, "context length"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": MAX_MODEL_LEN}, "context length"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "tools": TOOLS},
            "--enable-auto-tool-choice",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "role"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
    ],
)
def test_invalid_requests_are_400(server, path: str, body: dict, needle: str) -> None:
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"] == "invalid_request_error"


def test_bad_json_unknown_model_and_openai_errors(server, client: openai.OpenAI) -> None:
    r = httpx.post(
        server.url + "/v1/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", json={"model": "gpt-9", "prompt": "x"})
    assert r.status_code == 404 and "gpt-9" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.completions.create(model="SmolLM2-135M-Instruct", prompt="hi " * 600)
    assert httpx.get(server.url + "/health").status_code == 200  # still serving
    r = httpx.get(server.url + "/v1/nope")
    assert r.status_code == 404 and "/v1/nope" in r.json()["error"]["message"]


def test_disconnect_aborts_request(server, model: str) -> None:
    body = {"model": model, "prompt": "Tell me a long story.", "max_tokens": 400,
            "ignore_eos": True, "stream": True}  # fmt: skip
    generated, ttfts = server.metric("generation_tokens_total"), ttft_count(server)
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        got = 0
        for line in r.iter_lines():
            got += line.startswith("data:")
            if got >= 3:
                break  # leaving the block closes the connection mid-stream
    assert server.metric("num_requests_running") <= 1
    wait_idle(server, timeout=10.0)  # 400 tokens would take far longer than this
    # As in vLLM, the aborted request's tokens and first-token time are counted.
    assert server.metric("generation_tokens_total") >= generated + 3
    assert ttft_count(server) == ttfts + 1
    # Non-streaming: the client gives up; the server notices and aborts too.
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/completions", json={**body, "stream": False}, timeout=1.0)
    wait_idle(server, timeout=10.0)
    # A client going away is routine: no error, no traceback in the log.
    log = server.output()
    assert "Traceback" not in log and "ERROR" not in log, log


def ttft_count(server) -> float:
    return server.metric("time_to_first_token_seconds_count")


def test_metrics(server) -> None:
    text = httpx.get(server.url + "/metrics").text
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "prefix_cache_hit_rate",
        "time_to_first_token_seconds_bucket",
        "time_per_output_token_seconds_bucket",
        "generation_tokens_total",
    ):
        assert f"shm_engine_{name}" in text, name
    assert server.metric("prefix_cache_hit_rate") > 0  # test_completion repeated a prompt
    assert server.metric("time_to_first_token_seconds_count") > 0


def test_bench_serve(server, tmp_path) -> None:
    from shm_engine.benchmarks import serve

    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    rc = serve.main(
        ["--base-url", server.url, "--num-prompts", "6", "--input-len", "24",
         "--output-len", "8", "--sweep", "1,3", "--json", str(out), "--plot", str(png),
         "--no-progress"]
    )  # fmt: skip
    assert rc == 0
    rep = json.loads(out.read_text())
    assert rep["completed"] == 6 and rep["failed"] == 0 and rep["concurrency"] == 3
    assert rep["total_output_tokens"] == 6 * 8  # ignore_eos honoured
    for key in ("ttft_ms", "tpot_ms", "itl_ms"):
        s = rep[key]
        assert 0 < s["p50"] <= s["p99"] and s["mean"] > 0, (key, s)
    assert rep["ttft_ms"]["p50"] < 30_000 and rep["tpot_ms"]["p50"] < 5_000
    assert rep["request_throughput"] > 0 and rep["output_tok_s"] > 0
    assert len(rep["runs"]) == 2 and png.stat().st_size > 1000
    # Each run sends prompts of its own: the second found none of the first's in the cache.
    assert [r["cached_prompt_tokens"] for r in rep["runs"]] == [0, 0]
    assert rep["output_tokens_estimated"] == 0  # the server sent usage


def test_shutdown_sigterm_leaves_nothing(server) -> None:
    procs = [psutil.Process(server.proc.pid), *server.children]
    assert server.children, "the engine runs in a child process"
    # A stream in flight while the server stops must not keep it alive. Its engine paused, it
    # outlasts the grace period: it ends with an error event and [DONE] (uvicorn's cancel had
    # cut it mid-body) and the server logs no traceback.
    engine = next(p for p in server.children if "EngineCore" in " ".join(p.cmdline()))
    body = {"prompt": "Go on and on.", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data:"))
        engine.suspend()
        try:
            server.proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data:")]
        finally:
            engine.resume()
    assert rest[-1] == "data: [DONE]" and "the server is shutting down" in rest[-2]
    assert server.stop(signal.SIGTERM, timeout=30) == 0
    assert "Traceback" not in server.log_path.read_text(errors="replace")
    _, alive = psutil.wait_procs(procs, timeout=10)
    assert not alive, alive
    assert not server.leaked_shm()


def test_engine_death_then_sigint(make_server) -> None:
    """A dead engine: /health and requests answer 503, the server stays up; SIGINT stops it."""
    srv = make_server(kv_cache_mib=16)
    (engine,) = srv.children
    body = {"prompt": "Go on and on.", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data:"))
        assert srv.metric("num_requests_running") == 1
        engine.kill()  # a zombie until the server reaps it at shutdown
        rest = [line for line in lines if line.startswith("data:")]
    assert '"error"' in rest[-2] and rest[-1] == "data: [DONE]"  # the stream says why it ended
    deadline = time.monotonic() + 10
    while httpx.get(srv.url + "/health").status_code != 503:
        assert time.monotonic() < deadline, "health did not notice the dead engine"
        time.sleep(0.1)
    # A dead engine runs nothing: the gauges must not keep the last values it reported.
    assert srv.metric("num_requests_running") == 0 and srv.metric("engine_alive") == 0
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["message"]
    r = httpx.post(
        srv.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "stream": True},
    )
    assert r.status_code == 503
    assert httpx.get(srv.url + "/v1/models").status_code == 200
    assert srv.stop(signal.SIGINT, timeout=30) == 0
    _, alive = psutil.wait_procs([engine, *srv.children], timeout=10)
    assert not alive
    assert not srv.leaked_shm()


def test_data_parallel_server(make_server) -> None:
    """--data-parallel-size 2: two engines share the requests and answer as one engine does; one
    replica dying makes the whole server answer 503, and it still stops cleanly."""
    from concurrent.futures import ThreadPoolExecutor

    from shm_engine import LLM, SamplingParams

    srv = make_server(extra_args=("--data-parallel-size", "2"))
    engines = [p for p in srv.children if "EngineCore" in " ".join(p.cmdline())]
    assert len(engines) == 2
    busy = [e.cpu_times().user for e in engines]
    prompts = [f"Count from {i} to {i + 5}:" for i in range(6)]

    def complete(prompt: str) -> str:
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 0}
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
        return r.json()["choices"][0]["text"]

    with ThreadPoolExecutor(len(prompts)) as pool:
        texts = list(pool.map(complete, prompts))
    wait_idle(srv)  # the merged gauges come back to zero
    assert all(e.cpu_times().user > b + 0.05 for e, b in zip(engines, busy, strict=True))
    params = SamplingParams(max_tokens=12, temperature=0)
    with LLM(dtype=DTYPE, num_kv_blocks=64, in_process=True) as llm:
        ref = llm.generate(prompts, params, use_tqdm=False)
    assert texts == [r.outputs[0].text for r in ref]

    def long_stream(_: int) -> str:
        body = {"prompt": "Go on and on.", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
            return [line for line in r.iter_lines() if line.startswith("data:")][-2]

    with ThreadPoolExecutor(4) as pool:
        streams = pool.map(long_stream, range(4))
        deadline = time.monotonic() + 30
        while srv.metric("num_requests_running") < 4:  # two on each replica
            assert time.monotonic() < deadline
            time.sleep(0.05)
        engines[1].kill()
        assert all('"error"' in last for last in streams)
    deadline = time.monotonic() + 2
    while httpx.get(srv.url + "/health").status_code != 503:
        assert time.monotonic() < deadline, "health did not notice the dead replica"
        time.sleep(0.05)
    # The survivor dropped its share of the requests; it had run them on to max_tokens.
    spent = sum(engines[0].cpu_times()[:2])
    time.sleep(1.0)
    assert sum(engines[0].cpu_times()[:2]) - spent < 0.1  # measured 0.0; 0.47 before
    assert srv.stop(signal.SIGTERM, timeout=30) == 0
    _, alive = psutil.wait_procs(engines, timeout=10)
    assert not alive
    assert not srv.leaked_shm()


def test_api_key_with_the_openai_client_and_bench(make_server, tmp_path, monkeypatch) -> None:
    """serve --api-key (here from SHM_ENGINE_API_KEY): the official client with the key is
    served, without it gets AuthenticationError; bench serve sends the key it is given and says
    so in one line when it lacks it (it never sends OPENAI_API_KEY on its own)."""
    from shm_engine.benchmarks import serve

    monkeypatch.setenv("SHM_ENGINE_API_KEY", "k3y")
    srv = make_server()
    monkeypatch.delenv("SHM_ENGINE_API_KEY")
    good = openai.OpenAI(base_url=srv.url + "/v1", api_key="k3y", max_retries=0)
    model = good.models.list().data[0].id
    out = good.completions.create(
        model=model, prompt="Hi", max_tokens=2, extra_body={"ignore_eos": True}
    )
    assert out.usage.completion_tokens == 2
    bad = openai.OpenAI(base_url=srv.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert httpx.get(srv.url + "/health").status_code == 200
    args = ["--base-url", srv.url, "--num-prompts", "2", "--input-len", "8", "--output-len", "2",
            "--no-progress", "--json", str(tmp_path / "b.json")]  # fmt: skip
    monkeypatch.setenv("OPENAI_API_KEY", "k3y")
    assert serve.main(args) == 2  # one line naming the missing key
    assert serve.main([*args, "--api-key", "k3y"]) == 0
    assert json.loads((tmp_path / "b.json").read_text())["completed"] == 2
    assert srv.stop() == 0 and not srv.leaked_shm()
