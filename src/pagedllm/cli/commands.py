"""The client-side commands: generate, chat, plan, bench (options and what each runs)."""
from __future__ import annotations

import argparse
import os
import sys

from pagedllm.cli.options import (add_engine_args, add_lora_args, engine_config, lora_config,
                                  memory_amount, positive_int, size)
from pagedllm.config import (BENCH_MAX_TOKENS, CLI_CHAT_MAX_TOKENS, CLI_GENERATE_MAX_TOKENS,
                             DEFAULT_BLOCK_SIZE, DEFAULT_DTYPE, KV_CACHE_DTYPES, MODEL_DTYPES)


def add_generate(sub, formatter) -> None:
    gen = sub.add_parser("generate", help="one-shot generation in this process",
                         formatter_class=formatter)
    gen.add_argument("prompt", help="the text to continue")
    gen.add_argument("--max-tokens", type=positive_int, default=CLI_GENERATE_MAX_TOKENS,
                     help="tokens to generate at most")
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    gen.add_argument("--seed", type=int, default=None, help="random seed (default: none)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)


def cmd_generate(args) -> int:
    from pagedllm import LLM, SamplingParams

    llm = LLM(engine_config(args))
    prompt = args.prompt
    if args.chat:
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    for output in llm.generate([prompt], params):
        print(output.text)
    return 0


def add_chat(sub, formatter) -> None:
    chat = sub.add_parser(
        "chat", help="interactive chat in the terminal", formatter_class=formatter,
        description="Chat with a running server (--url) or with a model loaded in this process.\n"
                    "The model and engine options apply only without --url.")
    chat.add_argument("--url", default=None,
                      help="a running server, e.g. http://127.0.0.1:8000 (default: in-process)")
    chat.add_argument("--api-key", default=None,
                      help="the server's key (default: $PAGEDLLM_API_KEY)")
    chat.add_argument("--system", default=None, help="system prompt (default: none)")
    chat.add_argument("--max-tokens", type=positive_int, default=CLI_CHAT_MAX_TOKENS,
                      help="tokens per answer at most")
    chat.add_argument("--temperature", type=float, default=0.7, help="0: greedy")
    add_engine_args(chat, "model and engine (in-process only: ignored with --url)")
    chat.set_defaults(func=cmd_chat)


def cmd_chat(args) -> int:
    from pagedllm.tools.chat import ServerChat, chat_loop, line_editing, stream_in_process

    if sys.stdin.isatty():
        line_editing(os.path.join(os.path.expanduser("~"), ".pagedllm_chat_history"))

    if args.url:
        api_key = args.api_key or os.environ.get("PAGEDLLM_API_KEY")
        server = ServerChat(args.url, api_key, args.max_tokens, args.temperature)
        try:
            model = server.connect()
        except RuntimeError as exc:  # unreachable, or a key it refuses: say so before any typing
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return chat_loop(server.stream, args.system, banner=f"{model} at {args.url}")
    from pagedllm.engine.engine import LLMEngine
    engine = LLMEngine(engine_config(args))

    def stream(messages):
        return stream_in_process(engine, messages, args.max_tokens, args.temperature)
    return chat_loop(stream, args.system, banner=f"{engine.model_config.name} (in this process)")


def add_plan(sub, formatter) -> None:
    plan = sub.add_parser("plan", help="KV-cache sizing: memory for N parallel requests",
                          formatter_class=formatter)
    plan.add_argument("--model", default=None,
                      help="GGUF file or Hugging Face folder (default: the bundled SmolLM2-135M-Instruct)")
    plan.add_argument("--context", type=positive_int, default=None,
                      help="tokens per request (prompt + answer); at most the model's context "
                           "(default: the model's context, as serve serves it)")
    plan.add_argument("--parallel", default="1,2,4,8,16,32",
                      help="comma-separated counts of parallel requests to size")
    plan.add_argument("--memory", type=size, default=None,
                      help="memory to plan for, e.g. 8GiB (default: the weights and half of "
                           "this machine's available memory after them, leaving the rest to "
                           "its other users; with --device cuda the GPU's share by "
                           "--gpu-memory-utilization)")
    plan.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                      help="where the server will run the model (cuda: weights dense in "
                           "--dtype on the card, as `serve --device cuda` holds them)")
    plan.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                      help="as `serve --gpu-memory-utilization`, with --device cuda")
    plan.add_argument("--gpu-4bit-weights", action="store_true",
                      help="as `serve --gpu-4bit-weights`, with --device cuda: a GGUF's 4-bit "
                           "projections counted as held 4-bit (default: off)")
    plan.add_argument("--dtype", default=DEFAULT_DTYPE, choices=MODEL_DTYPES,
                      help="the model's dtype, as `serve --dtype`")
    plan.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                      help="as `serve --kv-cache-dtype`")
    plan.add_argument("--block-size", type=positive_int, default=DEFAULT_BLOCK_SIZE,
                      help="as `serve --block-size`")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    add_lora_args(plan.add_argument_group("LoRA adapters (as serve takes them)"))
    store = plan.add_argument_group("a model store (serve --models-dir)")
    store.add_argument("--models-dir", default=None, metavar="DIR",
                       help="size every model in DIR as the store loads it (weights + the KV "
                            "cache its engine sizes) and say which fit in --memory at once "
                            "(default: plan --model alone)")
    store.add_argument("--max-loaded-models", type=positive_int, default=3,
                       help="as `serve --max-loaded-models`")
    store.add_argument("--kv-cache-memory", type=memory_amount, default=None,
                       help="as `serve --kv-cache-memory` (default: what each engine sizes)")
    plan.set_defaults(func=cmd_plan)


