"""A chat request's conversation and tools -> prompt token ids, for both APIs (OpenAI's chat
completions and Ollama's /api/chat): tools checked, rendered the way the model's template
expects, a forced tool_choice turned into a grammar; and the tool-call parsing of the answer."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from typing import Any

from pagedllm.core.request import SamplingParams
from pagedllm.core.thinking import ThinkingControl
from pagedllm.core.output_budget import PromptTooLongError
from pagedllm.errors import FieldError
from pagedllm.reasoning.splitter import PromptThinking
from pagedllm.server.errors import APIError
from pagedllm.server.state import ServerState
from pagedllm.structured.spec import json_schema_spec
from pagedllm.tokenizer import ChatTemplateError, TokenLimitError
from pagedllm.tool_calls.prompt import template_inputs
from pagedllm.tool_calls.spec import Function, ToolChoice, parse_tool_choice, parse_tools
from pagedllm.tool_calls.syntax import TemplateTools


@dataclass(frozen=True)
class ToolUse:
    """The tools a request offered and how its answer is read back into calls."""

    functions: tuple[Function, ...]
    choice: ToolChoice
    template: TemplateTools
    tools_param: str = "tools"

    def new_parser(self):
        return self.template.syntax.new_parser(self.functions)



@dataclass(frozen=True)
class ChatPrompt:
    token_ids: list[int]
    tools: ToolUse | None  # None: no tools offered, or tool_choice "none"
    thinking: PromptThinking | None = None  # a reasoning model's: how its answer is split


def tool_use(state: ServerState, tools: Any, tool_choice: Any = None, tools_param: str = "tools",
             choice_param: str = "tool_choice") -> ToolUse:
    """Raises ToolError naming the field for a bad tool or tool_choice."""
    functions = parse_tools(tools, tools_param)
    choice = parse_tool_choice(tool_choice, functions, choice_param)
    return ToolUse(functions, choice, state.template_tools(), tools_param)


def render_chat(state: ServerState, messages: list[dict], use: ToolUse,
                add_generation_prompt: bool = True, continue_final: bool = False,
                template_options: dict | None = None) -> ChatPrompt:
    """continue_final: the last message is the assistant's start (prefill); the prompt ends
    with its text, so the answer continues it. template_options: more variables for the
    template (enable_thinking)."""
    tok = state.client.tokenizer
    text = chat_text(state, messages, use, add_generation_prompt, continue_final,
                     template_options)
    limit = state.client.info.max_model_len
    # The template writes special tokens as text; encode without adding BOS twice.
    try:
        ids = tok.encode_within(text, limit, add_special_tokens=False)
    except TokenLimitError as exc:  # refused before tokenizing all of it
        raise PromptTooLongError(exc.num_tokens, 0, limit, at_least=True,
                                 param="messages") from exc
    except ValueError as exc:  # not valid Unicode
        raise FieldError("messages", str(exc)) from exc
    offered = use.functions and use.choice.mode != "none"
    syntax = state.reasoning_syntax()
    thinking = PromptThinking(syntax, syntax.opened_by(text)) if syntax is not None else None
    return ChatPrompt(ids, use if offered else None, thinking)


def chat_text(state: ServerState, messages: list[dict], use: ToolUse,
              add_generation_prompt: bool = True, continue_final: bool = False,
              template_options: dict | None = None) -> str:
    """The conversation as the model's template renders it (what /apply-template shows)."""
    template_messages, tools = template_inputs(messages, use.functions, use.choice, use.template)
    try:
        text = state.client.tokenizer.apply_chat_template(
            template_messages, add_generation_prompt and not continue_final, tools=tools,
            **(template_options or {}))
    except ChatTemplateError as exc:
        raise FieldError("messages", str(exc)) from exc
    return cut_after_final(text, messages) if continue_final else text


