"""The FastAPI application: routes, error handlers, body limit, draining on shutdown."""
from __future__ import annotations

import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm.async_engine import AsyncEngine
from pagedllm.engine import LLMEngine
from pagedllm.server import errors
from pagedllm.server.errors import APIError
from pagedllm.server.generation import create_chat_completion, create_completion
from pagedllm.server.metrics import ServerMetrics
from pagedllm.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                      TokenizeRequest)
from pagedllm.tokenizer import ChatTemplateError

DEFAULT_MAX_BODY_BYTES = 4 << 20


@dataclass
class ServerState:
    engine: LLMEngine
    async_engine: AsyncEngine
    served_model_name: str
    metrics: ServerMetrics
    created: int
    draining: bool = False

    def check_model(self, model: str | None) -> None:
        if self.draining:
            raise APIError(503, "server is shutting down", None, "shutting_down")
        if model is not None and model != self.served_model_name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves "
                                f"`{self.served_model_name}`.", "model", "model_not_found")

    def cache_salt_for(self, user: str | None) -> str | None:
        return None


class BodySizeLimit:
    """ASGI middleware: a body over the limit gets 413 before any handler reads it."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._reject(send)
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _BodyTooLarge()
            return message

        try:
            await self.app(scope, limited_receive, send)
        except _BodyTooLarge:
            await self._reject(send)

    async def _reject(self, send):
        response = errors.error_response(
            413, f"request body is larger than the {self.max_bytes}-byte limit", None,
            "body_too_large")
        await response({"type": "http"}, None, send)


class _BodyTooLarge(Exception):
    pass


def create_app(engine: LLMEngine, served_model_name: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    name = served_model_name or engine.model_config.name
    async_engine = AsyncEngine(engine)
    state = ServerState(engine, async_engine, name, ServerMetrics(engine, name), int(time.time()))
    @asynccontextmanager
    async def lifespan(_app):
        yield
        async_engine.shutdown()

    app = FastAPI(title="pagedllm", version="0.1.0", lifespan=lifespan)
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    app.state.pagedllm = state
    app.add_exception_handler(RequestValidationError, errors.validation_error_handler)
    app.add_exception_handler(APIError, errors.api_error_handler)
    app.add_exception_handler(StarletteHTTPException, errors.http_error_handler)
    app.add_exception_handler(Exception, errors.unexpected_error_handler)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": state.created, "owned_by": "pagedllm",
            "max_model_len": engine.scheduler_config.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: HTTPRequest):
        return await create_completion(state, body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: HTTPRequest):
        return await create_chat_completion(state, body, request)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        state.check_model(body.model)
        tok = engine.tokenizer
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", "prompt", "invalid_value")
        if body.messages is not None:
            try:
                text = tok.apply_chat_template([{"role": m.role, "content": m.text()}
                                                for m in body.messages], body.add_generation_prompt)
            except ChatTemplateError as exc:
                raise APIError(400, str(exc), "messages", "invalid_value") from exc
            ids = tok.encode(text, add_special_tokens=False)
        else:
            ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"tokens": ids, "count": len(ids),
                "max_model_len": engine.scheduler_config.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        state.check_model(body.model)
        vocab = engine.model_config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids must be in [0, {vocab}), got {bad[:3]}", "tokens",
                           "invalid_value")
        return {"prompt": engine.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
