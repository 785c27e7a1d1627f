"""Errors in the shape of the API that was called: OpenAI's {"error": {"message", "type",
"param", "code"}} everywhere but under /api/, where Ollama's clients read {"error": "..."},
and under /v1/messages, where Anthropic's read {"type": "error", "error": {"type",
"message"}}."""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm.errors import FieldError

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
          408: "invalid_request_error", 503: "service_unavailable", 500: "internal_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


OLLAMA_PREFIX = "/api/"
ANTHROPIC_PREFIX = "/v1/messages"
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    403: "permission_error", 404: "not_found_error", 408: "timeout_error",
                    413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def anthropic_error_type(status: int) -> str:
    return _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def error_response(status: int, message: str, param: str | None = None,
                   code: str | None = None, headers: dict | None = None,
                   path: str = "") -> JSONResponse:
    if path.startswith(OLLAMA_PREFIX):
        return JSONResponse({"error": message}, status_code=status, headers=headers)
    if path.startswith(ANTHROPIC_PREFIX):
        return JSONResponse({"type": "error", "error": {"type": anthropic_error_type(status),
                                                        "message": message}},
                            status_code=status, headers=headers)
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def _field_name(loc: tuple) -> str | None:
    parts = [str(p) for p in loc if p not in ("body", "query", "path")]
    # Drop pydantic's union-branch labels such as "str" or "list[int]".
    parts = [p for p in parts if not p.startswith(("list[", "str", "int", "function-",
                                                   "constrained-", "dict[", "bool", "float"))]
    return ".".join(parts) or None


async def validation_error_handler(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    # A union field reports every branch; the one that is not a plain type mismatch says
    # what is wrong with the value the client meant ("at most 16 items", not "not a string").
    telling = [e for e in errors if not str(e.get("type", "")).endswith("_type")]
    first = (telling or errors or [{}])[0]
    param = _field_name(tuple(first.get("loc", ())))
    if first.get("type") == "json_invalid":
        loc = first.get("loc", ())
        at = f" at character {loc[1]}" if len(loc) > 1 and isinstance(loc[1], int) else ""
        why = (first.get("ctx") or {}).get("error") or first.get("msg")
        return error_response(400, f"request body is not valid JSON{at}: {why}", None,
                              "invalid_json", path=request.url.path)
    message = first.get("msg", "invalid request")
    if first.get("type") == "extra_forbidden":  # refused, never silently ignored
        return error_response(400, f"{param}: this server does not support this field; it "
                                   f"refuses it rather than ignore it", param,
                              "unsupported_field", path=request.url.path)
    if param:
        message = f"{param}: {message}"
    return error_response(400, message, param, "invalid_value", path=request.url.path)


async def api_error_handler(request: Request, exc: APIError) -> JSONResponse:
    return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers,
                          request.url.path)


# The sampling fields as Ollama's clients name them (its `options`), for its routes' errors.
OLLAMA_FIELDS = {
    "max_tokens": "options.num_predict", "temperature": "options.temperature",
    "top_p": "options.top_p", "top_k": "options.top_k", "min_p": "options.min_p",
    "presence_penalty": "options.presence_penalty",
    "frequency_penalty": "options.frequency_penalty",
    "repetition_penalty": "options.repeat_penalty", "seed": "options.seed",
    "stop": "options.stop", "response_format": "format",
}


async def field_error_handler(request: Request, exc: FieldError) -> JSONResponse:
    """Every FieldError (errors.py) the core, the engine or a parse step raises: a 400 naming
    the field, in the called API's shape (on Ollama's routes, by Ollama's name for it). No
    route translates them by hand."""
    path, message, param = request.url.path, str(exc), exc.param
    if path.startswith(OLLAMA_PREFIX) and param in OLLAMA_FIELDS:
        ollama_name = OLLAMA_FIELDS[param]
        if message.startswith(f"{param}: "):
            message = ollama_name + message[len(param):]
        param = ollama_name
    return error_response(400, message, param, exc.code, path=path)


async def http_error_handler(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error_response(exc.status_code, str(exc.detail), None, None,
                          getattr(exc, "headers", None), request.url.path)


async def unexpected_error_handler(request: Request, exc: Exception) -> JSONResponse:
    return error_response(500, f"internal error: {type(exc).__name__}", path=request.url.path)


def install_handlers(app: FastAPI) -> None:
    """Every error a route can raise, in the called API's shape: the body's validation, the
    server's APIErrors, the core's FieldErrors, HTTP errors, and anything unexpected (500,
    never a traceback to the client)."""
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(FieldError, field_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)
    app.add_exception_handler(Exception, unexpected_error_handler)
