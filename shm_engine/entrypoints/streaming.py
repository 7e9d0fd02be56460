"""Async plumbing of the HTTP responses: an SSE response that aborts its engine requests however
it ends, the merge of several prompts' output streams, and a race against a client's disconnect.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response

from shm_engine.entrypoints.async_engine import RequestHandle
from shm_engine.entrypoints.openai_errors import APIError, ClientDisconnected

T = TypeVar("T")

# The event that ends an OpenAI-style stream
SSE_DONE = b"data: [DONE]\n\n"


class SSEResponse(Response):
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
                # NOTE: the event that ends the stream ends the body in the same write (the
                # server appends the chunked terminator): each write to the socket wakes the
                # client, which on a small host takes a core from the engine
                last = chunk.endswith(SSE_DONE)
                await send({"type": "http.response.body", "body": chunk, "more_body": not last})
                if last:
                    break
            else:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            watch.cancel()
            await body.aclose()  # type: ignore[attr-defined]
            for h in self.handles:
                h.close()


async def merge_streams(
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


async def until_disconnect(raw: Request, work: Awaitable[T]) -> T:
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
