"""One engine request answering one choice of an API answer (each prompt x n), and what is
said of choices when they end: the finish reason clients are told, the usage."""
from __future__ import annotations

from dataclasses import dataclass, replace

from pagedllm.core.request import FinishReason, Request, RequestOutput
from pagedllm.server.auth import ApiKey
from pagedllm.server.limits import TokenUse
from pagedllm.server.protocol import usage
from pagedllm.server.state import ServerState
from pagedllm.serving.client import RequestStream


@dataclass
class Choice:
    """One engine request answering one choice; tracks what the client has seen."""

    index: int
    prompt_index: int
    request: Request
    arrival: float
    stream: RequestStream | None = None  # once submitted
    first_token_time: float | None = None
    user: str = ""
    key: ApiKey | None = None
    final: RequestOutput | None = None
    cut_reason: str | None = None  # why the server aborted it (a timeout), when it did
    tokens_seen: int = 0  # generated tokens so far
    latest: RequestOutput | None = None  # the last output the client was given
    failure: Exception | None = None  # the engine's, when it stopped serving this choice
    reservation: TokenUse | None = None  # its key's tokens-per-minute share, until settled

    def cut_by(self, failure: Exception) -> RequestOutput:
        """The final output of an answer whose engine stopped serving it (a crash, a stall):
        what was said so far, no new tokens, finish "abort" and why (told by public_finish)."""
        self.failure = failure
        self.cut_reason = f"the engine stopped serving it ({failure})"
        if self.latest is None:
            return RequestOutput(self.request.request_id, self.request.prompt_token_ids, [], "",
                                 [], "", True, FinishReason.ABORT.value)
        return replace(self.latest, new_token_ids=[], new_text="", new_logprobs=None,
                       finished=True, finish_reason=FinishReason.ABORT.value, stop_string=None)

    def settle_tokens(self, state: ServerState, queued: bool = True) -> None:
        """Once, when it ends however it ends: its tokens count as used, not reserved (none
        at all when it was never queued)."""
        if self.reservation is not None:
            used = self.request.num_prompt_tokens + self.tokens_seen if queued else 0
            state.rate_limiter.settle(self.reservation, used)
            self.reservation = None


def public_finish(state: ServerState, choice: Choice, finish_reason: str | None
                  ) -> tuple[str | None, dict | None]:
    """The finish_reason clients are told, and an error saying why when the server cut the
    answer short. OpenAI's clients know stop / length / tool_calls, not the engine's "abort":
    a cut-short answer is "length" (it ended before its end) plus the error."""
    if finish_reason != FinishReason.ABORT.value:
        return finish_reason, None
    why = choice.cut_reason or ("the server is shutting down" if state.draining
                                else "the request was aborted")
    return FinishReason.LENGTH.value, {"message": f"the answer was cut short: {why}",
                                       "type": "request_cut_short", "param": None, "code": None}


def usage_of(choices: list[Choice]) -> dict:
    prompt_tokens, completion, reasoning = 0, 0, None
    seen_prompts = {}
    for c in choices:
        final = c.final
        if final is None:
            continue
        completion += len(final.token_ids)
        thinking = c.request.params.thinking
        if thinking is not None:
            reasoning = (reasoning or 0) + thinking.reasoning_tokens(final.token_ids)
        best = seen_prompts.get(c.prompt_index)
        if best is None:
            prompt_tokens += len(final.prompt_token_ids)
            seen_prompts[c.prompt_index] = final.num_cached_tokens
        else:
            seen_prompts[c.prompt_index] = max(best, final.num_cached_tokens)
    counted = usage(prompt_tokens, completion, sum(seen_prompts.values()))
    if reasoning is not None:  # a reasoning model's answers: how many tokens were thinking
        counted["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return counted
