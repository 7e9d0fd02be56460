"""OpenAI-shaped errors: the exceptions handlers raise and the JSON bodies they become.

Every error answer is ``{"error": {"message", "type", "param", "code"}}``; ``to_api_error`` maps
any exception to its status (400 for bad input, 503 for a dead engine, 500 otherwise).
"""

from __future__ import annotations

import logging

import jinja2
from fastapi.responses import JSONResponse, Response

from shm_engine.engine.client import EngineDeadError

logger = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param


class ClientDisconnected(Exception):
    """The HTTP client went away mid-stream (its requests are aborted)."""


def error_body(status: int, message: str, type_: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": status}}


def error_response(status: int, message: str, type_: str, param: str | None = None) -> Response:
    return JSONResponse(error_body(status, message, type_, param), status_code=status)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param)


def engine_dead(message: str = "") -> APIError:
    return APIError(503, message or "the engine is not running", "service_unavailable")


def to_api_error(e: BaseException) -> APIError:
    """The HTTP error of an exception; only unexpected ones (500) are logged, with a traceback."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, EngineDeadError):
        return engine_dead(str(e))
    if isinstance(e, ClientDisconnected):
        return APIError(499, "client disconnected", "client_closed_request")
    if isinstance(e, ValueError | TypeError):
        return bad_request(str(e))
    # NOTE: a syntax error is the model's template being broken (a server fault, below); any
    # other template error is the template refusing these messages (raise_exception: "roles
    # must alternate", ...), i.e. the client's request.
    if isinstance(e, jinja2.TemplateError) and not isinstance(e, jinja2.TemplateSyntaxError):
        return bad_request(f"the chat template rejected the messages: {e}", "messages")
    logger.exception("request failed", exc_info=e)
    return APIError(500, f"internal error: {type(e).__name__}: {e}", "server_error")
