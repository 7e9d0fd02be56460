"""AsyncLLM: the asyncio face of the engine for servers.

One pump task reads every step's outputs from the engine (``AsyncMPClient.get_output_async``), runs
the OutputProcessor (detokenization, stop strings, n>1 fan-in) once for all requests, and hands
each request its newest ``RequestOutput``. Requests consume with ``generate()``, an async iterator.

Each request keeps only its *latest* output, not a queue: outputs are cumulative, so a consumer
that falls behind (a slow client, a busy event loop) skips straight to the newest state and sends
one larger delta instead of building a backlog. Leaving ``generate()`` early (client disconnect,
cancellation, an exception) aborts the request in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import numpy as np

from shm_engine.engine.client import AsyncMPClient, EngineDeadError, EngineLaunch
from shm_engine.engine.config import EngineConfig
from shm_engine.engine.dp_client import AsyncDPClient
from shm_engine.engine.output_processor import OutputProcessor, RequestOutput
from shm_engine.engine.protocol import EngineCoreRequest, SchedulerStats
from shm_engine.model.loader import ModelInfo
from shm_engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class PromptTooLongError(ValueError):
    """The prompt (plus at least one generated token) does not fit the model's context."""


def check_prompt_fits(num_tokens: int, max_model_len: int) -> None:
    """Refuse an empty prompt, or one that leaves no room for a generated token (frontends
    check this before an engine round trip)."""
    if num_tokens == 0:
        raise ValueError("the prompt is empty")
    if num_tokens >= max_model_len:
        raise PromptTooLongError(
            f"This model's maximum context length is {max_model_len} tokens, "
            f"but the prompt has {num_tokens} tokens (at least one token must be generated)."
        )


def check_token_ids(token_ids: Sequence[int], vocab_size: int) -> None:
    """Refuse prompt token ids the model has no embedding for (given as ids, not text)."""
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"prompt token id {bad} is out of the vocabulary (size {vocab_size})")


def check_stop_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """Refuse stop ids the model can never sample (vLLM refuses them too)."""
    bad = next((t for t in params.stop_token_ids if t >= vocab_size), None)
    if bad is not None:
        raise ValueError(f"stop token id {bad} is out of the vocabulary (size {vocab_size})")


def check_priority(priority: object, priority_scheduling: bool) -> None:
    """A request priority is an integer, and not zero only under the priority policy (vLLM)."""
    if not isinstance(priority, int | np.integer) or isinstance(priority, bool):
        raise ValueError(f"priorities must be integers, got {priority!r}")
    if priority and not priority_scheduling:
        raise ValueError(
            "priority needs the priority scheduling policy (scheduling_policy='priority', "
            "serve --scheduling-policy priority), as vLLM"
        )


class _Stream:
    """Newest output of one request plus a wake-up for its consumer."""

    __slots__ = ("latest", "event", "error")

    def __init__(self) -> None:
        self.latest: RequestOutput | None = None
        self.event = asyncio.Event()
        self.error: BaseException | None = None

    def put(self, out: RequestOutput) -> None:
        self.latest = out
        self.event.set()

    def fail(self, exc: BaseException) -> None:
        self.error = exc
        self.event.set()

    async def get(self) -> RequestOutput:
        while self.latest is None:
            if self.error is not None:
                raise self.error
            self.event.clear()
            await self.event.wait()
        out, self.latest = self.latest, None
        return out


class RequestHandle:
    """One request in flight: its output slot, and abort-on-close unless it finished."""

    def __init__(self, engine: AsyncLLM, request_id: str) -> None:
        self.engine = engine
        self.request_id = request_id
        self.stream = _Stream()
        self.finished = False
        self._closed = False

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """Newest cumulative outputs until the end; leaving early aborts the request."""
        try:
            while True:
                out = await self.stream.get()
                if out.error is not None:
                    self.finished = True
                    raise ValueError(out.error)
                self.finished = out.finished
                yield out
                if self.finished:
                    return
        finally:
            self.close()

    def close(self) -> None:
        """Idempotent; aborts the request in the engine if it has not finished."""
        if self._closed:
            return
        self._closed = True
        if self.engine.streams.get(self.request_id) is self.stream:
            del self.engine.streams[self.request_id]
        if not self.finished:
            self.engine._abort(self.request_id)


