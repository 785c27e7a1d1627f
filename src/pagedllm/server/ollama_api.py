"""Ollama's API on the same port, for the tools built for Ollama: /api/chat (with tools) and
/api/generate (NDJSON streamed by default, or one JSON object with `stream: false`),
/api/tags, /api/show, /api/ps, /api/version; the routes of a model manager (pull, delete,
...) answer with an error saying what this server does not do. Requests go through
the same choices as the OpenAI routes (keys, fair share, queue and token limits); errors
are Ollama's {"error": "..."} (errors.py picks the shape by path). The answer's NDJSON lines
or JSON object are this API's Shape in the one pipeline (pipeline.py)."""
from __future__ import annotations

import asyncio
import datetime
import json
import time
from importlib.metadata import PackageNotFoundError, version

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedllm.core.request import QueuePosition, RequestOutput
from pagedllm.core.output_budget import PromptTooLongError
from pagedllm.errors import FieldError
from pagedllm.server.chat_prompt import (ChatPrompt, prepare_chat, render_chat, tool_use,
                                         with_thinking)
from pagedllm.server.lora_routes import adapter_tags
from pagedllm.server.choice import Choice, public_finish
from pagedllm.server.drive import merged
from pagedllm.server.errors import OLLAMA_PREFIX, APIError
from pagedllm.server.pipeline import Job, run
from pagedllm.server.ollama_models import (EXPIRES_NEVER, ModelInfo, embedding_listing,
                                          expires_at, model_infos)
from pagedllm.server.ollama_protocol import (OllamaChatRequest, OllamaFields, keep_alive_seconds,
                                             OllamaGenerateRequest, OllamaModelRequest)
from pagedllm.server.ollama_shapes import ChatShape, GenerateShape
from pagedllm.server.state import ServerState
from pagedllm.tokenizer import TokenLimitError

NOT_A_MODEL_MANAGER = {
    "/api/pull": "pulling models", "/api/push": "pushing models", "/api/create": "creating models",
    "/api/copy": "copying models", "/api/delete": "deleting models",
}
_NO_IMAGES = "images are not supported: this server's model reads text only"


class JsonWhateverItsType:
    """Ollama reads its routes' bodies as JSON whatever their Content-Type (its own curl
    examples send none, so curl says form-encoded): so do these routes. Pure ASGI."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith(OLLAMA_PREFIX):
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        await self.app(scope, receive, send)


def add_ollama_routes(app: FastAPI, state: ServerState) -> None:
    infos = model_infos(state)
    app.add_middleware(JsonWhateverItsType)

    @app.post("/api/chat")
    async def chat(body: OllamaChatRequest, request: HTTPRequest):
        async with _serving(state, body.model, body.keep_alive) as served:
            # Ollama has no tool_choice: a model offered tools may call them or answer.
            prompt, params = await prepare_chat(
                served, _chat_messages(body), body.sampling_params(), tools=body.tools,
                template_options=body.template_options(
                    served.client.tokenizer.has_thinking_switch))
            return await run(served, request, _job(body, prompt.token_ids, params, "ollama.chat"),
                             OllamaShape(body.model, lambda: ChatShape(prompt)))

    @app.post("/api/generate")
    async def generate(body: OllamaGenerateRequest, request: HTTPRequest):
        for field in ("template", "suffix"):
            if getattr(body, field):
                raise APIError(400, f"{field} is not supported: pagedllm renders prompts with "
                                    f"the model's own chat template (or raw: true)", field)
        if body.images:
            raise APIError(400, _NO_IMAGES, "images")
        async with _serving(state, body.model, body.keep_alive) as served:
            if not body.prompt and not body.context:  # Ollama's "load (or unload) the model"
                unload = served.pool is not None and keep_alive_seconds(body.keep_alive) == 0
                return JSONResponse({"model": body.model, "created_at": _now(), "response": "",
                                     "done": True, "done_reason": "unload" if unload else "load"})
            # Tokenized off the event loop, and stopped at the context (a raw prompt of
            # megabytes is refused after about as much work as one that fits).
            prompt = await asyncio.to_thread(_generate_prompt, served, body)
            prompt_ids = list(body.context or []) + prompt.token_ids
            params = with_thinking(served, body.sampling_params(), prompt.thinking,
                                   served.config.reasoning_budget)
            return await run(served, request, _job(body, prompt_ids, params, "ollama.generate"),
                             OllamaShape(body.model, lambda: GenerateShape(prompt.thinking)))

    _add_model_routes(app, state, infos)


def _serving(state: ServerState, model: str | None, keep_alive=None, kind: str = "chat"):
    """state.serving with Ollama's own wording for a missing or unknown model."""
    seconds = keep_alive_seconds(keep_alive)
    state.check_draining()
    if not model:
        raise APIError(400, "model is required", "model")
    if not state.answers_to(model):
        raise APIError(404, f"model '{model}' not found; this server serves "
                            f"{state.known_models()}", "model")
    if kind is None:  # any model: a store's entry says which
        entry = state.pool.catalog.find(model) if state.pool is not None else None
        kind = entry.kind if entry is not None else "chat"
    return state.serving(model, seconds, kind)


