"""Each family's call text -> calls of the offered functions, or None when the text is not
calls (it then stays content: nothing the model wrote is lost).

A body is what a syntax's markers enclose (tool_calls/syntax.py says which markers):
- JSON objects {"name", "arguments" | "parameters"}, alone, `;`-joined or in a list
  (Hermes, Llama 3 JSON, Phi-4-mini, Mistral before v11);
- Mistral v11+: `name[ARGS]{...}`, one after each `[TOOL_CALLS]`;
- DeepSeek V3/R1: `<｜tool▁call▁begin｜>function<｜tool▁sep｜>name` and the arguments in a
  fenced json block, V3.1: `name<｜tool▁sep｜>{...}`, each closed by `<｜tool▁call▁end｜>`;
- Qwen3-Coder: `<function=name><parameter=key>value</parameter></function>`, values as text,
  read by the parameter's schema type;
- Python calls (Llama 3.2/4's pythonic list, Gemma's tool_code block): `[f(a=1), g(b="x")]`,
  literals only (never evaluated: read from the syntax tree).
"""
from __future__ import annotations

import ast
import json
import re

from pagedllm.tool_calls.spec import Function, ToolCall

Functions = dict[str, Function]
# What a model's text may make a parser raise: not JSON, or nested past Python's stack.
NOT_JSON = (json.JSONDecodeError, RecursionError)


def call_of(name, arguments, functions: Functions) -> ToolCall | None:
    """A call of an offered function with an object of arguments (a JSON string of one is
    read: some models write it so), else None."""
    if name not in functions:
        return None
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except NOT_JSON:
            return None
    return ToolCall.new(name, arguments) if isinstance(arguments, dict) else None


def _object_call(obj, functions: Functions) -> ToolCall | None:
    if not isinstance(obj, dict):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    return call_of(obj.get("name"), arguments, functions)


def json_object(body: str, functions: Functions) -> list[ToolCall] | None:
    """One call as one JSON object (Hermes' <tool_call> block)."""
    try:
        call = _object_call(json.loads(body.strip()), functions)
    except NOT_JSON:
        return None
    return [call] if call is not None else None


def json_values(body: str, functions: Functions) -> list[ToolCall] | None:
    """Calls as JSON objects or lists of them, one after another (`;`, `,` or space between):
    every value must be a call."""
    decoder, calls, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(body) and body[at] in " \t\r\n;,":
            at += 1
        if at == len(body):
            return calls or None
        try:
            value, at = decoder.raw_decode(body, at)
        except NOT_JSON:
            return None
        for obj in value if isinstance(value, list) else [value]:
            call = _object_call(obj, functions)
            if call is None:
                return None
            calls.append(call)


MISTRAL_CALLS, MISTRAL_ARGS, MISTRAL_CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"


def mistral(body: str, functions: Functions) -> list[ToolCall] | None:
    """What follows the first [TOOL_CALLS]: a JSON list (v3), or `name[ARGS]{...}` with
    [TOOL_CALLS] again before each further call (v11+; `[CALL_ID]id` may come between)."""
    if body.lstrip()[:1] in ("[", "{"):
        return json_values(body, functions)
    calls = []
    for part in body.split(MISTRAL_CALLS):
        if not part.strip():
            continue
        name, args_marker, arguments = part.partition(MISTRAL_ARGS)
        name = name.partition(MISTRAL_CALL_ID)[0].strip()
        if not args_marker:
            return None
        try:
            value, end = json.JSONDecoder().raw_decode(arguments.strip())
        except NOT_JSON:
            return None
        call = call_of(name, value, functions)
        if call is None or arguments.strip()[end:].strip():
            return None
        calls.append(call)
    return calls or None


DEEPSEEK_CALL_BEGIN, DEEPSEEK_SEP, DEEPSEEK_CALL_END = (
    "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>")


