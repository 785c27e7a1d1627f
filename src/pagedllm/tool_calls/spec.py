"""The functions a request offers and how it asks for them to be used, checked once.

OpenAI's shapes: `tools` is a list of {"type": "function", "function": {"name",
"description", "parameters"}}; `tool_choice` is "none", "auto", "required" or
{"type": "function", "function": {"name": ...}}. Ollama sends the same `tools`.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from pagedllm.errors import FieldError

NAME_PATTERN = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
MAX_TOOLS = 128
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


class ToolError(FieldError):
    """A tool definition or tool_choice cannot be used; `param` names the request field."""


@dataclass(frozen=True)
class Function:
    name: str
    description: str
    parameters_json: str  # the parameters' JSON schema, as canonical JSON (hashable)

    @property
    def parameters(self) -> dict:
        return json.loads(self.parameters_json)

    def as_tool(self) -> dict:
        """The OpenAI tool dict, as chat templates that know tools expect it."""
        function = {"name": self.name}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": {**function, "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # "none" | "auto" | "required" | "named"
    name: str | None = None  # the function, when mode is "named"

    @property
    def forced(self) -> bool:
        """The answer must be tool calls (enforced by a grammar)."""
        return self.mode in ("required", "named")


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as OpenAI sends it

    @classmethod
    def new(cls, name: str, arguments: dict) -> ToolCall:
        return cls(f"call_{uuid.uuid4().hex[:24]}", name, json.dumps(arguments, ensure_ascii=False))

    @property
    def arguments_dict(self) -> dict:
        return json.loads(self.arguments)

    def as_openai(self, index: int | None = None) -> dict:
        call = {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def parse_tools(tools: Any, param: str = "tools") -> tuple[Function, ...]:
    """Functions from a request's `tools` (None or [] gives none). Raises ToolError."""
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise ToolError(param, "must be a list of tools")
    if len(tools) > MAX_TOOLS:
        raise ToolError(param, f"at most {MAX_TOOLS} tools")
    functions, names = [], set()
    for i, tool in enumerate(tools):
        where = f"{param}[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ToolError(where, 'each tool must be {"type": "function", "function": {...}}')
        function = tool.get("function")
        if not isinstance(function, dict):
            raise ToolError(f"{where}.function", "must be an object with a name")
        name = function.get("name")
        if not isinstance(name, str) or not NAME_PATTERN.match(name):
            raise ToolError(f"{where}.function.name",
                            "must be 1-64 letters, digits, '_', '.' or '-'")
        if name in names:
            raise ToolError(f"{where}.function.name", f"{name!r} is given twice")
        names.add(name)
        description = function.get("description") or ""
        if not isinstance(description, str):
            raise ToolError(f"{where}.function.description", "must be a string")
        parameters = function.get("parameters")
        if parameters is None:
            parameters = EMPTY_PARAMETERS
        if not isinstance(parameters, dict):
            raise ToolError(f"{where}.function.parameters", "must be a JSON schema object")
        if parameters.get("type", "object") != "object":
            raise ToolError(f"{where}.function.parameters",
                            'must describe an object ("type": "object")')
        functions.append(Function(name, description, json.dumps(parameters)))
    return tuple(functions)


def parse_tool_choice(choice: Any, functions: tuple[Function, ...],
                      param: str = "tool_choice") -> ToolChoice:
    """OpenAI's default: "auto" with tools, "none" without."""
    if choice is None:
        return ToolChoice("auto" if functions else "none")
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise ToolError(param, f"unknown value {choice!r}; use none, auto, required or "
                                   f'{{"type": "function", "function": {{"name": ...}}}}')
        if choice != "none" and not functions:
            raise ToolError(param, f"{choice!r} needs tools")
        return ToolChoice(choice)
    if not isinstance(choice, dict) or not isinstance(choice.get("function"), dict):
        raise ToolError(param, 'must be a string or {"type": "function", "function": {"name": ...}}')
    name = choice["function"].get("name")
    if name not in {f.name for f in functions}:
        raise ToolError(param, f"names the function {name!r}, which is not in tools")
    return ToolChoice("named", name)
