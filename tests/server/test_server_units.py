"""Server pieces without a model: request -> SamplingParams mapping, stream hold-back,
benchmark statistics, report and plot, the disconnect race, the AsyncLLM stream slot, metrics and
the benchmark CLI."""

from __future__ import annotations

import argparse
import asyncio
import json

import pytest

from shm_engine.benchmarks import prompts
from shm_engine.benchmarks import serve as bench
from shm_engine.entrypoints.async_engine import _Stream
from shm_engine.entrypoints.openai_protocol import ChatCompletionRequest, CompletionRequest
from shm_engine.entrypoints.streaming import merge_streams
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
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]  # the tokenizer joins them or not, as its template reads content
    assert ChatCompletionRequest(messages=msgs).sampling_params().max_tokens is None


@pytest.mark.parametrize(
    "kw",
    [{"temperature": -1}, {"top_p": 0}, {"max_tokens": 0}, {"n": 0}, {"stop": [""]},
     {"logprobs": 50}],
)  # fmt: skip
def test_invalid_values_raise_value_error(kw: dict) -> None:
    with pytest.raises(ValueError):
        CompletionRequest(prompt="x", **kw).sampling_params()


def test_chat_rejects_top_logprobs_without_logprobs() -> None:
    msgs = [{"role": "user", "content": "x"}]
    with pytest.raises(ValueError, match="top_logprobs"):
        ChatCompletionRequest(messages=msgs, top_logprobs=2).sampling_params()


