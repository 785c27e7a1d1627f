"""Reasoning models' thinking kept apart (src/pagedllm/reasoning/): the splitter over every
way an answer can arrive in pieces (markers split across tokens included, nothing lost), the
parser chosen from the chat template and vocabulary, and the engine's gate: a budget writes
the end marker token by token, a grammar waits for the answer after the thinking. The real
tokenizer and grammar library; no model."""
from __future__ import annotations

import ctypes

import pytest

from pagedllm.core.thinking import ThinkingControl
from pagedllm.reasoning.gate import ANSWER, THINKING, ThinkingGate, request_grammar
from pagedllm.reasoning.splitter import ThinkingSplitter
from pagedllm.reasoning.syntax import SYNTAXES, choose_syntax

QWEN3 = SYNTAXES["qwen3"]


def split(text: str, sizes, inside: bool = False, syntax=QWEN3) -> tuple[str, str]:
    """(thinking, answer) of text fed in pieces of the given sizes, cycled."""
    splitter, thinking, answer, i, k = ThinkingSplitter(syntax, inside), "", "", 0, 0
    while i < len(text):
        size = sizes[k % len(sizes)]
        a, b = splitter.feed(text[i:i + size])
        thinking, answer, i, k = thinking + a, answer + b, i + size, k + 1
    a, b = splitter.finish()
    return thinking + a, answer + b


@pytest.mark.parametrize("sizes", [[1], [2], [3], [5, 1], [7], [1000]])
def test_thinking_and_answer_come_apart_however_the_text_is_split(sizes):
    text = "<think>\nTwo and two: four.</think>\n\nThe answer is 4."
    assert split(text, sizes) == ("\nTwo and two: four.", "The answer is 4.")
    # the prompt opened it (DeepSeek-R1): the answer starts inside, with no start marker
    assert split("Four, since 2+2=4.</think>It is 4.", sizes, inside=True) == (
        "Four, since 2+2=4.", "It is 4.")
    # no end marker: all thinking (cut by its length); nothing held back is lost
    assert split("<think>still going </thi", sizes) == ("still going </thi", "")
    assert split("A plain answer, no <think> in front.", sizes) == (
        "", "A plain answer, no <think> in front.")
    assert split("   <thi", sizes) == ("", "   <thi")  # a marker that never completed
    assert split("[THINK]hmm[/THINK]ok", sizes, syntax=SYNTAXES["mistral"]) == ("hmm", "ok")


def test_a_prompt_that_leaves_the_thinking_open_is_seen():
    assert QWEN3.opened_by("<|im_start|>assistant\n<think>\n")
    assert not QWEN3.opened_by("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # thinking off
    assert not QWEN3.opened_by("<|im_start|>assistant\n")


def test_the_parser_is_chosen_from_the_template_and_vocabulary():
    qwen3 = "{% if enable_thinking %}...{% endif %}<think>\n\n</think>"
    assert choose_syntax("auto", qwen3).name == "qwen3"
    assert choose_syntax("auto", "{{ '<｜Assistant｜><think>\\n' }}").name == "deepseek_r1"
    assert choose_syntax("auto", "[THINK]{{ m }}[/THINK]").name == "mistral"
    assert choose_syntax("auto", "<|im_start|>", {"<think>", "</think>"}).name == "deepseek_r1"
    assert choose_syntax("auto", "<|im_start|>{{ m }}") is None
    assert choose_syntax("none", qwen3) is None
    assert choose_syntax("deepseek_r1", None).name == "deepseek_r1"
    with pytest.raises(ValueError, match="unknown reasoning parser 'r1'.*deepseek_r1"):
        choose_syntax("r1", None)


def test_a_thinking_control_refuses_what_cannot_work():
    with pytest.raises(ValueError, match="at least 1 token"):
        ThinkingControl((1,), (2,), inside=True, budget=0)
    with pytest.raises(ValueError, match="no tokens"):
        ThinkingControl((), (2,), inside=True)


def _mask(gate: ThinkingGate, vocab: int) -> set[int]:
    row_bytes = (vocab + 31) // 32 * 4
    buffer = (ctypes.c_char * row_bytes)()
    gate.fill_mask(ctypes.addressof(buffer), row_bytes)
    bits = int.from_bytes(bytes(buffer), "little")
    return {t for t in range(vocab) if bits >> t & 1}


END = (7, 8, 9)


def test_a_budget_writes_the_end_marker_token_by_token_then_the_answer_is_free():
    gate = ThinkingGate(ThinkingControl((5,), END, inside=True, budget=3), eos_token_ids=(0,))
    for token in (11, 12, 13):
        assert gate.forced_token is None and gate.allows(token) and len(_mask(gate, 40)) == 40
        gate.accept(token)
    for token in END:  # spent: only the end marker's next token
        assert gate.forced_token == token and _mask(gate, 40) == {token}
        assert gate.allows(token) and not gate.allows(token + 10)
        gate.accept(token)
    assert gate.state == ANSWER and gate.forced_token is None and gate.allows(30)
    assert gate.thinking_tokens == 6


def test_the_model_ending_its_thinking_itself_stops_the_budget():
    gate = ThinkingGate(ThinkingControl((5,), END, inside=False, budget=10))
    assert gate.allows(5) and gate.allows(33)  # opening: it may start thinking or not
    for token in (5, 20, *END):
        gate.accept(token)
    assert gate.state == ANSWER and gate.thinking_tokens == 5
    plain = ThinkingGate(ThinkingControl((5,), END, inside=False, budget=1))
    plain.accept(33)  # no start marker: the answer, which no budget limits
    assert plain.state == ANSWER and plain.forced_token is None


@pytest.fixture(scope="module")
def tokenizer():
    from pagedllm.tokenizer import Tokenizer
    from pagedllm.weights import default_model_path

    return Tokenizer.from_model_path(default_model_path())


def test_a_grammar_applies_to_the_answer_after_the_thinking_only(tokenizer):
    from pagedllm.core.request import SamplingParams
    from pagedllm.structured.compiler import GrammarCompiler
    from pagedllm.structured.spec import choice_spec

    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, timeout_s=20.0)
    encode = lambda text: tuple(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    control = ThinkingControl(encode("<think>"), encode("</think>"), inside=True)
    params = SamplingParams(guided=choice_spec(["yes", "no"]), thinking=control)
    gate = request_grammar(params, compiler, tokenizer.eos_token_ids)
    assert isinstance(gate, ThinkingGate) and gate.grammar is not None
    [free] = encode(" Whatever")[:1]
    assert gate.allows(free)  # thinking: anything
    for token in encode(" Whatever I like") + control.end_ids:
        gate.accept(token)
    assert gate.state == ANSWER
    assert not gate.allows(free)  # the answer: the grammar's choices only
    [yes] = encode("yes")[:1]
    assert gate.allows(yes) and yes in _mask(gate, tokenizer.vocab_size)
    # no budget and no grammar: nothing to gate
    assert request_grammar(SamplingParams(thinking=control), compiler) is None
    assert request_grammar(SamplingParams(), compiler) is None
    assert gate.state != THINKING


def test_the_thinking_control_travels_to_an_engine_process():
    from pagedllm.core.request import SamplingParams
    from pagedllm.engine import wire

    params = SamplingParams(max_tokens=5, thinking=ThinkingControl((1, 2), (3, 4), True, 7))
    sent = wire.AddRequest("r", [1, 2], params, [0], 5, "u", None, 0.0, False)
    received = wire.to_engine.decode(wire.encoder.encode(sent))
    assert received.params.thinking == params.thinking
