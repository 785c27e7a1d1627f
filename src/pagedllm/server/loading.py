"""What answers on the port while the model loads: every request gets 503 with Retry-After
(`/health` says {"status": "loading"}; the page says it is loading and looks again), the
way Ollama answers while it loads, so a load balancer, a client or a person sees the server
coming up rather than a refused connection. It holds no key and reveals nothing but that.
The real server takes the port as soon as the model is ready (runner.serve)."""
from __future__ import annotations

import threading

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse
from starlette.routing import Route

RETRY_AFTER_SECONDS = 5
PAGE = ("<!doctype html><meta charset=utf-8><meta http-equiv=refresh content=3>"
        "<title>pagedllm: loading</title><p>pagedllm is loading its model; this page looks "
        "again every few seconds.</p>")


async def _loading(request: Request):
    headers = {"Retry-After": str(RETRY_AFTER_SECONDS)}
    path = request.url.path
    if path == "/health":
        return JSONResponse({"status": "loading"}, status_code=503, headers=headers)
    if path == "/" and "text/html" in request.headers.get("accept", ""):
        return HTMLResponse(PAGE, status_code=503, headers=headers)
    message = "the server is loading its model; try again shortly"
    if path.startswith("/api/"):
        return JSONResponse({"error": message}, status_code=503, headers=headers)
    return JSONResponse({"error": {"message": message, "type": "service_unavailable",
                                   "param": None, "code": "loading"}},
                        status_code=503, headers=headers)


def loading_app() -> Starlette:
    methods = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]
    return Starlette(routes=[Route("/{path:path}", _loading, methods=methods)])


class LoadingServer:
    """The loading answer on (host, port) in a thread, until stop()."""

    def __init__(self, host: str, port: int, ssl_certfile: str | None = None,
                 ssl_keyfile: str | None = None):
        config = uvicorn.Config(loading_app(), host=host, port=port, log_level="warning",
                                ssl_certfile=ssl_certfile, ssl_keyfile=ssl_keyfile,
                                lifespan="off")
        self.server = uvicorn.Server(config)  # in a thread: the signals stay the main thread's
        self.thread = threading.Thread(target=self.server.run, name="pagedllm-loading",
                                       daemon=True)

    def __enter__(self) -> LoadingServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        """Close the port (the real server binds it next)."""
        self.server.should_exit = True
        self.thread.join(timeout=10)
