"""Tool calls without a model: tools and tool_choice checked, the call syntax chosen from the
chat template, the model's text parsed back into calls as it streams, forced choices turned
into grammars that the real tokenizer's matcher follows."""
import json

import pytest

from pagedllm.tool_calls.prompt import template_inputs
from pagedllm.tool_calls.spec import ToolChoice, ToolError, parse_tool_choice, parse_tools
from pagedllm.tool_calls.syntax import HERMES, LLAMA3_JSON, template_tools

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string"},
                                  "unit": {"enum": ["c", "f"]}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "additionalProperties": False}}}
FUNCTIONS = parse_tools([WEATHER, TIME])


def test_tools_and_choices_parse():
    assert [f.name for f in FUNCTIONS] == ["get_weather", "get_time"]
    assert FUNCTIONS[0].as_tool() == WEATHER
    bare = parse_tools([{"type": "function", "function": {"name": "ping"}}])
    assert bare[0].parameters == {"type": "object", "properties": {}}
    assert parse_tools(None) == () and parse_tools([]) == ()
    assert parse_tool_choice(None, FUNCTIONS) == ToolChoice("auto")
    assert parse_tool_choice(None, ()) == ToolChoice("none")
    assert parse_tool_choice("required", FUNCTIONS).forced
    named = parse_tool_choice({"type": "function", "function": {"name": "get_time"}}, FUNCTIONS)
    assert named == ToolChoice("named", "get_time") and named.forced
    assert not parse_tool_choice("auto", FUNCTIONS).forced


@pytest.mark.parametrize("tools, param", [
    ({"a": 1}, "tools"),
    (["get_weather"], "tools[0]"),
    ([{"type": "retrieval"}], "tools[0]"),
    ([{"type": "function"}], "tools[0].function"),
    ([{"type": "function", "function": {"name": "has space"}}], "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "x" * 65}}], "tools[0].function.name"),
    ([WEATHER, WEATHER], "tools[1].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": "{}"}}],
     "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
     "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "description": 3}}],
     "tools[0].function.description"),
])
def test_bad_tools_name_their_field(tools, param):
    with pytest.raises(ToolError) as info:
        parse_tools(tools)
    assert info.value.param == param


@pytest.mark.parametrize("choice, functions, words", [
    ("sometimes", FUNCTIONS, "unknown value"),
    ("required", (), "needs tools"),
    ({"type": "function", "function": {"name": "nope"}}, FUNCTIONS, "not in tools"),
    ({"type": "function"}, FUNCTIONS, "must be a string"),
    (3, FUNCTIONS, "must be a string"),
])
def test_bad_tool_choices_are_refused(choice, functions, words):
    with pytest.raises(ToolError) as info:
        parse_tool_choice(choice, functions)
    assert info.value.param == "tool_choice" and words in str(info.value)


# -- parsing the model's text ----------------------------------------------------------------

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _feed_in_pieces(parser, text, size):
    content, calls = "", []
    for i in range(0, len(text), size):
        c, k = parser.feed(text[i:i + size])
        content, calls = content + c, calls + k
    c, k = parser.finish()
    return content + c, calls + k


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_hermes_calls_are_found_whatever_the_pieces(size):
    text = f"Let me check.\n{CALL}\n{CALL.replace('Paris', 'Oslo')}"
    content, calls = _feed_in_pieces(HERMES.new_parser(FUNCTIONS), text, size)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})]
    assert calls[0].id.startswith("call_") and calls[0].id != calls[1].id


def test_hermes_text_without_calls_streams_unchanged_and_held_back_tags_come_out():
    text = "a <b> and <tool but no call, 2 < 3 "
    content, calls = _feed_in_pieces(HERMES.new_parser(FUNCTIONS), text, 2)
    assert content == text and calls == []
    parser = HERMES.new_parser(FUNCTIONS)
    assert parser.feed("Hi <tool_ca") == ("Hi", [])  # the tag's start is held back


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "unknown", "arguments": {}}\n</tool_call>',  # not an offered function
    '<tool_call>\n{"name": "get_weather", "arguments": [1]}\n</tool_call>',
    '<tool_call>\nnot json\n</tool_call>',
    '<tool_call>\n{"name": "get_weather", "argu',  # cut off
])
def test_hermes_text_that_is_not_a_valid_call_stays_content(text):
    content, calls = _feed_in_pieces(HERMES.new_parser(FUNCTIONS), text, 5)
    assert calls == [] and content == text


def test_hermes_unclosed_call_that_parses_counts_and_string_arguments_are_read():
    content, calls = _feed_in_pieces(HERMES.new_parser(FUNCTIONS), CALL.removesuffix("\n</tool_call>"), 4)
    assert content == "" and calls[0].name == "get_weather"
    text = '<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}</tool_call>'
    _, calls = _feed_in_pieces(HERMES.new_parser(FUNCTIONS), text, 4)
    assert json.loads(calls[0].arguments) == {"zone": "UTC"}


def test_llama3_json_calls_and_plain_text():
    text = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; '
            '{"name": "get_time", "parameters": {}}')
    content, calls = _feed_in_pieces(LLAMA3_JSON.new_parser(FUNCTIONS), text, 3)
    assert content == "" and [c.name for c in calls] == ["get_weather", "get_time"]
    plain = "It is sunny {probably}."
    assert _feed_in_pieces(LLAMA3_JSON.new_parser(FUNCTIONS), plain, 3) == (plain, [])
    broken = '{"name": "get_weather", "parameters": {"city": '
    assert _feed_in_pieces(LLAMA3_JSON.new_parser(FUNCTIONS), broken, 3) == (broken, [])


# -- templates -------------------------------------------------------------------------------

