"""The OpenAI-compatible server's app and process: FastAPI routes, the engine's start and stop
in the app's lifespan, and uvicorn with a graceful shutdown.

    shm-engine serve --host 127.0.0.1 --port 8000 [--model PATH]

What each route answers is OpenAIServer's (openai_server.py); the two generation routes are
served by HotRoutes in front of FastAPI (hot_routes.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
from collections.abc import Callable
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException

from shm_engine.engine.client import EngineDeadError, EngineLaunch
from shm_engine.engine.config import EngineConfig
from shm_engine.entrypoints.async_engine import AsyncLLM
from shm_engine.entrypoints.hot_routes import HotRoutes, validation_message
from shm_engine.entrypoints.metrics import CONTENT_TYPE, ServerMetrics
from shm_engine.entrypoints.openai_errors import APIError, error_response, to_api_error
from shm_engine.entrypoints.openai_protocol import (
    GENERATION_RESPONSES,
    HEALTH_RESPONSES,
    METRICS_RESPONSES,
    TOKENIZER_RESPONSES,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    without_validation_422,
)
from shm_engine.entrypoints.openai_server import ChatOptions, OpenAIServer
from shm_engine.model.loader import ModelInfo

logger = logging.getLogger(__name__)


def build_app(
    config: EngineConfig,
    served_model_name: str | None = None,
    data_parallel_size: int = 1,
    model_info: ModelInfo | None = None,
    chat_options: ChatOptions | None = None,
    api_key: str | None = None,
    launches: list[EngineLaunch] | None = None,
) -> HotRoutes:
    """The ASGI app; the engine starts in its lifespan and stops with it (``launches``: its
    processes, one a replica, started ahead by the caller).

    Lifespan startup runs before uvicorn binds, so the port opens once the model is loaded.

    The FastAPI app serves everything but the two generation endpoints, which ``HotRoutes``
    answers in front of it with the same handlers (see hot_routes.py for why).
    """

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        try:
            engine = await AsyncLLM.create(
                config, served_model_name, data_parallel_size, model_info, launches
            )
        except EngineDeadError as e:
            app.state.start_failure = str(e)  # serve() reports it in one line
            raise
        metrics = ServerMetrics(engine.model_name)
        engine.on_finished = metrics.observe_finished
        app.state.server = OpenAIServer(engine, metrics, engine.model_name, chat_options)
        # NOTE: the startup heap (FastAPI, pydantic, the tokenizer, torch's modules: ~200k
        # objects) leaves the collector's generations. A full collection walked it in 75-135 ms
        # here, a stall for every stream in flight; per-request garbage triggers one every few
        # hundred requests. After the freeze the worst collection in the same load took 18 ms.
        gc.collect()
        gc.freeze()
        if engine.sampling_defaults:
            logger.info("sampling defaults from the model: %s", engine.sampling_defaults)
        logger.info(
            "serving %s (%s; max_model_len %d, %d KV blocks)",
            engine.model_name,
            engine.client.ready.weights,
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

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, e: HTTPException) -> Response:
        """Routing errors (404 unknown path, 405 wrong method) in the OpenAI shape too."""
        message = f"{e.detail}: {request.method} {request.url.path}"
        response = error_response(e.status_code, message, "invalid_request_error")
        response.headers.update(e.headers or {})  # 405 keeps its Allow header
        return response

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError) -> Response:
        return error_response(400, validation_message(e.errors()), "invalid_request_error")

    def api_error_response(e: Exception) -> Response:
        err = to_api_error(e)
        return error_response(err.status, err.message, err.type, err.param)

    @app.exception_handler(Exception)
    async def _any_error(request: Request, e: Exception) -> Response:
        return api_error_response(e)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = without_validation_422(FastAPI.openapi(app))
        return app.openapi_schema

    app.openapi = openapi

    @app.post("/v1/completions", responses=GENERATION_RESPONSES)
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        try:
            return await server(raw).completions(req, raw)
        except Exception as e:  # answered here: the generic handler would also log a traceback
            return api_error_response(e)

    @app.post("/v1/chat/completions", responses=GENERATION_RESPONSES)
    async def chat(req: ChatCompletionRequest, raw: Request) -> Response:
        try:
            return await server(raw).chat(req, raw)
        except Exception as e:  # answered here: the generic handler would also log a traceback
            return api_error_response(e)

    # vLLM's tokenizer endpoints. Served by HotRoutes too: its body limit and JSON checks.
    @app.post("/tokenize", responses=TOKENIZER_RESPONSES)
    async def tokenize(req: TokenizeRequest, raw: Request) -> Response:
        try:
            return await server(raw).tokenize(req)
        except Exception as e:
            return api_error_response(e)

    @app.post("/detokenize", responses=TOKENIZER_RESPONSES)
    async def detokenize(req: DetokenizeRequest, raw: Request) -> Response:
        try:
            return await server(raw).detokenize(req)
        except Exception as e:
            return api_error_response(e)

    @app.get("/v1/models")
    async def models(raw: Request) -> dict[str, Any]:
        return server(raw).models()

    # HEAD: load balancers probe with it. Two routes, not one with two methods, so the OpenAPI
    # schema gets an operation id each.
    # NOTE: response_class=Response: a 200 has no body, which the schema then says (it had
    # documented JSON, and a schema-driven client or fuzzer took the empty body for an error)
    @app.get("/health", responses=HEALTH_RESPONSES, response_class=Response)
    @app.head("/health", responses=HEALTH_RESPONSES, response_class=Response)
    async def health(raw: Request) -> Response:
        s = server(raw)
        if s.engine.is_dead:
            return error_response(
                503, s.engine.dead_reason or "the engine is not running", "service_unavailable"
            )
        return Response(status_code=200)

    @app.get("/metrics", response_class=Response, responses=METRICS_RESPONSES)
    async def metrics(raw: Request) -> Response:
        return Response(await server(raw).render_metrics(), media_type=CONTENT_TYPE)

    return HotRoutes(
        app,
        {
            "/v1/completions": (CompletionRequest, completions),
            "/v1/chat/completions": (ChatCompletionRequest, chat),
            "/tokenize": (TokenizeRequest, tokenize),
            "/detokenize": (DetokenizeRequest, detokenize),
        },
        lambda status, message: error_response(status, message, "invalid_request_error"),
        screen=lambda path, body: app.state.server.screen_body(path, body),
        api_key=api_key,
    )


def serve(
    config: EngineConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_name: str | None = None,
    log_level: str = "info",
    access_log: bool = False,
    data_parallel_size: int = 1,
    model_info: ModelInfo | None = None,
    chat_options: ChatOptions | None = None,
    api_key: str | None = None,
    launches: list[EngineLaunch] | None = None,
) -> None:
    """Run until SIGINT/SIGTERM; the lifespan then stops the engine and frees its shared memory.

    ``api_key``: /v1 requests must carry ``Authorization: Bearer <api_key>`` (api_key.py).
    ``launches``: the engine processes, one a replica, if the caller started them ahead
    (``launch_engines``)."""
    if not 0 <= port <= 65535:
        # NOTE: uvicorn's bind raises OverflowError for it after the lifespan started the
        # engine, and the process then never exited.
        raise ValueError(f"port must be in 0..65535, got {port}")
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    app = build_app(
        config, served_model_name, data_parallel_size, model_info, chat_options, api_key, launches
    )
    if api_key is not None:
        logging.getLogger(__name__).info("/v1 requests need the API key (Authorization: Bearer)")
    uv = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=access_log,
        # Open requests get this long to finish on shutdown (see _GracefulServer).
        timeout_graceful_shutdown=_SHUTDOWN_GRACE_S,
        lifespan="on",
    )
    # uvicorn re-raises the stop signal once it has shut down gracefully; a requested stop that
    # completed cleanly is a success, so that re-raise ends the process with status 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _exit_cleanly)
    state = app.app.state
    quiet = _QuietStartFailure(state)
    logging.getLogger("uvicorn.error").addFilter(quiet)
    try:
        _GracefulServer(uv, lambda: getattr(state, "server", None)).run()
    except SystemExit:  # uvicorn's exit status 3 for a failed lifespan, among others
        failure = getattr(state, "start_failure", None)
        if failure is None:
            raise
        raise ValueError(failure) from None  # the CLI's one line and exit 2, as its checks
    finally:
        logging.getLogger("uvicorn.error").removeFilter(quiet)


class _QuietStartFailure(logging.Filter):
    """Drops uvicorn's report of a lifespan that failed because the engine could not start
    (two tracebacks for a configuration mistake); serve() raises its message instead."""

    def __init__(self, state: Any) -> None:
        super().__init__()
        self.state = state

    def filter(self, record: logging.LogRecord) -> bool:
        failed = getattr(self.state, "start_failure", None) is not None
        return not (failed and record.levelno >= logging.ERROR)


_SHUTDOWN_GRACE_S = 3.0


class _GracefulServer(uvicorn.Server):
    """uvicorn's server, ending open requests itself shortly before the grace period runs out.

    NOTE: uvicorn cancels the tasks still running at the end of timeout_graceful_shutdown: a
    stream was then cut mid-body (no error event, no [DONE]; clients raised a transfer-length
    error) and uvicorn logged the CancelledError. Failed half a second earlier, every open
    response ends as an engine failure would end it, and its engine request is aborted.
    """

    def __init__(self, config: Any, server: Callable[[], OpenAIServer | None]) -> None:
        super().__init__(config)
        self._server = server

    async def shutdown(self, sockets: Any = None) -> None:
        def end_streams() -> None:
            server = self._server()
            if server is not None:  # None: the lifespan never started the engine
                server.engine.end_streams("the server is shutting down")

        timer = asyncio.get_running_loop().call_later(_SHUTDOWN_GRACE_S - 0.5, end_streams)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


def _exit_cleanly(signum: int, frame: Any) -> None:
    raise SystemExit(0)
