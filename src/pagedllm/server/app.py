"""The FastAPI application: routes, error handlers, auth, limits, draining on shutdown."""
from __future__ import annotations

import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pagedllm.server.server_config import ServerConfig
from pagedllm.server import errors
from pagedllm.server.anthropic_api import add_anthropic_routes
from pagedllm.server.auth import KeyStore, is_loopback
from pagedllm.server.cors import add_cors
from pagedllm.server.docs import install_docs
from pagedllm.server.embeddings_api import add_embedding_routes
from pagedllm.server.lora_routes import add_lora_routes
from pagedllm.server.web_routes import add_web_routes
from pagedllm.server.errors import APIError
from pagedllm.server.metrics import EmbeddingCollector, ModelPoolCollector, ServerMetrics
from pagedllm.server.middleware import ApiKeyAuth, BodyGuard
from pagedllm.server.ollama_api import add_ollama_routes
from pagedllm.server.openai_routes import add_openai_routes
from pagedllm.server.openapi import install_openapi
from pagedllm.server.responses_api import add_responses_routes
from pagedllm.server.state import ServerState
from pagedllm.serving.client import EngineClient
from pagedllm.serving.model_pool import ModelPool

logger = logging.getLogger("pagedllm.server")


def create_app(client: EngineClient, served_model_name: str | None = None,
               config: ServerConfig | None = None,
               metrics: ServerMetrics | None = None, embeddings=None) -> FastAPI:
    """The server over any EngineClient (serving/client.py): one local engine, whose loop the
    caller runs (client.run()), the replicas' front (its own metrics, labelled by replica),
    or a model store's pool (serving/model_pool.py: models loaded on demand)."""
    config = config or ServerConfig()
    state = _server_state(client, served_model_name, config, metrics, embeddings)
    name, keys = state.served_model_name, state.keys

    @asynccontextmanager
    async def lifespan(_app):
        yield
        client.shutdown()
        if embeddings is not None:
            embeddings.shutdown()

    app = FastAPI(title="pagedllm", version="0.1.0", lifespan=lifespan, docs_url=None,
                  redoc_url=None)
    app.state.pagedllm = state
    _add_guards(app, config, keys)
    errors.install_handlers(app)

    @app.get("/health")
    async def health(request: Request):
        if client.dead:
            raise APIError(503, f"the engine is unusable: {client.dead}", None,
                           "engine_dead")
        # Still listening, so a load balancer hears it and moves on.
        state.check_draining()
        answer = {"status": "ok"}
        # The key file's reloads, for `pagedllm keys` to read back its edit; asked from this
        # machine only (the path in an error is nobody else's business).
        if keys.enabled and request.client and is_loopback(request.client.host):
            answer["api_keys"] = keys.reload_status()
        return answer

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    add_openai_routes(app, state)
    add_ollama_routes(app, state)
    add_anthropic_routes(app, state)
    add_responses_routes(app, state)
    add_embedding_routes(app, state)
    add_lora_routes(app, state)
    add_web_routes(app, state, config.bench_results)
    install_openapi(app, name)
    install_docs(app)
    return app


def _server_state(client: EngineClient, served_model_name: str | None, config: ServerConfig,
                  metrics: ServerMetrics | None, embeddings) -> ServerState:
    """What every route reads: the client, the served name, keys, metrics, embeddings."""
    pool = client if isinstance(client, ModelPool) else None
    # A store has no one name: its models' rows carry theirs (the first is the examples').
    name = (pool.catalog.names[0] if pool is not None
            else served_model_name or client.info.model_config.name)
    keys = KeyStore(config.api_key_file)
    if config.chat_template is not None and pool is None:
        client.tokenizer.set_chat_template(config.chat_template)
    state = ServerState(client, name, metrics or ServerMetrics(client.figures, name),
                        config, keys, int(time.time()), pool=pool)
    if pool is not None:
        state.metrics.registry.register(ModelPoolCollector(pool))
    if config.start_command:
        state.metrics.describe_start(config.start_command)
    state.apply_key_policies()
    if embeddings is not None:
        state.embeddings = embeddings
        state.metrics.registry.register(EmbeddingCollector(embeddings))
    return state


def _add_guards(app: FastAPI, config: ServerConfig, keys: KeyStore) -> None:
    # Added last = outermost: CORS (answers preflights), then auth, then the body's guard,
    # so a client without a key never gets its body read.
    app.add_middleware(BodyGuard, max_bytes=config.max_body_bytes)
    app.add_middleware(ApiKeyAuth, keys=keys, public_metrics=config.public_metrics)
    add_cors(app, config.allowed_origins)
