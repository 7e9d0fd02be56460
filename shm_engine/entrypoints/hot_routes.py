"""The generation endpoints as bare ASGI in front of the FastAPI app.

Why: the server shares two cores with an engine that streams ~130 MB of weights through the
caches every step, so the server's Python runs cold. FastAPI's middleware stack, routing and
dependency solving cost ~0.4 ms of TTFT per request there (~0.1 ms warm), a fifth of the
frontend's 2 ms budget. ``HotRoutes`` answers ``POST /v1/completions`` and
``POST /v1/chat/completions`` itself (read the body, validate it with the same pydantic model,
call the same handler) and passes everything else, lifespan included, to the app. The FastAPI
routes stay registered: the OpenAPI schema still lists them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response

from shm_engine.entrypoints.api_key import check_api_key, has_key, needs_key

# The handler of a route: (validated body, request) -> response. It answers its own errors.
Handler = Callable[[Any, Request], Awaitable[Response]]

MAX_BODY_BYTES = 32 << 20  # a 1M-token prompt as JSON text fits with room to spare
SCREEN_BODY_BYTES = 1 << 20  # bodies past this are screened before validation

# A cheap check of a large body before it is validated: (path, body) -> why it is refused, or None.
Screen = Callable[[str, bytes], str | None]


class HotRoutes:
    def __init__(
        self,
        app: FastAPI,
        routes: dict[str, tuple[type[BaseModel], Handler]],
        error: Callable[[int, str], Response],
        screen: Screen | None = None,
        api_key: str | None = None,
    ) -> None:
        """``error(status, message)`` builds the error response (OpenAI-style JSON).

        ``screen`` sees bodies past SCREEN_BODY_BYTES first: validating a large one can hold
        the event loop for seconds, and a cheap count may already show it cannot be served.
        ``api_key``: /v1 requests without it are refused here, before any route (api_key.py).
        """
        self.app = app
        self.routes = routes
        self.error = error
        self.screen = screen
        self.api_key = None if api_key is None else check_api_key(api_key)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if self.api_key is not None and needs_key(scope) and not has_key(scope, self.api_key):
            response = self.error(401, "a valid API key is required (Authorization: Bearer KEY)")
            response.headers["WWW-Authenticate"] = "Bearer"
            await response(scope, receive, send)
            return
        route = self.routes.get(scope["path"]) if scope["type"] == "http" else None
        if route is None or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        model, handler = route
        scope["app"] = self.app  # what Starlette sets: handlers reach app.state through it
        body = await _read_body(receive)
        refused = None
        if not _is_json(scope):
            # NOTE: as FastAPI's own check (CVE-2021-32677): a browser posts text/plain across
            # origins without a preflight, so any web page could start generations here.
            refused = "Content-Type must be application/json"
        elif body is not None and len(body) > SCREEN_BODY_BYTES and self.screen is not None:
            refused = self.screen(scope["path"], body)
        if body is None:
            response = self.error(413, f"request body larger than {MAX_BODY_BYTES} bytes")
        elif refused is not None:
            response = self.error(400, refused)
        else:
            try:
                req = model.model_validate_json(body)
            except ValidationError as e:
                response = self.error(400, validation_message(e.errors()))
            else:
                # NOTE: the body is consumed; the handler's receive() now only reports a
                # disconnect, which is what the streaming and waiting paths listen for.
                response = await handler(req, Request(scope, receive))
        await response(scope, receive, send)


def _is_json(scope: dict) -> bool:
    """No Content-Type, application/json or application/*+json (FastAPI's rule)."""
    value = next((v for k, v in scope["headers"] if k == b"content-type"), b"")
    kind = value.split(b";", 1)[0].strip().lower()
    return (
        not kind
        or kind == b"application/json"
        or (kind.startswith(b"application/") and kind.endswith(b"+json"))
    )


async def _read_body(receive: Callable) -> bytes | None:
    """The whole request body, or None past MAX_BODY_BYTES (the rest is not read)."""
    parts: list[bytes] = []
    size = 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            break
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            return None
        parts.append(chunk)
        if not msg.get("more_body", False):
            break
    return b"".join(parts)


def validation_message(errors: list[dict[str, Any]]) -> str:
    """pydantic errors as one line: ``field.sub: message; ...`` (FastAPI's "body" prefix dropped)."""
    parts = []
    for err in errors:
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    return "; ".join(parts) or "invalid request"
