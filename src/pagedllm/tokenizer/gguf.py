"""The `tokenizers` tokenizer a GGUF describes: its vocabulary, merges (or SentencePiece
scores), special tokens, and the pre-tokenizer its `tokenizer.ggml.pre` names, as llama.cpp
reads them. An unknown model or pre-tokenizer is refused by name, never guessed.
"""
from __future__ import annotations

from collections.abc import Sequence

from tokenizers import AddedToken, Regex, Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers

from pagedllm.errors import ModelLoadError

# Pre-tokenizer regexes by llama.cpp's `tokenizer.ggml.pre` name.
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLIT_REGEXES = {"llama-bpe": _LLAMA3_REGEX, "llama3": _LLAMA3_REGEX, "smaug-bpe": _LLAMA3_REGEX,
                  "qwen2": _QWEN2_REGEX}
_NFC = ("qwen2",)  # Qwen2's tokenizer.json normalizes to NFC first
# Pre-tokenizers that split digits one by one before GPT-2's byte-level regex.
_DIGIT_SPLIT = ("smollm", "starcoder", "refact")
_GPT2 = (None, "default", "gpt2", "gpt-2")  # GPT-2's byte-level regex as it is
SUPPORTED_PRE_TOKENIZERS = tuple(sorted([*_SPLIT_REGEXES, *_DIGIT_SPLIT, "default", "gpt-2"]))

_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4



def _byte_level_pre_tokenizer(pre: str | None):
    if pre in _SPLIT_REGEXES:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLIT_REGEXES[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLIT:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level


def _merges_from_scores(tokens: list[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """SentencePiece BPE stores scores, not merges: a merge a+b exists when a, b and ab are
    all tokens, ranked by the score of ab (higher merges first)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for token, score in zip(tokens, scores):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                merges.append((score, vocab[left], vocab[right], left, right))
    merges.sort(key=lambda m: (-m[0], m[1], m[2]))
    return [(left, right) for _, _, _, left, right in merges]


def tokenizer_from_gguf(path: str, meta: dict) -> HFTokenizer:
    """A `tokenizers` tokenizer from a GGUF's tokenizer.ggml.* metadata: byte-level BPE
    (gpt2) with the split its `pre` names, or SentencePiece BPE (llama) with byte fallback."""
    kind = meta.get("tokenizer.ggml.model")
    tokens = list(meta.get("tokenizer.ggml.tokens") or [])
    if not tokens:
        raise ModelLoadError(path, "GGUF has no tokenizer.ggml.tokens")
    vocab = {token: i for i, token in enumerate(tokens)}
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    if kind == "gpt2":
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
        tok = HFTokenizer(models.BPE(vocab, merges, fuse_unk=False))
        pre = meta.get("tokenizer.ggml.pre")
        if pre not in (*_SPLIT_REGEXES, *_DIGIT_SPLIT, *_GPT2):
            # Another split would give other tokens than the model was trained on: refused,
            # never guessed.
            raise ModelLoadError(path, f"tokenizer.ggml.pre {pre!r} is not supported yet "
                                       f"(supported: {', '.join(SUPPORTED_PRE_TOKENIZERS)})")
        if pre in _NFC:
            tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = _byte_level_pre_tokenizer(pre)
        tok.decoder = decoders.ByteLevel()
    elif kind == "llama":
        scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        unk = tokens[unk_id] if unk_id is not None else None
        tok = HFTokenizer(models.BPE(vocab, _merges_from_scores(tokens, scores),
                                     unk_token=unk, byte_fallback=True, fuse_unk=True))
        steps = [normalizers.Replace(" ", "▁")]
        if meta.get("tokenizer.ggml.add_space_prefix", True):
            steps.insert(0, normalizers.Prepend("▁"))
        tok.normalizer = normalizers.Sequence(steps)
        dec = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        if meta.get("tokenizer.ggml.add_space_prefix", True):
            dec.append(decoders.Strip(" ", 1, 0))
        tok.decoder = decoders.Sequence(dec)
    else:
        raise ModelLoadError(path, f"unknown tokenizer model {kind!r}; supported: gpt2, llama")
    types = meta.get("tokenizer.ggml.token_type") or []
    special = [AddedToken(tokens[i], special=True, normalized=False)
               for i, t in enumerate(types) if t in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED)]
    tok.add_special_tokens(special)
    return tok
