"""OpenAI-compatible HTTP server: FastAPI on uvicorn in the frontend process.

    shm-engine serve --host 127.0.0.1 --port 8000 [--model PATH]

Endpoints: ``/v1/completions``, ``/v1/chat/completions`` (SSE streaming or not), ``/v1/models``,
``/health`` (503 once the engine is dead), ``/metrics`` (Prometheus).

Errors are OpenAI-shaped JSON (``{"error": {"message", "type", "param", "code"}}``): 400 for
invalid parameters and prompts that do not fit the context, 404 for an unknown model, 503 when the
engine is gone. No request error takes the server down. A client that disconnects has its request
aborted in the engine: streaming responses are cancelled by Starlette's disconnect listener,
non-streaming ones race the generation against ``http.disconnect``.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from shm_engine.engine.client import EngineDeadError
from shm_engine.engine.config import EngineConfig
from shm_engine.engine.output_processor import CompletionOutput, RequestOutput
from shm_engine.entrypoints.async_engine import AsyncLLM, RequestHandle
from shm_engine.entrypoints.hot_routes import HotRoutes, validation_message
from shm_engine.entrypoints.metrics import CONTENT_TYPE, ServerMetrics
from shm_engine.entrypoints.openai_protocol import ChatCompletionRequest, CompletionRequest
from shm_engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")
_json = msgspec.json.Encoder()
_SSE_DONE = b"data: [DONE]\n\n"


# --------------------------------------------------------------------------- errors


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param


def _error_body(status: int, message: str, type_: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": status}}


def error_response(status: int, message: str, type_: str, param: str | None = None) -> Response:
    return JSONResponse(_error_body(status, message, type_, param), status_code=status)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param)


def engine_dead(message: str = "") -> APIError:
    return APIError(503, message or "the engine is not running", "service_unavailable")


def _to_api_error(e: BaseException) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, EngineDeadError):
        return engine_dead(str(e))
    if isinstance(e, ValueError | TypeError):
        return bad_request(str(e))
    logger.exception("request failed", exc_info=e)
    return APIError(500, f"internal error: {type(e).__name__}: {e}", "server_error")


# --------------------------------------------------------------------------- per-request state


@dataclass
class _Choice:
    """What one choice has already sent to the client (outputs are cumulative)."""

    text_sent: int = 0
    tokens_sent: int = 0
    done: bool = False


@dataclass
class _Prompt:
    text: str | None
    token_ids: list[int]
    params: SamplingParams
    request_id: str
    choices: list[_Choice] = field(default_factory=list)
    final: RequestOutput | None = None
    handle: RequestHandle | None = None


def _holdback(params: SamplingParams) -> int:
    """Characters to withhold while streaming: a stop string may still cut them off."""
    if not params.stop or params.include_stop_str_in_output:
        return 0
    return max(len(s) for s in params.stop) - 1


def _sse_chunk(
    rid: str, obj: str, created: int, model: str, choices: list[dict], usage: dict | None
) -> bytes:
    """One SSE event of a streamed completion (OpenAI chunk shape)."""
    body: dict[str, Any] = {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": choices,
    }
    if usage is not None:
        body["usage"] = usage
    return b"data: " + _json.encode(body) + b"\n\n"


def _usage(prompts: list[_Prompt]) -> dict[str, Any]:
    prompt_tokens = sum(len(p.token_ids) for p in prompts)
    completion = sum(
        len(c.token_ids) for p in prompts if p.final is not None for c in p.final.outputs
    )
    cached = sum(p.final.num_cached_tokens for p in prompts if p.final is not None)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _finish_reason(c: CompletionOutput) -> str | None:
    r = c.finish_reason
    return None if r is None else ("stop" if r in ("stop", "abort") else r)


# --------------------------------------------------------------------------- the server


class OpenAIServer:
    """Turns OpenAI requests into AsyncLLM requests and outputs into OpenAI responses."""

    def __init__(self, engine: AsyncLLM, metrics: ServerMetrics, model_name: str) -> None:
        self.engine = engine
        self.metrics = metrics
        self.model_name = model_name
        self.tokenizer = engine.tokenizer
        self.created = int(time.time())
        self._token_text: dict[int, str] = {}

    # ------------------------------------------------------------------ helpers

    def check_model(self, model: str | None) -> None:
        if model and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist.", "model_not_found", "model")

    def check_alive(self) -> None:
        if self.engine.is_dead:
            raise engine_dead(self.engine.dead_reason or "")

    def token_text(self, token_id: int) -> str:
        s = self._token_text.get(token_id)
        if s is None:
            s = self._token_text[token_id] = self.tokenizer.decode(
                [token_id], skip_special_tokens=False
            )
        return s

    def _prompts_from_completion(
        self, req: CompletionRequest, params: SamplingParams
    ) -> list[_Prompt]:
        p = req.prompt
        if isinstance(p, str):
            raw: list[str | list[int]] = [p]
        elif p and all(isinstance(x, int) for x in p):
            raw = [list(p)]  # type: ignore[arg-type]
        else:
            raw = list(p)  # type: ignore[arg-type]
        if not raw:
            raise bad_request("prompt must not be empty", "prompt")
        prompts = []
        base = f"cmpl-{uuid.uuid4().hex[:24]}"
        for i, item in enumerate(raw):
            if isinstance(item, str):
                text, ids = item, self.tokenizer.encode(item)
            else:
                if any(t < 0 or t >= self.engine.client.ready.vocab_size for t in item):
                    raise bad_request("prompt token ids out of the vocabulary", "prompt")
                text, ids = None, list(item)
            prompts.append(_Prompt(text, ids, params, f"{base}-{i}"))
        for pr in prompts:
            self.engine.check_prompt(pr.token_ids, params)
        return prompts

    def _prompt_from_chat(self, req: ChatCompletionRequest, params: SamplingParams) -> _Prompt:
        text = self.tokenizer.apply_chat_template(
            req.conversation(), add_generation_prompt=req.add_generation_prompt
        )
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        self.engine.check_prompt(ids, params)
        return _Prompt(text, ids, params, f"chatcmpl-{uuid.uuid4().hex[:24]}")

    def _start(self, prompts: list[_Prompt]) -> list[RequestHandle]:
        """Send every prompt to the engine before the HTTP response is set up (TTFT)."""
        handles: list[RequestHandle] = []
        try:
            for p in prompts:
                p.handle = self.engine.add_request(p.text, p.token_ids, p.params, p.request_id)
                handles.append(p.handle)
        except BaseException:
            for h in handles:
                h.close()
            raise
        return handles

    async def _run(self, prompt: _Prompt) -> AsyncIterator[RequestOutput]:
        assert prompt.handle is not None
        async for out in prompt.handle.outputs():
            prompt.final = out
            yield out

    async def _collect(self, prompts: list[_Prompt]) -> None:
        async def one(p: _Prompt) -> None:
            async for _ in self._run(p):
                pass

        await asyncio.gather(*(one(p) for p in prompts))

    # ------------------------------------------------------------------ logprobs

    def _completion_logprobs(
        self, c: CompletionOutput, start: int, end: int, text_offset: int
    ) -> dict[str, Any]:
        tokens, token_lps, tops, offsets = [], [], [], []
        off = text_offset
        for tid, lps in zip(c.token_ids[start:end], c.logprobs[start:end], strict=False):
            s = self.token_text(tid)
            tokens.append(s)
            token_lps.append(lps.get(tid))
            tops.append({self.token_text(t): lp for t, lp in lps.items()})
            offsets.append(off)
            off += len(s)
        return {
            "tokens": tokens,
            "token_logprobs": token_lps,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def _chat_logprobs(
        self, c: CompletionOutput, start: int, end: int, top_n: int
    ) -> dict[str, Any]:
        content = []
        for tid, lps in zip(c.token_ids[start:end], c.logprobs[start:end], strict=False):
            s = self.token_text(tid)
            top = sorted(lps.items(), key=lambda kv: -kv[1])[:top_n]
            content.append(
                {
                    "token": s,
                    "logprob": lps.get(tid),
                    "bytes": list(s.encode()),
                    "top_logprobs": [
                        {
                            "token": self.token_text(t),
                            "logprob": lp,
                            "bytes": list(self.token_text(t).encode()),
                        }
                        for t, lp in top
                    ],
                }
            )
        return {"content": content}

    # ------------------------------------------------------------------ completions

    async def completions(self, req: CompletionRequest, raw: Request) -> Response:
        self.check_model(req.model)
        self.check_alive()
        params = req.sampling_params()
        prompts = self._prompts_from_completion(req, params)
        if req.stream:
            return _SSEResponse(self._stream_completions(req, prompts), self._start(prompts))
        handles = self._start(prompts)
        try:
            await _until_disconnect(raw, self._collect(prompts))
        finally:
            for h in handles:
                h.close()
        choices = []
        for i, p in enumerate(prompts):
            assert p.final is not None
            prefix = (p.text or self.tokenizer.decode(p.token_ids)) if req.echo else ""
            for c in p.final.outputs:
                lp = None
                if params.logprobs is not None and c.logprobs is not None:
                    lp = self._completion_logprobs(c, 0, len(c.token_ids), len(prefix))
                choices.append(
                    {
                        "index": i * params.n + c.index,
                        "text": prefix + c.text,
                        "logprobs": lp,
                        "finish_reason": _finish_reason(c),
                        "stop_reason": c.stop_reason,
                    }
                )
        return JSONResponse(
            {
                "id": prompts[0].request_id.rsplit("-", 1)[0],
                "object": "text_completion",
                "created": int(time.time()),
                "model": self.model_name,
                "choices": choices,
                "usage": _usage(prompts),
            }
        )

    async def _stream_completions(
        self, req: CompletionRequest, prompts: list[_Prompt]
    ) -> AsyncIterator[bytes]:
        rid = prompts[0].request_id.rsplit("-", 1)[0]
        created = int(time.time())
        n = prompts[0].params.n
        want_lp = prompts[0].params.logprobs is not None

        def chunk(choices: list[dict], usage: dict | None = None) -> bytes:
            return _sse_chunk(rid, "text_completion", created, self.model_name, choices, usage)

        try:
            async for i, p, out in _merge([(i, p, self._run(p)) for i, p in enumerate(prompts)]):
                if not p.choices:
                    p.choices = [_Choice() for _ in range(n)]
                    if req.echo:
                        prefix = p.text or self.tokenizer.decode(p.token_ids)
                        yield chunk(
                            [
                                {
                                    "index": i * n + j,
                                    "text": prefix,
                                    "logprobs": None,
                                    "finish_reason": None,
                                }
                                for j in range(n)
                            ]
                        )
                hold = _holdback(p.params)
                choices = []
                for c in out.outputs:
                    st = p.choices[c.index]
                    if st.done:
                        continue
                    finish = _finish_reason(c)
                    end = len(c.text) if finish else max(st.text_sent, len(c.text) - hold)
                    delta = c.text[st.text_sent : end]
                    ntok = len(c.token_ids)
                    if not delta and finish is None:
                        continue
                    lp = None
                    if want_lp and c.logprobs is not None:
                        lp = self._completion_logprobs(c, st.tokens_sent, ntok, st.text_sent)
                        st.tokens_sent = ntok
                    st.text_sent = end
                    st.done = finish is not None
                    choices.append(
                        {
                            "index": i * n + c.index,
                            "text": delta,
                            "logprobs": lp,
                            "finish_reason": finish,
                        }
                    )
                if choices:
                    yield chunk(choices)
            if req.include_usage:
                yield chunk([], _usage(prompts))
        except Exception as e:
            err = _to_api_error(e)
            yield b"data: " + _json.encode(_error_body(err.status, err.message, err.type)) + b"\n\n"
        yield _SSE_DONE

    # ------------------------------------------------------------------ chat

    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Response:
        self.check_model(req.model)
        self.check_alive()
        params = req.sampling_params()
        prompt = self._prompt_from_chat(req, params)
        if req.stream:
            return _SSEResponse(self._stream_chat(req, prompt), self._start([prompt]))
        (handle,) = self._start([prompt])
        try:
            await _until_disconnect(raw, self._collect([prompt]))
        finally:
            handle.close()
        assert prompt.final is not None
        choices = []
        for c in prompt.final.outputs:
            lp = None
            if params.logprobs is not None and c.logprobs is not None:
                lp = self._chat_logprobs(c, 0, len(c.token_ids), params.logprobs)
            choices.append(
                {
                    "index": c.index,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": lp,
                    "finish_reason": _finish_reason(c),
                    "stop_reason": c.stop_reason,
                }
            )
        return JSONResponse(
            {
                "id": prompt.request_id,
                "object": "chat.completion",
                "created": int(time.time()),
                "model": self.model_name,
                "choices": choices,
                "usage": _usage([prompt]),
            }
        )

    async def _stream_chat(self, req: ChatCompletionRequest, p: _Prompt) -> AsyncIterator[bytes]:
        created = int(time.time())
        params = p.params
        hold = _holdback(params)

        def chunk(choices: list[dict], usage: dict | None = None) -> bytes:
            return _sse_chunk(
                p.request_id, "chat.completion.chunk", created, self.model_name, choices, usage
            )

        try:
            p.choices = [_Choice() for _ in range(params.n)]
            # The role comes first, before any token, as OpenAI does.
            yield chunk(
                [
                    {
                        "index": j,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    for j in range(params.n)
                ]
            )
            async for out in self._run(p):
                choices = []
                for c in out.outputs:
                    st = p.choices[c.index]
                    if st.done:
                        continue
                    finish = _finish_reason(c)
                    end = len(c.text) if finish else max(st.text_sent, len(c.text) - hold)
                    delta = c.text[st.text_sent : end]
                    if not delta and finish is None:
                        continue
                    lp = None
                    ntok = len(c.token_ids)
                    if params.logprobs is not None and c.logprobs is not None:
                        lp = self._chat_logprobs(c, st.tokens_sent, ntok, params.logprobs)
                        st.tokens_sent = ntok
                    st.text_sent = end
                    st.done = finish is not None
                    choices.append(
                        {
                            "index": c.index,
                            "delta": {"content": delta} if delta else {},
                            "logprobs": lp,
                            "finish_reason": finish,
                        }
                    )
                if choices:
                    yield chunk(choices)
            if req.include_usage:
                yield chunk([], _usage([p]))
        except Exception as e:
            err = _to_api_error(e)
            yield b"data: " + _json.encode(_error_body(err.status, err.message, err.type)) + b"\n\n"
        yield _SSE_DONE

    # ------------------------------------------------------------------ misc endpoints

    def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model_name,
                    "object": "model",
                    "created": self.created,
                    "owned_by": "shm_engine",
                    "root": self.model_name,
                    "max_model_len": self.engine.max_model_len,
                }
            ],
        }

    async def render_metrics(self) -> bytes:
        stats = await self.engine.get_stats(timeout=1.0)
        self.metrics.update_stats(stats, alive=not self.engine.is_dead)
        self.metrics.frontend_inflight.set(self.engine.num_unfinished())
        return self.metrics.render()


# --------------------------------------------------------------------------- async helpers


class ClientDisconnected(Exception):
    """The HTTP client went away mid-stream (its requests are aborted)."""


class _SSEResponse(Response):
    """An SSE stream whose engine requests are aborted however the response ends.

    The requests are started before the response; if the client vanishes before the body is
    first iterated, the body generator never runs its cleanup, so the response does it.

    NOTE: not Starlette's StreamingResponse: its anyio task group (a disconnect listener next to
    the body) costs ~0.2 ms per request, a tenth of the TTFT budget of the frontend. Here one
    plain asyncio task waits for the disconnect and, if it comes, aborts the requests and fails
    their streams, which ends the body wherever it is waiting.
    """

    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[bytes], handles: list[RequestHandle]) -> None:
        self.body_iterator = body
        self.handles = handles
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _watch(self, receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        for h in self.handles:
            h.close()
            h.stream.fail(ClientDisconnected())

    async def __call__(self, scope, receive, send) -> None:
        watch = asyncio.ensure_future(self._watch(receive))
        body = self.body_iterator
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for chunk in body:
                if watch.done():
                    break
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            else:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            watch.cancel()
            await body.aclose()  # type: ignore[attr-defined]
            for h in self.handles:
                h.close()


async def _merge(
    sources: list[tuple[int, Any, AsyncIterator[T]]],
) -> AsyncIterator[tuple[int, Any, T]]:
    """Interleave several async iterators (one per prompt) as their items arrive."""
    if len(sources) == 1:
        i, tag, it = sources[0]
        async for item in it:
            yield i, tag, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def drain(i: int, tag: Any, it: AsyncIterator[T]) -> None:
        try:
            async for item in it:
                await queue.put((i, tag, item))
        except BaseException as e:
            await queue.put(e)
            return
        await queue.put(done)

    tasks = [asyncio.create_task(drain(*s)) for s in sources]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is done:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _until_disconnect(raw: Request, work: Awaitable[T]) -> T:
    """Run ``work`` unless the client disconnects first; then cancel it (aborting its requests)."""
    work_task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while True:
            msg = await raw.receive()
            if msg["type"] == "http.disconnect":
                return

    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work_task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work_task.done():
            work_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch
    if not work_task.done():
        with contextlib.suppress(asyncio.CancelledError):
            await work_task
        raise APIError(499, "client disconnected", "client_closed_request")
    return work_task.result()


# --------------------------------------------------------------------------- the app


def build_app(config: EngineConfig, served_model_name: str | None = None) -> HotRoutes:
    """The ASGI app; the engine starts in its lifespan (after uvicorn binds) and stops with it.

    The FastAPI app serves everything but the two generation endpoints, which ``HotRoutes``
    answers in front of it with the same handlers (see hot_routes.py for why).
    """

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine = await AsyncLLM.create(config, served_model_name)
        metrics = ServerMetrics(engine.model_name)
        engine.on_finished = metrics.observe_finished
        app.state.server = OpenAIServer(engine, metrics, engine.model_name)
        # NOTE: the startup heap (FastAPI, pydantic, the tokenizer, torch's modules: ~200k
        # objects) leaves the collector's generations. A full collection walked it in 75-135 ms
        # here, a stall for every stream in flight; per-request garbage triggers one every few
        # hundred requests. After the freeze the worst collection in the same load took 18 ms.
        gc.collect()
        gc.freeze()
        logger.info(
            "serving %s (max_model_len %d, %d KV blocks)",
            engine.model_name,
            engine.max_model_len,
            engine.client.ready.num_kv_blocks,
        )
        try:
            yield
        finally:
            await engine.shutdown()

    app = FastAPI(title="shm_engine OpenAI-compatible server", lifespan=lifespan)

    def server(request: Request) -> OpenAIServer:
        return request.app.state.server

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> Response:
        return error_response(e.status, e.message, e.type, e.param)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError) -> Response:
        return error_response(400, validation_message(e.errors()), "invalid_request_error")

    def api_error_response(e: Exception) -> Response:
        err = _to_api_error(e)
        return error_response(err.status, err.message, err.type, err.param)

    @app.exception_handler(Exception)
    async def _any_error(request: Request, e: Exception) -> Response:
        return api_error_response(e)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        try:
            return await server(raw).completions(req, raw)
        except Exception as e:  # answered here: the generic handler would also log a traceback
            return api_error_response(e)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, raw: Request) -> Response:
        try:
            return await server(raw).chat(req, raw)
        except Exception as e:  # answered here: the generic handler would also log a traceback
            return api_error_response(e)

    @app.get("/v1/models")
    async def models(raw: Request) -> dict[str, Any]:
        return server(raw).models()

    @app.get("/health")
    async def health(raw: Request) -> Response:
        s = server(raw)
        if s.engine.is_dead:
            return error_response(
                503, s.engine.dead_reason or "the engine is not running", "service_unavailable"
            )
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics(raw: Request) -> Response:
        return Response(await server(raw).render_metrics(), media_type=CONTENT_TYPE)

    return HotRoutes(
        app,
        {
            "/v1/completions": (CompletionRequest, completions),
            "/v1/chat/completions": (ChatCompletionRequest, chat),
        },
        lambda status, message: error_response(status, message, "invalid_request_error"),
    )


def serve(
    config: EngineConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_name: str | None = None,
    log_level: str = "info",
    access_log: bool = False,
) -> None:
    """Run until SIGINT/SIGTERM; the lifespan then stops the engine and frees its shared memory."""
    import uvicorn

    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    app = build_app(config, served_model_name)
    uv = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=access_log,
        # Open streams get this long to finish on shutdown, then they are cancelled.
        timeout_graceful_shutdown=3,
        lifespan="on",
    )
    # uvicorn re-raises the stop signal once it has shut down gracefully; a requested stop that
    # completed cleanly is a success, so that re-raise ends the process with status 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _exit_cleanly)
    uvicorn.Server(uv).run()


def _exit_cleanly(signum: int, frame: Any) -> None:
    raise SystemExit(0)
