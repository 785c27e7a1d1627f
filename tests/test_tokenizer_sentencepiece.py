"""A GGUF's SentencePiece vocabulary (tokenizer.ggml.model "llama": Llama 2, Phi-3, Gemma)
tokenizes as the family's own tokenizer does: SentencePiece models trained here (BPE with
byte fallback, digits split, as those families' are), written into GGUF metadata the way
llama.cpp's converter writes them (pieces, scores, token types, add_space_prefix), give the
ids the sentencepiece library gives on a mixed text (digits, CJK, emoji, code, accents,
whitespace runs), with and without the leading space (Llama 2 / Phi-3 add it, Gemma does
not), and decode back to the text."""
from __future__ import annotations

import pytest
import sentencepiece as spm

from pagedllm.tokenizer.gguf import tokenizer_from_gguf

CORPUS = ("The quick brown fox jumps over the lazy dog 1234567 times.\n"
          "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n"
          "東京是日本的首都。北京是中国的首都。 Emoji: 😀🎉 and  multiple   spaces\tand tabs.\n"
          "Numbers 3.14159 and 2,718 and 1e-5; URLs https://example.com/path?x=1&y=2\n") * 30
TEXTS = ["Hello wörld 12345 東京 😀 code: x=[1,2]  \t spaces\n\nnew  line ÿ̈ Ωmega",
         "  leading spaces, 中文 mixed with English 42 and 🎉🎉\n\tdef f(x): return x**2",
         "unseen: Ж ∑ 🦜 ﬁ"]  # characters the model never saw: byte fallback
# llama.cpp's token types (gguf.TokenType)
NORMAL, UNKNOWN, CONTROL, UNUSED, BYTE = 1, 2, 3, 5, 6


def gguf_metadata(sp, add_space_prefix: bool) -> dict:
    """What llama.cpp's converter writes for a SentencePiece vocabulary."""
    def kind(i: int) -> int:
        if sp.is_unknown(i):
            return UNKNOWN
        if sp.is_control(i):
            return CONTROL
        if sp.is_unused(i):
            return UNUSED
        return BYTE if sp.is_byte(i) else NORMAL

    n = sp.get_piece_size()
    return {"tokenizer.ggml.model": "llama",
            "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(n)],
            "tokenizer.ggml.scores": [sp.get_score(i) for i in range(n)],
            "tokenizer.ggml.token_type": [kind(i) for i in range(n)],
            "tokenizer.ggml.unknown_token_id": sp.unk_id(),
            "tokenizer.ggml.add_space_prefix": add_space_prefix}


@pytest.fixture(scope="module", params=[True, False], ids=["space-prefix", "no-prefix"])
def family(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("spm")
    corpus = folder / "corpus.txt"
    corpus.write_text(CORPUS, encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(folder / "m"), vocab_size=400, model_type="bpe",
        byte_fallback=True, split_digits=True, character_coverage=1.0,
        allow_whitespace_only_pieces=True, remove_extra_whitespaces=False,
        normalization_rule_name="identity", add_dummy_prefix=request.param,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_file=str(folder / "m.model"))
    return sp, tokenizer_from_gguf("family.gguf", gguf_metadata(sp, request.param))


@pytest.mark.parametrize("text", TEXTS)
def test_ids_equal_sentencepiece(family, text):
    sp, ours = family
    ids = ours.encode(text, add_special_tokens=False).ids
    assert ids == sp.encode(text)
    assert ours.decode(ids) == sp.decode(ids) == text


def test_control_tokens_are_special_not_split(family):
    sp, ours = family
    ids = ours.encode("a</s>b", add_special_tokens=False).ids
    assert sp.eos_id() in ids  # "</s>" is the control token itself, not its letters
