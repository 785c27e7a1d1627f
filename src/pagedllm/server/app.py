"""The FastAPI application: routes, error handlers, auth, limits, draining on shutdown."""
from __future__ import annotations

import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm.config import ServerConfig
from pagedllm.errors import FieldError
from pagedllm.server import errors
from pagedllm.server.auth import KeyStore
from pagedllm.server.docs import install_docs
from pagedllm.server.web_routes import add_web_routes
from pagedllm.server.errors import APIError
from pagedllm.server.generation import create_chat_completion, create_completion
from pagedllm.server.metrics import ServerMetrics
from pagedllm.server.middleware import ApiKeyAuth, BodyGuard
from pagedllm.server.ollama_api import add_ollama_routes
from pagedllm.server.openapi import install_openapi
from pagedllm.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                      TokenizeRequest)
from pagedllm.server.state import ServerState
from pagedllm.serving.client import EngineClient
from pagedllm.tokenizer import ChatTemplateError, TokenLimitError

logger = logging.getLogger("pagedllm.server")


def create_app(client: EngineClient, served_model_name: str | None = None,
               config: ServerConfig | None = None,
               metrics: ServerMetrics | None = None) -> FastAPI:
    """The server over any EngineClient (serving/client.py): one local engine, whose loop the
    caller runs (client.run()), or the replicas' front (its own metrics, labelled by
    replica)."""
    config = config or ServerConfig()
    info = client.info
    name = served_model_name or info.model_config.name
    keys = KeyStore(config.api_key_file)
    state = ServerState(client, name, metrics or ServerMetrics(client.figures, name),
                        config, keys, int(time.time()))
    state.apply_key_policies()

    @asynccontextmanager
    async def lifespan(_app):
        yield
        client.shutdown()

    app = FastAPI(title="pagedllm", version="0.1.0", lifespan=lifespan, docs_url=None,
                  redoc_url=None)
    app.state.pagedllm = state
    # Added last = outermost: CORS (answers preflights), then auth, then the body's guard,
    # so a client without a key never gets its body read.
    app.add_middleware(BodyGuard, max_bytes=config.max_body_bytes)
    app.add_middleware(ApiKeyAuth, keys=keys, public_metrics=config.public_metrics)
    if config.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                           allow_methods=["GET", "POST", "OPTIONS"],
                           allow_headers=["Authorization", "X-Api-Key", "Content-Type"])
    app.add_exception_handler(RequestValidationError, errors.validation_error_handler)
    app.add_exception_handler(APIError, errors.api_error_handler)
    app.add_exception_handler(FieldError, errors.field_error_handler)
    app.add_exception_handler(StarletteHTTPException, errors.http_error_handler)
    app.add_exception_handler(Exception, errors.unexpected_error_handler)

    @app.get("/health")
    async def health():
        if client.dead:
            raise APIError(503, f"the engine is unusable: {client.dead}", None,
                           "engine_dead")
        if state.draining:  # still listening, so a load balancer hears it and moves on
            raise APIError(503, "server is shutting down", None, "shutting_down")
        return {"status": "ok"}

    card = _model_card(info)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": state.created, "owned_by": "pagedllm",
            "max_model_len": info.max_model_len, **card}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: HTTPRequest):
        return await create_completion(state, body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: HTTPRequest):
        return await create_chat_completion(state, body, request)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        state.check_model(body.model)
        tok = client.tokenizer
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", "prompt", "invalid_value")
        if body.messages is not None:
            try:
                text = tok.apply_chat_template([{"role": m.role, "content": m.text()}
                                                for m in body.messages], body.add_generation_prompt)
            except ChatTemplateError as exc:
                raise FieldError("messages", str(exc)) from exc
        else:
            text = body.prompt
        limit = info.max_model_len
        try:  # bounded like a generation request's prompt: no text stalls the HTTP thread
            ids = tok.encode_within(text, limit, body.prompt is not None and body.add_special_tokens)
        except TokenLimitError as exc:
            raise APIError(400, f"the text has at least {exc.num_tokens} tokens, over this "
                                f"server's context of {limit}", "prompt",
                           "context_length_exceeded") from exc
        except ValueError as exc:
            raise FieldError("prompt", str(exc)) from exc
        return {"tokens": ids, "count": len(ids), "max_model_len": limit}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        state.check_model(body.model)
        vocab = info.model_config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids must be in [0, {vocab}), got {bad[:3]}", "tokens",
                           "invalid_value")
        return {"prompt": client.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    add_ollama_routes(app, state)
    add_web_routes(app, state, config.bench_results)
    install_openapi(app, name)
    install_docs(app)
    return app


def _model_card(info) -> dict:
    """What /v1/models adds to OpenAI's fields: what is served, in what format and dtype."""
    from pagedllm.weights.inspect import summarize_checkpoint

    try:
        file_type = summarize_checkpoint(info.model_path).file_type
    except Exception:  # noqa: BLE001 - a listing must not fail on a header it cannot read
        file_type = None
    return {"architecture": info.model_config.architecture,
            # the GGUF's file type ("Q4_1"); a Hugging Face folder's weights are not quantized
            "quantization": file_type or "none", "dtype": info.dtype,
            "context_length": info.max_model_len}
