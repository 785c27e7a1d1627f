"""Every family's tool-call syntax without a model: chosen from its chat template (or by
--tool-call-parser), its calls read back as the models write them, fed in pieces of any
size and token by token through a vocabulary where its markers are special tokens; text that
is not a call stays content; a forced choice's grammar accepts the family's calls (markers as
special tokens) and nothing else."""
import json

import pytest

from family_templates import FAMILY_SPECIAL_TOKENS, LLAMA4_PYTHONIC, TOOL_TEMPLATES
from pagedllm.tool_calls.spec import ToolChoice, parse_tools
from pagedllm.tool_calls.syntax import SYNTAXES, template_tools

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "required": ["city"],
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                   "unit": {"enum": ["c", "f"]}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}},
    "additionalProperties": False}}}
FUNCTIONS = parse_tools([WEATHER, TIME])
CALLS = [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"zone": "UTC"})]

# What each family's models write (the forms their own parsers read), and the calls in it.
WRITTEN = {
    "mistral": '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
               '{"name": "get_time", "arguments": {"zone": "UTC"}}]',
    "mistral_v11": '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}'
                   '[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{"zone": "UTC"}',
    "deepseek_v3": '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n'
                   '```json\n{"city": "Paris", "days": 3}\n```<｜tool▁call▁end｜>\n'
                   '<｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"zone": "UTC"}'  # V3.1's form
                   '<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "phi4_mini_json": '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", '
                      '"days": 3}}, {"name": "get_time", "arguments": {"zone": "UTC"}}]<|/tool_call|>',
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                   "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
                   "<function=get_time>\n<parameter=zone>\nUTC\n</parameter>\n</function>\n"
                   "</tool_call>",
    "pythonic": "[get_weather(city='Paris', days=3), get_time(zone=\"UTC\")]",
    "gemma": '```tool_code\nget_weather(city="Paris", days=3)\nget_time(zone="UTC")\n```',
    "llama3_json": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", '
                   '"days": 3}}; {"name": "get_time", "parameters": {"zone": "UTC"}}',
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
              '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n'
              '</tool_call>',
}


def _read(parser, pieces, cut=False):
    content, calls = "", []
    for piece in pieces:
        c, k = parser.feed(piece)
        content, calls = content + c, calls + k
    c, k = parser.finish(cut)
    return content + c, [(call.name, json.loads(call.arguments)) for call in calls + k]


def _pieces(text, size):
    return [text[i:i + size] for i in range(0, len(text), size)]


@pytest.fixture(scope="module")
def family_tokenizer(tmp_path_factory):
    """A vocabulary where every family's markers are special tokens (as in the real ones)."""
    from tiny_models import tiny_hf_model, write_hf_folder
    from pagedllm.tokenizer import Tokenizer

    folder = tmp_path_factory.mktemp("family-vocab")
    write_hf_folder(tiny_hf_model(vocab_size=288), folder, FAMILY_SPECIAL_TOKENS)
    return Tokenizer.from_folder(str(folder), eos_token_ids=[256])


def test_auto_chooses_each_familys_syntax_from_its_template():
    for name, template in TOOL_TEMPLATES.items():
        chosen = template_tools(template)
        assert chosen.renders_tools and chosen.syntax.name == name, name
    assert template_tools(LLAMA4_PYTHONIC).syntax.name == "pythonic"
    # --tool-call-parser overrides the template; a template without tools gets Hermes
    assert template_tools(TOOL_TEMPLATES["gemma"], "mistral").syntax.name == "mistral"
    assert template_tools("{{ messages }}").syntax.name == "hermes"
    assert template_tools("{{ messages }}", "pythonic").syntax.name == "pythonic"
    with pytest.raises(ValueError, match="unknown tool-call parser 'mistal'"):
        template_tools(None, "mistal")


@pytest.mark.parametrize("name", sorted(WRITTEN))
@pytest.mark.parametrize("size", [1, 4, 10_000])
def test_each_familys_calls_are_read_whatever_the_pieces(name, size):
    syntax = SYNTAXES[name]
    before = "" if syntax.leads else "Let me look that up. "
    content, calls = _read(syntax.new_parser(FUNCTIONS), _pieces(before + WRITTEN[name], size))
    assert calls == CALLS and content == before.rstrip()


