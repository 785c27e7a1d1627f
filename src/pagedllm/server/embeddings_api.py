"""Embeddings: OpenAI's POST /v1/embeddings and Ollama's POST /api/embed (and its older
/api/embeddings), answered by the embedding model (`serve --embedding-model`, run by
embeddings/service.py). Inputs are checked before anything queues: an empty list, an empty
text, too many inputs, token ids outside the vocabulary and inputs longer than the model
takes (its limit named) are 400s; `dimensions` other than the model's is refused, since its
vectors are not trained to be cut; a key's tokens per minute count the inputs' tokens.
"""
from __future__ import annotations

import base64
import time
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Literal, Union

import numpy as np
from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse
from pydantic import Field, StrictInt, StrictStr

from pagedllm.embeddings import EmbeddingQueueFull
from pagedllm.embeddings.packaged import is_packaged_name
from pagedllm.server.errors import APIError
from pagedllm.server.ollama_protocol import keep_alive_seconds
from pagedllm.server.request_model import RequestModel
from pagedllm.server.state import ServerState

if TYPE_CHECKING:  # the service runs torch; the server never imports it
    from pagedllm.embeddings.service import EmbeddingService

# Inputs one request may hold (OpenAI's limit).
MAX_INPUTS = 2048


class EmbeddingRequest(RequestModel):
    """OpenAI's body. Token ids are this model's ([CLS] and [SEP] included, as its tokenizer
    gives them)."""
    input: Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]
    model: StrictStr
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = Field(default=None, ge=1)
    user: StrictStr | None = None


class OllamaEmbedRequest(RequestModel):
    """Ollama's /api/embed. `truncate` (default true): inputs longer than the model takes are
    cut to fit; false: refused. keep_alive: as for chat, a store's model stays loaded that
    long (--embedding-model's stays for the server's life); options must be empty (an
    encoder samples nothing; _check_options refuses any set)."""
    model: StrictStr
    input: Union[StrictStr, list[StrictStr]]
    truncate: bool = True
    dimensions: StrictInt | None = Field(default=None, ge=1)
    keep_alive: Union[StrictStr, StrictInt, float, None] = None
    options: dict | None = None


class OllamaEmbeddingsRequest(RequestModel):
    """Ollama's older /api/embeddings: one prompt, one vector."""
    model: StrictStr
    prompt: StrictStr
    keep_alive: Union[StrictStr, StrictInt, float, None] = None
    options: dict | None = None


def answers_embeddings(service: "EmbeddingService | None", model: str) -> bool:
    """Its name in any case, with or without an Ollama tag (all-minilm:latest); the bundled
    model also by Ollama's name for it."""
    if service is None:
        return False
    return (model.split(":", 1)[0].lower() == service.name.lower()
            or (is_packaged_name(model) and is_packaged_name(service.name)))


@asynccontextmanager
async def _service_for(state: ServerState, model: str, keep_alive=None, field: str = "model"):
    """The embedding service a request names: --embedding-model's, or a store's embedding
    model (loaded on demand and held, as a chat model is, until the block ends)."""
    service = state.embeddings
    seconds = keep_alive_seconds(keep_alive)
    if state.draining:
        raise APIError(503, "server is shutting down", None, "shutting_down")
    if answers_embeddings(service, model):
        yield service
        return
    if state.pool is not None and state.answers_to(model):
        async with state.serving(model, seconds, kind="embedding") as served:
            yield served.client.service
        return
    if state.answers_to(model):
        served = f"; the embedding model here is `{service.name}`" if service else \
            "; this server has none (serve --embedding-model all-minilm)"
        raise APIError(400, f"The model `{model}` generates text and does not make embeddings{served}.",
                       field, "model_not_embedding")
    names = state.known_models() + (f", `{service.name}`" if service else "")
    raise APIError(404, f"The model `{model}` does not exist; this server serves {names}.",
                   field, "model_not_found")