def cut_after_final(text: str, messages: list[dict]) -> str:
    """The rendered conversation up to the end of the final assistant message's text: what
    the template closes it with (an end-of-turn token) is cut, as vLLM does."""
    last = messages[-1]
    final = last.get("content") or ""
    if last.get("role") != "assistant" or not final:
        raise FieldError("messages", "continuing the final message needs the conversation to "
                                     "end with an assistant message that has text")
    end = text.rfind(final)
    if end < 0:  # the template rewrote it (stripped it, say): try without outer spaces
        final = final.strip()
        end = text.rfind(final) if final else -1
    if end < 0:
        raise FieldError("messages", "the chat template does not keep the final assistant "
                                     "message's text as given, so it cannot be continued")
    return text[:end + len(final)]


async def prepare_chat(state: ServerState, messages: list[dict], params: SamplingParams, *,
                       tools=None, tool_choice=None, add_generation_prompt: bool = True,
                       continue_final: bool = False, parallel_tool_calls: bool = True,
                       template_options: dict | None = None,
                       thinking_budget: int | None = None) -> tuple[ChatPrompt, SamplingParams]:
    """A chat request's prompt and final sampling parameters, for every chat API: its tools
    read (ToolError names a bad one), the conversation rendered through the model's
    template, the offered functions' schemas compiled (cached; on a worker thread; tools
    that will not be used, tool_choice "none", are not), a forced call made a grammar, a
    reasoning model's thinking told to the engine (its budget: the request's, else the
    server's --reasoning-budget)."""
    prompt = render_chat(state, messages, tool_use(state, tools, tool_choice),
                         add_generation_prompt, continue_final, template_options)
    use = prompt.tools
    for i, function in enumerate(use.functions if use is not None else ()):
        spec = json_schema_spec(function.parameters, f"{use.tools_param}[{i}].function.parameters")
        await asyncio.to_thread(state.client.compile_grammar, spec)
    special_ids = marker_tokens(state, prompt)
    if special_ids:
        params = replace(params, kept_special_token_ids=tuple(sorted(special_ids.values())))
    params = with_tool_grammar(params, prompt, parallel_tool_calls, special_ids)
    return prompt, with_thinking(state, params, prompt.thinking,
                                 thinking_budget or state.config.reasoning_budget)


def marker_tokens(state: ServerState, prompt: ChatPrompt) -> dict[str, int]:
    """The answer's markers (the tool-call syntax's, the thinking's) that are special tokens
    of this vocabulary: kept in the answer's text for its parsers (skip_special_tokens
    would drop them), and named as tokens in a forced call's grammar."""
    texts = set()
    if prompt.tools is not None:
        texts.update(prompt.tools.template.syntax.markers)
    if prompt.thinking is not None:
        texts.update((prompt.thinking.syntax.start, prompt.thinking.syntax.end))
    return state.client.tokenizer.special_token_ids(texts) if texts else {}


def with_thinking(state: ServerState, params: SamplingParams, thinking: PromptThinking | None,
                  budget: int | None) -> SamplingParams:
    """The engine told of the thinking: its markers' tokens, where the answer starts, the
    budget; a grammar then applies to the answer after it. Under the engine's gate (a
    grammar or a budget) n-gram proposals are off: a verification's later rows would read
    the gate as it is now, not as the thinking's end or the forced marker leaves it."""
    if thinking is None:
        return params
    tok = state.client.tokenizer
    syntax = thinking.syntax
    control = ThinkingControl(tuple(tok.encode(syntax.start, add_special_tokens=False)),
                              tuple(tok.encode(syntax.end, add_special_tokens=False)),
                              thinking.inside, budget)
    gated = params.guided is not None or budget is not None
    speculative = "off" if gated else params.speculative
    return replace(params, thinking=control, speculative=speculative)


def with_tool_grammar(params: SamplingParams, prompt: ChatPrompt, parallel: bool,
                      special_ids: dict[str, int]) -> SamplingParams:
    """A forced tool_choice ("required", a named function) is enforced by a grammar in the
    model's own call syntax, so the calls always parse and their arguments validate."""
    use = prompt.tools
    if use is None or not use.choice.forced:
        return params
    if params.guided is not None:
        raise APIError(400, "a forced tool_choice cannot be combined with response_format or "
                            "guided_* (both constrain the answer)", "tool_choice", "invalid_value")
    return replace(params, guided=use.template.syntax.grammar(use.functions, use.choice, parallel,
                                                              special_ids))