QWEN_LIKE = ("{% if tools %}{% for t in tools %}{{ t | tojson }}{% endfor %}{% endif %}"
             "{% for m in messages %}{{ m.role }}: {{ m.content }}"
             "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.arguments | tojson }}"
             "</tool_call>{% endfor %}\n{% endfor %}")
LLAMA_LIKE = "{% if tools %}ipython {{ tools | length }}{% endif %}<|python_tag|>"
PLAIN = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"


def test_the_syntax_follows_the_template():
    assert template_tools(QWEN_LIKE).renders_tools and template_tools(QWEN_LIKE).syntax is HERMES
    assert template_tools(LLAMA_LIKE).syntax is LLAMA3_JSON
    assert not template_tools(PLAIN).renders_tools and template_tools(PLAIN).syntax is HERMES
    assert not template_tools(None).renders_tools


HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "name": "get_weather", "arguments": {"city": "Paris"}}]},
    {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_1"},
]


def test_a_template_without_tools_gets_them_as_text():
    messages, tools = template_inputs(HISTORY, FUNCTIONS, ToolChoice("auto"), template_tools(PLAIN))
    assert tools is None
    assert messages[0]["role"] == "system" and "<tools>" in messages[0]["content"]
    assert json.dumps(WEATHER) in messages[0]["content"]
    assert messages[2] == {"role": "assistant", "content": CALL}
    assert messages[3] == {"role": "user", "content": '<tool_response>\n{"temp": 21}\n</tool_response>'}
    with_system, _ = template_inputs([{"role": "system", "content": "Be brief."}, *HISTORY],
                                     FUNCTIONS, ToolChoice("auto"), template_tools(PLAIN))
    assert with_system[0]["content"].startswith("Be brief.\n\n# Tools")
    none, _ = template_inputs(HISTORY[:1], FUNCTIONS, ToolChoice("none"), template_tools(PLAIN))
    assert none == HISTORY[:1]  # tool_choice "none": the tools stay out of the prompt


def test_a_template_with_tools_gets_hugging_face_shapes():
    messages, tools = template_inputs(HISTORY, FUNCTIONS, ToolChoice("auto"),
                                      template_tools(QWEN_LIKE))
    assert tools == [WEATHER, TIME]
    assert messages[1]["tool_calls"] == [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Paris"}}}]
    assert messages[2]["tool_call_id"] == "call_1"


# -- forced choices as grammars, followed by the real tokenizer's matcher ---------------------

@pytest.fixture(scope="module")
def compiler():
    from pagedllm.structured.compiler import GrammarCompiler
    from pagedllm.tokenizer import Tokenizer
    from pagedllm.weights import default_model_path

    tokenizer = Tokenizer.from_model_path(default_model_path())
    return GrammarCompiler(tokenizer, tokenizer.vocab_size), tokenizer


def _accepts(compiler, spec, text):
    compiled, tokenizer = compiler
    matcher = compiled.matcher(spec)._matcher
    for token in tokenizer.encode(text, add_special_tokens=False):
        if not matcher.consume_token(token):
            return False
    return matcher.is_accepting()


@pytest.mark.parametrize("syntax", [HERMES, LLAMA3_JSON])
def test_forced_grammars_accept_calls_and_nothing_else(compiler, syntax):
    one = syntax.render_call("get_weather", {"city": "Paris"})
    two = syntax.write([("get_weather", {"city": "Paris"}), ("get_time", {"zone": "UTC"})])
    required = syntax.grammar(FUNCTIONS, ToolChoice("required"), parallel=True)
    assert _accepts(compiler, required, one) and _accepts(compiler, required, two)
    single = syntax.grammar(FUNCTIONS, ToolChoice("required"), parallel=False)
    assert _accepts(compiler, single, one) and not _accepts(compiler, single, two)
    named = syntax.grammar(FUNCTIONS, ToolChoice("named", "get_time"), parallel=False)
    assert not _accepts(compiler, named, one)
    assert _accepts(compiler, named, syntax.render_call("get_time", {}))
    # arguments must follow the schema: `city` is required, `unit` an enum
    assert not _accepts(compiler, required, syntax.render_call("get_weather", {}))
    assert not _accepts(compiler, required, syntax.render_call(
        "get_weather", {"city": "Paris", "unit": "k"}))
    assert not _accepts(compiler, required, "Sure! " + one)
    # additionalProperties: false is honoured: get_time takes `zone` and nothing else
    assert not _accepts(compiler, named, syntax.render_call("get_time", {"zone": "UTC", "city": "x"}))


@pytest.mark.parametrize("size", [1, 5, 1000])
def test_a_call_the_token_limit_cut_is_not_shown_as_text(size):
    """An answer cut inside a call (finish_reason "length"): the complete calls before it
    count, the cut one is dropped rather than shown as raw syntax; without the cut, the
    unparsable text stays content (nothing the model wrote is lost)."""
    text = f"Checking.\n{CALL}\n" + CALL[:40]
    parser = HERMES.new_parser(FUNCTIONS)
    content, calls = "", []
    for i in range(0, len(text), size):
        c, k = parser.feed(text[i:i + size])
        content, calls = content + c, calls + k
    rest, more = parser.finish(cut=True)
    assert content + rest == "Checking." and len(calls + more) == 1
    assert "<tool_call>" not in content + rest
    kept, _ = _feed_in_pieces(HERMES.new_parser(FUNCTIONS), text, size)
    assert kept.endswith(CALL[:40])
    llama = LLAMA3_JSON.new_parser(FUNCTIONS)
    llama.feed('{"name": "get_weather", "parameters": {"ci')
    assert llama.finish(cut=True) == ("", [])
