"""Server pieces without a model: request -> SamplingParams mapping, stream hold-back,
benchmark statistics, report and plot, the disconnect race and the AsyncLLM stream slot."""

from __future__ import annotations

import argparse
import asyncio
import json

import pytest

from shm_engine.benchmarks import serve as bench
from shm_engine.entrypoints.async_engine import _Stream
from shm_engine.entrypoints.openai_protocol import ChatCompletionRequest, CompletionRequest
from shm_engine.entrypoints.openai_server import _holdback, _merge
from shm_engine.sampling_params import SamplingParams


def test_completion_request_maps_to_sampling_params() -> None:
    req = CompletionRequest(
        prompt="x", max_tokens=5, temperature=0, top_k=3, seed=1, stop="END", logprobs=2,
        ignore_eos=True, n=2,
    )  # fmt: skip
    sp = req.sampling_params()
    assert (sp.max_tokens, sp.temperature, sp.top_k, sp.seed) == (5, 0.0, 3, 1)
    assert sp.stop == ["END"] and sp.logprobs == 2 and sp.ignore_eos and sp.n == 2
    assert CompletionRequest(prompt="x").sampling_params().max_tokens == 16  # OpenAI default


def test_chat_request_maps_to_sampling_params() -> None:
    msgs = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]  # fmt: skip
    req = ChatCompletionRequest(messages=msgs, max_completion_tokens=7, logprobs=True,
                                top_logprobs=3)  # fmt: skip
    sp = req.sampling_params()
    assert sp.max_tokens == 7 and sp.logprobs == 3
    assert req.conversation() == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ab"},
    ]
    assert ChatCompletionRequest(messages=msgs).sampling_params().max_tokens is None


@pytest.mark.parametrize(
    "kw",
    [{"temperature": -1}, {"top_p": 0}, {"max_tokens": 0}, {"n": 0}, {"stop": [""]},
     {"logprobs": 50}],
)  # fmt: skip
def test_invalid_values_raise_value_error(kw: dict) -> None:
    with pytest.raises(ValueError):
        CompletionRequest(prompt="x", **kw).sampling_params()


def test_chat_rejects_top_logprobs_without_logprobs_and_tools() -> None:
    msgs = [{"role": "user", "content": "x"}]
    with pytest.raises(ValueError, match="top_logprobs"):
        ChatCompletionRequest(messages=msgs, top_logprobs=2).sampling_params()
    with pytest.raises(ValueError, match="tools"):
        ChatCompletionRequest(messages=msgs, tools=[{"type": "function"}]).sampling_params()


def test_holdback_covers_the_longest_stop_string_but_one() -> None:
    assert _holdback(SamplingParams()) == 0
    assert _holdback(SamplingParams(stop=["ab", "xyzw"])) == 3
    assert _holdback(SamplingParams(stop=["xyzw"], include_stop_str_in_output=True)) == 0


def test_stream_slot_keeps_only_the_newest_output_and_reports_errors() -> None:
    async def go() -> None:
        s = _Stream()
        s.put("a")  # type: ignore[arg-type]
        s.put("b")  # type: ignore[arg-type]
        assert await s.get() == "b"
        s.put("c")  # type: ignore[arg-type]
        s.fail(RuntimeError("dead"))
        assert await s.get() == "c"  # what arrived before the failure is still delivered
        with pytest.raises(RuntimeError, match="dead"):
            await asyncio.wait_for(s.get(), 1.0)

    asyncio.run(go())


def test_merge_interleaves_and_propagates_errors() -> None:
    async def gen(items, fail=False):
        for x in items:
            await asyncio.sleep(0)
            yield x
        if fail:
            raise ValueError("boom")

    async def go() -> None:
        got = [x async for _, _, x in _merge([(0, None, gen([1, 2])), (1, None, gen([3]))])]
        assert sorted(got) == [1, 2, 3]
        with pytest.raises(ValueError, match="boom"):
            async for _ in _merge([(0, None, gen([1], fail=True)), (1, None, gen([2, 3]))]):
                pass

    asyncio.run(go())


def _args(**kw) -> argparse.Namespace:
    base = dict(base_url="http://x", endpoint="/v1/completions", input_len=8, output_len=4)
    return argparse.Namespace(**{**base, **kw})


