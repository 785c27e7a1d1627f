"""Command line: pagedllm generate | serve."""
from __future__ import annotations

import argparse
import logging
import sys


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="GGUF file or HF folder (default: SmolLM2-135M)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", default="auto")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--kv-cache-memory", type=float, default=None,
                        help="bytes, or a fraction (0-1] of available memory")
    parser.add_argument("--max-model-len", type=int, default=None)


def engine_kwargs(args) -> dict:
    memory = args.kv_cache_memory
    if memory is not None and memory > 1:
        memory = int(memory)
    max_num_seqs = args.max_num_seqs if args.max_num_seqs == "auto" else int(args.max_num_seqs)
    return dict(dtype=args.dtype, block_size=args.block_size, kv_cache_memory=memory,
                max_num_seqs=max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                max_model_len=args.max_model_len)


def cmd_generate(args) -> int:
    from pagedllm import LLM, SamplingParams

    llm = LLM(args.model, **engine_kwargs(args))
    prompt = args.prompt
    if args.chat:
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            seed=args.seed)
    for output in llm.generate([prompt], params):
        print(output.text)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedllm")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="one-shot generation")
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    _add_engine_args(gen)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return {"generate": cmd_generate}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