@pytest.mark.parametrize("name", sorted(SYNTAXES))
def test_what_each_syntax_writes_it_reads_back(name):
    syntax = SYNTAXES[name]
    arguments = {"city": "Zürich\n\"old town\"", "days": -2, "unit": "c"}
    calls = [("get_weather", arguments), ("get_time", {})]
    assert _read(syntax.new_parser(FUNCTIONS), [syntax.write(calls)])[1] == calls


@pytest.mark.parametrize("name", sorted(WRITTEN))
def test_the_markers_survive_detokenizing_token_by_token_as_special_tokens(name, family_tokenizer):
    """The markers are special tokens here: kept in the text (skip_special_tokens drops every
    other one), read by the parser one token at a time."""
    tok = family_tokenizer
    syntax = SYNTAXES[name]
    kept = tok.special_token_ids(syntax.markers)
    if name in ("mistral", "mistral_v11", "deepseek_v3", "phi4_mini_json", "llama3_json"):
        assert kept  # these families' markers are special tokens
    ids = tok.encode(WRITTEN[name] + "<|im_end|>", add_special_tokens=False)
    detokenizer = tok.new_detokenizer((), True, tuple(kept.values()))
    pieces = [detokenizer.step(t) for t in ids]
    assert "".join(pieces) == WRITTEN[name]  # <|im_end|>, not kept, is skipped
    assert _read(syntax.new_parser(FUNCTIONS), pieces)[1] == CALLS
    plain = tok.new_detokenizer((), True)  # without them, those markers would be lost
    markers_written = any(marker in WRITTEN[name] for marker in kept)
    assert ("".join(plain.step(t) for t in ids) != WRITTEN[name]) == markers_written


@pytest.mark.parametrize("name,text", [
    ("pythonic", "[1] The weather is fine."),
    ("pythonic", "[get_weather(city=open('/etc/passwd'))]"),  # not a literal: never run
    ("pythonic", "[unknown(x=1)]"),
    ("gemma", "Here:\n```tool_code\nprint('hi')\n```"),
    ("mistral", "[TOOL_CALLS] [{\"name\": \"nope\", \"arguments\": {}}]"),
    ("mistral_v11", "[TOOL_CALLS]get_weather{\"city\": \"Paris\"}"),  # no [ARGS]
    ("deepseek_v3", "<｜tool▁calls▁begin｜>garbage<｜tool▁calls▁end｜>"),
    ("phi4_mini_json", "<|tool_call|>[{\"name\": \"get_weather\", \"arguments\": 7}]<|/tool_call|>"),
    ("qwen3_coder", "<tool_call>\n<function=launch>\n</function>\n</tool_call>"),
])
def test_text_that_is_not_a_call_stays_content(name, text):
    for size in (1, 1000):
        content, calls = _read(SYNTAXES[name].new_parser(FUNCTIONS), _pieces(text, size))
        assert calls == [] and content == text


def test_a_call_cut_by_the_token_limit_is_dropped_not_shown():
    for name in ("mistral_v11", "deepseek_v3", "qwen3_coder", "pythonic", "gemma"):
        text = "Sure. " + WRITTEN[name][:30] if not SYNTAXES[name].leads else WRITTEN[name][:30]
        content, calls = _read(SYNTAXES[name].new_parser(FUNCTIONS), [text], cut=True)
        assert calls == [] and content in ("", "Sure."), name


def test_qwen3_coder_values_follow_the_parameter_types():
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n"
            "<parameter=days>\n5\n</parameter>\n<parameter=unit>\nf\n</parameter>\n"
            "</function>\n</tool_call>")
    _, calls = _read(SYNTAXES["qwen3_coder"].new_parser(FUNCTIONS), [text])
    assert calls == [("get_weather", {"city": "42", "days": 5, "unit": "f"})]


# -- forced choices: the family's syntax, markers as special tokens -------------------------

@pytest.fixture(scope="module")
def family_compiler(family_tokenizer):
    from pagedllm.structured.compiler import GrammarCompiler

    compiler = GrammarCompiler(family_tokenizer, 288)
    compiler.validate_in_child = False  # no child process: these grammars are the suite's own
    return compiler


