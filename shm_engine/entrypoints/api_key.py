"""vLLM's ``--api-key``: requests to ``/v1`` paths must carry ``Authorization: Bearer <key>``.

As vLLM: ``/health``, ``/metrics`` and the tokenizer endpoints stay open (probes and scrapers
carry no key), and CORS preflights (OPTIONS) pass.
"""

from __future__ import annotations

import hmac


def check_api_key(key: str) -> bytes:
    """The key as the bytes a request must present; a key no request could present is an error.

    NOTE: checked once, at start-up: a key with surrounding whitespace never matches (servers
    strip header values), an empty one refuses everything, and one that is not ASCII either
    failed to encode on every request (500s) or cannot be sent by HTTP clients."""
    if not key:
        raise ValueError("the API key is empty")
    if not all(33 <= ord(ch) <= 126 for ch in key):
        raise ValueError("the API key must be printable ASCII without spaces")
    return key.encode("ascii")


def needs_key(scope: dict) -> bool:
    """Whether an ASGI request falls under the key: HTTP, a /v1 path, not a preflight."""
    if scope["type"] != "http" or scope["method"] == "OPTIONS":
        return False
    path = scope["path"]
    return path == "/v1" or path.startswith("/v1/")


def has_key(scope: dict, key: bytes) -> bool:
    """Whether the request's one Authorization header is ``Bearer <key>`` (the scheme's case
    is free, RFC 7235).

    NOTE: compared in constant time (hmac.compare_digest): a byte-by-byte comparison that stops
    at the first difference tells a timing attacker how much of a guess was right."""
    got = [v for k, v in scope.get("headers", ()) if k.lower() == b"authorization"]
    if len(got) != 1:
        return False
    scheme, _, token = got[0].partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(token, key)