def test_report_statistics(tmp_path) -> None:
    rs = [
        bench.RequestResult(ok=True, prompt_tokens=8, output_tokens=4, ttft=0.1, latency=0.4,
                            itl=[0.1, 0.1, 0.1]),
        bench.RequestResult(ok=True, prompt_tokens=8, output_tokens=4, ttft=0.3, latency=0.6,
                            itl=[0.1, 0.1, 0.1]),
        bench.RequestResult(ok=False, error="HTTP 500"),
    ]  # fmt: skip
    rep = bench.report(rs, 2.0, _args(), "m", 4, float("inf"))
    assert rep["completed"] == 2 and rep["failed"] == 1 and rep["errors"] == ["HTTP 500"]
    assert rep["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert rep["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert rep["tpot_ms"]["mean"] == pytest.approx(100.0)
    assert rep["itl_ms"]["p99"] == pytest.approx(100.0)
    assert rep["request_throughput"] == pytest.approx(1.0)
    assert rep["output_tok_s"] == pytest.approx(4.0)
    json.dumps(rep)  # serializable as is
    png = tmp_path / "p.png"
    bench.plot([rep, {**rep, "concurrency": 8}], "concurrency", str(png))
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_file_prompts_cycle(tmp_path) -> None:
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a"}\nplain line\n\n')
    assert [p for p, _ in bench.file_prompts(str(f), 5)] == [
        "a",
        "plain line",
        "a",
        "plain line",
        "a",
    ]


def test_hot_routes_validate_and_pass_the_rest_to_the_app(monkeypatch) -> None:
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse
    from starlette.testclient import TestClient

    from shm_engine.entrypoints import hot_routes

    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"data": []}

    async def handler(req: CompletionRequest, raw) -> JSONResponse:
        return JSONResponse({"prompt": req.prompt, "app": raw.app is app})

    hot = hot_routes.HotRoutes(
        app,
        {"/v1/completions": (CompletionRequest, handler)},
        lambda status, msg: JSONResponse({"error": msg}, status_code=status),
    )
    with TestClient(hot) as c:
        assert c.post("/v1/completions", json={"prompt": "hi"}).json() == {
            "prompt": "hi",
            "app": True,
        }
        r = c.post("/v1/completions", json={"prompt": "x", "n": "many"})
        assert r.status_code == 400 and r.json()["error"].startswith("n: ")
        assert c.post("/v1/completions", content=b"{not json").status_code == 400
        assert c.get("/v1/models").json() == {"data": []}  # other routes: the app's
        assert c.get("/v1/completions").status_code == 404  # other methods: the app (none here)
        monkeypatch.setattr(hot_routes, "MAX_BODY_BYTES", 100)
        r = c.post("/v1/completions", json={"prompt": "x" * 200})
        assert r.status_code == 413


def test_serving_lifespan_freezes_the_startup_heap(monkeypatch) -> None:
    """Once the engine is up, the server's startup heap leaves the collector's generations, so a
    full collection no longer walks it (a 75-135 ms stall for every stream, see build_app)."""
    import gc
    import types

    from starlette.testclient import TestClient

    from shm_engine.engine.config import EngineConfig
    from shm_engine.entrypoints import openai_server

    class FakeEngine:
        model_name = "m"
        max_model_len = 64
        tokenizer = None
        on_finished = None
        client = types.SimpleNamespace(ready=types.SimpleNamespace(num_kv_blocks=1))

        async def shutdown(self) -> None:
            pass

    async def create(config, served_model_name=None):
        return FakeEngine()

    monkeypatch.setattr(openai_server.AsyncLLM, "create", staticmethod(create))
    gc.unfreeze()
    try:
        with TestClient(openai_server.build_app(EngineConfig())):
            assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def test_serve_flags_reach_the_engine_config() -> None:
    from shm_engine.engine.config import EngineConfig
    from shm_engine.entrypoints.cli import build_parser, serve_config

    argv = ["serve", "--max-num-batched-tokens", "384", "--long-prefill-token-threshold", "64"]
    argv += ["--max-num-seqs", "8", "--kv-cache-mib", "64", "--no-prefix-caching"]
    config = serve_config(build_parser().parse_args(argv))
    assert (config.max_num_batched_tokens, config.long_prefill_token_threshold) == (384, 64)
    assert (config.max_num_seqs, config.kv_cache_bytes) == (8, 64 << 20)
    assert not config.enable_prefix_caching
    default = serve_config(build_parser().parse_args(["serve"]))
    engine = EngineConfig()
    assert default.max_num_batched_tokens == engine.max_num_batched_tokens
    assert default.long_prefill_token_threshold == engine.long_prefill_token_threshold
    assert default.max_num_seqs == engine.max_num_seqs
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        serve_config(build_parser().parse_args(["serve", "--long-prefill-token-threshold", "-1"]))
