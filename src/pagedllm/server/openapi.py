"""The published OpenAPI schema, made to say what the server really answers, so clients and
fuzzers (schemathesis) can trust it: validation errors are 400 in the API's error shape (not
FastAPI's 422), every route documents the errors any request can meet, streamed answers
document their content types, /metrics is Prometheus text."""
from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

OPENAI_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
OLLAMA_ERROR = {"type": "object", "required": ["error"],
                "properties": {"error": {"type": "string"}}}
ANTHROPIC_ERROR = {"type": "object", "required": ["type", "error"], "properties": {
    "type": {"const": "error"}, "error": {
        "type": "object", "required": ["type", "message"],
        "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}}}
# What any request may meet, whatever its route: bad input, no key, unknown model, a body
# over the limit or too slow, a full queue or a rate limit, a failed request, draining.
ERRORS = {400: "a field is invalid (the error names it)", 401: "missing or invalid API key",
          404: "unknown model", 408: "the body arrived too slowly",
          413: "the body is over --max-body-bytes", 429: "queue full or over a rate limit",
          500: "this request failed in the engine", 503: "shutting down, or the engine is unusable"}
STREAMED = {"/v1/completions": "text/event-stream", "/v1/chat/completions": "text/event-stream",
            "/v1/server/state": "text/event-stream", "/v1/messages": "text/event-stream",
            "/v1/responses": "text/event-stream",
            "/api/chat": "application/x-ndjson", "/api/generate": "application/x-ndjson"}
TEXT_ROUTES = {"/metrics": "text/plain"}


def install_openapi(app: FastAPI, served_model_name: str) -> None:
    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = _accurate(get_openapi(title=app.title, version=app.version,
                                                       routes=app.routes), served_model_name)
        return app.openapi_schema

    app.openapi = openapi


def _accurate(schema: dict, served_model_name: str) -> dict:
    for path, operations in schema.get("paths", {}).items():
        error = OLLAMA_ERROR if path.startswith("/api/") else \
            ANTHROPIC_ERROR if path.startswith("/v1/messages") else OPENAI_ERROR
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            for status, why in ERRORS.items():
                responses.setdefault(str(status), {
                    "description": why, "content": {"application/json": {"schema": error}}})
            ok = responses.setdefault("200", {"description": "OK"})
            if path in STREAMED:  # SSE events carry JSON in `data`; NDJSON lines are objects
                event = ({"type": "object", "properties": {"data": {"type": "string"}}}
                         if STREAMED[path] == "text/event-stream" else {"type": "object"})
                ok.setdefault("content", {})[STREAMED[path]] = {"schema": event}
            if path in TEXT_ROUTES:
                ok["content"] = {TEXT_ROUTES[path]: {"schema": {"type": "string"}}}
    # The key goes as a bearer token or in x-api-key (Anthropic's clients); without keys the
    # server takes requests without one, hence the empty alternative. /docs shows an
    # Authorize button from this.
    schema.setdefault("components", {})["securitySchemes"] = {
        "bearer": {"type": "http", "scheme": "bearer",
                   "description": "an API key from `pagedllm keys add NAME`"},
        "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key"}}
    schema["security"] = [{"bearer": []}, {"x-api-key": []}, {}]
    components = schema.get("components", {}).get("schemas", {})
    components.pop("HTTPValidationError", None)
    components.pop("ValidationError", None)
    for component in components.values():  # the one name a request can use, as an example
        model = component.get("properties", {}).get("model")
        if model is not None:
            model["examples"] = [served_model_name]
    return schema