def _add_model_routes(app: FastAPI, state: ServerState, infos: dict[str, ModelInfo]) -> None:
    """What Ollama's clients ask of the models: tags, ps, show, version; a model manager's
    routes answer that this server does not do that."""
    # The models' details are read from their files once, on a worker thread (a GGUF's
    # header takes a second to parse), never on the event loop.
    @app.get("/api/tags")
    async def tags():
        embedder = [embedding_listing(state.embeddings)] if state.embeddings else []
        listed = [await asyncio.to_thread(info.listing) for info in infos.values()]
        return {"models": [*listed, *adapter_tags(state), *embedder]}

    @app.get("/api/ps")
    async def ps():
        if state.pool is None:  # the one model, loaded for the server's life
            info, client = next(iter(infos.values())), state.client
            loaded = [await asyncio.to_thread(
                lambda: info.loaded(info.card.file_bytes + int(client.info.kv_memory_bytes or 0),
                                    EXPIRES_NEVER, client.info.max_model_len))]
        else:
            now = time.monotonic()
            loaded = [await asyncio.to_thread(
                infos[m.name].loaded, m.size_bytes, expires_at(m.expires_in(now)),
                m.client.info.max_model_len) for m in state.pool.loaded()]
        if state.embeddings is not None:  # loaded for the server's life
            embedder = await asyncio.to_thread(embedding_listing, state.embeddings)
            loaded.append({**embedder, "size_vram": 0, "expires_at": EXPIRES_NEVER,
                           "context_length": state.embeddings.model.max_tokens})
        return {"models": loaded}

    @app.post("/api/show")
    async def show(body: OllamaModelRequest):
        async with _serving(state, body.model or body.name, kind=None) as served:
            if served.lora is not None:  # an adapter: its base's card, its own lines added
                shown = await asyncio.to_thread(infos[state.served_model_name].show,
                                                served.client)
                adapter = served.client.loras.get(served.lora)
                return {**shown, "modelfile": shown["modelfile"] + f"ADAPTER {adapter.path}\n",
                        "details": {**shown["details"], "parent_model": state.served_model_name}}
            info = infos[served.served_model_name]
            return await asyncio.to_thread(info.show, served.client)

    @app.get("/api/version")
    async def api_version():
        try:
            return {"version": version("pagedllm")}
        except PackageNotFoundError:
            return {"version": "0.0.0"}

    for path, what in NOT_A_MODEL_MANAGER.items():
        app.add_api_route(path, _refusal(state, path, what), methods=["POST", "DELETE"],
                          include_in_schema=False)  # polite refusals, not an API


def _refusal(state: ServerState, path: str, what: str):
    # A client error, not a server fault: this server will never do it, whatever is retried.
    async def refuse():
        raise APIError(400, f"{path}: pagedllm does not do {what}; it serves the models it "
                            f"was started with ({state.known_models()}), chosen with "
                            f"`pagedllm serve --model PATH` or `--models-dir DIR`", None,
                       "unsupported")
    return refuse


