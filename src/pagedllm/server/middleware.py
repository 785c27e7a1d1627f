"""Pure ASGI middleware (safe for streaming responses): the request body's guard and API-key
auth."""
from __future__ import annotations

import asyncio
import json
import re

from pagedllm.server import errors
from pagedllm.server import docs, web_routes
from pagedllm.server.auth import KeyStore

# The page and the API docs are open (they say how to call the API, not what anyone asked
# it); everything they fetch from the API needs a key.
OPEN_PATHS = ("/health", *docs.OPEN_PATHS, *web_routes.OPEN_PATHS)
OPEN_PREFIXES = docs.OPEN_PREFIXES + web_routes.OPEN_PREFIXES
# A JSON escape of a UTF-16 surrogate: only then can a decoded string hold a lone one.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
# JSON strings, and every byte that is not a bracket: what is left says how deep a body nests.
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
# Nesting a body may have: far beyond any API's shape, far below where parsing it (or a
# schema in it) recurses past Python's stack limit, which was a 500.
MAX_BODY_DEPTH = 64


class BodyGuard:
    """Reads a request's body before any handler does, whatever its framing (Content-Length
    or chunked): past `max_bytes` it stops reading and answers 413; a body that does not
    arrive within `timeout` seconds (a client trickling it) gets 408; a JSON string holding a
    lone UTF-16 surrogate, which no text can be made of, gets 400 naming its field; one that
    nests deeper than MAX_BODY_DEPTH gets 400 (on every route, before anything parses it).
    The handler then reads the same bytes; later receives (disconnects) pass through."""

    def __init__(self, app, max_bytes: int, timeout: float = 30.0):
        self.app = app
        self.max_bytes = max_bytes
        self.timeout = timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._too_large(scope, receive, send, path)
        try:
            body = await asyncio.wait_for(self._read(receive), self.timeout)
        except asyncio.TimeoutError:
            response = errors.error_response(
                408, f"the request body did not arrive within {self.timeout:g} s", None,
                "request_timeout", path=path)
            return await response(scope, receive, send)
        if body is None:
            return await self._too_large(scope, receive, send, path)
        if too_deep(body):
            response = errors.error_response(
                400, f"the request body nests deeper than {MAX_BODY_DEPTH} levels", None,
                "invalid_value", path=path)
            return await response(scope, receive, send)
        if _SURROGATE_ESCAPE.search(body):
            field = _lone_surrogate_field(body)
            if field is not None:
                response = errors.error_response(
                    400, f"{field or 'body'}: the text holds a lone UTF-16 surrogate, which is "
                         f"not valid Unicode", field or None, "invalid_value", path=path)
                return await response(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)

    async def _read(self, receive) -> bytes | None:
        """The whole body, or None once it passes the limit (the rest is never read)."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return b"".join(chunks)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return None
            chunks.append(chunk)
            if not message.get("more_body"):
                return b"".join(chunks)

    async def _too_large(self, scope, receive, send, path):
        response = errors.error_response(
            413, f"request body is larger than the {self.max_bytes}-byte limit", None,
            "body_too_large", path=path)
        return await response(scope, receive, send)


def _lone_surrogate_field(body: bytes) -> str | None:
    """The dotted path of the first string (or key) holding a lone surrogate ("" for the
    whole body), or None when there is none or the body is not JSON (the handler says so)."""
    try:
        value = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None

    def bad(text: str) -> bool:
        try:
            text.encode("utf-8")
            return False
        except UnicodeEncodeError:
            return True

    def walk(item, where: str) -> str | None:
        if isinstance(item, str):
            return where if bad(item) else None
        children = item.items() if isinstance(item, dict) else (
            enumerate(item) if isinstance(item, list) else ())
        for key, child in children:
            name = f"{where}.{key}" if where else str(key)
            if isinstance(key, str) and bad(key):
                return name
            found = walk(child, name)
            if found is not None:
                return found
        return None

    return walk(value, "")


class ApiKeyAuth:
    """Every route but /health, the API docs (and /metrics when public) needs `Authorization: Bearer KEY`
    (or `x-api-key: KEY`).
    The matching key is put in scope["state"]["api_key"] for the handlers."""

    def __init__(self, app, keys: KeyStore, public_metrics: bool = False):
        self.app = app
        self.keys = keys
        self.open_paths = OPEN_PATHS + (("/metrics",) if public_metrics else ())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.keys.enabled or scope["path"] in self.open_paths \
                or scope["path"].startswith(OPEN_PREFIXES) or scope.get("method") == "OPTIONS":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        header = headers.get(b"authorization", b"").decode("latin-1")
        scheme, _, token = header.partition(" ")
        if not header:  # Anthropic-style clients and some proxies send the key this way
            header = token = headers.get(b"x-api-key", b"").decode("latin-1")
            scheme = "bearer"
        key = self.keys.lookup(token.strip()) if scheme.lower() == "bearer" and token else None
        if key is None:
            message = ("missing API key: send `Authorization: Bearer KEY` (or `x-api-key: KEY`)"
                       if not header else "invalid API key")
            response = errors.error_response(401, message, None, "invalid_api_key",
                                             {"WWW-Authenticate": "Bearer"}, scope["path"])
            return await response(scope, receive, send)
        scope.setdefault("state", {})["api_key"] = key
        return await self.app(scope, receive, send)


def too_deep(body: bytes, limit: int = MAX_BODY_DEPTH) -> bool:
    """Whether JSON text nests deeper than `limit` levels (at most 2 x limit pass: each round
    takes away at least one level), at C speed: strings dropped, then innermost pairs
    removed round by round. Unbalanced brackets are the parser's to refuse."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    brackets = _JSON_STRING.sub(b"", body).translate(None, _NOT_BRACKETS)
    for _ in range(limit):
        shorter = brackets.replace(b"[]", b"").replace(b"{}", b"")
        if shorter == brackets:
            return False  # unbalanced: the parser says so
        brackets = shorter
        if not brackets:
            return False
    return True
