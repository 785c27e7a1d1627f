"""Every stop decision, and token ids -> text for each request (incremental detokenization).

`stop_reason` is the one place that decides whether a request stops after a new token:
token-level stops first (EOS, stop_token_ids, max_tokens, the context length), then stop
strings. Stop strings are found on text, so they are found even when split across tokens;
the stop string itself is never returned. While a request runs, the last (longest stop - 1)
characters are held back, since they might be the start of a stop string.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from pagedllm.core.request import FinishReason, Request, RequestOutput, RequestStatus

if TYPE_CHECKING:
    from pagedllm.tokenizer import Tokenizer


def token_stop_reason(request: Request) -> FinishReason | None:
    """Token-level stop conditions after a new token (pure: no text needed)."""
    last = request.all_token_ids[-1]
    if last in request.eos_token_ids or last in request.params.stop_token_ids:
        return FinishReason.STOP
    if request.max_tokens is not None and request.num_output_tokens >= request.max_tokens:
        return FinishReason.LENGTH
    if request.num_tokens >= request.max_model_len:
        return FinishReason.LENGTH
    return None


def stop_reason(request: Request, text: RequestTextState | None) -> FinishReason | None:
    """Whether the request stops after its newest token: token-level stops, else a stop
    string completed by that token (`text` detokenizes it either way)."""
    completes_stop_string = text is not None and text.add_token(request.all_token_ids[-1])
    reason = token_stop_reason(request)
    if reason is None and completes_stop_string:
        reason = FinishReason.STOP
    return reason


class RequestTextState:
    def __init__(self, request: Request, tokenizer: Tokenizer | None):
        """tokenizer=None: outputs carry token ids only and no stop string is looked for
        (the engine-core process: its front end detokenizes, serving/process_client.py)."""
        self.request = request
        self.detokenizer = None if tokenizer is None else tokenizer.new_detokenizer(
            request.prompt_token_ids, request.params.skip_special_tokens,
            request.params.kept_special_token_ids)
        self.stops = request.params.stop
        self.hold_back = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self.num_emitted_chars = 0
        self.num_emitted_tokens = 0
        self.stopped_by_string = False
        self.matched_stop: str | None = None  # the stop string that ended it (Anthropic says)

    def add_token(self, token_id: int) -> bool:
        """Detokenize one new token; True when it completes a stop string."""
        if self.stopped_by_string:
            return True
        if self.detokenizer is None:
            return False
        piece = self.detokenizer.step(token_id)
        if not piece:
            return False
        search_from = max(0, len(self.text) - self.hold_back)
        self.text += piece
        if self.stops:
            hits = [(i, s) for i, s in ((self.text.find(s, search_from), s) for s in self.stops)
                    if i >= 0]
            if hits:
                at, self.matched_stop = min(hits, key=lambda hit: hit[0])
                self.text = self.text[:at]
                self.stopped_by_string = True
        return self.stopped_by_string

    def follow(self, new_token_ids: list[int], finish_reason: str | None,
               num_cached_tokens: int = 0, new_logprobs: list | None = None,
               queue_time: float | None = None) -> bool:
        """What an engine elsewhere did for this request since its last word (the engine
        process, which sends token ids only): its tokens appended and detokenized, as the
        in-process engine would have, stopping at a stop string; its finish taken. True when
        a stop string ended the request here, before that engine knew (tell it to drop it)."""
        request = self.request
        accepted, stopped = 0, False
        for token_id in new_token_ids:
            request.append_token(token_id)
            accepted += 1
            if self.add_token(token_id):
                stopped = True
                break
        if new_logprobs:
            request.logprobs.extend(new_logprobs[:accepted])
        request.num_cached_tokens = num_cached_tokens
        if queue_time is not None and request.first_scheduled_time is None:
            request.first_scheduled_time = request.arrival_time + queue_time
        # A token-level stop on the same token wins, as in stop_reason().
        if finish_reason is not None and accepted == len(new_token_ids):
            reason = FinishReason(finish_reason)
        else:
            reason = FinishReason.STOP if stopped else None
        if reason is not None:
            request.status, request.finish_reason = RequestStatus.FINISHED, reason
        return reason is not None and finish_reason is None

    def last_output(self, reason: FinishReason, error: str | None = None) -> RequestOutput:
        """The final output when there is no engine output to make it from (an abort with
        the engine gone, a failure here): the text so far, nothing new."""
        request = self.request
        return RequestOutput(request.request_id, request.prompt_token_ids,
                             request.output_token_ids, self.text, [], "", True, reason.value,
                             error=error)

    def make_output(self) -> RequestOutput:
        """The request's output after a step, with only what is new since the last one."""
        request = self.request
        finished = request.is_finished
        visible = len(self.text) if finished else max(self.num_emitted_chars,
                                                      len(self.text) - self.hold_back)
        new_text = self.text[self.num_emitted_chars:visible]
        self.num_emitted_chars = visible
        token_ids = request.output_token_ids
        new_token_ids = token_ids[self.num_emitted_tokens:]
        logprobs = request.logprobs if request.params.logprobs is not None else None
        new_logprobs = logprobs[self.num_emitted_tokens:] if logprobs is not None else None
        self.num_emitted_tokens = len(token_ids)
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=token_ids,
            text=self.text[:visible],
            new_token_ids=new_token_ids,
            new_text=new_text,
            finished=finished,
            finish_reason=request.finish_reason.value if request.finish_reason else None,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            logprobs=logprobs,
            new_logprobs=new_logprobs,
            stop_string=self.matched_stop if finished else None,
            queue_time=(request.first_scheduled_time - request.arrival_time
                        if request.first_scheduled_time is not None else None),
        )
