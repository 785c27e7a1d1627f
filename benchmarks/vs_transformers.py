"""pagedllm's engine against Hugging Face transformers on the same weights and prompts.

    .venv/bin/python benchmarks/vs_transformers.py [--threads 2] [--max-tokens 64]

Both in bfloat16 on the default SmolLM2 GGUF, 8 prompts of 128-768 tokens of real text,
greedy, exactly --max-tokens new tokens each. transformers runs them one after another and
as one static (left-padded) batch of 8; pagedllm runs them through LLM.generate. Prints
tokens/s and the ratios, all measured in this run.
"""
from __future__ import annotations

import argparse
import os
import random
import time

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.tools.text_prompts import make_prompt_token_ids
from pagedllm.weights import default_model_path
from timing import add_smoke, smoke_or


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    add_smoke(parser)
    args = parser.parse_args()
    args.max_tokens = smoke_or(args.max_tokens, 4)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    llm = LLM(dtype="bfloat16", enable_prefix_caching=False)
    rng = random.Random(0)
    lengths = [rng.randint(*smoke_or((128, 768), (8, 24))) for _ in range(8)]
    prompts = make_prompt_token_ids(llm.tokenizer, lengths, seed=0)
    prompt_tokens = sum(lengths)
    new = args.max_tokens
    path = default_model_path()
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=torch.bfloat16).eval()
    gen = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=2)

    llm.generate(prompts[:1], SamplingParams(max_tokens=4))  # warm-up
    with torch.no_grad():
        hf.generate(torch.tensor([prompts[0]]), **{**gen, "max_new_tokens": 4, "min_new_tokens": 4})

    start = time.perf_counter()
    with torch.no_grad():
        for p in prompts:
            hf.generate(torch.tensor([p]), **gen)
    hf_seq = time.perf_counter() - start

    width = max(lengths)
    batch = torch.full((8, width), 2, dtype=torch.long)
    mask = torch.zeros((8, width), dtype=torch.long)
    for i, p in enumerate(prompts):
        batch[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    start = time.perf_counter()
    with torch.no_grad():
        hf.generate(batch, attention_mask=mask, **gen)
    hf_batch = time.perf_counter() - start

    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True))
    ours = time.perf_counter() - start
    assert all(len(o.token_ids) == new for o in outs)

    total = prompt_tokens + 8 * new
    print(f"threads={args.threads} bfloat16, 8 prompts ({prompt_tokens} prompt tokens), {new} new tokens each")
    for name, seconds in (("transformers, one at a time", hf_seq),
                          ("transformers, static batch of 8", hf_batch), ("pagedllm LLM.generate", ours)):
        print(f"{name:32s} {seconds:7.2f} s  {8 * new / seconds:7.1f} output tok/s  "
              f"{total / seconds:7.1f} total tok/s")
    print(f"pagedllm vs transformers one at a time: {hf_seq / ours:.2f}x")
    print(f"pagedllm vs transformers static batch:  {hf_batch / ours:.2f}x")


if __name__ == "__main__":
    main()
