"""The OpenAI-style routes: /v1/models (and one model by id), /v1/completions, /v1/chat/completions (generation.py
parses and shapes them; the pipeline runs them), and vLLM's /tokenize and /detokenize. Each
/v1 route also answers without the prefix (a client whose base_url lacks /v1), unpublished
in the schema."""
from __future__ import annotations

import asyncio
import functools

from fastapi import FastAPI, Request as HTTPRequest

from pagedllm.errors import FieldError
from pagedllm.server.errors import APIError
from pagedllm.server.generation import create_chat_completion, create_completion
from pagedllm.server.lora_routes import adapter_cards, shows_paths
from pagedllm.server.chat_prompt import chat_text, tool_use
from pagedllm.server.chat_protocol import ApplyTemplateRequest
from pagedllm.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                      TokenizeRequest)
from pagedllm.server.state import ServerState
from pagedllm.tokenizer import ChatTemplateError, TokenLimitError


def add_openai_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/v1/models")
    @app.get("/models", include_in_schema=False)
    async def models(request: HTTPRequest):
        return {"object": "list",
                "data": await _model_entries(state, shows_paths(state, request))}

    # OpenAI's "retrieve model" (the openai SDK's models.retrieve): the one entry of the list.
    # `:path`, since a served name may hold a slash (HuggingFaceTB/SmolLM2-135M-Instruct).
    @app.get("/v1/models/{model_id:path}")
    @app.get("/models/{model_id:path}", include_in_schema=False)
    async def model(model_id: str, request: HTTPRequest):
        for entry in await _model_entries(state, shows_paths(state, request)):
            if entry["id"] == model_id:
                return entry
        raise APIError(404, f"The model `{model_id}` does not exist", "model", "model_not_found")

    @app.post("/v1/completions")
    @app.post("/completions", include_in_schema=False)
    async def completions(body: CompletionRequest, request: HTTPRequest):
        return await create_completion(state, body, request)

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions", include_in_schema=False)
    async def chat_completions(body: ChatCompletionRequest, request: HTTPRequest):
        return await create_chat_completion(state, body, request)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        async with state.serving(body.model) as served:
            return _tokenize(served, body)

    @app.post("/apply-template")
    async def apply_template(body: ApplyTemplateRequest):
        """llama.cpp's route: the prompt the model's chat template makes of a conversation
        (tools and chat_template_kwargs included), to see what a chat request sends."""
        async with state.serving(body.model) as served:
            use = tool_use(served, body.tools, body.tool_choice)
            options = body.template_options(served.client.tokenizer.template_variables)
            return {"prompt": chat_text(served, body.template_messages(), use,
                                        body.add_generation_prompt, template_options=options)}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        async with state.serving(body.model) as served:
            vocab = served.client.info.model_config.vocab_size
            bad = [t for t in body.tokens if not 0 <= t < vocab]
            if bad:
                raise APIError(400, f"token ids must be in [0, {vocab}), got {bad[:3]}",
                               "tokens", "invalid_value")
            return {"prompt": served.client.tokenizer.decode(body.tokens,
                                                             skip_special_tokens=False)}


async def _model_entries(state: ServerState, paths: bool) -> list[dict]:
    """Every model /v1/models lists: the served ones (with their cards), the adapters, the
    embedding model."""
    embedder = state.embeddings
    embedding = [{"id": embedder.name, "object": "model", "created": state.created,
                  "owned_by": "pagedllm", "max_model_len": embedder.model.max_tokens,
                  "kind": "embedding", "dimensions": embedder.model.dimensions}] if embedder else []
    cards = await asyncio.to_thread(_model_cards, state)
    return [{"id": name, "object": "model", "created": state.created, "owned_by": "pagedllm",
             **card} for name, card in cards.items()] + adapter_cards(state, paths) + embedding


def _tokenize(state: ServerState, body: TokenizeRequest) -> dict:
    tok = state.client.tokenizer
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
    limit = state.client.info.max_model_len
    try:  # bounded like a generation request's prompt: no text stalls the HTTP thread
        ids = tok.encode_within(text, limit, body.prompt is not None and body.add_special_tokens)
    except TokenLimitError as exc:
        raise APIError(400, f"the text has at least {exc.num_tokens} tokens, over this "
                            f"server's context of {limit}", "prompt",
                       "context_length_exceeded") from exc
    except ValueError as exc:
        raise FieldError("prompt", str(exc)) from exc
    return {"tokens": ids, "count": len(ids), "max_model_len": limit}


def _model_cards(state: ServerState) -> dict[str, dict]:
    """What /v1/models adds to OpenAI's fields, per model: what it is (read from its file
    without loading it) and, once loaded, how it is served."""
    if state.pool is None:
        return {state.served_model_name: _loaded_card(state.client.info)}
    loaded = {m.name: m for m in state.pool.loaded()}
    cards = {}
    for name, entry in state.pool.catalog.entries.items():
        try:
            card = state.pool.catalog.card(name)
            known = {"architecture": card.architecture, "quantization": card.quantization,
                     "parameters": card.parameters, "size": card.file_bytes,
                     "context_length": card.context_length}
        except Exception as exc:  # noqa: BLE001 - one unreadable file must not hide the rest
            known = {"error": f"cannot read {entry.path}: {exc}"}
        model = loaded.get(name)
        served = {}
        if entry.kind == "embedding":
            served = {"kind": "embedding"}
            if model is not None:
                served.update(dimensions=model.client.service.model.dimensions,
                              max_model_len=model.client.info.max_model_len)
        elif model is not None:
            served = _loaded_card(model.client.info)
        cards[name] = {**known, "loaded": model is not None, **served}
    return cards


def _loaded_card(info) -> dict:
    """A loaded model's card: what is served, in what format and dtype, where."""
    return {"max_model_len": info.max_model_len, "architecture": info.model_config.architecture,
            # the GGUF's file type ("Q4_1"); a Hugging Face folder's weights are not quantized
            "quantization": _file_type(info.model_path) or "none", "dtype": info.dtype,
            "context_length": info.max_model_len, "device": info.device}


@functools.lru_cache(maxsize=64)
def _file_type(path: str) -> str | None:
    """A GGUF's file type, read once per file (its header: about a second)."""
    from pagedllm.weights.inspect import summarize_checkpoint

    try:
        return summarize_checkpoint(path).file_type
    except Exception:  # noqa: BLE001 - a listing must not fail on a header it cannot read
        return None
