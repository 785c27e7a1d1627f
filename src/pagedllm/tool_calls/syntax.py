"""How a model writes tool calls, chosen from its chat template, and how a forced choice
("required", a named function) becomes a grammar in that syntax, so the arguments always
parse against the function's schema. The grammar is Lark for llguidance, with each call's
JSON given as a `%json` schema."""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache

import jinja2
import jinja2.meta

from pagedllm.structured.spec import GrammarSpec
from pagedllm.tool_calls.parser import HermesParser, Llama3JsonParser
from pagedllm.tool_calls.spec import Function, ToolChoice

# Call JSON exactly as json.dumps writes it (no free whitespace), as structured output does.
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class ToolSyntax:
    name: str  # "hermes" | "llama3_json"
    arguments_key: str  # "arguments" (Hermes) or "parameters" (Llama 3)
    call_open: str  # text before each call's JSON
    call_close: str  # text after it
    separator: str  # between parallel calls

    def new_parser(self, functions: tuple[Function, ...]):
        return (HermesParser if self.name == "hermes" else Llama3JsonParser)(functions)

    def render_call(self, name: str, arguments: dict) -> str:
        """One call as the model writes it (for the history of templates without tools)."""
        body = json.dumps({"name": name, self.arguments_key: arguments}, ensure_ascii=False)
        return f"{self.call_open}{body}{self.call_close}"

    def grammar(self, functions: tuple[Function, ...], choice: ToolChoice,
                parallel: bool) -> GrammarSpec:
        """The answer must be one call (or, with parallel calls, several) of the allowed
        functions, with arguments valid against their schemas."""
        allowed = [f for f in functions if choice.mode != "named" or f.name == choice.name]
        shapes = [{"type": "object", "additionalProperties": False,
                   "required": ["name", self.arguments_key],
                   "properties": {"name": {"const": f.name}, self.arguments_key: f.parameters}}
                  for f in allowed]
        schema = {**(shapes[0] if len(shapes) == 1 else {"anyOf": shapes}),
                  "x-guidance": _JSON_STYLE}
        call = f"{json.dumps(self.call_open)} %json {json.dumps(schema)} {json.dumps(self.call_close)}"
        start = f"call ({json.dumps(self.separator)} call)*" if parallel else "call"
        return GrammarSpec("lark", f"start: {start}\ncall: {call}\n", "tool_choice")


HERMES = ToolSyntax("hermes", "arguments", "<tool_call>\n", "\n</tool_call>", "\n")
LLAMA3_JSON = ToolSyntax("llama3_json", "parameters", "", "", "; ")


@dataclass(frozen=True)
class TemplateTools:
    """What a chat template does with tools: whether it renders them itself, and the syntax
    its model answers in."""

    renders_tools: bool
    syntax: ToolSyntax


@lru_cache(maxsize=8)
def template_tools(chat_template: str | None) -> TemplateTools:
    if not chat_template:
        return TemplateTools(False, HERMES)
    try:
        names = jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(chat_template))
    except jinja2.TemplateSyntaxError:
        names = set()
    if "tools" not in names:
        # pagedllm writes the tools into the system prompt in Hermes' syntax, which small
        # instruction models follow best and which the parser reads.
        return TemplateTools(False, HERMES)
    if "<tool_call>" in chat_template:
        return TemplateTools(True, HERMES)
    if "<|python_tag|>" in chat_template or "ipython" in chat_template:
        return TemplateTools(True, LLAMA3_JSON)
    return TemplateTools(True, HERMES)
