"""A request's output budget is resolved and checked in one place (no torch, no model)."""
import pytest

from pagedllm.core.output_processor import token_stop_reason
from pagedllm.core.request import FinishReason, Request, SamplingParams, SamplingParamsError
from pagedllm.core.output_budget import OutputCaps, PromptTooLongError, resolve_max_tokens
from pagedllm.errors import FieldError


def test_explicit_value_is_kept_when_it_fits():
    assert resolve_max_tokens(10, num_prompt_tokens=5, caps=OutputCaps(100)) == 10
    assert resolve_max_tokens(95, num_prompt_tokens=5, caps=OutputCaps(100)) == 95


def test_none_means_the_rest_of_the_context_capped_by_the_server_limit():
    assert resolve_max_tokens(None, num_prompt_tokens=30, caps=OutputCaps(100)) == 70
    assert resolve_max_tokens(None, num_prompt_tokens=30, caps=OutputCaps(100, server_limit=8)) == 8
    assert resolve_max_tokens(None, num_prompt_tokens=30, caps=OutputCaps(100, server_limit=500)) == 70


def test_over_the_server_limit_is_an_error_not_a_silent_cut():
    with pytest.raises(SamplingParamsError) as info:
        resolve_max_tokens(9, num_prompt_tokens=1, caps=OutputCaps(100, server_limit=8))
    assert info.value.param == "max_tokens" and "limit of 8" in str(info.value)


def test_past_the_context_is_an_error_with_both_numbers():
    with pytest.raises(PromptTooLongError) as info:
        resolve_max_tokens(20, num_prompt_tokens=90, caps=OutputCaps(100))
    assert (info.value.num_prompt_tokens, info.value.max_tokens) == (90, 20)
    assert "110 in all" in str(info.value)
    with pytest.raises(PromptTooLongError):  # a prompt that fills the context leaves nothing
        resolve_max_tokens(None, num_prompt_tokens=100, caps=OutputCaps(100))


def test_a_client_context_window_cuts_the_answer_and_is_checked():
    caps = OutputCaps(100, context=40)  # Ollama's num_ctx
    assert resolve_max_tokens(None, 30, caps) == 10
    assert resolve_max_tokens(50, 30, caps) == 10  # cut, as Ollama ends the answer there
    assert resolve_max_tokens(5, 30, caps) == 5
    with pytest.raises(FieldError) as over:
        resolve_max_tokens(None, 30, OutputCaps(100, context=101))
    assert over.value.param == "options.num_ctx" and "over this server's context" in str(over.value)
    with pytest.raises(FieldError) as full:
        resolve_max_tokens(None, 40, caps)
    assert full.value.param == "options.num_ctx" and "no room" in str(full.value)


def test_an_open_ended_answer_fits_what_the_key_has_left():
    assert resolve_max_tokens(None, 10, caps=OutputCaps(100, key_budget=30)) == 20
    assert resolve_max_tokens(None, 10, caps=OutputCaps(100, key_budget=5)) == 1  # the key's 429 then
    assert resolve_max_tokens(50, 10, caps=OutputCaps(100, key_budget=30)) == 50  # asked: checked there


def test_the_resolved_budget_is_what_stops_the_request():
    r = Request("x", [1, 2, 3], SamplingParams(max_tokens=None), max_model_len=100, max_tokens=2)
    r.append_token(7)
    assert token_stop_reason(r) is None
    r.append_token(7)
    assert token_stop_reason(r) == FinishReason.LENGTH