def _chat_messages(body: OllamaChatRequest) -> list[dict]:
    if not body.messages:
        raise APIError(400, "messages must not be empty", "messages")
    if any(m.images for m in body.messages):
        raise APIError(400, _NO_IMAGES, "messages")
    messages = []
    for m in body.messages:
        message = {"role": m.role, "content": m.content}
        if m.tool_calls:
            message["tool_calls"] = [{"id": None, "name": c.function.name,
                                      "arguments": c.function.arguments} for c in m.tool_calls]
        if m.tool_name:
            message["name"] = m.tool_name
        messages.append(message)
    return messages


def _generate_prompt(state: ServerState, body: OllamaGenerateRequest) -> ChatPrompt:
    tok = state.client.tokenizer
    if body.raw:  # the text as given: no template, so no thinking opened by one
        limit = state.client.info.max_model_len
        try:
            return ChatPrompt(tok.encode_within(body.prompt, limit, add_special_tokens=False),
                              None)
        except TokenLimitError as exc:
            raise PromptTooLongError(exc.num_tokens, 0, limit, at_least=True, param="prompt") from exc
        except ValueError as exc:  # not valid Unicode
            raise FieldError("prompt", str(exc)) from exc
    messages = ([{"role": "system", "content": body.system}] if body.system else []) + [
        {"role": "user", "content": body.prompt}]
    return render_chat(state, messages, tool_use(state, None), template_options=
                       body.template_options(tok.has_thinking_switch))


def _job(body: OllamaFields, prompt_ids: list[int], params, api: str) -> Job:
    # options.num_ctx is the client's own context: the answer ends there (OutputCaps).
    return Job([prompt_ids], params, body.stream, context=body.options.num_ctx, api=api)


class OllamaShape:
    """NDJSON lines (streamed, the default) or one JSON object, in Ollama's fields."""

    def __init__(self, model: str, pieces):
        """pieces(): a fresh ChatShape or GenerateShape, saying how text goes into a line."""
        self.head = {"model": model}
        self.pieces = pieces

    def stream(self, state: ServerState, choices: list[Choice]) -> Response:
        head, choice = self.head, choices[0]

        async def lines():
            pieces = self.pieces()
            try:
                async for _, out in merged(state, choices):
                    if isinstance(out, QueuePosition):
                        continue
                    fields = pieces.feed(out.new_text)
                    if fields is not None:
                        yield _line({**head, "created_at": _now(), **fields, "done": False})
                    if out.finished:
                        yield _line({**head, "created_at": _now(), **pieces.finish(out.finish_reason == "length"),
                                     **_done(state, choice, out), **pieces.final_extra(out)})
            except Exception as exc:  # noqa: BLE001 - the status line is sent; report in-band
                yield _line({"error": str(exc)})

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    def whole(self, state: ServerState, choices: list[Choice]) -> Response:
        choice = choices[0]
        out, pieces = choice.final, self.pieces()
        whole = pieces.whole(out.text, out.finish_reason == "length")
        return JSONResponse({**self.head, "created_at": _now(), **whole,
                             **_done(state, choice, out), **pieces.final_extra(out)})


def _line(payload: dict) -> str:
    return json.dumps(payload, ensure_ascii=False) + "\n"


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat()


def _ns(seconds: float) -> int:
    return max(0, int(seconds * 1e9))


def _done(state: ServerState, choice: Choice, out: RequestOutput) -> dict:
    """Ollama's closing fields: why it ended (a cut-short answer is "length" with the error
    beside it, as on /v1), token counts, durations in nanoseconds."""
    end = time.monotonic()
    first = choice.first_token_time or end
    started = choice.arrival + (out.queue_time or 0.0)
    reason, error = public_finish(state, choice, out.finish_reason)
    return {"done": True, "done_reason": reason, **({"error": error["message"]} if error else {}),
            "total_duration": _ns(end - choice.arrival), "load_duration": 0,
            "prompt_eval_count": len(out.prompt_token_ids),
            "prompt_eval_duration": _ns(first - started),
            "eval_count": len(out.token_ids), "eval_duration": _ns(end - first)}
