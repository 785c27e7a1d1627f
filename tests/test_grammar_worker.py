"""A new grammar is compiled first in a child process: a grammar that crashes the library
kills the child, not this process, and is a GrammarError; so is one past the time limit; a
fresh child takes the next grammar. Compiled templates are cached within a byte bound.
The real tokenizer and grammar library; no model."""
import json

import pytest

from pagedllm.structured.compile_worker import CompileFailed
from pagedllm.structured.compiler import PARSER_LIMITS, GrammarCompiler
from pagedllm.structured.spec import GrammarError, GrammarSpec, json_schema_spec


@pytest.fixture(scope="module")
def tokenizer():
    from pagedllm.tokenizer import Tokenizer
    from pagedllm.weights import default_model_path

    return Tokenizer.from_model_path(default_model_path())


@pytest.fixture()
def compiler(tokenizer):
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, timeout_s=20.0)
    yield compiler
    compiler.worker.close()


def lark_chain(n: int) -> str:
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "x"\n'


def test_a_grammar_that_kills_its_compiler_kills_only_the_child(compiler):
    import llguidance

    deadly = llguidance.LLMatcher.grammar_from_lark(lark_chain(20_000))  # past the limits' check
    with pytest.raises(CompileFailed, match="crashed its compiler"):
        compiler.worker.validate(deadly)
    assert compiler.worker.replaced == 1
    # This process lives on, and a fresh child compiles the next grammar.
    compiler.compile(json_schema_spec({"type": "object"}, "response_format"))
    matcher = compiler.matcher(json_schema_spec({"type": "object"}, "response_format"))
    assert not matcher.failed


def test_a_grammar_past_the_time_limit_is_refused_and_its_child_replaced(tokenizer):
    slow = GrammarCompiler(tokenizer, tokenizer.vocab_size, timeout_s=0.05)
    schema = {"type": "object", "patternProperties": {
        f"^p{i}[a-z]*$": {"type": "integer"} for i in range(300)}}
    try:
        with pytest.raises(GrammarError, match="took more than") as info:
            slow.compile(json_schema_spec(schema, "response_format"))
        assert info.value.param == "response_format" and slow.worker.replaced == 1
    finally:
        slow.worker.close()


def test_the_crash_shapes_are_refused_before_any_compiler_runs(compiler):
    with pytest.raises(GrammarError, match="chain of more than"):
        compiler.compile(GrammarSpec("lark", lark_chain(3000), "guided_grammar"))
    assert compiler._worker is None  # refused by counting: no child was needed


def test_templates_are_cached_within_their_byte_bound(tokenizer):
    small = GrammarCompiler(tokenizer, tokenizer.vocab_size, cache_bytes=4000)
    try:
        specs = [json_schema_spec({"type": "object", "properties": {f"k{i}": {"type": "string"}},
                                   "required": [f"k{i}"]}, "response_format") for i in range(40)]
        for spec in specs:
            small.compile(spec)
            assert small.cached_bytes <= 4000
        assert 0 < len(small._templates) < 40  # the oldest went
        small.compile(specs[-1])  # the newest is still there: no child call
        copies = [small.matcher(specs[-1]) for _ in range(3)]  # each request its own walk
        copies[0].accept(tokenizer.encode('{"', add_special_tokens=False)[0])
        assert copies[1]._matcher is not copies[0]._matcher
    finally:
        small.worker.close()


def test_the_parser_limits_are_explicit():
    assert PARSER_LIMITS["step_lexer_fuel"] > 0 and PARSER_LIMITS["step_max_items"] > 0
    assert json.dumps(PARSER_LIMITS)  # plain data, also sent to the child
