"""A grammar's first compilation, in a child process: a grammar that makes the library
recurse past its stack kills that child, not the server, and one that takes too long is
stopped there; either is a 400 for that request, and a fresh child takes the next grammar.
Only a grammar the child compiled within its time is compiled again in the server.

One child, one grammar at a time (a lock): grammars compile in milliseconds and are then
cached, so only a new, costly one waits, and never longer than the time limit. The child is
started (spawn: no copy of the server's threads or torch) on the first grammar."""
from __future__ import annotations

import concurrent.futures
import multiprocessing
import threading
from concurrent.futures.process import BrokenProcessPool

import llguidance

_tokenizer: llguidance.LLTokenizer | None = None
_limits: llguidance.LLParserLimits | None = None


def parser_limits(**limits) -> llguidance.LLParserLimits:
    """The limits every matcher is built with, set explicitly rather than left to the
    library's defaults (which may change between its releases)."""
    return llguidance.LLParserLimits(**limits)


def _start_child(tokenizer_json: str, vocab_size: int, eos: list[int], limits: dict) -> None:
    global _tokenizer, _limits
    _tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos)
    _limits = parser_limits(**limits)


def _validate(grammar: str) -> str:
    """In the child: the library's complaint about the grammar, or "" when it compiles."""
    return llguidance.LLMatcher.validate_grammar(grammar, _tokenizer, limits=_limits) or ""


class CompileFailed(Exception):
    """The child died compiling the grammar, or ran past the time limit."""


class CompileWorker:
    def __init__(self, tokenizer_json: str, vocab_size: int, eos: list[int], limits: dict,
                 timeout_s: float):
        self._child_args = (tokenizer_json, vocab_size, list(eos), dict(limits))
        self.timeout_s = timeout_s
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._lock = threading.Lock()
        self.replaced = 0  # children replaced after a crash or a timeout

    def validate(self, grammar: str) -> str:
        """The library's complaint ("" when the grammar compiles). Raises CompileFailed when
        the child crashed or ran out of time (it is replaced)."""
        with self._lock:
            pool = self._pool or self._start()
            future = pool.submit(_validate, grammar)
            try:
                return future.result(timeout=self.timeout_s)
            except concurrent.futures.TimeoutError:
                self._replace()
                raise CompileFailed(f"the grammar took more than {self.timeout_s:g} s to "
                                    f"compile") from None
            except BrokenProcessPool:
                self._replace()
                raise CompileFailed("the grammar crashed its compiler (a chain of rules or "
                                    "references too long, or a grammar too large)") from None

    def close(self) -> None:
        with self._lock:
            self._replace()
            self.replaced -= 1

    def _start(self) -> concurrent.futures.ProcessPoolExecutor:
        self._pool = concurrent.futures.ProcessPoolExecutor(
            max_workers=1, mp_context=multiprocessing.get_context("spawn"),
            initializer=_start_child, initargs=self._child_args)
        return self._pool

    def _replace(self) -> None:
        pool, self._pool = self._pool, None
        if pool is None:
            return
        self.replaced += 1
        for process in list(getattr(pool, "_processes", {}).values()):
            process.kill()  # a child stuck in a compile never returns to shutdown's call
        pool.shutdown(wait=False, cancel_futures=True)
