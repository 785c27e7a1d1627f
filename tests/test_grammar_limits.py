"""Grammar limits counted before compiling (structured/grammar_limits.py): the chains that
overflowed the grammar library's stack, and the counted regex that asked for a million
lexer states, are refused by name; real schemas and grammars pass. No model, no server."""
import json

import pytest
from hypothesis import given, settings, strategies as st

from pagedllm.structured.grammar_limits import (MAX_REPETITION, MAX_RULE_CHAIN, MAX_RULES,
                                                MAX_SCHEMA_DEPTH, check_limits)
from pagedllm.structured.spec import GrammarError, GrammarSpec, grammar_spec, json_schema_spec


def lark_chain(n: int) -> str:
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "x"\n'


def gbnf_chain(n: int) -> str:
    return "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(n)) + f'r{n} ::= "x"\n'


def ref_chain(n: int, nested: bool = False) -> dict:
    """$defs d0 -> d1 -> ... -> dn; nested: each an object whose property is the next."""
    defs = {f"d{i}": ({"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}}
                      if nested else {"$ref": f"#/$defs/d{i + 1}"}) for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def refused(spec: GrammarSpec) -> str:
    with pytest.raises(GrammarError) as info:
        check_limits(spec)
    assert info.value.param == spec.param
    return str(info.value)


def test_the_chains_that_crashed_the_process_are_refused_by_name():
    assert "chain of more than" in refused(GrammarSpec("lark", lark_chain(3000), "guided_grammar"))
    assert "chain of more than" in refused(grammar_spec(gbnf_chain(1000)))
    assert "$refs" in refused(json_schema_spec(ref_chain(2500), "response_format"))
    assert "$refs" in refused(json_schema_spec(ref_chain(1000, nested=True), "format"))
    assert "rules" in refused(grammar_spec(gbnf_chain(MAX_RULES + 10)))


def test_a_counted_repetition_inside_another_is_refused():
    assert "1,000,000" in refused(GrammarSpec("regex", "(a{1000}){1000}", "guided_regex"))
    assert "multiply" in refused(GrammarSpec("regex", "((ab){200}c){100}", "guided_regex"))


def test_a_schema_nested_past_the_limit_is_refused():
    schema = {"type": "string"}
    for _ in range(MAX_SCHEMA_DEPTH):
        schema = {"type": "object", "properties": {"a": schema}}
    assert "nests deeper" in refused(json_schema_spec(schema, "guided_json"))


def test_real_grammars_and_schemas_pass():
    check_limits(GrammarSpec("lark", lark_chain(MAX_RULE_CHAIN - 5), "guided_grammar"))
    check_limits(json_schema_spec(ref_chain(50, nested=True), "response_format"))
    recursive = {"type": "object", "properties": {"children": {"type": "array",
                                                                "items": {"$ref": "#"}}}}
    check_limits(json_schema_spec(recursive, "response_format"))  # recursion is no chain
    check_limits(GrammarSpec("regex", r"\d{3}-\d{4}[{(]x{2,5}(ab){3}", "guided_regex"))
    check_limits(GrammarSpec("regex", "a{%d}" % MAX_REPETITION, "guided_regex"))
    json_grammar = ('start: value\nvalue: obj | arr | STRING\nobj: "{" (pair ("," pair)*)? "}"\n'
                    'pair: STRING ":" value\narr: "[" (value ("," value)*)? "]"\n'
                    'STRING: /"[a-z]*"/\n')
    check_limits(GrammarSpec("lark", json_grammar, "guided_grammar"))


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(["lark", "gbnf", "refs", "nested"]), n=st.integers(1, 3000))
def test_any_chain_is_either_within_the_limit_or_refused(kind, n):
    """Never a crash, never a pass past the limit (the compiler is not reached here)."""
    spec = {"lark": lambda: GrammarSpec("lark", lark_chain(n), "guided_grammar"),
            "gbnf": lambda: grammar_spec(gbnf_chain(n)),
            "refs": lambda: json_schema_spec(ref_chain(n), "response_format"),
            "nested": lambda: json_schema_spec(ref_chain(n, nested=True), "format")}[kind]()
    chain = n + 2  # the start rule (or the root), the n links, the last rule
    if chain <= MAX_RULE_CHAIN:
        check_limits(spec)
    elif chain > MAX_RULE_CHAIN + 2:
        refused(spec)


def test_json_schema_given_as_deep_text_is_a_field_error_not_a_crash():
    deep = "[" * 5000 + "]" * 5000
    with pytest.raises(GrammarError) as info:
        json_schema_spec(deep, "guided_json")
    assert info.value.param == "guided_json"
    json.loads("[" * 10 + "]" * 10)  # (the check is of depth, not of JSON arrays as such)
