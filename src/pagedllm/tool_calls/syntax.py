"""How each model family writes tool calls: its markers, how its call text reads
(tool_calls/bodies.py), how a call is written back for the history of templates that know no
tools, and a forced choice's grammar (tool_calls/grammars.py). Chosen from the chat template
(`serve --tool-call-parser`, vLLM's option and names, overrides it)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable

import jinja2
import jinja2.meta

from pagedllm.structured.spec import GrammarSpec
from pagedllm.tool_calls import bodies, grammars
from pagedllm.tool_calls.grammars import Terms
from pagedllm.tool_calls.parser import LeadingCallsParser, MarkedCallsParser
from pagedllm.tool_calls.spec import Function, ToolCall, ToolChoice

Calls = list[tuple[str, dict]]


@dataclass(frozen=True)
class ToolSyntax:
    name: str
    body: Callable[[str, dict], list[ToolCall] | None]  # call text -> calls, or None
    write: Callable[[Calls], str]  # calls as the model writes them
    frame: Callable[[Terms], tuple[str, str, str]]  # grammar: before, between, after calls
    call_rules: Callable[[tuple[Function, ...], Terms], list[str]]  # grammar: `call`
    open: str = ""  # marked: the text before calls
    close: str = ""  # and after them ("": they run to the end of the answer)
    leads: tuple[str, ...] = ()  # leading: how an answer that is calls begins
    markers: tuple[str, ...] = field(default=())  # texts that may be special tokens

    def new_parser(self, functions: tuple[Function, ...]):
        if self.leads:
            return LeadingCallsParser(functions, self)
        return MarkedCallsParser(functions, self)

    def render_call(self, name: str, arguments: dict) -> str:
        return self.write([(name, arguments)])

    def grammar(self, functions: tuple[Function, ...], choice: ToolChoice, parallel: bool,
                special_ids: dict[str, int] | None = None) -> GrammarSpec:
        """special_ids: the markers that are one special token of the vocabulary."""
        terms = Terms(special_ids or {})
        allowed = tuple(f for f in functions if choice.mode != "named" or f.name == choice.name)
        before, between, after = self.frame(terms)
        calls = f"call ({between} call)*" if parallel else "call"
        start = f"start: {before} {calls} {after}"
        return GrammarSpec("lark", "\n".join([start, *self.call_rules(allowed, terms)]) + "\n",
                           "tool_choice")


def _json(value) -> str:
    return json.dumps(value, ensure_ascii=False)


def _objects(calls: Calls, key: str) -> list[str]:
    return [_json({"name": name, key: arguments}) for name, arguments in calls]


def _python(calls: Calls) -> list[str]:
    return [f"{name}({', '.join(f'{k}={_json(v)}' for k, v in arguments.items())})"
            for name, arguments in calls]


def _xml(calls: Calls) -> str:
    def value(v):
        return v if isinstance(v, str) else _json(v)
    return "\n".join(
        "<tool_call>\n<function=" + name + ">\n"
        + "".join(f"<parameter={k}>\n{value(v)}\n</parameter>\n" for k, v in arguments.items())
        + "</function>\n</tool_call>" for name, arguments in calls)


NONE = ('""', '""', '""')
DS = ("<｜tool▁calls▁begin｜>", bodies.DEEPSEEK_CALL_BEGIN, bodies.DEEPSEEK_SEP,
      bodies.DEEPSEEK_CALL_END, "<｜tool▁calls▁end｜>")


def _deepseek_call(function: Function, terms: Terms, index: int):
    return (f'{terms.marker(DS[1])} "function" {terms.marker(DS[2])} '
            f'{terms.text(function.name + chr(10) + "```json" + chr(10))} '
            f'{terms.json(function.parameters)} {terms.text(chr(10) + "```")} '
            f'{terms.marker(DS[3])}', [])


def _mistral_v11_call(function: Function, terms: Terms, index: int):
    return (f'{terms.marker(bodies.MISTRAL_CALLS)} {terms.text(function.name)} '
            f'{terms.marker(bodies.MISTRAL_ARGS)} {terms.json(function.parameters)}', [])


def _qwen3_coder_call(function: Function, terms: Terms, index: int):
    expression, rules = grammars.xml_call(function, terms, index)
    return (f'{terms.marker("<tool_call>")} "\\n" {expression} {terms.marker("</tool_call>")}',
            rules)


def _strip_tag(tag: str, body: Callable) -> Callable:
    return lambda text, functions: body(text.strip().removeprefix(tag), functions)


HERMES = ToolSyntax(
    "hermes", bodies.json_object,
    lambda calls: "\n".join(f"<tool_call>\n{c}\n</tool_call>" for c in _objects(calls, "arguments")),
    lambda t: ('""', '"\\n"', '""'),
    lambda fs, t: grammars.json_object_rules(
        "arguments", f'{t.marker("<tool_call>")} "\\n"', f'"\\n" {t.marker("</tool_call>")}')(fs, t),
    open="<tool_call>", close="</tool_call>", markers=("<tool_call>", "</tool_call>"))
LLAMA3_JSON = ToolSyntax(
    "llama3_json", _strip_tag("<|python_tag|>", bodies.json_values),
    lambda calls: "; ".join(_objects(calls, "parameters")),
    lambda t: ('""', '"; "', '""'), grammars.json_object_rules("parameters"),
    leads=("{", "<|python_tag|>"), markers=("<|python_tag|>",))
MISTRAL = ToolSyntax(  # v3 (Mistral 7B v0.3, Mixtral 8x22B): a JSON list
    "mistral", bodies.mistral,
    lambda calls: f"[TOOL_CALLS][{', '.join(_objects(calls, 'arguments'))}]",
    lambda t: (f'{t.marker(bodies.MISTRAL_CALLS)} "["', '", "', '"]"'),
    grammars.json_object_rules("arguments"),
    open=bodies.MISTRAL_CALLS,
    markers=(bodies.MISTRAL_CALLS, bodies.MISTRAL_ARGS, bodies.MISTRAL_CALL_ID))
MISTRAL_V11 = ToolSyntax(  # v11+ (Mistral Small 3.2, Magistral, Devstral): name[ARGS]{...}
    "mistral_v11", bodies.mistral,
    lambda calls: "".join(f"[TOOL_CALLS]{name}[ARGS]{_json(arguments)}" for name, arguments in calls),
    lambda t: NONE, grammars.per_function_rules(_mistral_v11_call),
    open=bodies.MISTRAL_CALLS, markers=MISTRAL.markers)
DEEPSEEK_V3 = ToolSyntax(  # DeepSeek V3 and the R1 distills' templates
    "deepseek_v3", bodies.deepseek,
    lambda calls: DS[0] + "\n".join(
        f"{DS[1]}function{DS[2]}{name}\n```json\n{_json(arguments)}\n```{DS[3]}"
        for name, arguments in calls) + DS[4],
    lambda t: (t.marker(DS[0]), '"\\n"', t.marker(DS[4])),
    grammars.per_function_rules(_deepseek_call),
    open=DS[0], close=DS[4], markers=DS)
PHI4_MINI_JSON = ToolSyntax(
    "phi4_mini_json", bodies.json_values,
    lambda calls: f"<|tool_call|>[{', '.join(_objects(calls, 'arguments'))}]<|/tool_call|>",
    lambda t: (f'{t.marker("<|tool_call|>")} "["', '", "', f'"]" {t.marker("<|/tool_call|>")}'),
    grammars.json_object_rules("arguments"),
    open="<|tool_call|>", close="<|/tool_call|>", markers=("<|tool_call|>", "<|/tool_call|>"))
QWEN3_CODER = ToolSyntax(
    "qwen3_coder", bodies.qwen3_coder, _xml,
    lambda t: ('""', '"\\n"', '""'), grammars.per_function_rules(_qwen3_coder_call),
    open="<tool_call>", close="</tool_call>", markers=("<tool_call>", "</tool_call>"))
PYTHONIC = ToolSyntax(  # Llama 3.2's and Llama 4's lists of Python calls
    "pythonic", bodies.python_calls,
    lambda calls: f"[{', '.join(_python(calls))}]",
    lambda t: ('"["', '", "', '"]"'), grammars.per_function_rules(grammars.python_call),
    leads=("[", bodies.PYTHON_START), markers=(bodies.PYTHON_START, bodies.PYTHON_END))
GEMMA = ToolSyntax(  # Gemma 3's function calling: Python calls in a tool_code block
    "gemma", bodies.python_calls,
    lambda calls: "```tool_code\n" + "\n".join(_python(calls)) + "\n```",
    lambda t: ('"```tool_code\\n"', '"\\n"', '"\\n```"'),
    grammars.per_function_rules(grammars.python_call),
    open="```tool_code", close="```")

SYNTAXES = {s.name: s for s in (HERMES, LLAMA3_JSON, MISTRAL, MISTRAL_V11, DEEPSEEK_V3,
                                PHI4_MINI_JSON, QWEN3_CODER, PYTHONIC, GEMMA)}
CHOICES = ("auto", *SYNTAXES)


@dataclass(frozen=True)
class TemplateTools:
    """What a chat template does with tools: whether it renders them itself, and the syntax
    its model answers in."""

    renders_tools: bool
    syntax: ToolSyntax


def syntax_in_template(chat_template: str) -> ToolSyntax:
    """The family whose call syntax the template writes (its history and instructions)."""
    t = chat_template
    if "[TOOL_CALLS]" in t:
        return MISTRAL_V11 if "[ARGS]" in t else MISTRAL
    if "tool▁call▁begin" in t or "tool▁calls▁begin" in t:
        return DEEPSEEK_V3
    if "<|tool_call|>" in t:
        return PHI4_MINI_JSON
    if "<function=" in t and "<parameter=" in t:
        return QWEN3_CODER
    if "<tool_call>" in t:
        return HERMES
    if "<|python_start|>" in t or "[func_name" in t:
        return PYTHONIC
    if "<|python_tag|>" in t or "ipython" in t:
        return LLAMA3_JSON
    if "tool_code" in t:
        return GEMMA
    return HERMES


@lru_cache(maxsize=16)
def template_tools(chat_template: str | None, option: str = "auto") -> TemplateTools:
    """option: `--tool-call-parser` (auto: the template's family; a template that renders no
    tools gets them from pagedllm in Hermes' syntax, which small instruction models follow
    best)."""
    if option not in CHOICES:
        raise ValueError(f"unknown tool-call parser {option!r}: choose one of {', '.join(CHOICES)}")
    renders = False
    if chat_template:
        try:
            names = jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(chat_template))
        except jinja2.TemplateSyntaxError:
            names = set()
        renders = "tools" in names
    if option != "auto":
        return TemplateTools(renders, SYNTAXES[option])
    return TemplateTools(renders, syntax_in_template(chat_template) if renders else HERMES)
