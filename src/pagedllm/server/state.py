"""What every request handler shares: the engine client, the served name, metrics,
config, keys and rate limits; who is asking; admission (queue room, tokens per minute).
Built once by app.create_app; the handlers take it as their first argument.

With a model store (serve --models-dir) the state's client is the pool of loaded models
(serving/model_pool.py); a handler asks `serving(model)` for the request's view: the same
state with the named model's engine as its client (loaded first if need be), held until the
handler is done."""
from __future__ import annotations

import dataclasses
import fnmatch
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import Request as HTTPRequest

from pagedllm.reasoning.syntax import ReasoningSyntax, choose_syntax
from pagedllm.tool_calls.syntax import TemplateTools, template_tools
from pagedllm.server.server_config import ServerConfig
from pagedllm.core.output_budget import OutputCaps
from pagedllm.serving.client import EngineClient
from pagedllm.server.auth import ApiKey, KeyStore
from pagedllm.server.errors import APIError
from pagedllm.server.limits import TokenRateLimiter, check_queue
from pagedllm.server.metrics import ServerMetrics
from pagedllm.server.response_store import ResponseStore


@dataclass
class ServerState:
    client: EngineClient
    served_model_name: str
    metrics: ServerMetrics
    config: ServerConfig
    keys: KeyStore
    created: int
    rate_limiter: TokenRateLimiter = field(default_factory=TokenRateLimiter)
    draining: bool = False
    # Submitted choices by engine request id, until their stream ends: the live view reads
    # their time to first token (only the event loop changes it).
    live_choices: dict = field(default_factory=dict)
    # The Responses API's finished responses, for previous_response_id (bounded).
    responses: ResponseStore = field(default_factory=ResponseStore)
    # The embedding model (embeddings/service.py's EmbeddingService), when one is served.
    embeddings: object | None = None
    # A model store's loaded models (serving/model_pool.py's ModelPool, also `client`);
    # None: the one model of `client`.
    pool: object | None = None
    # The LoRA adapter this view's requests run with (its name; None: the base model), and
    # its weight (llama.cpp's per-request scale).
    lora: str | None = None
    lora_scale: float = 1.0

    def reasoning_syntax(self) -> ReasoningSyntax | None:
        """How this model's thinking is marked (--reasoning-parser; auto: from its template
        and vocabulary), or None."""
        tokenizer = self.client.tokenizer
        return choose_syntax(self.config.reasoning_parser, tokenizer.chat_template,
                             tokenizer.added_token_texts)

    def template_tools(self) -> TemplateTools:
        """Whether this model's template renders tools, and the syntax its calls are read
        in (--tool-call-parser; auto: from its template)."""
        return template_tools(self.client.tokenizer.chat_template, self.config.tool_call_parser)

    def check_draining(self) -> None:
        """New work is refused while the server drains or its engine restarts or stalls."""
        if self.draining:
            raise APIError(503, "server is shutting down", None, "shutting_down")
        restarting = self.client.restarting
        if restarting:
            raise APIError(503, f"the engine is restarting: {restarting}; retry shortly", None,
                           "engine_restarting", {"Retry-After": "2"})
        stalled = self.client.stalled
        if stalled:
            raise APIError(503, f"the engine is stalled: {stalled}", None, "engine_stalled",
                           {"Retry-After": "5"})

    def check_model(self, model: str | None) -> None:
        self.check_draining()
        if self.pool is not None:
            if not model:
                raise APIError(400, f"model is required: this server serves "
                                    f"{self.known_models()}", "model", "model_required")
            if self.pool.catalog.find(model) is None:
                raise APIError(404, f"The model `{model}` does not exist; this server serves "
                                    f"{self.known_models()}.", "model", "model_not_found")
        elif model is not None and not self.answers_to(model):
            raise APIError(404, f"The model `{model}` does not exist; this server serves "
                                f"{self.known_models()}.", "model", "model_not_found")

    def known_models(self) -> str:
        names = ([*self.pool.catalog.names, *self.pool.catalog.adapters]
                 if self.pool is not None else [self.served_model_name, *self.adapter_names()])
        return ", ".join(f"`{n}`" for n in names)

    def adapter_names(self) -> list[str]:
        """The LoRA adapters served over the model, in the order they were loaded."""
        loras = self.client.loras
        return [] if loras is None else [adapter.name for adapter in loras.adapters()]

    def adapter_named(self, model: str | None) -> str | None:
        """The adapter a request's `model` names (Ollama's `NAME:latest` too), or None."""
        loras = self.client.loras
        return None if loras is None else loras.named(model)

    def answers_to(self, model: str) -> bool:
        """The served name, or one of the admin's aliases (--model-alias; * patterns); in a
        store, any of its models' names or aliases."""
        if self.pool is not None:
            return self.pool.catalog.find(model) is not None
        return model in (self.served_model_name, self.served_model_name + ":latest") or any(
            fnmatch.fnmatchcase(model, alias) for alias in self.config.model_aliases) or (
            self.adapter_named(model) is not None)

    @asynccontextmanager
    async def serving(self, model: str | None, keep_alive: float | None = None,
                      kind: str = "chat"):
        """This request's view of the server: itself with one model; in a store, the named
        model's engine as `client` (loaded on demand, which the caller waits for), leased
        until the block ends so it is not unloaded before the requests are submitted (then
        they keep it busy). keep_alive: seconds it stays loaded after (Ollama's field).
        kind: what the route needs ("embedding": a store's embedding model)."""
        self.check_model(model)
        if self.pool is None:
            adapter = self.adapter_named(model)
            yield self if adapter is None else dataclasses.replace(
                self, lora=adapter, served_model_name=adapter)
            return
        loaded = await self.acquire(model, keep_alive, kind)
        adapter = self.pool.catalog.adapter_named(model)  # served by its base's engine
        try:
            view = self.view(loaded)
            yield view if adapter is None else dataclasses.replace(
                view, lora=adapter, served_model_name=adapter)
        finally:
            self.pool.release(loaded)

    async def acquire(self, model: str, keep_alive: float | None = None, kind: str = "chat"):
        """A store's model (checked by check_model), loaded if need be and leased to the
        caller (pool.release it); the pool's refusals as APIErrors."""
        from pagedllm.serving.model_pool import ModelLoadFailed, ModelsBusy, ModelTooLarge

        entry = self.pool.catalog.find(model)
        if entry.kind != kind:
            raise APIError(400, f"The model `{model}` "
                                + ("makes embeddings (/v1/embeddings, /api/embed) and does not "
                                   "generate text." if entry.kind == "embedding" else
                                   "generates text and does not make embeddings."),
                           "model", "model_not_embedding" if kind == "embedding"
                           else "model_not_generative")
        try:
            return await self.pool.acquire(entry, keep_alive)
        except ModelsBusy as exc:
            raise APIError(503, str(exc), "model", "model_busy", {"Retry-After": "5"}) from exc
        except ModelTooLarge as exc:
            raise APIError(503, str(exc), "model", "model_too_large") from exc
        except ModelLoadFailed as exc:
            raise APIError(500, str(exc), "model", "model_load_failed") from exc

    def view(self, loaded) -> ServerState:
        """The state as a request to a store's loaded model sees it."""
        config = self.config
        if loaded.entry.chat_settings:  # its own template and parsers in the server's place
            config = dataclasses.replace(config, **dict(loaded.entry.chat_settings))
        return dataclasses.replace(self, client=loaded.client, served_model_name=loaded.name,
                                   config=config)

    def with_lora_field(self, entries: list | None) -> ServerState:
        """llama.cpp's per-request `lora`: [{id, scale}], ids as GET /lora-adapters lists
        them. One adapter a request (entries of scale 0 are off, as in llama.cpp); the
        view runs with it at its scale. Refused by name when it cannot be honoured."""
        if not entries:
            return self
        chosen = [entry for entry in entries if entry.scale != 0]
        names = self.adapter_names()
        for entry in entries:
            if not 0 <= entry.id < len(names):
                raise APIError(400, f"lora: no adapter has id {entry.id}; this server serves "
                                    f"{len(names)} (GET /lora-adapters lists them)", "lora",
                               "lora_not_found")
        if len(chosen) > 1:
            raise APIError(400, "lora: one adapter a request (its products are summed into "
                                "one slot); give the others scale 0", "lora", "unsupported")
        if not chosen:
            return self
        if self.lora is not None and names[chosen[0].id] != self.lora:
            raise APIError(400, f"lora names the adapter {names[chosen[0].id]} and `model` "
                                f"names {self.lora}: name one", "lora", "lora_conflict")
        return dataclasses.replace(self, lora=names[chosen[0].id], lora_scale=chosen[0].scale)

    def cache_salt_for(self, user: str) -> str | None:
        # Salted by user so one user cannot learn another's prompts through cache timing.
        return None if self.config.shared_prefix_cache else user

    def identify(self, http_request: HTTPRequest,
                 user_field: str | None) -> tuple[str, ApiKey | None]:
        """Who is asking: the API key's name, else the `user` field, else the client
        address; and the key."""
        key = http_request.scope.get("state", {}).get("api_key")
        if key is not None:
            return key.name, key
        if user_field:
            return f"user:{user_field}", None
        client = http_request.client
        return f"addr:{client.host if client else 'unknown'}", None

    def admit(self, http_request: HTTPRequest, user_field: str | None,
              num_new: int) -> tuple[str, ApiKey | None]:
        """Who is asking (the API key's name, else the `user` field, else the client
        address) and its key; 429 when the queue is full or the key is over its tokens per
        minute."""
        user, key = self.identify(http_request, user_field)
        if key is not None:
            self.rate_limiter.check(key.name, key.tokens_per_minute)
        # Requests in flight fill the parallel slots first; only those beyond them wait. In a
        # store the bound is the server's: every loaded model's waiting requests count.
        clients = ([m.client for m in self.pool.loaded() if m.kind == "chat"]
                   if self.pool is not None else [self.client])
        waiting = sum(max(0, c.num_in_flight - c.info.scheduler_config.max_num_seqs)
                      for c in clients)
        check_queue(waiting, num_new, self.config.max_queue)
        return user, key

    def output_caps(self, key: ApiKey | None, context: int | None = None) -> OutputCaps:
        """What bounds a request's output here (resolve_max_tokens decides it from these):
        the context, --max-tokens-limit, the client's own context (Ollama's num_ctx) and,
        for a key with a tokens-per-minute limit, what it has left now."""
        budget = None
        if key is not None and key.tokens_per_minute is not None:
            budget = key.tokens_per_minute - self.rate_limiter.used(key.name)
        return OutputCaps(self.client.info.max_model_len, self.config.max_tokens_limit, context,
                          key_budget=budget)

    def apply_key_policies(self) -> None:
        """Weights and per-key concurrency caps, sent to the engine's loop thread."""
        self.client.set_user_policies(
            {k.name: k.weight for k in self.keys.keys},
            {k.name: k.max_concurrent for k in self.keys.keys if k.max_concurrent})

    def reload_keys(self) -> None:
        """Re-read the key file (SIGHUP): new policies apply at once, and a revoked key's
        running requests end now, each stream with a final chunk saying why."""
        if self.keys.reload():
            self.apply_key_policies()
            self.end_revoked()

    def end_revoked(self) -> int:
        """Abort the requests of keys no longer in the file; returns how many."""
        names = {key.name for key in self.keys.keys}
        ended = 0
        for request_id, choice in list(self.live_choices.items()):  # one C call: atomic
            if choice.key is not None and choice.key.name not in names:
                choice.cut_reason = "its API key was revoked"
                self.client.abort(request_id)
                ended += 1
        return ended
