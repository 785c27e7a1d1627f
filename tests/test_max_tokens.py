"""A request's output budget is resolved and checked in one place (no torch, no model)."""
import pytest

from pagedllm.core.output_processor import token_stop_reason
from pagedllm.core.request import (FinishReason, PromptTooLongError, Request, SamplingParams,
                                   SamplingParamsError, resolve_max_tokens)


def test_explicit_value_is_kept_when_it_fits():
    assert resolve_max_tokens(10, num_prompt_tokens=5, max_model_len=100) == 10
    assert resolve_max_tokens(95, num_prompt_tokens=5, max_model_len=100) == 95


def test_none_means_the_rest_of_the_context_capped_by_the_server_limit():
    assert resolve_max_tokens(None, num_prompt_tokens=30, max_model_len=100) == 70
    assert resolve_max_tokens(None, num_prompt_tokens=30, max_model_len=100, limit=8) == 8
    assert resolve_max_tokens(None, num_prompt_tokens=30, max_model_len=100, limit=500) == 70


def test_over_the_server_limit_is_an_error_not_a_silent_cut():
    with pytest.raises(SamplingParamsError) as info:
        resolve_max_tokens(9, num_prompt_tokens=1, max_model_len=100, limit=8)
    assert info.value.param == "max_tokens" and "limit of 8" in str(info.value)


def test_past_the_context_is_an_error_with_both_numbers():
    with pytest.raises(PromptTooLongError) as info:
        resolve_max_tokens(20, num_prompt_tokens=90, max_model_len=100)
    assert (info.value.num_prompt_tokens, info.value.max_tokens) == (90, 20)
    assert "110 in all" in str(info.value)
    with pytest.raises(PromptTooLongError):  # a prompt that fills the context leaves nothing
        resolve_max_tokens(None, num_prompt_tokens=100, max_model_len=100)


def test_the_resolved_budget_is_what_stops_the_request():
    r = Request("x", [1, 2, 3], SamplingParams(max_tokens=None), max_model_len=100, max_tokens=2)
    r.append_token(7)
    assert token_stop_reason(r) is None
    r.append_token(7)
    assert token_stop_reason(r) == FinishReason.LENGTH
