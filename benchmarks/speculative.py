"""Speculative decoding (n-gram proposals) against plain decoding, in one process, same host.

    .venv/bin/python benchmarks/speculative.py grounded [--requests 6] [--max-tokens 128]
        input-grounded prompts (`pagedllm bench --load grounded`'s: a passage of the bundled
        corpus, then an instruction to repeat it), default model, bfloat16, greedy: TPOT p50
        at N=1 and total tokens/s at N=16, without and with --speculative ngram, the ratios,
        and the acceptance figures. Outputs are checked to be identical.
    .venv/bin/python benchmarks/speculative.py json
        structured output: a chat request for six people as a JSON array of objects (a JSON
        schema), default model, greedy, 5 runs each: ms per token without and with n-gram
        proposals (each position verified under the grammar's mask), outputs checked equal.
    .venv/bin/python benchmarks/speculative.py verify-cost [--model PATH] [--shape-1.7b DIR]
        one decode step of one request computing 1 + k positions (k = 0..8 proposals) against
        one plain step (k = 0), on the default model and on a random model of SmolLM2-1.7B's
        shape in Q4_K_M's formats (written once into DIR): the cost ratio c(k), and the
        acceptance rate a at which k proposals pay off: (1 - a^(k+1)) / (1 - a) = c(k).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch

from pagedllm import LLM
from pagedllm.attention import AttentionMetadata
from pagedllm.config import SpeculativeConfig
from pagedllm.core.request import SamplingParams
from pagedllm.tools.text_prompts import grounded_prompt_token_ids

sys.path.insert(0, os.path.dirname(__file__))

from timing import add_smoke, smoke_or  # noqa: E402


def decode_ms(llm: LLM, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    """Milliseconds per output token after the first, and the tokens, for one request."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))  # prompt cached
    start = time.perf_counter()
    first = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))
    ttft = time.perf_counter() - start
    start = time.perf_counter()
    out = llm.generate([prompt], params)[0]
    elapsed = time.perf_counter() - start
    del first
    return (elapsed - ttft) / (max_tokens - 1) * 1000, out.token_ids


def throughput(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[float, list]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1))
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    return len(prompts) * max_tokens / (time.perf_counter() - start), [o.token_ids for o in outs]


def cmd_grounded(args) -> None:
    results, tokens = {}, {}
    for method in ("off", "ngram"):
        llm = LLM(dtype="bfloat16", speculative=SpeculativeConfig(method=method))
        prompts = grounded_prompt_token_ids(llm.tokenizer, [args.prompt_tokens] * 16, seed=1)
        tpots, outs = [], []
        for prompt in prompts[:args.requests]:
            ms, out = decode_ms(llm, prompt, args.max_tokens)
            tpots.append(ms)
            outs.append(out)
        tps, batch = throughput(llm, prompts[:smoke_or(16, 4)], args.max_tokens)
        stats = llm.engine.speculator.stats
        results[method] = (statistics.median(tpots), tps, stats)
        tokens[method] = (outs, batch)
        print(f"{method:6s} TPOT p50 at N=1 {statistics.median(tpots):6.2f} ms "
              f"(each: {', '.join(f'{t:.2f}' for t in tpots)}); N=16 {tps:7.1f} tok/s"
              + (f"; acceptance {stats.acceptance_rate:.2f}, {stats.mean_accepted_length:.2f} "
                 f"tokens a verification" if stats.num_drafts else ""))
    same = tokens["off"] == tokens["ngram"]
    print(f"identical outputs: {same}")
    off, on = results["off"], results["ngram"]
    print(f"ratio ngram/off: TPOT p50 at N=1 {on[0] / off[0]:.2f}x, total tokens/s at N=16 "
          f"{on[1] / off[1]:.2f}x   ({torch.get_num_threads()} threads)")


def cmd_json(args) -> None:
    from pagedllm.structured.spec import json_schema_spec

    schema = {"type": "array", "minItems": 6, "maxItems": 6, "items": {
        "type": "object", "properties": {"name": {"type": "string"}, "city": {"type": "string"},
                                         "age": {"type": "integer"}},
        "required": ["name", "city", "age"], "additionalProperties": False}}
    results = {}
    for method in ("off", "ngram"):
        llm = LLM(dtype="bfloat16", speculative=SpeculativeConfig(method=method))
        prompt = llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": "List six people with their city and age as JSON."}])
        params = SamplingParams(temperature=0, max_tokens=200,
                                guided=json_schema_spec(schema, "response_format"))
        llm.generate([prompt], params)
        times = []
        for _ in range(smoke_or(5, 1)):
            start = time.perf_counter()
            out = llm.generate([prompt], params)[0]
            times.append((time.perf_counter() - start) / len(out.token_ids) * 1000)
        stats = llm.engine.speculator.stats
        results[method] = (statistics.median(times), out.token_ids)
        print(f"{method:6s} {statistics.median(times):.2f} ms a token over {len(out.token_ids)} tokens"
              + (f"; acceptance {stats.acceptance_rate:.2f}, {stats.mean_accepted_length:.2f} "
                 f"tokens a verification" if stats.num_drafts else ""))
    print(f"identical outputs: {results['off'][1] == results['ngram'][1]}; ratio ngram/off "
          f"{results['ngram'][0] / results['off'][0]:.2f}x ({torch.get_num_threads()} threads)")


