"""Pure ASGI middleware (safe for streaming responses): body size limit and API-key auth."""
from __future__ import annotations

from pagedllm.server import errors
from pagedllm.server.auth import KeyStore

OPEN_PATHS = ("/health",)


class BodySizeLimit:
    """A body over the limit gets 413 before any handler reads it."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            response = errors.error_response(
                413, f"request body is larger than the {self.max_bytes}-byte limit", None,
                "body_too_large", path=scope.get("path", ""))
            return await response(scope, receive, send)
        return await self.app(scope, receive, send)


class ApiKeyAuth:
    """Every route but /health (and /metrics when public) needs `Authorization: Bearer KEY`.
    The matching key is put in scope["state"]["api_key"] for the handlers."""

    def __init__(self, app, keys: KeyStore, public_metrics: bool = False):
        self.app = app
        self.keys = keys
        self.open_paths = OPEN_PATHS + (("/metrics",) if public_metrics else ())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.keys.enabled or scope["path"] in self.open_paths \
                or scope.get("method") == "OPTIONS":
            return await self.app(scope, receive, send)
        header = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = header.partition(" ")
        key = self.keys.lookup(token.strip()) if scheme.lower() == "bearer" and token else None
        if key is None:
            message = ("missing API key: send `Authorization: Bearer KEY`" if not header
                       else "invalid API key")
            response = errors.error_response(401, message, None, "invalid_api_key",
                                             {"WWW-Authenticate": "Bearer"}, scope["path"])
            return await response(scope, receive, send)
        scope.setdefault("state", {})["api_key"] = key
        return await self.app(scope, receive, send)