def _accepts(compiler, tokenizer, spec, text):
    matcher = compiler.matcher(spec)._matcher
    for token in tokenizer.encode(text, add_special_tokens=False):
        if not matcher.consume_token(token):
            return False
    return matcher.is_accepting()


@pytest.mark.parametrize("name", sorted(SYNTAXES))
def test_forced_grammars_accept_the_familys_calls_and_nothing_else(name, family_tokenizer,
                                                                  family_compiler):
    syntax, tok = SYNTAXES[name], family_tokenizer
    special = tok.special_token_ids(syntax.markers)

    def accepts(choice, parallel, calls, before=""):
        spec = syntax.grammar(FUNCTIONS, choice, parallel, special)
        return _accepts(family_compiler, tok, spec, before + syntax.write(calls))

    required = ToolChoice("required")
    assert accepts(required, True, CALLS) and accepts(required, False, CALLS[:1])
    assert not accepts(required, False, CALLS)  # one call only
    assert accepts(ToolChoice("named", "get_time"), False, [("get_time", {})])
    assert not accepts(ToolChoice("named", "get_time"), False, CALLS[:1])
    assert not accepts(required, True, [("get_weather", {"days": 1})])  # city is required
    assert not accepts(required, True, [("get_weather", {"city": "x", "unit": "k"})])
    assert not accepts(required, True, CALLS, before="Sure! ")


def test_the_kept_markers_travel_to_an_engine_process():
    """The engine process's front end detokenizes from the request's parameters as sent."""
    from pagedllm.core.request import SamplingParams
    from pagedllm.engine import wire

    params = SamplingParams(max_tokens=5, kept_special_token_ids=(270, 271))
    sent = wire.AddRequest("r", [1, 2], params, [0], 5, "u", None, 0.0, False)
    received = wire.to_engine.decode(wire.encoder.encode(sent))
    assert received.params.kept_special_token_ids == (270, 271)


def test_a_template_without_tools_gets_them_in_the_syntax_named():
    """--tool-call-parser on a template that renders no tools: the system prompt shows that
    syntax, and earlier calls are written in it."""
    from pagedllm.tool_calls.prompt import template_inputs

    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "c1", "name": "get_weather", "arguments": {"city": "Oslo"}}]}]
    messages, tools = template_inputs(history, FUNCTIONS, ToolChoice("auto"),
                                      template_tools("{{ messages }}", "mistral_v11"))
    assert tools is None
    assert '[TOOL_CALLS]function_name[ARGS]{"argument": "value"}' in messages[0]["content"]
    assert messages[2]["content"] == '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}'


@pytest.mark.parametrize("name", sorted(WRITTEN))
def test_text_nested_past_the_stack_is_content_not_a_crash(name):
    """A model may write brackets without end: no parser raises, the text stays content."""
    syntax = SYNTAXES[name]
    deep = "[" * 50_000 + "{" * 50_000
    text = WRITTEN[name].replace('"Paris"', deep).replace("'Paris'", deep).replace(
        "\nParis\n", "\n" + '{"a": ' * 50_000 + "\n")
    content, calls = _read(syntax.new_parser(FUNCTIONS), [text])
    # the deep call is text (Qwen3-Coder's city, a string, takes the brackets as its value)
    assert len(calls) <= (2 if name == "qwen3_coder" else 1) and (calls or content)


def test_a_long_run_of_whitespace_is_read_in_linear_time():
    """Model text is untrusted: readers use no regex that backtracks on it (a fenced-JSON
    regex once did, quadratically, on a long run of spaces)."""
    import time

    from pagedllm.tool_calls import bodies

    functions = {f.name: f for f in FUNCTIONS}
    spaces = " " * 300_000
    started = time.process_time()
    assert bodies.deepseek(bodies.DEEPSEEK_CALL_BEGIN + "function" + bodies.DEEPSEEK_SEP
                           + "get_time\n```json" + spaces, functions) is None
    assert bodies.qwen3_coder("<function=get_time>\n<parameter=zone>\n" + spaces, functions)
    # a bound no honest machine meets only if the reading were quadratic (~hours)
    assert time.process_time() - started < 60
