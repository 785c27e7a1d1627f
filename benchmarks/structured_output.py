"""What structured output costs, and what it buys, on the default model.

    .venv/bin/python benchmarks/structured_output.py [--threads 2] [--rounds 3]

1. Decode throughput at N=8: eight requests each under a JSON schema against the same eight
   without one, same engine, same run, rounds alternated. The schemas ask for 40 strings, so
   every guided answer is still open when max_tokens (128) ends it: both variants decode
   exactly 8 x 128 tokens and the ratio is the cost of the masks alone. Two schemas: strings
   as most schemas have them, and strings with maxLength, which llguidance's token-trie
   shortcuts ("slices") cannot serve, so each mask inside such a string walks the vocabulary.
   At temperature 1 the sampler draws first and computes a mask only for a draw the grammar
   refuses; with top_p 0.9 (a truncating sampler) every guided token is masked first. Each
   sampler has its own unguided baseline, and the share of guided tokens that needed a full
   mask is printed.
2. Compile time of a 50-property schema through the server's GrammarCompiler (cold, cache
   off): grammar build plus the first token mask, which is where llguidance does its lazy work.
3. Why it matters: 20 prompts asking for a JSON object of a given shape at temperature 1,
   unguided against guided; how many answers parse and validate.
"""
from __future__ import annotations

import json
import statistics
import time

import jsonschema
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.structured.compiler import GrammarCompiler
from pagedllm.structured import mask as mask_module
from pagedllm.structured.mask import apply_grammar_masks
from pagedllm.structured.spec import json_schema_spec
from timing import parse_args, smoke_or

N, MAX_TOKENS = smoke_or((8, 128), (2, 8))
PROMPT = "List forty fruits as JSON."


def forty_strings(item: dict) -> dict:
    return {"type": "object", "required": ["fruits"], "additionalProperties": False,
            "properties": {"fruits": {"type": "array", "minItems": 40, "maxItems": 40,
                                      "items": item}}}


SCHEMAS = {"plain strings": forty_strings({"type": "string"}),
           "strings with maxLength 20": forty_strings({"type": "string", "maxLength": 20})}
FIFTY = {"type": "object", "additionalProperties": False, "required": [f"field_{i}" for i in range(50)],
         "properties": {f"field_{i}": [{"type": "integer"}, {"type": "string", "maxLength": 20},
                                       {"type": "boolean"}, {"enum": ["a", "b", "c"]},
                                       {"type": "array", "items": {"type": "number"}}][i % 5]
                        for i in range(50)}}
OWNER = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pets"],
         "properties": {"name": {"type": "string", "maxLength": 16},
                        "age": {"type": "integer", "minimum": 0, "maximum": 120},
                        "pets": {"type": "array", "minItems": 1, "maxItems": 2,
                                 "items": {"enum": ["cat", "dog", "fish"]}}}}
TOPICS = ["a farmer", "a pilot", "a child", "a teacher", "a painter", "a sailor", "a baker",
          "a doctor", "a poet", "a miner", "a nurse", "a judge", "a chef", "a monk", "a clown",
          "a spy", "a knight", "a queen", "a runner", "a robot"]


def chat_ids(llm: LLM, text: str) -> list[int]:
    tok = llm.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]),
                      add_special_tokens=False)


def run_together(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list:
    """Every prompt added at once (one batch), their finished outputs in order."""
    engine = llm.engine
    ids = [engine.add_request(None, p, sp).request_id for p, sp in zip(prompts, params)]
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return [finished[i] for i in ids]


class MaskCounter:
    """Counts the rows whose full token mask was computed (wraps the mask module's filler)."""

    def __init__(self):
        self.rows = 0
        self._fill = mask_module.fill_bitmasks
        mask_module.fill_bitmasks = self

    def __call__(self, matchers, ptr, row_bytes):
        self.rows += len(matchers)
        return self._fill(matchers, ptr, row_bytes)


def decode_seconds(llm: LLM, schema: dict | None, top_p: float) -> float:
    """Seconds to run N requests of MAX_TOKENS each, all in one batch."""
    spec = json_schema_spec(schema, "guided_json") if schema else None
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, top_p=top_p, seed=i,
                             ignore_eos=True, guided=spec) for i in range(N)]
    start = time.perf_counter()
    outs = run_together(llm, [chat_ids(llm, PROMPT)] * N, params)
    elapsed = time.perf_counter() - start
    assert all(len(o.token_ids) == MAX_TOKENS for o in outs), "every request decodes MAX_TOKENS"
    return elapsed


def compile_ms(llm: LLM, schema: dict) -> float:
    compiler = GrammarCompiler(llm.tokenizer, llm.engine.model_config.vocab_size)
    compiler.lltokenizer  # built once per server, not per schema
    start = time.perf_counter()
    matcher = compiler.matcher(json_schema_spec(schema, "guided_json"))
    apply_grammar_masks(torch.zeros(1, llm.engine.model_config.vocab_size), [matcher])
    return (time.perf_counter() - start) * 1e3


def valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    args = parse_args(parser)
    llm = LLM(dtype="bfloat16", max_num_seqs=N)  # the server's fast path
    print(f"threads={args.threads}, default model in bfloat16, N={N}, {MAX_TOKENS} tokens each")
    variants = {"no schema": None, **SCHEMAS}
    counter = MaskCounter()
    for top_p, sampler in ((1.0, "temperature 1 (draw, then mask if refused)"),
                           (0.9, "temperature 1, top_p 0.9 (mask every token)")):
        for schema in variants.values():
            decode_seconds(llm, schema, top_p)  # warm-up: kernels, grammar cache
        times = {name: [] for name in variants}
        masked = {name: 0 for name in variants}
        for _ in range(args.rounds):
            for name, schema in variants.items():
                before = counter.rows
                times[name].append(decode_seconds(llm, schema, top_p))
                masked[name] += counter.rows - before
        free, tokens = statistics.median(times["no schema"]), N * MAX_TOKENS
        print(f"{sampler}: decode N={N}, median of {args.rounds} alternated rounds:")
        for name in variants:
            seconds = statistics.median(times[name])
            share = f"{masked[name] / (tokens * args.rounds):6.1%} of tokens masked" if variants[name] else ""
            print(f"  {name:<28} {tokens / seconds:7.1f} tok/s   time vs no schema "
                  f"{seconds / free:.3f}x   {share}")

    cold = [compile_ms(llm, FIFTY) for _ in range(smoke_or(3, 1))]
    print(f"50-property schema: compile + first mask {statistics.median(cold):.1f} ms "
          f"(median of 3, each cold); cached afterwards")

    prompts = [chat_ids(llm, f"Describe {t} as JSON with keys name, age (a number) and pets "
                             f"(a list of cat/dog/fish).") for t in smoke_or(TOPICS, TOPICS[:2])]
    for label, spec in (("unguided", None), ("guided", json_schema_spec(OWNER, "guided_json"))):
        outs = run_together(llm, prompts, [SamplingParams(max_tokens=smoke_or(120, 8), temperature=1.0, seed=s,
                                                          guided=spec) for s in range(len(prompts))])
        ok = sum(valid(o.text, OWNER) for o in outs)
        print(f"{label:>9}: {ok}/{len(outs)} answers parse and validate at temperature 1")


if __name__ == "__main__":
    main()
