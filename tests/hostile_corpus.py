"""Request bodies that once killed the server, froze it or got a 500 (generated here, not
stored as 88 KB literals): each is (name, route, body: a JSON value or raw bytes), and each
must now be a 4xx while the server goes on serving."""
from __future__ import annotations


def lark_chain(n: int) -> str:
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "x"\n'


def gbnf_chain(n: int) -> str:
    return "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(n)) + f'r{n} ::= "x"\n'


def ref_chain(n: int, nested: bool = False) -> dict:
    defs = {f"d{i}": ({"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}}
                      if nested else {"$ref": f"#/$defs/d{i + 1}"}) for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def nested_list(depth: int) -> str:
    return "[" * depth + "]" * depth


def chat(**fields) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}


def tool(parameters) -> list[dict]:
    return [{"type": "function", "function": {"name": "f", "parameters": parameters}}]


def corpus() -> list[tuple[str, str, dict]]:
    schema = ref_chain(2500)
    rows = [
        ("lark rule chain", "/v1/completions",
         {"prompt": "hi", "max_tokens": 4, "guided_grammar": lark_chain(3000)}),
        ("gbnf rule chain", "/v1/completions",
         {"prompt": "hi", "max_tokens": 4, "guided_grammar": gbnf_chain(5000)}),
        ("$ref chain as response_format", "/v1/chat/completions", chat(response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": schema}})),
        ("$ref chain as a tool's parameters", "/v1/chat/completions",
         chat(tools=tool(schema), tool_choice="auto")),
        ("$ref chain as Ollama's format", "/api/chat",
         {"model": "smollm2", "stream": False, "format": schema,
          "messages": [{"role": "user", "content": "hi"}]}),
        ("objects nested through $ref", "/v1/chat/completions", chat(response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": ref_chain(1000, True)}})),
        ("counted regex inside a counted group", "/v1/completions",
         {"prompt": "hi", "max_tokens": 5, "n": 16, "guided_regex": "(a{1000}){1000}"}),
        ("guided_json text nested 1,000 deep", "/v1/completions",
         {"prompt": "hi", "max_tokens": 4, "guided_json": nested_list(1000)}),
        ("tool call arguments nested 1,000 deep", "/v1/chat/completions",
         {"max_tokens": 4, "messages": [
             {"role": "assistant", "content": None, "tool_calls": [{
                 "id": "c1", "type": "function",
                 "function": {"name": "f", "arguments": nested_list(1000)}}]},
             {"role": "user", "content": "hi"}]}),
    ]
    # Raw JSON text (no client library would encode it): a lone surrogate 990 levels down.
    deep_body = ('{"x":' * 990 + '{"prompt": "\\ud800"}' + "}" * 990).encode()
    rows.append(("a body nested 990 deep", "/v1/completions", deep_body))
    rows.append(("an Ollama body nested 2,000 deep", "/api/generate", nested_list(2000).encode()))
    return rows
