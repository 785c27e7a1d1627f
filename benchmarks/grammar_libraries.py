"""llguidance against xgrammar on this project's tokenizer (49,152 tokens): what issue 17 asked
to measure before picking one. pagedllm uses llguidance (structured/compiler.py says why).

    .venv/bin/pip install --no-deps xgrammar apache-tvm-ffi   # not a pagedllm dependency
    .venv/bin/python benchmarks/grammar_libraries.py

Per library: tokenizer set-up, compile of a small and a 50-property schema (with the first
token mask, where llguidance does its lazy work), and the time of one token mask along a
JSON answer, once with unbounded strings and once with maxLength strings.
"""
from __future__ import annotations

import json
import statistics
import time

import llguidance
import torch

from pagedllm.structured.compiler import JSON_OPTIONS
from pagedllm.tokenizer import Tokenizer
from pagedllm.weights import default_model_path

FIFTY = {"type": "object", "required": [f"f{i}" for i in range(50)],
         "properties": {f"f{i}": [{"type": "integer"}, {"type": "string"}, {"type": "boolean"}][i % 3]
                        for i in range(50)}}
SMALL = {"type": "object", "required": ["name", "tags"],
         "properties": {"name": {"type": "string"},
                        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}}}
BOUNDED = {"type": "object", "required": ["name", "tags"],
           "properties": {"name": {"type": "string", "maxLength": 30},
                          "tags": {"type": "array", "maxItems": 3,
                                   "items": {"type": "string", "maxLength": 20}}}}
ANSWER = json.dumps({"name": "Ada Lovelace, mathematician", "tags": ["math", "poetry", "engines"]})


def ms(start: float) -> float:
    return (time.perf_counter() - start) * 1e3


class Llguidance:
    def __init__(self, tok: Tokenizer):
        self.tok = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=tok.vocab_size,
                                          eos_token=list(tok.eos_token_ids))
        self.mask = torch.zeros((tok.vocab_size + 31) // 32, dtype=torch.int32)

    def matcher(self, schema):
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema),
                                                                overrides=JSON_OPTIONS)
        return llguidance.LLMatcher(self.tok, grammar, log_level=0)

    def fill(self, m):
        m.unsafe_compute_mask_ptr(self.mask.data_ptr(), self.mask.numel() * 4)

    def accept(self, m, token):
        assert m.consume_token(token)


class Xgrammar:
    def __init__(self, tok: Tokenizer):
        import xgrammar
        from transformers import PreTrainedTokenizerFast

        self.xgr = xgrammar
        hf = PreTrainedTokenizerFast(tokenizer_object=tok.backend)
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=tok.vocab_size,
                                                       stop_token_ids=list(tok.eos_token_ids))
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.mask = xgrammar.allocate_token_bitmask(1, tok.vocab_size)

    def matcher(self, schema):
        compiled = self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                     separators=(", ", ": "))
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m):
        m.fill_next_token_bitmask(self.mask, 0)

    def accept(self, m, token):
        assert m.accept_token(token)


def main() -> None:
    torch.set_num_threads(1)
    tok = Tokenizer.from_model_path(default_model_path())
    answer = tok.encode(ANSWER, add_special_tokens=False)
    print(f"vocabulary {tok.vocab_size} tokens, answer {len(answer)} tokens; 1 thread; ms")
    print("library       tokenizer  compile small  compile 50-prop  mask median (max)  "
          "maxLength mask median (max)")
    for name, make in (("llguidance", Llguidance), ("xgrammar", Xgrammar)):
        try:
            start = time.perf_counter()
            lib = make(tok)
        except ImportError as exc:
            print(f"{name:<12}  not installed ({exc.name}); see the docstring")
            continue
        setup = ms(start)
        compiles = []
        for schema in (SMALL, FIFTY):
            start = time.perf_counter()
            lib.fill(lib.matcher(schema))
            compiles.append(ms(start))
        walks = []
        for schema in (SMALL, BOUNDED):
            m, times = lib.matcher(schema), []
            for token in answer:
                start = time.perf_counter()
                lib.fill(m)
                times.append(ms(start))
                lib.accept(m, token)
            walks.append(f"{statistics.median(times):.3f} ({max(times):.2f})")
        print(f"{name:<12}  {setup:9.0f}  {compiles[0]:13.1f}  {compiles[1]:15.1f}  "
              f"{walks[0]:>17}  {walks[1]:>27}")


if __name__ == "__main__":
    main()
