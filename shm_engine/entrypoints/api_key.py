"""vLLM's ``--api-key``: requests to ``/v1`` paths must carry ``Authorization: Bearer <key>``.

As vLLM: ``/health``, ``/metrics`` and the tokenizer endpoints stay open (probes and scrapers
carry no key), and CORS preflights (OPTIONS) pass.
"""

from __future__ import annotations

import hmac


def needs_key(scope: dict) -> bool:
    """Whether an ASGI request falls under the key: HTTP, a /v1 path, not a preflight."""
    if scope["type"] != "http" or scope["method"] == "OPTIONS":
        return False
    path = scope["path"]
    return path == "/v1" or path.startswith("/v1/")


def has_key(scope: dict, key: str) -> bool:
    """Whether the request's Authorization header is ``Bearer <key>``.

    NOTE: compared in constant time (hmac.compare_digest): a byte-by-byte comparison that stops
    at the first difference tells a timing attacker how much of a guess was right."""
    want = b"Bearer " + key.encode()
    got = [v for k, v in scope.get("headers", ()) if k.lower() == b"authorization"]
    return len(got) == 1 and hmac.compare_digest(got[0], want)
