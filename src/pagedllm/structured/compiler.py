"""Grammar specs -> llguidance matchers, on the HTTP side (never on the engine loop).

llguidance, not xgrammar: both give a batch's token masks in microseconds here
(benchmarks/grammar_libraries.py, BENCHMARKS.md), but llguidance is one 3 MB wheel with no
dependencies and builds its tokenizer from our own `tokenizers` JSON, where xgrammar pulls in
transformers and triton. Grammars are compiled once per spec (an LRU keyed by the spec) and
each request gets its own matcher, which walks the grammar as tokens are accepted.
"""
from __future__ import annotations

import ctypes
import threading
from functools import lru_cache

import llguidance
from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark

from pagedllm.structured.spec import GrammarError, GrammarSpec

# JSON as json.dumps writes it, no free whitespace: a sampled model must not be able to pad
# an answer with newlines until max_tokens runs out.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 256  # compiled grammars kept


class GrammarMatcher:
    """One request's walk through its grammar: which tokens may come next, and the token
    that came. A matcher in error (it cannot happen with the mask applied) allows only EOS."""

    def __init__(self, matcher: llguidance.LLMatcher, eos_token_ids: tuple[int, ...]):
        self._matcher = matcher
        self._eos = eos_token_ids

    def accept(self, token_id: int) -> None:
        if not self._matcher.is_stopped():
            self._matcher.consume_token(token_id)

    def allows(self, token_id: int) -> bool:
        """Whether this step's mask would allow token_id, without computing the mask: one
        token through the grammar (about a microsecond) against a walk over the vocabulary."""
        if self.failed or self._matcher.is_stopped():
            return token_id in self._eos  # the mask of a finished or failed walk: EOS only
        return self._matcher.validate_tokens([token_id]) == 1

    @property
    def failed(self) -> bool:
        return self._matcher.is_error()

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos


def fill_bitmasks(matchers: list[GrammarMatcher], bitmask_ptr: int, row_bytes: int) -> None:
    """Write each matcher's allowed-token bitmask (bit t of 32-bit word t // 32) into row i of
    the zeroed int32 array at bitmask_ptr; a failed matcher's row allows its EOS tokens only.
    One row after another: llguidance's parallel executor was slower here (its threads
    contend with torch's spinning OpenMP threads on a 2-core machine)."""
    words = (ctypes.c_uint32 * (row_bytes // 4 * len(matchers))).from_address(bitmask_ptr)
    for i, m in enumerate(matchers):
        if not m.failed:
            m._matcher.unsafe_compute_mask_ptr(bitmask_ptr + i * row_bytes, row_bytes)
        else:
            for token in m.eos_token_ids:
                words[i * (row_bytes // 4) + token // 32] |= 1 << (token % 32)


class GrammarCompiler:
    def __init__(self, tokenizer, vocab_size: int):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._lltok: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._compile = lru_cache(maxsize=CACHE_SIZE)(self._compile_uncached)

    @property
    def lltokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:  # built once (~0.2 s), on the first request that has a grammar
            if self._lltok is None:
                self._lltok = llguidance.LLTokenizer(
                    self._tokenizer.backend.to_str(), n_vocab=self._vocab_size,
                    eos_token=list(self._tokenizer.eos_token_ids))
            return self._lltok

    def compile(self, spec: GrammarSpec) -> str:
        """The spec's grammar in llguidance's form, checked; GrammarError when it cannot be
        used (the message says why, for the client)."""
        return self._compile(spec)

    def matcher(self, spec: GrammarSpec) -> GrammarMatcher:
        grammar = self.compile(spec)
        matcher = llguidance.LLMatcher(self.lltokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(spec.param, matcher.get_error())
        return GrammarMatcher(matcher, tuple(self._tokenizer.eos_token_ids))

    def _compile_uncached(self, spec: GrammarSpec) -> str:
        try:
            if spec.kind == "json_schema":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    spec.source, overrides=JSON_OPTIONS)
            elif spec.kind == "regex":
                grammar = llguidance.LLMatcher.grammar_from_regex(spec.source)
            elif spec.kind == "gbnf":
                grammar = llguidance.LLMatcher.grammar_from_lark(gbnf_to_lark(spec.source))
            else:
                grammar = llguidance.LLMatcher.grammar_from_lark(spec.source)
        except (ValueError, TypeError, GbnfToLarkError) as exc:
            raise GrammarError(spec.param, str(exc)) from exc
        problem = llguidance.LLMatcher.validate_grammar(grammar, self.lltokenizer)
        if problem:
            raise GrammarError(spec.param, _first_lines(problem))
        return grammar


def _first_lines(message: str, limit: int = 5) -> str:
    return "\n".join(message.strip().splitlines()[:limit])

