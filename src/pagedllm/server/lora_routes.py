"""LoRA adapters over the served model, as vLLM and llama.cpp's server expose them:
POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's routes and bodies), for an
admin only: a key marked admin=yes, or, on a server without keys, a client on this machine; GET /lora-adapters (llama.cpp's list, whose ids a request's `lora` field names).
Loading reads and checks the whole file off the event loop before the adapter is listed; a
bad file is a 400 naming why, and nothing is half-loaded."""
from __future__ import annotations

import asyncio
import fnmatch

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import PlainTextResponse
from pydantic import Field

from pagedllm.errors import AdapterError
from pagedllm.core.adapter_names import check_name, look_alike
from pagedllm.server.auth import is_loopback
from pagedllm.server.errors import APIError
from pagedllm.server.request_model import RequestModel
from pagedllm.server.state import ServerState


class LoadLoRARequest(RequestModel):
    lora_name: str = Field(min_length=1, max_length=128)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRARequest(RequestModel):
    lora_name: str = Field(min_length=1, max_length=128)
    lora_int_id: int | None = None  # vLLM's clients send it; names are what pagedllm keys on


def add_lora_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/load_lora_adapter", tags=["LoRA"])
    async def load_lora_adapter(body: LoadLoRARequest, request: HTTPRequest):
        loras = _admin_loras(state, request)
        _check_new_name(state, loras, body.lora_name)
        try:
            adapter = await asyncio.to_thread(loras.load, body.lora_name, body.lora_path)
        except AdapterError as exc:
            raise APIError(400, str(exc), "lora_path", "invalid_lora_adapter") from exc
        return PlainTextResponse(f"Success: LoRA adapter '{adapter.name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", tags=["LoRA"])
    async def unload_lora_adapter(body: UnloadLoRARequest, request: HTTPRequest):
        loras = _admin_loras(state, request)
        try:
            adapter = loras.unload(body.lora_name)
        except KeyError:
            raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found; this "
                                f"server serves {_names(state)}", "lora_name",
                           "lora_not_found") from None
        return PlainTextResponse(f"Success: LoRA adapter '{adapter.name}' removed successfully.")

    @app.get("/lora-adapters", tags=["LoRA"])
    async def lora_adapters(request: HTTPRequest):
        loras, paths = state.client.loras, shows_paths(state, request)
        return [{"id": i, "name": a.name, "path": a.path if paths else None, "scale": 1.0,
                 "rank": a.rank}
                for i, a in enumerate(loras.adapters() if loras is not None else [])]


def model_name_clash(name: str, served_model_name: str, aliases: tuple[str, ...]) -> str | None:
    """Why an adapter may not be named `name` on this server (requests pick it by `model`,
    so it must not read as the served model's name or match an alias); None when it may."""
    if any(fnmatch.fnmatchcase(name, alias) for alias in aliases):
        return f"`{name}` matches a --model-alias of the served model; give the adapter another name"
    if look_alike(name, [served_model_name, served_model_name + ":latest"]) is not None:
        return (f"`{name}` reads as the served model's name `{served_model_name}` (case, or "
                f"look-alike letters); give the adapter another name")
    return None


def shows_paths(state: ServerState, request: HTTPRequest) -> bool:
    """Whether this caller may see files on the server (adapters' paths): an admin key, or
    anyone on a server without keys (loopback only, unless --insecure-no-auth)."""
    if not state.keys.enabled:
        return True
    key = request.scope.get("state", {}).get("api_key")
    return key is not None and key.admin


def adapter_cards(state: ServerState, paths: bool = True) -> list[dict]:
    """/v1/models' entries of the adapters, each with its base as `parent` (as vLLM lists
    them) and `root` its file (None for a caller who may not see files: shows_paths)."""
    if state.pool is not None:  # a store's adapters, beside their bases (loaded or not)
        loaded = {m.name for m in state.pool.loaded()}
        return [{"id": name, "object": "model", "created": state.created,
                 "owned_by": "pagedllm", "parent": base.name,
                 "root": dict(base.loras)[name] if paths else None,
                 "kind": "lora", "loaded": base.name in loaded}
                for name, base in state.pool.catalog.adapters.items()]
    loras = state.client.loras
    return [{"id": a.name, "object": "model", "created": state.created, "owned_by": "pagedllm",
             "parent": state.served_model_name, "root": a.path if paths else None, "kind": "lora",
             "lora_rank": a.rank, "lora_format": a.source, "lora_targets": list(a.targets)}
            for a in (loras.adapters() if loras is not None else [])]


def adapter_tags(state: ServerState) -> list[dict]:
    """Ollama's /api/tags entries of the adapters (`details.parent_model` their base)."""
    loras = state.client.loras
    return [{"name": f"{a.name}:latest", "model": f"{a.name}:latest",
             "modified_at": _modified(a.path), "size": a.num_bytes,
             "digest": a.key.rpartition("@")[2],
             "details": {"parent_model": state.served_model_name, "format": a.source,
                         "family": "lora", "families": ["lora"],
                         "parameter_size": f"{a.num_bytes // 4 / 1e6:.1f}M",
                         "quantization_level": "F32"}}
            for a in (loras.adapters() if loras is not None else [])]


def _modified(path: str) -> str:
    import datetime
    import os

    try:
        stamp = os.path.getmtime(path)
    except OSError:
        stamp = 0
    return datetime.datetime.fromtimestamp(stamp, datetime.timezone.utc).isoformat()


def _admin_loras(state: ServerState, request: HTTPRequest):
    key = request.scope.get("state", {}).get("api_key")
    if state.keys.enabled and (key is None or not key.admin):
        raise APIError(403, "loading and unloading adapters takes an admin key (admin=yes in "
                            "the key file)", None, "permission_denied")
    # Without keys (a loopback server, or one bound wide with --insecure-no-auth) only this
    # machine may: a path on the server is read, which no one else should choose.
    if not state.keys.enabled and not (request.client and is_loopback(request.client.host)):
        raise APIError(403, "without API keys, adapters are loaded and unloaded from this "
                            "machine only", None, "permission_denied")
    loras = state.client.loras
    if loras is None:
        raise APIError(400, "this server has no adapter slots: start it with --enable-lora (or "
                            "--lora NAME=PATH)", None, "lora_disabled")
    return loras


def _check_new_name(state: ServerState, loras, name: str) -> None:
    """A name that cannot be written, or that reads as the served model's or a loaded
    adapter's: 400 naming lora_name (the file is not read)."""
    try:
        check_name(name)
    except AdapterError as exc:
        raise APIError(400, str(exc), "lora_name", "invalid_value") from exc
    clash = model_name_clash(name, state.served_model_name, state.config.model_aliases)
    if clash is not None:
        raise APIError(400, clash, "lora_name", "invalid_value")
    taken = look_alike(name, [adapter.name for adapter in loras.adapters()])
    if taken is not None:
        raise APIError(400, f"an adapter named {name} is already loaded" if taken == name else
                       f"`{name}` reads as the loaded adapter `{taken}` (case, or look-alike "
                       f"letters): give it another name", "lora_name", "invalid_value")


def _names(state: ServerState) -> str:
    names = state.adapter_names()
    return ", ".join(f"`{n}`" for n in names) if names else "no adapters"
