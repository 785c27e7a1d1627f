"""The FastAPI application: routes, error handlers, auth, limits, draining on shutdown."""
from __future__ import annotations

import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm.config import ServerConfig
from pagedllm.core.async_engine import AsyncEngine
from pagedllm.core.engine import LLMEngine
from pagedllm.server import errors
from pagedllm.server.auth import ApiKey, KeyStore
from pagedllm.server.errors import APIError
from pagedllm.server.generation import create_chat_completion, create_completion
from pagedllm.server.limits import TokenRateLimiter, check_queue
from pagedllm.server.metrics import ServerMetrics
from pagedllm.server.middleware import ApiKeyAuth, BodyGuard
from pagedllm.server.ollama_api import add_ollama_routes
from pagedllm.server.openapi import install_openapi
from pagedllm.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                      TokenizeRequest)
from pagedllm.tokenizer import ChatTemplateError, TokenLimitError

logger = logging.getLogger("pagedllm.server")


@dataclass
class ServerState:
    engine: LLMEngine
    async_engine: AsyncEngine
    served_model_name: str
    metrics: ServerMetrics
    config: ServerConfig
    keys: KeyStore
    created: int
    rate_limiter: TokenRateLimiter = field(default_factory=TokenRateLimiter)
    draining: bool = False

    def check_model(self, model: str | None) -> None:
        if self.draining:
            raise APIError(503, "server is shutting down", None, "shutting_down")
        if model is not None and model != self.served_model_name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves "
                                f"`{self.served_model_name}`.", "model", "model_not_found")

    def identity(self, http_request: HTTPRequest, user_field: str | None) -> tuple[str, ApiKey | None]:
        """Who is asking: the API key's name, else the `user` field, else the client address."""
        key = http_request.scope.get("state", {}).get("api_key")
        if key is not None:
            return key.name, key
        if user_field:
            return f"user:{user_field}", None
        client = http_request.client
        return f"addr:{client.host if client else 'unknown'}", None

    def cache_salt_for(self, user: str) -> str | None:
        # Salted by user so one user cannot learn another's prompts through cache timing.
        return None if self.config.shared_prefix_cache else user

    def admit(self, key: ApiKey | None, num_new: int) -> None:
        """Raise 429 when the queue is full or the key is over its tokens per minute."""
        if key is not None:
            self.rate_limiter.check(key.name, key.tokens_per_minute)
        # Requests in flight fill the parallel slots first; only those beyond them wait.
        slots = self.engine.scheduler_config.max_num_seqs
        waiting = max(0, self.async_engine.num_in_flight - slots)
        check_queue(waiting, num_new, self.config.max_queue)

    def apply_key_policies(self) -> None:
        """Weights and per-key concurrency caps, sent to the engine's loop thread."""
        self.async_engine.set_user_policies(
            {k.name: k.weight for k in self.keys.keys},
            {k.name: k.max_concurrent for k in self.keys.keys if k.max_concurrent})

    def reload_keys(self) -> None:
        if self.keys.reload():
            self.apply_key_policies()


def create_app(engine: LLMEngine, served_model_name: str | None = None,
               config: ServerConfig | None = None, engine_thread: bool = True) -> FastAPI:
    """engine_thread=False: the caller runs app.state.pagedllm.core.async_engine.run_loop()."""
    config = config or ServerConfig()
    name = served_model_name or engine.model_config.name
    async_engine = AsyncEngine(engine, start_thread=engine_thread)
    keys = KeyStore(config.api_key_file)
    state = ServerState(engine, async_engine, name, ServerMetrics(engine, name), config, keys,
                        int(time.time()))
    state.apply_key_policies()

    @asynccontextmanager
    async def lifespan(_app):
        yield
        async_engine.shutdown()

    app = FastAPI(title="pagedllm", version="0.1.0", lifespan=lifespan)
    app.state.pagedllm = state
    # Added last = outermost: CORS (answers preflights), then auth, then the body's guard,
    # so a client without a key never gets its body read.
    app.add_middleware(BodyGuard, max_bytes=config.max_body_bytes)
    app.add_middleware(ApiKeyAuth, keys=keys, public_metrics=config.public_metrics)
    if config.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                           allow_methods=["GET", "POST", "OPTIONS"],
                           allow_headers=["Authorization", "Content-Type"])
    app.add_exception_handler(RequestValidationError, errors.validation_error_handler)
    app.add_exception_handler(APIError, errors.api_error_handler)
    app.add_exception_handler(StarletteHTTPException, errors.http_error_handler)
    app.add_exception_handler(Exception, errors.unexpected_error_handler)

    @app.get("/health")
    async def health():
        if async_engine.dead:
            raise APIError(503, f"the engine is unusable: {async_engine.dead}", None,
                           "engine_dead")
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
        else:
            text = body.prompt
        limit = engine.scheduler_config.max_model_len
        try:  # bounded like a generation request's prompt: no text stalls the HTTP thread
            ids = tok.encode_within(text, limit, body.prompt is not None and body.add_special_tokens)
        except TokenLimitError as exc:
            raise APIError(400, f"the text has at least {exc.num_tokens} tokens, over this "
                                f"server's context of {limit}", "prompt",
                           "context_length_exceeded") from exc
        except ValueError as exc:
            raise APIError(400, str(exc), "prompt", "invalid_value") from exc
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

    add_ollama_routes(app, state)
    install_openapi(app, name)
    return app