# -- the cost of verifying k proposals ----------------------------------------------------------
def step_ms(llm: LLM, rows: int, context: int = 256, repeat: int = 20) -> float:
    """One step of one request at position `context` computing `rows` positions, as the
    engine's runner lays out a verification (one single-token query per position)."""
    runner = llm.engine.runner
    bs = runner.block_size
    table = list(range((context + rows + bs - 1) // bs))
    ids = torch.randint(100, 1000, (context + rows,))

    def run(start: int, n: int, verify: bool):
        if verify:
            meta = AttentionMetadata.build(list(range(start, start + n)), list(range(n + 1)),
                                           list(range(start + 1, start + n + 1)), [table] * n, bs)
            meta.num_requests = 1
        else:
            meta = AttentionMetadata.build(list(range(start, start + n)), [0, n], [start + n],
                                           [table], bs)
        hidden = runner.model(ids[start:start + n], torch.arange(start, start + n),
                              runner.kv_caches, meta)
        return runner.model.compute_logits(hidden)

    run(0, context, False)
    for _ in range(smoke_or(3, 1)):
        run(context, rows, True)
    times = []
    for _ in range(smoke_or(repeat, 1)):
        start = time.perf_counter()
        run(context, rows, True)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def break_even(cost: float, k: int) -> float:
    """The acceptance rate a with (1 - a^(k+1)) / (1 - a) = cost (bisection)."""
    low, high = 0.0, 1.0
    for _ in range(60):
        a = (low + high) / 2
        tokens = (1 - a ** (k + 1)) / (1 - a)
        low, high = (a, high) if tokens < cost else (low, a)
    return (low + high) / 2


def write_random_q4_k_m(path: str) -> None:
    """Random blocks in Q4_K_M's formats (Q6_K for attn_v and ffn_down) at SmolLM2-1.7B's
    shape: what a step costs depends on shapes and formats, not on the values."""
    import gguf
    from realistic_size import SHAPE, writer_with_default_tokenizer

    def blocks(qtype: str, rows: int, cols: int, seed: int) -> np.ndarray:
        per_block, nbytes = gguf.GGML_QUANT_SIZES[getattr(gguf.GGMLQuantizationType, qtype)]
        rng = np.random.default_rng(seed)
        data = rng.integers(0, 256, size=(rows, cols // per_block, nbytes), dtype=np.uint8)
        scale = np.frombuffer(np.float16(0.001).tobytes(), dtype=np.uint8)
        for offset in {"Q4_K": (0, 2), "Q6_K": (208,)}[qtype]:
            data[:, :, offset:offset + 2] = scale
        return data.reshape(rows, -1)

    writer, vocab = writer_with_default_tokenizer(path)
    h, i = SHAPE["hidden"], SHAPE["intermediate"]
    q4k, q6k = gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K
    writer.add_tensor("token_embd.weight", blocks("Q4_K", vocab, h, 0), raw_dtype=q4k)
    writer.add_tensor("output.weight", blocks("Q6_K", vocab, h, 1), raw_dtype=q6k)
    writer.add_tensor("output_norm.weight", np.ones(h, dtype=np.float32))
    for layer in range(SHAPE["layers"]):
        for n, (rows, cols) in {"attn_q": (h, h), "attn_k": (h, h), "attn_v": (h, h),
                                "attn_output": (h, h), "ffn_gate": (i, h), "ffn_up": (i, h),
                                "ffn_down": (h, i)}.items():
            qtype = "Q6_K" if n in ("attn_v", "ffn_down") else "Q4_K"
            writer.add_tensor(f"blk.{layer}.{n}.weight", blocks(qtype, rows, cols, layer * 7 + len(n)),
                              raw_dtype=getattr(gguf.GGMLQuantizationType, qtype))
        writer.add_tensor(f"blk.{layer}.attn_norm.weight", np.ones(h, dtype=np.float32))
        writer.add_tensor(f"blk.{layer}.ffn_norm.weight", np.ones(h, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def cmd_verify_cost(args) -> None:
    models = [("default 135M (Q4_1)", None)]
    if args.shape_dir:
        path = os.path.join(args.shape_dir, "smollm2-1.7b-random-q4_k_m-layout.gguf")
        if not os.path.exists(path):
            os.makedirs(args.shape_dir, exist_ok=True)
            write_random_q4_k_m(path)
        models.append(("1.7B shape (Q4_K_M formats)", path))
    for name, path in models:
        llm = LLM(path, dtype="bfloat16", kv_cache_memory=512 << 20, max_model_len=1024)
        base = step_ms(llm, 1)
        print(f"{name}: one plain step {base:.2f} ms ({torch.get_num_threads()} threads)")
        print("   k   step ms   cost c(k)   break-even acceptance")
        for k in range(1, smoke_or(9, 3)):
            ms = step_ms(llm, k + 1)
            cost = ms / base
            print(f"  {k:2d}   {ms:7.2f}   {cost:9.2f}   {break_even(cost, k):.2f}")
        del llm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_smoke(parser)  # every command at tiny sizes, one after the other
    sub = parser.add_subparsers(dest="command", required="--smoke" not in sys.argv)
    grounded = sub.add_parser("grounded")
    grounded.add_argument("--requests", type=int, default=6)
    grounded.add_argument("--max-tokens", type=int, default=128)
    grounded.add_argument("--prompt-tokens", type=int, default=200)
    grounded.set_defaults(func=cmd_grounded)
    sub.add_parser("json").set_defaults(func=cmd_json)
    cost = sub.add_parser("verify-cost")
    cost.add_argument("--shape-dir", default=None,
                      help="folder for the random 1.7B-shaped file (written once, ~1 GB)")
    cost.set_defaults(func=cmd_verify_cost)
    args = parser.parse_args()
    if args.smoke:
        for func in (cmd_grounded, cmd_json, cmd_verify_cost):
            func(argparse.Namespace(requests=2, max_tokens=8, prompt_tokens=64, shape_dir=None))
        return
    args.func(args)


if __name__ == "__main__":
    main()
