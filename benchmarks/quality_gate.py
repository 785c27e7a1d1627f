"""The quality gate: every approximation the fast paths make, against float32, on the same
model, by perplexity on a held-out text and by the answers to fixed questions.

    .venv/bin/python benchmarks/quality_gate.py [--model PATH] [--tokens 1024]
        [--settings "bfloat16 (default),generic + fp8 weights"]

Settings (each a way to run `pagedllm serve`):
  float32                     --dtype float32: the reference (equals transformers)
  bfloat16 (default)          4-bit weights on their codes, activations as the model's size
                              chooses (config.exact_activations_for): exact everywhere under
                              1B parameters (the default model); from 1B on, small decode
                              steps exact and larger steps rounded to int8 (q4_q8_gemm)
                              except the 2 layers at each end; 8-bit head with its top-16
                              recomputed exactly
  bfloat16 exact activations  --exact-activations: no int8 rounding of activations
  bfloat16 int8 activations   --int8-activations: int8-rounded activations in steps above
                              the exact rows, whatever the model's size
  bfloat16 + int8 KV          --kv-cache-dtype int8
  bfloat16 + ngram            --speculative ngram: by construction the same greedy tokens
                              (checked here on the questions) and, sampled, the same
                              distribution (tests/test_speculative_engine.py counts it)
  generic bfloat16            --device torch-cpu: the GPU's code path (every matrix dense
                              in bfloat16), here on the CPU
  generic + fp8 weights       --device torch-cpu --gpu-fp8-weights: its projections as
                              float8 (e4m3) with a scale a row, activations per token

Perplexity: the held-out text is the docstrings of a few Python standard-library modules
(English prose, not in the bundled corpus the other benchmarks draw from), tokenized once,
scored in chunks of 256 tokens, each prefilled in one step (the prefill path: where int8
activations apply) and, for the first 256 tokens, one token a step (the decode path).
Questions: plain factual questions asked through the chat template, greedy, 24 tokens; a
setting's answer counts as right when it contains the expected word, and "same as float32"
when it is the same text.
"""
from __future__ import annotations

import argparse
import math

import torch

from pagedllm import LLM
from pagedllm.attention import AttentionMetadata
from pagedllm.config import SpeculativeConfig
from pagedllm.core.request import SamplingParams
from timing import add_smoke, smoke_or

QUESTIONS = [
    ("What is the capital of France?", "Paris"), ("What is the capital of Japan?", "Tokyo"),
    ("What is the capital of Italy?", "Rome"), ("What is the capital of Germany?", "Berlin"),
    ("What is the capital of Spain?", "Madrid"), ("What is the largest planet in our solar system?", "Jupiter"),
    ("What planet is known as the Red Planet?", "Mars"), ("What is the chemical symbol for water?", "H2O"),
    ("How many days are there in a week?", "seven"), ("What color is the sky on a clear day?", "blue"),
    ("Who wrote Romeo and Juliet?", "Shakespeare"), ("What is the freezing point of water in Celsius?", "0"),
    ("What gas do plants absorb from the air?", "carbon dioxide"), ("How many legs does a spider have?", "eight"),
    ("What is the largest ocean on Earth?", "Pacific"), ("What is the opposite of hot?", "cold"),
    ("Which animal is known as the king of the jungle?", "lion"), ("What do bees make?", "honey"),
    ("What is 2 plus 2?", "4"), ("In which continent is Egypt?", "Africa"),
]
SETTINGS = {
    "float32": dict(dtype="float32"),
    "bfloat16 (default)": dict(dtype="bfloat16"),
    "bfloat16 exact activations": dict(dtype="bfloat16", exact_activations=True),
    "bfloat16 int8 activations": dict(dtype="bfloat16", exact_activations=False),
    "bfloat16 + int8 KV": dict(dtype="bfloat16", kv_cache_dtype="int8"),
    "bfloat16 + ngram": dict(dtype="bfloat16", speculative=SpeculativeConfig(method="ngram")),
    "generic bfloat16": dict(dtype="bfloat16", device="torch-cpu"),
    "generic + fp8 weights": dict(dtype="bfloat16", device="torch-cpu", gpu_fp8_weights=True),
}
CHUNK = 256


