"""CORS for a browser page on another origin: `--allowed-origins` lists origins, and the
word `localhost` means what people mean by it, any port on a loopback host (a dev server on
http://localhost:5173 or http://127.0.0.1:3000). A preflight that is refused is answered the
way browsers expect a refusal: no Access-Control-Allow-* headers (the browser then blocks the
call), not an error body."""
from __future__ import annotations

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response

LOCALHOST = "localhost"
# Any scheme://loopback-host[:port]: the names and addresses of this machine.
_LOOPBACK_ORIGIN = r"https?://(localhost|127\.0\.0\.1|\[::1\])(:\d{1,5})?"

METHODS = ("GET", "POST", "DELETE", "OPTIONS")
HEADERS = ("Authorization", "X-Api-Key", "Content-Type", "Anthropic-Version", "Anthropic-Beta",
           "OpenAI-Organization", "OpenAI-Project")


class RefusingCORS(CORSMiddleware):
    async def __call__(self, scope, receive, send) -> None:
        # A request without Origin (every non-browser client) passes straight through:
        # Starlette's middleware otherwise wraps `send` for every response, each streamed
        # chunk included, which the one-process server's tokens/s showed once CORS was on
        # by default (BENCHMARKS.md, "Architecture III").
        if scope["type"] == "http" and not any(name == b"origin" for name, _ in scope["headers"]):
            await self.app(scope, receive, send)
            return
        await super().__call__(scope, receive, send)

    def preflight_response(self, request_headers: Headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code == 200:
            return response
        # Refused (origin, method or headers): nothing that would let the call through.
        return Response(status_code=204, headers={"Vary": "Origin"})


def add_cors(app, allowed_origins: tuple[str, ...]) -> None:
    if not allowed_origins:
        return
    exact = [o for o in allowed_origins if o != LOCALHOST]
    app.add_middleware(RefusingCORS, allow_origins=exact,
                       allow_origin_regex=_LOOPBACK_ORIGIN if LOCALHOST in allowed_origins
                       else None,
                       allow_methods=list(METHODS), allow_headers=list(HEADERS))