def deepseek(body: str, functions: Functions) -> list[ToolCall] | None:
    """Between <｜tool▁calls▁begin｜> and its end: one block per call (a last one left open
    at the end of the answer still counts when it parses)."""
    calls = []
    for part in body.split(DEEPSEEK_CALL_BEGIN)[1:]:
        part = part.split(DEEPSEEK_CALL_END)[0]
        head, sep, rest = part.partition(DEEPSEEK_SEP)
        if not sep:
            return None
        if head.strip() == "function":  # V3/R1: the name, a newline, fenced JSON
            name, _, arguments = rest.partition("\n")
            arguments = _unfenced(arguments)
        else:  # V3.1: name<｜tool▁sep｜>{...}
            name, arguments = head, rest
        call = call_of(name.strip(), arguments.strip(), functions)
        if call is None:
            return None
        calls.append(call)
    return calls or None


def _unfenced(text: str) -> str:
    """A fenced ```json block's inside (string operations: a regex with lazy and greedy
    spaces around it backtracked quadratically on a long run of a model's whitespace)."""
    text = text.strip()
    if text.startswith("```") and text.endswith("```") and len(text) >= 6:
        text = text[3:-3].removeprefix("json")
    return text.strip()


_XML_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.S)
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.S)


def qwen3_coder(body: str, functions: Functions) -> list[ToolCall] | None:
    """One call in Qwen3-Coder's XML form; each value read as its schema's type says
    (text for strings, JSON for the rest where it parses)."""
    found = _XML_FUNCTION.search(body)
    if found is None or body[:found.start()].strip():
        return None
    name = found.group(1).strip()
    if name not in functions:
        return None
    properties = functions[name].parameters.get("properties") or {}
    arguments = {}
    for key, raw in _XML_PARAMETER.findall(found.group(2)):
        key = key.strip()
        arguments[key] = _xml_value(raw.removeprefix("\n").removesuffix("\n"),
                                    properties.get(key) or {})
    return [ToolCall.new(name, arguments)]


def _xml_value(text: str, schema: dict):
    if schema.get("type") == "string":
        return text
    try:  # numbers, booleans, objects, lists; text where it is not JSON
        return json.loads(text)
    except NOT_JSON:
        return text


PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
_NAMED_LITERALS = {"True": True, "False": False, "None": None,
                   "true": True, "false": False, "null": None}


def python_calls(body: str, functions: Functions) -> list[ToolCall] | None:
    """Calls written as Python: a list of calls, or calls one per line (Gemma's tool_code
    block); keyword arguments with literal values only."""
    text = body.strip().removeprefix(PYTHON_START).removesuffix(PYTHON_END).strip()
    try:  # a model's text may nest without end: too deep is not a call
        tree = ast.parse(text, mode="exec")
        return _python_statements(tree, functions)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def _python_statements(tree, functions: Functions) -> list[ToolCall] | None:
    nodes = []
    for statement in tree.body:
        if not isinstance(statement, ast.Expr):
            return None
        value = statement.value
        nodes += value.elts if isinstance(value, (ast.List, ast.Tuple)) else [value]
    calls = []
    for node in nodes:
        call = _python_call(node, functions)
        if call is None:
            return None
        calls.append(call)
    return calls or None


def _python_call(node, functions: Functions) -> ToolCall | None:
    if not isinstance(node, ast.Call) or node.args:
        return None
    name = _dotted_name(node.func)
    try:
        arguments = {k.arg: _literal(k.value) for k in node.keywords}
    except ValueError:
        return None
    if None in arguments:  # **kwargs
        return None
    return call_of(name, arguments, functions)


def _dotted_name(node) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted_name(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _literal(node):
    """A literal's value: constants, lists, tuples, dicts, negative numbers and JSON's
    true/false/null as well as Python's names for them."""
    if isinstance(node, ast.Constant) and not isinstance(node.value, (bytes, complex)):
        return node.value
    if isinstance(node, ast.Name) and node.id in _NAMED_LITERALS:
        return _NAMED_LITERALS[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict) and None not in node.keys:
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values)}
    if (isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd))
            and isinstance(node.operand, ast.Constant)
            and isinstance(node.operand.value, (int, float))):
        return -node.operand.value if isinstance(node.op, ast.USub) else node.operand.value
    raise ValueError("not a literal")
