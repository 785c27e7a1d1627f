"""A forced tool_choice ("required", a named function) as a grammar in the model's own call
syntax, so the calls always parse and their arguments follow the function's schema. Lark for
llguidance: JSON arguments as `%json` schemas; a marker that is one special token of the
vocabulary as that token (`<[id]>`: text that spells it would not match it); Python keyword
arguments and Qwen3-Coder's XML parameters in the schema's property order, the required
ones always, the others where the model writes them."""
from __future__ import annotations

import json
from pagedllm.tool_calls.spec import Function

# Call JSON exactly as json.dumps writes it (no free whitespace), as structured output does.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class Terms:
    """Lark terms for text and for markers (special tokens by id where they are one)."""

    def __init__(self, special_ids: dict[str, int]):
        self._special = special_ids

    def text(self, text: str) -> str:
        return json.dumps(text)

    def marker(self, text: str) -> str:
        token = self._special.get(text)
        return f"<[{token}]>" if token is not None else json.dumps(text)

    @staticmethod
    def json(schema: dict) -> str:
        return f"%json {json.dumps({**schema, 'x-guidance': JSON_STYLE})}"


def call_object_schema(function: Function, arguments_key: str) -> dict:
    return {"type": "object", "additionalProperties": False,
            "required": ["name", arguments_key],
            "properties": {"name": {"const": function.name}, arguments_key: function.parameters}}


def json_object_rules(arguments_key: str, before: str = '""', after: str = '""'):
    """call: each function's {"name", arguments_key} object, between `before` and `after`
    (Lark expressions)."""
    def rules(functions: tuple[Function, ...], terms: Terms) -> list[str]:
        shapes = [call_object_schema(f, arguments_key) for f in functions]
        schema = shapes[0] if len(shapes) == 1 else {"anyOf": shapes}
        return [f"call: {before} {terms.json(schema)} {after}"]
    return rules


def per_function_rules(write_call):
    """call: one alternative per function, `write_call(function, terms, index)` -> (its
    expression, helper rules)."""
    def rules(functions: tuple[Function, ...], terms: Terms) -> list[str]:
        alternatives, helpers = [], []
        for i, function in enumerate(functions):
            expression, more = write_call(function, terms, i)
            alternatives.append(expression)
            helpers += more
        return ["call: " + " | ".join(alternatives), *helpers]
    return rules


def ordered_fields(prefix: str, function: Function, field, separator: str | None,
                   ) -> tuple[str, list[str]]:
    """The function's properties in schema order as Lark rules: `field(key, schema)` is one
    written; `separator` (a Lark expression) between written ones, or None when each field
    closes itself. Returns (the first rule's name, the rules)."""
    parameters = function.parameters
    properties = list((parameters.get("properties") or {}).items())
    required = set(parameters.get("required") or [])
    rules = []
    for i, (key, schema) in enumerate(properties):
        rules.append(f"{prefix}_f{i}: {field(key, schema if isinstance(schema, dict) else {})}")
    n = len(properties)
    # seq_i: fields i.. with none before them; rest_i: fields i.. after one already written.
    for i in range(n, -1, -1):
        if i == n:
            rules += [f'{prefix}_seq{i}: ""', f'{prefix}_rest{i}: ""']
            continue
        this, needed = f"{prefix}_f{i}", properties[i][0] in required
        lead = f"{separator} {this}" if separator is not None else this
        if needed:
            rules.append(f"{prefix}_seq{i}: {this} {prefix}_rest{i + 1}")
            rules.append(f"{prefix}_rest{i}: {lead} {prefix}_rest{i + 1}")
        else:
            rules.append(f"{prefix}_seq{i}: {this} {prefix}_rest{i + 1} | {prefix}_seq{i + 1}")
            rules.append(f"{prefix}_rest{i}: ({lead})? {prefix}_rest{i + 1}")
    return f"{prefix}_seq0", rules


def python_call(function: Function, terms: Terms, index: int) -> tuple[str, list[str]]:
    """name(key=value, ...), values as JSON (which the Python-call reader takes)."""
    first, rules = ordered_fields(f"fn{index}", function,
                                  lambda key, schema: f'{terms.text(key + "=")} {terms.json(schema)}',
                                  terms.text(", "))
    return f'{terms.text(function.name + "(")} {first} {terms.text(")")}', rules


# A string value of Qwen3-Coder's XML form and its closing tag, as one lexeme: any text
# without "</" (so it cannot run past the tag), then the tag.
_XML_TEXT_VALUE = r'/(?:[^<]|<[^\/])*\n<\/parameter>\n/'


def xml_call(function: Function, terms: Terms, index: int) -> tuple[str, list[str]]:
    def field(key: str, schema: dict) -> str:
        opening = terms.text(f"<parameter={key}>\n")
        closing = terms.text("\n</parameter>\n")
        choices = schema.get("enum", [schema["const"]] if "const" in schema else None)
        if choices and all(isinstance(c, str) for c in choices):  # the values as text
            return f'{opening} ({" | ".join(terms.text(c) for c in choices)}) {closing}'
        if schema.get("type") == "string":
            return f"{opening} XMLTEXT{index}"
        return f"{opening} {terms.json(schema)} {closing}"

    first, rules = ordered_fields(f"fn{index}", function, field, None)
    rules.append(f"XMLTEXT{index}: {_XML_TEXT_VALUE}")
    return (f'{terms.text(f"<function={function.name}>" + chr(10))} {first} '
            f'{terms.text("</function>" + chr(10))}', rules)
