"""A conversation with tools -> what the chat template renders.

Messages come in one shape from both APIs: {"role", "content": str, "tool_calls":
[{"id", "name", "arguments": dict}], "tool_call_id", "name"}. A template that knows tools
(Qwen's, Llama 3's) gets them as Hugging Face templates expect: `tools` as OpenAI tool dicts
and each call as {"type": "function", "function": {"name", "arguments": dict}}. A template
that does not (SmolLM2's) gets plain text: the tools in the system prompt, earlier calls
written in the syntax the answer is read in (Hermes' unless --tool-call-parser says), tool
results as user turns in <tool_response> tags (as Qwen's own template writes them).
"""
from __future__ import annotations

import json

from pagedllm.tool_calls.spec import Function, ToolChoice
from pagedllm.tool_calls.syntax import HERMES, TemplateTools, ToolSyntax

_SYSTEM_TOOLS = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

{how}"""
# Hermes' own words (the format Qwen's template writes), and the other syntaxes' example.
_HERMES_HOW = """For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call>"""
_OTHER_HOW = "To call functions, write the calls like this:\n"


def _tools_block(tools_text: str, syntax: ToolSyntax) -> str:
    """The tools and how to call them, in the syntax the answer is read in (Hermes' unless
    --tool-call-parser names another)."""
    how = _HERMES_HOW if syntax is HERMES else _OTHER_HOW + syntax.write(
        [("function_name", {"argument": "value"})])
    return _SYSTEM_TOOLS.format(tools=tools_text, how=how)


def template_inputs(messages: list[dict], functions: tuple[Function, ...], choice: ToolChoice,
                    template: TemplateTools) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) for Tokenizer.apply_chat_template. tool_choice "none" leaves the
    tools out of the prompt, so the model is not invited to call them."""
    offered = functions if choice.mode != "none" else ()
    if template.renders_tools:
        return [_hf_message(m) for m in messages], [f.as_tool() for f in offered] or None
    rendered = [_text_message(m, template) for m in messages]
    if offered:
        tools_text = "\n".join(json.dumps(f.as_tool(), ensure_ascii=False) for f in offered)
        block = _tools_block(tools_text, template.syntax)
        if rendered and rendered[0]["role"] == "system":
            rendered[0] = {**rendered[0], "content": f"{rendered[0]['content']}\n\n{block}"}
        else:
            rendered.insert(0, {"role": "system", "content": block})
    return rendered, None


def _hf_message(message: dict) -> dict:
    out = {"role": message["role"], "content": message.get("content") or ""}
    if message.get("tool_calls"):
        out["tool_calls"] = [{"id": c.get("id"), "type": "function",
                              "function": {"name": c["name"], "arguments": c["arguments"]}}
                             for c in message["tool_calls"]]
    for key in ("tool_call_id", "name", "reasoning_content"):
        if message.get(key):
            out[key] = message[key]
    return out


def _text_message(message: dict, template: TemplateTools) -> dict:
    content = message.get("content") or ""
    if message["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
    calls = message.get("tool_calls") or []
    if calls:
        written = template.syntax.write([(c["name"], c["arguments"]) for c in calls])
        content = f"{content}\n{written}" if content else written
    out = {"role": message["role"], "content": content}
    if message.get("reasoning_content"):  # the template decides whether to show it
        out["reasoning_content"] = message["reasoning_content"]
    return out