def _token_inputs(service: "EmbeddingService", raw, truncate: bool) -> list[list[int]]:
    """The request's inputs as token id lists, checked (see the module's docstring)."""
    model = service.model
    if isinstance(raw, str):
        raw = [raw]
    if not raw:
        raise APIError(400, "input must not be empty", "input", "invalid_value")
    if len(raw) > MAX_INPUTS:
        raise APIError(400, f"input holds {len(raw)} items; at most {MAX_INPUTS} a request",
                       "input", "invalid_value")
    if isinstance(raw[0], int):  # one input as token ids
        raw = [raw]
    if isinstance(raw[0], str):
        if any(not isinstance(text, str) for text in raw):
            raise APIError(400, "input mixes texts and token ids", "input", "invalid_value")
        if any(text == "" for text in raw):
            raise APIError(400, "input holds an empty text", "input", "invalid_value")
        inputs = model.tokenize(raw, truncate=truncate)
    else:
        if any(not isinstance(ids, list) for ids in raw):
            raise APIError(400, "input mixes texts and token ids", "input", "invalid_value")
        inputs = raw
        for ids in inputs:
            if not ids:
                raise APIError(400, "input holds an empty token list", "input", "invalid_value")
            bad = [t for t in ids if not 0 <= t < model.vocab_size]
            if bad:
                raise APIError(400, f"token ids must be in [0, {model.vocab_size}), got {bad[:3]}",
                               "input", "invalid_value")
        if truncate:
            inputs = [ids[:model.max_tokens] for ids in inputs]
    for i, ids in enumerate(inputs):
        if len(ids) > model.max_tokens:
            raise APIError(400, f"input {i} has {len(ids)} tokens; {service.name} takes at most "
                                f"{model.max_tokens} an input", "input", "context_length_exceeded")
    return inputs


def _check_options(options: dict | None) -> None:
    """Ollama's clients send `options` with unset entries as null; a set one is refused."""
    named = sorted(k for k, v in (options or {}).items() if v is not None)
    if named:
        raise APIError(400, f"options {', '.join(named)}: an embedding model takes no options",
                       "options", "unsupported_field")


def _check_dimensions(service: "EmbeddingService", dimensions: int | None) -> None:
    if dimensions is not None and dimensions != service.model.dimensions:
        raise APIError(400, f"dimensions: {service.name} makes vectors of "
                            f"{service.model.dimensions} only (it is not trained to be cut)",
                       "dimensions", "invalid_value")


async def _embed(state: ServerState, http_request: HTTPRequest, service: "EmbeddingService",
                 inputs: list[list[int]], user_field: str | None, api: str) -> np.ndarray:
    _, key = state.identify(http_request, user_field)
    if key is not None:
        state.rate_limiter.reserve(key.name, key.tokens_per_minute, sum(map(len, inputs)), 0)
    try:
        vectors = await service.embed(inputs)
    except EmbeddingQueueFull as exc:
        raise APIError(503, f"the embedding model is busy ({exc}); retry shortly", None,
                       "server_busy", {"Retry-After": "1"}) from exc
    state.metrics.api_requests.labels(service.name, api).inc()
    return vectors


def _as_base64(vector: np.ndarray) -> str:
    return base64.b64encode(vector.astype("<f4").tobytes()).decode()


def add_embedding_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/embeddings")
    @app.post("/embeddings", include_in_schema=False)
    async def embeddings(body: EmbeddingRequest, request: HTTPRequest):
        async with _service_for(state, body.model) as service:
            return await _openai_embeddings(service, body, request)

    async def _openai_embeddings(service, body: EmbeddingRequest, request: HTTPRequest):
        _check_dimensions(service, body.dimensions)
        inputs = _token_inputs(service, body.input, truncate=False)
        vectors = await _embed(state, request, service, inputs, body.user, "openai.embeddings")
        encode = _as_base64 if body.encoding_format == "base64" else (lambda v: v.tolist())
        tokens = sum(map(len, inputs))
        # A JSONResponse: FastAPI's encoder walks every float of a returned dict, which took
        # longer than the model for a batch of vectors.
        return JSONResponse({"object": "list", "model": service.name,
                             "data": [{"object": "embedding", "index": i, "embedding": encode(v)}
                                      for i, v in enumerate(vectors)],
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    @app.post("/api/embed")
    async def ollama_embed(body: OllamaEmbedRequest, request: HTTPRequest):
        started = time.monotonic_ns()
        async with _service_for(state, body.model, body.keep_alive) as service:
            loaded = time.monotonic_ns()
            _check_dimensions(service, body.dimensions)
            _check_options(body.options)
            inputs = _token_inputs(service, body.input, truncate=body.truncate)
            vectors = await _embed(state, request, service, inputs, None, "ollama.embed")
            return JSONResponse({"model": body.model, "embeddings": vectors.tolist(),
                                 "total_duration": time.monotonic_ns() - started,
                                 "load_duration": loaded - started,
                                 "prompt_eval_count": sum(map(len, inputs))})

    @app.post("/api/embeddings")
    async def ollama_embeddings(body: OllamaEmbeddingsRequest, request: HTTPRequest):
        async with _service_for(state, body.model, body.keep_alive) as service:
            _check_options(body.options)
            inputs = _token_inputs(service, body.prompt, truncate=True)
            vectors = await _embed(state, request, service, inputs, None, "ollama.embeddings")
            return JSONResponse({"embedding": vectors[0].tolist()})