def cmd_plan(args) -> int:
    if args.models_dir is not None:
        return _plan_store(args)
    from pagedllm.tools.plan import ContextTooLongError, NoGPUError
    from pagedllm.tools.plan import make_plan, print_plan
    from pagedllm.weights import ModelLoadError

    try:
        parallels = [int(p) for p in args.parallel.split(",") if p.strip()]
    except ValueError as exc:
        print(f"error: --parallel is a list of integers like 1,2,4 ({exc})", file=sys.stderr)
        return 2
    if not parallels or min(parallels) < 1:
        print("error: --parallel counts must be positive", file=sys.stderr)
        return 2
    try:
        plan = make_plan(args.model, dtype=args.dtype, context=args.context, parallels=parallels,
                         memory=args.memory, block_size=args.block_size,
                         kv_cache_dtype=args.kv_cache_dtype, device=args.device,
                         gpu_memory_utilization=args.gpu_memory_utilization,
                         gpu_4bit_weights=args.gpu_4bit_weights, lora=lora_config(args))
    except (ModelLoadError, ContextTooLongError, NoGPUError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print_plan(plan, args.json)
    return 0


def _plan_store(args) -> int:
    from pagedllm.config import EngineConfig
    from pagedllm.core import sizing
    from pagedllm.errors import ModelLoadError
    from pagedllm.serving.model_store import StoreError, scan_models_dir
    from pagedllm.tools.store_plan import plan_store, print_store_plan

    try:
        entries = scan_models_dir(args.models_dir)
        if not entries:
            raise StoreError(f"{args.models_dir} has no *.gguf file or Hugging Face folder")
        base = EngineConfig(dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                            block_size=args.block_size, kv_cache_memory=args.kv_cache_memory)
        memory = args.memory if args.memory is not None else sizing.available_memory_bytes()
        plan = plan_store(entries, base, memory, args.max_loaded_models)
    except (StoreError, ModelLoadError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print_store_plan(plan, args.json)
    return 0


def add_bench(sub, formatter) -> None:
    bench = sub.add_parser(
        "bench", help="load benchmark: N concurrent streams, recommends N", formatter_class=formatter,
        description="Sends N concurrent streaming requests at each level, measures time to first\n"
                    "token (TTFT) and time per output token (TPOT), and recommends the highest N\n"
                    "whose p95 latencies meet the targets. Writes bench.json and bench.png.")
    bench.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server to load")
    bench.add_argument("--model", default=None, help="served model name (default: the first listed)")
    bench.add_argument("--api-key", default=None,
                       help="the server's key (default: $PAGEDLLM_API_KEY or $OPENAI_API_KEY)")
    bench.add_argument("--concurrency", default="1,2,4,8",
                       help="comma-separated numbers of concurrent requests, one level each")
    bench.add_argument("--requests", type=positive_int, default=None,
                       help="requests per level (default: 3 x N, at least 6)")
    bench.add_argument("--prompt-tokens", default="128:768",
                       help="MIN:MAX prompt length in tokens, drawn uniformly")
    bench.add_argument("--max-tokens", type=positive_int, default=BENCH_MAX_TOKENS,
                       help="tokens each request generates")
    bench.add_argument("--load", default="plain", choices=("plain", "grounded"),
                       help="plain: passages of text to continue; grounded: each prompt asks "
                            "for its passage to be repeated (answers that quote their input, "
                            "where --speculative ngram helps)")
    bench.add_argument("--shared-prefix-tokens", type=int, default=0,
                       help="tokens every prompt starts with (a shared system prompt)")
    bench.add_argument("--slo-ttft-p95", type=float, default=2000.0,
                       help="target: time to first token at p95, in ms")
    bench.add_argument("--slo-tpot-p95", type=float, default=100.0,
                       help="target: time per output token at p95, in ms")
    bench.add_argument("--warmup", type=int, default=2,
                       help="short requests sent before measuring (not counted)")
    bench.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    bench.add_argument("--tokenizer", default=None,
                       help="model file whose tokenizer sizes prompts (default: the bundled model's)")
    bench.add_argument("--out", default="bench-out", help="folder for bench.json and bench.png")
    bench.add_argument("--launch", action="store_true",
                       help="start a pagedllm server for the run and stop it after")
    bench.add_argument("--launch-args", default="",
                       help="extra arguments for the launched server (default: none)")
    bench.set_defaults(func=cmd_bench)


def cmd_bench(args) -> int:
    from pagedllm.tools.bench_cli import run_bench

    return run_bench(args)


def add_client_commands(sub: argparse._SubParsersAction, formatter) -> None:
    add_chat(sub, formatter)
    add_plan(sub, formatter)
    add_bench(sub, formatter)
    add_generate(sub, formatter)
