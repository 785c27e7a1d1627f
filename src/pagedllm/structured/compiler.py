"""Grammar specs -> llguidance matchers, on the HTTP side (never on the engine loop).

llguidance, not xgrammar: both give a batch's token masks in microseconds here
(benchmarks/grammar_libraries.py, BENCHMARKS.md), but llguidance is one 3 MB wheel with no
dependencies and builds its tokenizer from our own `tokenizers` JSON, where xgrammar pulls in
transformers and triton.

A new grammar is held to the counted limits (grammar_limits.py), then compiled first in a
child process within a time limit (compile_worker.py: a crash or a timeout there is a 400,
never the server's end), then compiled once here on a worker thread (the library drops the
GIL meanwhile) into a template matcher. Templates are cached by the spec's content, bounded
in bytes; each request gets a copy of its template (microseconds), which walks the grammar
as tokens are accepted. Every matcher has the same explicit parser limits.
"""
from __future__ import annotations

import ctypes
import threading
from collections import OrderedDict

import llguidance
from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark

from pagedllm.structured.compile_worker import CompileFailed, CompileWorker, parser_limits
from pagedllm.structured.grammar_limits import check_limits
from pagedllm.structured.spec import GrammarError, GrammarSpec

# JSON as json.dumps writes it, no free whitespace: a sampled model must not be able to pad
# an answer with newlines until max_tokens runs out.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_BYTES = 64 << 20  # compiled grammars kept, counted by the size of their text
COMPILE_TIMEOUT_S = 10.0  # a new grammar's first compilation (in the child)
# The parser's limits, explicit (llguidance's defaults at 1.9): a row of at most 2,000
# alternatives, 1M lexer fuel to build a grammar's regexes, and per token at most 200k
# fuel (~15 ms) and 50k Earley items (~2.5 ms): past them the matcher errs, and the
# request ends with that error (engine/model_runner.py).
PARSER_LIMITS = {"max_items_in_row": 2_000, "initial_lexer_fuel": 1_000_000,
                 "step_lexer_fuel": 200_000, "step_max_items": 50_000,
                 "max_lexer_states": 250_000, "max_grammar_size": 500_000,
                 "verbose_errors": False}


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
    def error(self) -> str:
        """Why the walk failed (the library gave up: a limit, or a grammar it cannot go on in)."""
        return _first_lines(self._matcher.get_error() or "the grammar failed")

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    def fill_mask(self, ptr: int, row_bytes: int) -> None:
        """This step's allowed-token bitmask (bit t of 32-bit word t // 32) into the zeroed
        row at ptr; a failed walk's row allows its EOS tokens only."""
        if not self.failed:
            self._matcher.unsafe_compute_mask_ptr(ptr, row_bytes)
            return
        words = (ctypes.c_uint32 * (row_bytes // 4)).from_address(ptr)
        for token in self._eos:
            words[token // 32] |= 1 << (token % 32)

    def masks_along(self, tokens: list[int], row_bytes: int) -> list[GrammarMask]:
        """The masks after 1, 2, ... of `tokens`, as long as the grammar accepts them (a
        request verifying proposed tokens samples each position under its own mask; the
        first position reads the walk itself); the walk is left where it was."""
        masks: list[GrammarMask] = []
        if self.failed or self._matcher.is_stopped():
            return masks
        valid = self._matcher.validate_tokens(tokens)
        for token in tokens[:valid]:
            self._matcher.consume_token(token)
            masks.append(GrammarMask.of(self, row_bytes))
        if valid:
            self._matcher.rollback(valid)
        return masks


class GrammarMask:
    """A GrammarMatcher's mask at one point of its walk, kept: what the sampler reads of a
    matcher (fill_mask, allows, failed, error, eos_token_ids), for one position of a
    verification (masks_along)."""

    def __init__(self, words: bytearray, failed: bool, error: str, eos: tuple[int, ...]):
        self._words, self.failed, self.error, self.eos_token_ids = words, failed, error, eos

    @classmethod
    def of(cls, matcher: GrammarMatcher, row_bytes: int) -> GrammarMask:
        words = bytearray(row_bytes)
        buffer = (ctypes.c_char * row_bytes).from_buffer(words)
        matcher.fill_mask(ctypes.addressof(buffer), row_bytes)
        failed = matcher.failed
        return cls(words, failed, matcher.error if failed else "", matcher.eos_token_ids)

    def fill_mask(self, ptr: int, row_bytes: int) -> None:
        ctypes.memmove(ptr, bytes(self._words[:row_bytes]), min(row_bytes, len(self._words)))

    def allows(self, token_id: int) -> bool:
        byte = token_id // 8
        return byte < len(self._words) and bool(self._words[byte] >> (token_id % 8) & 1)


def fill_bitmasks(matchers: list[GrammarMatcher | GrammarMask], bitmask_ptr: int,
                  row_bytes: int) -> None:
    """Write each matcher's allowed-token bitmask into row i of the zeroed int32 array at
    bitmask_ptr (GrammarMatcher.fill_mask). One row after another: llguidance's parallel
    executor was slower here (its threads contend with torch's spinning OpenMP threads on a
    2-core machine)."""
    for i, m in enumerate(matchers):
        m.fill_mask(bitmask_ptr + i * row_bytes, row_bytes)


class GrammarCompiler:
    def __init__(self, tokenizer, vocab_size: int, cache_bytes: int = CACHE_BYTES,
                 timeout_s: float = COMPILE_TIMEOUT_S):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._lltok: llguidance.LLTokenizer | None = None
        self._worker: CompileWorker | None = None
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._limits = parser_limits(**PARSER_LIMITS)
        self.cache_bytes = cache_bytes
        # False where a front end already validated every grammar in its own child (the
        # engine process): compiled here directly, with no second child process.
        self.validate_in_child = True
        self._templates: OrderedDict[GrammarSpec, tuple[llguidance.LLMatcher, int]] = OrderedDict()
        self.cached_bytes = 0

    @property
    def lltokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:  # built once (~0.2 s), on the first request that has a grammar
            if self._lltok is None:
                self._lltok = llguidance.LLTokenizer(
                    self._tokenizer.backend.to_str(), n_vocab=self._vocab_size,
                    eos_token=list(self._tokenizer.eos_token_ids))
            return self._lltok

    @property
    def worker(self) -> CompileWorker:
        with self._lock:
            if self._worker is None:
                self._worker = CompileWorker(self._tokenizer.backend.to_str(), self._vocab_size,
                                             list(self._tokenizer.eos_token_ids), PARSER_LIMITS,
                                             self._timeout_s)
            return self._worker

    def compile(self, spec: GrammarSpec) -> None:
        """Compile the spec into the cache (slow for a new grammar: call it off the event
        loop); GrammarError when it cannot be used (the message says why, for the client)."""
        self._template(spec)

    def matcher(self, spec: GrammarSpec) -> GrammarMatcher:
        """A fresh walk of the spec's grammar: a copy of its cached template."""
        return GrammarMatcher(self._template(spec).deep_copy(), tuple(self._tokenizer.eos_token_ids))

    def _template(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        with self._lock:
            cached = self._templates.get(spec)
            if cached is not None:
                self._templates.move_to_end(spec)
                return cached[0]
        check_limits(spec)
        grammar = _grammar_text(spec)
        try:
            problem = self.worker.validate(grammar) if self.validate_in_child else ""
        except CompileFailed as exc:
            raise GrammarError(spec.param, str(exc)) from exc
        if problem:
            raise GrammarError(spec.param, _first_lines(problem))
        template = llguidance.LLMatcher(self.lltokenizer, grammar, log_level=0, limits=self._limits)
        if template.is_error():
            raise GrammarError(spec.param, _first_lines(template.get_error()))
        self._keep(spec, template, len(grammar) + len(spec.source))
        return template

    def _keep(self, spec: GrammarSpec, template: llguidance.LLMatcher, size: int) -> None:
        with self._lock:
            if spec in self._templates or size > self.cache_bytes:
                return
            self._templates[spec] = (template, size)
            self.cached_bytes += size
            while self.cached_bytes > self.cache_bytes:
                _, (_, dropped) = self._templates.popitem(last=False)
                self.cached_bytes -= dropped


def _grammar_text(spec: GrammarSpec) -> str:
    """The spec in llguidance's grammar form (no compiling yet)."""
    try:
        if spec.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(spec.source, overrides=JSON_OPTIONS)
        if spec.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec.source)
        if spec.kind == "gbnf":
            return llguidance.LLMatcher.grammar_from_lark(gbnf_to_lark(spec.source))
        return llguidance.LLMatcher.grammar_from_lark(spec.source)
    except (ValueError, TypeError, GbnfToLarkError, RecursionError) as exc:
        raise GrammarError(spec.param, str(exc) or type(exc).__name__) from exc


def _first_lines(message: str, limit: int = 5) -> str:
    return "\n".join(message.strip().splitlines()[:limit])

