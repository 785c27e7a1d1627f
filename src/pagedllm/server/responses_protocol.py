"""Pydantic schemas of OpenAI's Responses API (POST /v1/responses) and their mapping onto what
every chat API shares: the conversation in tool_calls/prompt.py's shape, OpenAI chat-style
tools and tool_choice (chat_prompt.py reads those), SamplingParams and the grammar spec.

Every field is honoured, accepted with no effect on the answer (metadata, prompt_cache_key,
safety_identifier, service_tier, truncation "disabled"), or refused with a 400 naming it."""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Field

from pagedllm.core.request import SamplingParams
from pagedllm.errors import FieldError
from pagedllm.server.chat_protocol import call_arguments
from pagedllm.server.request_model import RequestModel
from pagedllm.structured.spec import GrammarSpec, spec_from_request


class InputText(RequestModel):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # of an earlier answer's text: none are made here
    logprobs: list[Any] | None = None  # likewise: history, not read


class MessageItem(RequestModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else \
            "".join(part.text for part in self.content)


class FunctionCallItem(RequestModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str = "{}"
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(RequestModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


# A message item may leave out its type: tried in this order, the first that fits is taken.
InputItem = Annotated[Union[MessageItem, FunctionCallItem, FunctionCallOutputItem],
                      Field(union_mode="left_to_right")]


class FunctionTool(RequestModel):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # the arguments always follow the schema when forced


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    name: str


class TextFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextOptions(RequestModel):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the only one a plain model has


class ReasoningOptions(RequestModel):
    """A reasoning model's thinking: `effort` maps to the template's switch; summaries of the
    thinking are not written here (its text comes back whole, as a reasoning item)."""
    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    summary: None = None  # no summaries: only null is taken
    generate_summary: None = None


class ResponsesRequest(RequestModel):
    model: str | None = None  # None: the one model served (as the chat route takes it)
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    text: TextOptions | None = None
    stream: bool = False
    previous_response_id: str | None = None
    store: bool = True
    user: str | None = None
    # Accepted with no effect on the answer.
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    truncation: Literal["disabled"] | None = None
    include: list[Literal["message.output_text.logprobs"]] | None = Field(default=None,
                                                                           max_length=0)
    reasoning: ReasoningOptions | None = None

    def template_options(self, has_switch: bool) -> dict:
        """reasoning.effort where the template has a thinking switch (Qwen3's): none and
        minimal turn the thinking off, the others on."""
        effort = self.reasoning.effort if self.reasoning is not None else None
        if not has_switch or effort is None:
            return {}
        return {"enable_thinking": effort not in ("none", "minimal")}

    def items(self) -> list:
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)

    def conversation(self) -> list[dict[str, Any]]:
        """This request's turns (instructions first), in tool_calls/prompt.py's shape."""
        out: list[dict[str, Any]] = []
        if self.instructions:
            out.append({"role": "system", "content": self.instructions})
        for i, item in enumerate(self.items()):
            if isinstance(item, MessageItem):
                role = "system" if item.role == "developer" else item.role
                out.append({"role": role, "content": item.text()})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "name": item.name,
                        "arguments": call_arguments(item.arguments, f"input[{i}].arguments")}
                if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                    out[-1]["tool_calls"].append(call)
                else:
                    out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            else:
                out.append({"role": "tool", "tool_call_id": item.call_id,
                            "content": item.output})
        if not out or out[-1]["role"] == "system":
            raise FieldError("input", "must hold at least one message")
        return out

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_output_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            guided=self.grammar_spec())

    def grammar_spec(self) -> GrammarSpec | None:
        fmt = self.text.format if self.text else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return spec_from_request({"type": "json_object"})
        if fmt.schema_ is None:
            raise FieldError("text.format.schema", 'is required with type "json_schema"')
        spec = spec_from_request({"type": "json_schema",
                                  "json_schema": {"name": fmt.name or "answer",
                                                  "schema": fmt.schema_}})
        return GrammarSpec(spec.kind, spec.source, "text.format.schema")

    def chat_tools(self) -> list[dict] | None:
        if self.tools is None:
            return None
        return [{"type": "function", "function": {
            "name": t.name, "description": t.description or "",
            "parameters": t.parameters if t.parameters is not None else
            {"type": "object", "properties": {}}}} for t in self.tools]

    def chat_tool_choice(self) -> str | dict | None:
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            return {"type": "function", "function": {"name": choice.name}}
        return choice