class AsyncLLM:
    """Engine process + output processing for many concurrent asyncio requests.

    Build it with ``await AsyncLLM.create(config)`` inside the loop that will serve requests
    (the client binds to the running loop).
    """

    def __init__(
        self,
        client: AsyncMPClient | AsyncDPClient,
        tokenizer,
        model_name: str,
        sampling_defaults: dict[str, Any] | None = None,
        priority_scheduling: bool = False,
    ) -> None:
        self.client = client
        self.priority_scheduling = priority_scheduling  # a request's priority counts
        self.tokenizer = tokenizer
        self.model_name = model_name
        # what a request leaves unset takes from the model (generation_config.json), as in vLLM
        self.sampling_defaults = dict(sampling_defaults or {})
        self.max_model_len = client.ready.max_model_len
        self.processor = OutputProcessor(tokenizer)
        self.streams: dict[str, _Stream] = {}
        self.last_stats = SchedulerStats()
        self.dead_reason: str | None = None
        # Called with every finished RequestOutput (metrics); must not raise.
        self.on_finished: Callable[[RequestOutput], None] | None = None
        self._ids = itertools.count()
        self._pump_task = asyncio.get_running_loop().create_task(self._pump(), name="engine-pump")

    @classmethod
    async def create(
        cls,
        config: EngineConfig,
        model_name: str | None = None,
        data_parallel_size: int = 1,
        model_info: ModelInfo | None = None,
        launches: list[EngineLaunch] | None = None,
    ) -> AsyncLLM:
        """``model_info``: the model's config and tokenizer, if the caller has read them;
        ``launches``: the engine processes (one a replica), if the caller started them ahead."""
        from shm_engine.model.loader import load_model_info

        # NOTE: only the config and tokenizer are read in this process (no torch, no weights).
        info = model_info or load_model_info(config.model)
        # Blocks the loop while the engine loads the model: fine at startup, nothing is served yet.
        if data_parallel_size > 1:
            client = AsyncDPClient(config, data_parallel_size, launches)
        else:
            client = AsyncMPClient(config, launch=launches[0] if launches else None)
        name = model_name or client.ready.model_name
        priority = config.scheduling_policy == "priority"
        return cls(client, info.tokenizer, name, info.sampling_defaults, priority)

    # ------------------------------------------------------------------ state

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None or self.client.is_dead

    def num_unfinished(self) -> int:
        return len(self.streams)

    async def get_stats(self, timeout: float = 2.0) -> SchedulerStats:
        """Fresh scheduler stats from the engine; the last piggybacked ones if it does not answer."""
        if not self.is_dead:
            with contextlib.suppress(Exception):
                self.last_stats = await asyncio.wait_for(
                    self.client.call_utility_coro("get_stats"), timeout
                )
        return self.last_stats

    # ------------------------------------------------------------------ requests

    def new_request_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{next(self._ids)}-{int(time.time() * 1000) % 100000}"

    def check_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Reject a prompt that cannot fit before it costs an engine round trip."""
        n = len(prompt_token_ids)
        check_prompt_fits(n, self.max_model_len)
        check_stop_token_ids(params, self.client.ready.vocab_size)
        if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise PromptTooLongError(
                f"This model's maximum context length is {self.max_model_len} tokens; "
                f"the prompt ({n} tokens) plus max_tokens ({params.max_tokens}) exceeds it."
            )

    def add_request(
        self,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> RequestHandle:
        """Send a request to the engine now; consume it with ``handle.outputs()``.

        ``priority`` orders requests under the priority scheduling policy (lower first);
        ``cache_salt`` lets only requests with the same salt share prefix-cache blocks.

        Eager on purpose: a server can start the engine's work before it sets up the HTTP
        response (Starlette's streaming setup costs ~0.6 ms of TTFT otherwise). The caller must
        ``close()`` the handle if it never iterates it (close aborts unfinished requests).
        """
        if self.is_dead:
            raise EngineDeadError(self.dead_reason or "the engine is not running")
        self.check_prompt(prompt_token_ids, params)
        check_priority(priority, self.priority_scheduling)
        if request_id in self.streams:  # finished, perhaps, but its handle is still open
            raise ValueError(f"duplicate request_id {request_id!r}: its handle is still open")
        children = self.processor.add_request(request_id, prompt, prompt_token_ids, params)
        handle = RequestHandle(self, request_id)
        self.streams[request_id] = handle.stream
        try:
            tokens = np.asarray(prompt_token_ids, dtype=np.int32)
            now = time.time()
            for eid, child_params in children:
                self.client.add_request(
                    EngineCoreRequest(
                        request_id=eid,
                        prompt_token_ids=tokens,
                        sampling_params=child_params,
                        arrival_time=now,
                        priority=priority,
                        cache_salt=cache_salt,
                    )
                )
        except BaseException:
            handle.close()
            raise
        return handle

    async def generate(
        self,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's newest cumulative output until it finishes.

        Raises EngineDeadError if the engine dies, ValueError for a request the engine rejected.
        Closing or cancelling the iterator before the end aborts the request in the engine.
        """
        handle = self.add_request(
            prompt, prompt_token_ids, params, request_id, priority, cache_salt
        )
        try:
            async for out in handle.outputs():
                yield out
        finally:
            handle.close()

    def _abort(self, request_id: str) -> None:
        engine_ids = self.processor.engine_ids(request_id)
        aborted = self.processor.abort(request_id)  # None if it had finished
        if aborted is not None:
            self._report_finished(aborted)  # its tokens and first-token time count too, as vLLM's
        if engine_ids and not self.is_dead:
            with contextlib.suppress(EngineDeadError):
                self.client.abort_requests(engine_ids)

    # ------------------------------------------------------------------ the pump

    async def _pump(self) -> None:
        """Route engine outputs to request streams until the engine is gone."""
        try:
            while True:
                out = await self.client.get_output_async()
                if out.scheduler_stats is not None:
                    self.last_stats = out.scheduler_stats
                results, to_abort = self.processor.process(out)
                if to_abort:
                    self.client.abort_requests(to_abort)
                for r in results:
                    stream = self.streams.get(r.request_id)
                    if r.finished:
                        self._report_finished(r)
                    if stream is not None:
                        stream.put(r)
        except EngineDeadError as e:
            logger.error("engine is dead: %s", e)
            self._fail_all(e)
        except asyncio.CancelledError:
            self._fail_all(EngineDeadError("the server is shutting down"))
            raise
        except Exception as e:  # a bug here must not leave requests hanging forever
            logger.exception("engine output pump failed")
            self._fail_all(EngineDeadError(f"engine output pump failed: {e}"))

    def _report_finished(self, r: RequestOutput) -> None:
        """on_finished, once per request that ended without an error (finished or aborted)."""
        if self.on_finished is None or r.error is not None:
            return
        try:
            self.on_finished(r)
        except Exception:
            logger.exception("on_finished hook failed")

    def end_streams(self, reason: str) -> None:
        """Fail every open request's stream with EngineDeadError(reason): each response ends with
        an error (an SSE error event and [DONE]) and, as it closes, aborts its engine request.
        The engine keeps running."""
        self._fail_streams(EngineDeadError(reason))

    def _fail_all(self, exc: EngineDeadError) -> None:
        self.dead_reason = str(exc) or "the engine is not running"
        self._fail_streams(exc)

    def _fail_streams(self, exc: EngineDeadError) -> None:
        for stream in list(self.streams.values()):
            stream.fail(exc)

    # ------------------------------------------------------------------ lifecycle

    async def shutdown(self) -> None:
        """Fail open requests, stop the engine process and remove its shared memory."""
        self._pump_task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._pump_task
        # NOTE: shutdown joins the engine process (up to seconds): keep the loop responsive.
        await asyncio.get_running_loop().run_in_executor(None, self.client.shutdown)