def test_holdback_covers_the_longest_stop_string_but_one() -> None:
    assert SamplingParams().stop_holdback == 0
    assert SamplingParams(stop=["ab", "xyzw"]).stop_holdback == 3
    assert SamplingParams(stop=["xyzw"], include_stop_str_in_output=True).stop_holdback == 0


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
        got = [x async for _, _, x in merge_streams([(0, None, gen([1, 2])), (1, None, gen([3]))])]
        assert sorted(got) == [1, 2, 3]
        with pytest.raises(ValueError, match="boom"):
            async for _ in merge_streams([(0, None, gen([1], fail=True)), (1, None, gen([2, 3]))]):
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
    f.write_text('{"prompt": "a"}\n{"text": "plain line"}\n\n')
    assert [p for p, _ in prompts.file_prompts(str(f), 5)] == [
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


def test_serve_flags_reach_the_engine_config() -> None:
    from shm_engine.engine.config import EngineConfig
    from shm_engine.entrypoints.cli import build_parser, serve_config

    argv = ["serve", "--max-num-batched-tokens", "384", "--long-prefill-token-threshold", "64"]
    argv += ["--max-num-seqs", "8", "--kv-cache-mib", "64", "--no-prefix-caching"]
    argv += ["--scheduling-policy", "priority", "--activation-dtype", "int8"]
    config = serve_config(build_parser().parse_args(argv))
    assert config.scheduling_policy == "priority"
    assert config.activation_dtype == "int8"
    assert (config.max_num_batched_tokens, config.long_prefill_token_threshold) == (384, 64)
    assert (config.max_num_seqs, config.kv_cache_bytes) == (8, 64 << 20)
    assert not config.enable_prefix_caching
    default = serve_config(build_parser().parse_args(["serve"]))
    engine = EngineConfig()
    assert default.max_num_batched_tokens == engine.max_num_batched_tokens
    assert default.long_prefill_token_threshold == engine.long_prefill_token_threshold
    assert default.max_num_seqs == engine.max_num_seqs
    assert default.activation_dtype == engine.activation_dtype == "auto"
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        serve_config(build_parser().parse_args(["serve", "--long-prefill-token-threshold", "-1"]))


def _sse(*events: dict | str) -> bytes:
    return b"".join(
        b"data: " + (e.encode() if isinstance(e, str) else json.dumps(e).encode()) + b"\n\n"
        for e in events
    )


_CANNED = {
    # Finishes on its first token without any text (a stop token, an EOS): still a success.
    "/empty": _sse(
        {"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]},
        {
            "choices": [],
            "usage": {
                "prompt_tokens": 3,
                "completion_tokens": 1,
                "prompt_tokens_details": {"cached_tokens": 2},
            },
        },
        "[DONE]",
    ),  # fmt: skip
    "/early": _sse({"choices": [{"index": 0, "text": "a", "finish_reason": None}]}),
    "/no-usage": _sse(*({"choices": [{"index": 0, "text": t}]} for t in ("a", "", "b")), "[DONE]"),
    "/nothing": _sse("[DONE]"),
}


def test_send_request_success_ttft_and_token_counts() -> None:
    """vLLM's rules: any chunk with choices counts (TTFT at the first), latency at the last one;
    a 200 stream must end with [DONE]; without usage, text chunks are counted and flagged."""
    import aiohttp
    from aiohttp import web

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(_CANNED[request.path])
        return resp

    async def go() -> dict[str, bench.RequestResult]:
        app = web.Application()
        app.router.add_post("/{name}", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            async with aiohttp.ClientSession() as client:
                return {
                    path: await bench.send_request(
                        client, f"http://127.0.0.1:{port}{path}", {}, False, 0
                    )
                    for path in _CANNED
                }
        finally:
            await runner.cleanup()

    res = asyncio.run(go())
    empty = res["/empty"]
    assert empty.ok and empty.ttft > 0 and empty.latency == empty.ttft and not empty.itl
    assert (empty.output_tokens, empty.prompt_tokens, empty.cached_tokens) == (1, 3, 2)
    assert empty.usage_reported
    assert not res["/early"].ok and "stream ended early" in res["/early"].error
    assert not res["/nothing"].ok and res["/nothing"].error
    no_usage = res["/no-usage"]
    assert no_usage.ok and no_usage.output_tokens == 2 and not no_usage.usage_reported
    assert len(no_usage.itl) == 2  # gaps between all three chunks with choices
    rep = bench.report(list(res.values()), 1.0, _args(), "m", 1, float("inf"))
    assert rep["completed"] == 2 and rep["output_tokens_estimated"] == 1
    assert rep["cached_prompt_tokens"] == 2


def test_every_run_of_a_sweep_sends_prompts_of_its_own(tmp_path) -> None:
    f = tmp_path / "p.txt"
    f.write_text("same start, line one\nsame start, line two\n")
    args = argparse.Namespace(dataset_path=str(f), num_prompts=4, seed=0)
    runs = [[p for p, _ in bench.run_prompts(args, run)] for run in (0, 1)]
    assert runs[0] == [p for p, _ in bench.run_prompts(args, 0)] != runs[1]  # deterministic
    for run in runs:
        # Each prompt of a run starts differently from every prompt of the other run, and the
        # second pass over the file from the first: no prefix can be served from cache.
        assert len({p.split(")")[0] for p in run}) == 2
        assert run[0].endswith("line one") and run[2].endswith("line one")
    assert not {p.split(")")[0] for p in runs[0]} & {p.split(")")[0] for p in runs[1]}
    args = argparse.Namespace(
        dataset_path=None, num_prompts=3, input_len=16, tokenizer=None, seed=0
    )
    a, b = bench.run_prompts(args, 0), bench.run_prompts(args, 1)
    assert a == bench.run_prompts(args, 0) and not {p for p, _ in a} & {p for p, _ in b}
    assert all(abs(n - 16) <= 2 for _, n in a + b)


def test_metrics_of_a_dead_engine() -> None:
    from shm_engine.engine.protocol import SchedulerStats
    from shm_engine.entrypoints.metrics import ServerMetrics

    m = ServerMetrics("m")
    stats = SchedulerStats(num_running=3, num_waiting=2, kv_cache_usage=0.5,
                           prefix_cache_queries=64, prefix_cache_hits=16)  # fmt: skip
    m.update_stats(stats, alive=True)
    assert m.running._value.get() == 3
    m.update_stats(stats, alive=False)  # the last stats the engine sent before it died
    text = m.render().decode()
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert f'shm_engine_{name}{{model_name="m"}} 0.0' in text, name
    assert 'shm_engine_prefix_cache_hits{model_name="m"} 16.0' in text  # totals stay
    assert "(blocks)" not in text and "block lookups" not in text  # counted in tokens


def test_bench_ipc_runs_from_any_directory(tmp_path) -> None:
    """``shm-engine bench ipc`` imports the benchmark from the installed package, not the repo."""
    import subprocess
    import sys
    from pathlib import Path

    exe = Path(sys.executable).with_name("shm-engine")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "shm_engine.entrypoints.cli"]
    r = subprocess.run(
        [*cmd, "bench", "ipc", "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    assert "shm-engine bench ipc" in r.stdout and "--quick" in r.stdout


def test_echoed_text_prompt_offsets_skip_a_bos_the_tokenizer_added() -> None:
    """A text prompt is echoed as given: its typed special tokens are in it, a BOS the tokenizer
    added (as Llama's and Mistral's do) is not, so only the typed ones take characters."""
    from shm_engine.engine.output_processor import RequestOutput
    from shm_engine.entrypoints.openai_logprobs import LogprobFormatter, TokenTable
    from shm_engine.model.loader import load_model

    tok = load_model(None).tokenizer
    fmt = LogprobFormatter(TokenTable(tok))
    bos = tok.token_to_id("<|im_start|>")
    for text, added in [("Hello world", True), ("<|im_start|>Hello world", False)]:
        ids = ([bos] if added else []) + tok.encode(text, add_special_tokens=False)
        out = RequestOutput("r", text, ids, [])
        offsets = fmt.prompt(out, text, None, 1)["text_offset"]
        assert offsets == ([0, 0, 5] if added else [0, 12, 17]), text