def held_out_text() -> str:
    import argparse as a, collections, json, textwrap, string
    return "\n\n".join(m.__doc__ or "" for m in (textwrap, a, json, collections, string)) + "\n\n" + \
        "\n\n".join(f.__doc__ or "" for f in (textwrap.wrap, textwrap.dedent, json.dumps, json.loads,
                                              collections.Counter, collections.OrderedDict))


def nll(llm: LLM, ids: list[int], one_at_a_time: bool) -> tuple[float, int]:
    """Summed negative log-likelihood of ids[1:] given what precedes, and the count."""
    runner = llm.engine.runner
    bs = runner.block_size
    table = list(range(-(-len(ids) // bs)))
    total, count = 0.0, 0
    steps = [(i, i + 1) for i in range(len(ids) - 1)] if one_at_a_time else \
        [(0, len(ids))]
    for start, end in steps:
        meta = AttentionMetadata.build(list(range(start, end)), [0, end - start], [end], [table], bs)
        hidden = runner.model(torch.tensor(ids[start:end]), torch.arange(start, end),
                              runner.kv_caches, meta)
        logits = runner.model.compute_logits(hidden).float()
        targets = torch.tensor(ids[start + 1:end + 1])
        logprobs = logits[:len(targets)].log_softmax(-1)
        total -= float(logprobs.gather(1, targets[:, None]).sum())
        count += len(targets)
    return total, count


def perplexity(llm: LLM, tokens: list[int], one_at_a_time: bool) -> float:
    total, count = 0.0, 0
    for start in range(0, len(tokens) - 1, CHUNK):
        chunk = tokens[start:start + CHUNK + 1]
        if one_at_a_time and start > 0:
            break
        t, c = nll(llm, chunk, one_at_a_time)
        total, count = total + t, count + c
    return math.exp(total / count)


def answers(llm: LLM) -> list[str]:
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q, _ in QUESTIONS]
    ids = [llm.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    outs = [llm.generate([i], SamplingParams(temperature=0, max_tokens=smoke_or(24, 4)))[0]
            for i in ids[:smoke_or(len(ids), 2)]]
    return [o.text for o in outs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=1024, help="held-out tokens scored")
    parser.add_argument("--settings", default=",".join(SETTINGS),
                        help="which, comma-separated (float32, the reference, always runs)")
    add_smoke(parser)
    args = parser.parse_args()
    if args.smoke:  # two settings, a few tokens, two questions
        args.tokens, args.settings = 16, list(SETTINGS)[1]
    chosen = ["float32"] + [n for n in args.settings.split(",") if n and n != "float32"]
    unknown = [n for n in chosen if n not in SETTINGS]
    if unknown:
        parser.error(f"unknown settings {unknown}; known: {list(SETTINGS)}")
    rows, reference = [], None
    for name in chosen:
        settings = SETTINGS[name]
        llm = LLM(args.model, kv_cache_memory=256 << 20, **settings)
        tokens = llm.tokenizer.encode(held_out_text(), add_special_tokens=False)[:args.tokens + 1]
        prefill_ppl = perplexity(llm, tokens, one_at_a_time=False)
        decode_ppl = perplexity(llm, tokens, one_at_a_time=True)
        said = answers(llm)
        right = sum(word.lower() in text.lower() for text, (_, word) in zip(said, QUESTIONS))
        if reference is None:
            reference = said
        same = sum(a == b for a, b in zip(said, reference))
        rows.append((name, prefill_ppl, decode_ppl, right, same, said[0]))
        del llm
    print(f"held-out text: {args.tokens} tokens; questions: {len(QUESTIONS)}; {torch.get_num_threads()} threads")
    print(f"{'setting':28s} {'ppl prefill':>11s} {'ppl decode':>10s} {'right':>6s} {'same as f32':>11s}  first answer")
    for name, pp, dp, right, same, first in rows:
        print(f"{name:28s} {pp:11.3f} {dp:10.3f} {right:3d}/{len(QUESTIONS)} {same:8d}/{len(QUESTIONS)}  "
              f"{first.strip()[:60]!r}")


if __name__ == "__main__":
    main()
