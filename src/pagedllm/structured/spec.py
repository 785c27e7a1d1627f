"""What a request's output must follow, as plain data, from the OpenAI fields
(`response_format`) and vLLM's (`guided_json`, `guided_regex`, `guided_choice`,
`guided_grammar`). No grammar library here: the spec is also the cache key of its compiled
grammar (compiler.py)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pagedllm.errors import FieldError

KINDS = ("json_schema", "regex", "lark", "gbnf")


class GrammarError(FieldError):
    """A grammar or schema cannot be used; `param` names the request field it came from."""

    code = "invalid_grammar"


@dataclass(frozen=True)
class GrammarSpec:
    kind: str  # one of KINDS
    source: str  # the schema as canonical JSON, the regex, or the grammar text
    param: str = "response_format"  # the field it came from, for error messages

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown grammar kind {self.kind!r}")


def json_schema_spec(schema: Any, param: str) -> GrammarSpec:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise GrammarError(param, f"the schema is not valid JSON: {exc}") from exc
        except RecursionError as exc:
            raise GrammarError(param, "the schema nests too deep") from exc
    if not isinstance(schema, (dict, bool)):
        raise GrammarError(param, "a JSON schema must be an object")
    # Not sort_keys: properties are generated in the order the schema lists them.
    try:
        return GrammarSpec("json_schema", json.dumps(schema), param)
    except RecursionError as exc:
        raise GrammarError(param, "the schema nests too deep") from exc


def choice_spec(choices: list[str], param: str = "guided_choice") -> GrammarSpec:
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise GrammarError(param, "must be a non-empty list of non-empty strings")
    # A Lark rule of string literals: JSON string escapes are Lark's too.
    alternatives = " | ".join(json.dumps(c) for c in dict.fromkeys(choices))
    return GrammarSpec("lark", f"start: {alternatives}\n", param)


def grammar_spec(text: str, param: str = "guided_grammar") -> GrammarSpec:
    """GBNF (llama.cpp's; rules written `name ::= ...`) or Lark (llguidance's own)."""
    if not text.strip():
        raise GrammarError(param, "the grammar is empty")
    return GrammarSpec("gbnf" if "::=" in text else "lark", text, param)


def spec_from_request(response_format: dict | None = None, guided_json: Any = None,
                      guided_regex: str | None = None, guided_choice: list[str] | None = None,
                      guided_grammar: str | None = None, *, grammar: str | None = None,
                      json_schema: Any = None) -> GrammarSpec | None:
    """The one grammar a request asks for, or None. More than one is an error. `grammar`
    and `json_schema` are llama.cpp's names for guided_grammar and guided_json."""
    asked = [name for name, value in (("guided_json", guided_json), ("guided_regex", guided_regex),
                                      ("guided_choice", guided_choice),
                                      ("guided_grammar", guided_grammar), ("grammar", grammar),
                                      ("json_schema", json_schema)) if value is not None]
    fmt_type = (response_format or {}).get("type", "text")
    if response_format is not None:
        _check_keys(response_format, _RESPONSE_FORMAT_KEYS.get(fmt_type, {"type"}),
                    "response_format")
    if fmt_type != "text":
        asked.insert(0, "response_format")
    if len(asked) > 1:
        raise GrammarError(asked[1], f"only one of {', '.join(asked)} may be given")
    if not asked:
        return None
    which = asked[0]
    if which == "response_format":
        return _response_format_spec(response_format)
    if which == "guided_json":
        return json_schema_spec(guided_json, "guided_json")
    if which == "guided_regex":
        if not guided_regex:
            raise GrammarError("guided_regex", "the regex is empty")
        return GrammarSpec("regex", guided_regex, "guided_regex")
    if which == "guided_choice":
        return choice_spec(guided_choice)
    if which == "json_schema":
        return json_schema_spec(json_schema, "json_schema")
    if which == "grammar":
        return grammar_spec(grammar, "grammar")
    return grammar_spec(guided_grammar)


# What each response_format type may hold: anything else is refused, not ignored.
_RESPONSE_FORMAT_KEYS = {"text": {"type"}, "json_object": {"type", "schema"},
                         "json_schema": {"type", "json_schema"}}
_JSON_SCHEMA_KEYS = {"name", "schema", "strict", "description"}


def _check_keys(value: dict, allowed: set[str], param: str) -> None:
    unknown = sorted(k for k in value if k not in allowed)
    if unknown:
        raise GrammarError(f"{param}.{unknown[0]}", "is not a field this server supports here "
                                                    f"(it takes {', '.join(sorted(allowed))})")


def _response_format_spec(response_format: dict) -> GrammarSpec:
    fmt_type = response_format.get("type")
    if fmt_type == "json_object":
        if "schema" in response_format:  # llama.cpp's form: a schema beside json_object
            return json_schema_spec(response_format["schema"], "response_format.schema")
        return GrammarSpec("json_schema", json.dumps({"type": "object"}), "response_format")
    if fmt_type == "json_schema":
        wrapper = response_format.get("json_schema")
        if not isinstance(wrapper, dict) or "schema" not in wrapper:
            raise GrammarError("response_format",
                               'json_schema needs {"name": ..., "schema": {...}}')
        _check_keys(wrapper, _JSON_SCHEMA_KEYS, "response_format.json_schema")
        return json_schema_spec(wrapper["schema"], "response_format")
    raise GrammarError("response_format", f"unknown type {fmt_type!r}; use text, json_object "
                                          f"or json_schema")
