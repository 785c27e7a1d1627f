"""The team's page at `/` (plain HTML, CSS and JS modules in server/web/, no build step) and
the state endpoint it draws from. The page itself is open, like /docs; every call it makes
goes through the API keys (it asks for one once and keeps it in the browser's session)."""
from __future__ import annotations

from importlib.resources import files

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse

from pagedllm.server.errors import APIError
from pagedllm.server.live_view import LiveView
from pagedllm.server.state import ServerState

WEB = files("pagedllm.server") / "web"
ASSETS = {"app.js", "api.js", "chat.js", "live.js", "charts.js", "markdown.js", "style.css"}
OPEN_PATHS = ("/",)
OPEN_PREFIXES = ("/ui/",)


def add_web_routes(app: FastAPI, state: ServerState, bench_results: str | None) -> LiveView:
    view = LiveView(state, bench_results)

    @app.get("/", include_in_schema=False)
    async def page():
        return FileResponse(str(WEB / "index.html"), media_type="text/html")

    @app.get("/ui/{name}", include_in_schema=False)
    async def asset(name: str):
        if name not in ASSETS:  # only the page's own files, never a path into the package
            raise APIError(404, f"no such file: /ui/{name}", None, "not_found")
        media = "text/css" if name.endswith(".css") else "text/javascript"
        return FileResponse(str(WEB / name), media_type=media,
                            headers={"Cache-Control": "no-cache"})

    @app.get("/v1/server/state", tags=["server"],
             summary="What the server is doing now: KV blocks, requests, fair share, load")
    async def server_state(http_request: HTTPRequest, stream: bool = False,
                           config: bool = False, replica: str | None = None):
        """The engine's snapshot with counters, recent latencies and memory. `stream=true`:
        server-sent events, one snapshot at most every 0.5 s while the client reads.
        `config=true`: also the configuration, the cost of more parallel slots and the
        newest `pagedllm bench` results (--bench-results). With replicas, `replica` picks
        whose blocks and requests are shown (default: the first); `replicas` lists them all."""
        if stream:
            await view.snapshot(replica)  # a replica unknown or not posted yet: an error now
            return StreamingResponse(view.stream(replica), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        data = await view.snapshot(replica)
        if config:
            data.update(config=view.config(data.get("replica")), bench=view.bench())
            info = view.info(data.get("replica"))
            data["plan"] = view.plan(info) if info is not None else []
        return JSONResponse(data)

    return view
