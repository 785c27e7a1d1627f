"""Command line: pagedllm serve | chat | generate."""
from __future__ import annotations

import argparse
import logging
import os
import sys

from pagedllm.config import (BENCH_MAX_TOKENS, CLI_CHAT_MAX_TOKENS, CLI_GENERATE_MAX_TOKENS,
                             DEFAULT_BLOCK_SIZE, KV_CACHE_DTYPES, MODEL_DTYPES, EngineConfig,
                             ServerConfig)


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="GGUF file or HF folder (default: SmolLM2-135M)")
    parser.add_argument("--dtype", default="bfloat16", choices=MODEL_DTYPES,
                        help="bfloat16 (default): fast, 4-bit weights kept 4-bit; float32: exact")
    parser.add_argument("--exact-activations", action="store_true",
                        help="bfloat16: never round activations to int8 for the 4-bit GEMMs "
                             "(prefill ~1.2x slower, logits closer to float32; BENCHMARKS.md)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                        help="auto (default): K/V in the model's dtype; int8: codes with a scale "
                             "per row, ~half the memory and decode-attention reads (BENCHMARKS.md)")
    parser.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    parser.add_argument("--max-num-seqs", default="auto", help="parallel slots, or 'auto'")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--kv-cache-memory", type=float, default=None,
                        help="bytes, or a fraction (0-1] of available memory")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--max-memory", type=int, default=None,
                        help="resident bytes past which new requests wait (running ones go on); "
                             "default: wait while the machine has under 10%% of its memory free")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch compute threads (default: all cores; see BENCHMARKS.md)")


def engine_config(args) -> EngineConfig:
    """The command line's engine settings as the one EngineConfig (its defaults where a flag
    is not given); raises ValueError for a bad value."""
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    memory = args.kv_cache_memory
    if memory is not None and memory > 1:
        memory = int(memory)
    max_num_seqs = args.max_num_seqs if args.max_num_seqs == "auto" else int(args.max_num_seqs)
    optional = {} if args.max_num_batched_tokens is None else {
        "max_num_batched_tokens": args.max_num_batched_tokens}
    return EngineConfig(model=args.model, dtype=args.dtype, exact_activations=args.exact_activations,
                        kv_cache_dtype=args.kv_cache_dtype, block_size=args.block_size,
                        kv_cache_memory=memory, max_num_seqs=max_num_seqs,
                        max_model_len=args.max_model_len, max_memory=args.max_memory,
                        enable_prefix_caching=not args.no_prefix_caching, **optional)


def cmd_serve(args) -> int:
    from pagedllm.server.auth import KeyFileError, parse_key_file
    from pagedllm.server.runner import check_binding, load_engine_with_progress, serve

    # Refuse a bad setup before spending time loading the model.
    refusal = check_binding(args.host, args.api_key_file, args.insecure_no_auth)
    if refusal:
        print(f"error: {refusal}", file=sys.stderr)
        return 2
    if args.api_key_file:
        try:
            parse_key_file(args.api_key_file)
        except KeyFileError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    if bool(args.ssl_certfile) != bool(args.ssl_keyfile):
        print("error: --ssl-certfile and --ssl-keyfile go together", file=sys.stderr)
        return 2
    config = server_config(args)
    engine = load_engine_with_progress(engine_config(args))
    return serve(engine, config)


def server_config(args) -> ServerConfig:
    """The command line's server settings as one frozen ServerConfig."""
    optional = {"max_body_bytes": args.max_body_bytes} if args.max_body_bytes else {}
    return ServerConfig(
        host=args.host, port=args.port, served_model_name=args.served_model_name,
        api_key_file=args.api_key_file, public_metrics=args.public_metrics,
        shared_prefix_cache=args.shared_prefix_cache,
        allowed_origins=tuple(o.strip() for o in (args.allowed_origins or "").split(",") if o.strip()),
        max_queue=args.max_queue, max_prompt_tokens=args.max_prompt_tokens,
        max_tokens_limit=args.max_tokens_limit, request_timeout=args.request_timeout,
        shutdown_grace=args.shutdown_grace, ssl_certfile=args.ssl_certfile,
        ssl_keyfile=args.ssl_keyfile, header_timeout=args.header_timeout,
        max_connections_per_client=args.max_connections_per_client, **optional)


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


def cmd_chat(args) -> int:
    from pagedllm.tools.chat import chat_loop, stream_from_server, stream_in_process

    if args.url:
        api_key = args.api_key or os.environ.get("PAGEDLLM_API_KEY")

        def stream(messages):
            return stream_from_server(args.url, messages, args.max_tokens, args.temperature, api_key)
    else:
        from pagedllm.core.engine import LLMEngine
        engine = LLMEngine(engine_config(args))

        def stream(messages):
            return stream_in_process(engine, messages, args.max_tokens, args.temperature)
    return chat_loop(stream, args.system)


def cmd_plan(args) -> int:
    from pagedllm.core import sizing
    from pagedllm.tools.plan import make_plan, print_plan
    from pagedllm.weights import ModelLoadError

    try:
        parallels = [int(p) for p in args.parallel.split(",") if p.strip()]
        memory = sizing.parse_bytes(args.memory) if args.memory else None
    except ValueError as exc:
        print(f"error: --parallel is a list of integers and --memory a size like 8GiB ({exc})",
              file=sys.stderr)
        return 2
    if not parallels or min(parallels) < 1 or args.context < 1:
        print("error: --parallel and --context must be positive", file=sys.stderr)
        return 2
    try:
        plan = make_plan(args.model, dtype=args.dtype, context=args.context, parallels=parallels,
                         memory=memory, block_size=args.block_size,
                         kv_cache_dtype=args.kv_cache_dtype)
    except ModelLoadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print_plan(plan, args.json)
    return 0


def cmd_bench(args) -> int:
    from pagedllm.tools.bench_cli import run_bench

    return run_bench(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", description="LLM inference server")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _add_engine_args(serve)
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--shutdown-grace", type=float, default=30.0,
                       help="seconds running requests get to finish on SIGTERM")
    serve.add_argument("--max-body-bytes", type=int, default=None, help="default 4 MiB")
    serve.add_argument("--header-timeout", type=float, default=10.0,
                       help="seconds a request's headers may take to arrive (slow clients are "
                            "cut off)")
    serve.add_argument("--max-connections-per-client", type=int, default=128,
                       help="open connections per client address (0: no cap; behind a proxy "
                            "every client shares its address)")
    shared = serve.add_argument_group("shared-server controls")
    shared.add_argument("--api-key-file", default=None,
                        help="lines of `NAME KEY [weight=W] [max_concurrent=C] [tokens_per_minute=T]`;"
                             " re-read on SIGHUP")
    shared.add_argument("--insecure-no-auth", action="store_true",
                        help="allow a non-loopback bind without API keys")
    shared.add_argument("--public-metrics", action="store_true", help="/metrics without a key")
    shared.add_argument("--shared-prefix-cache", action="store_true",
                        help="share cached prompt blocks across users (default: salted per user)")
    shared.add_argument("--allowed-origins", default=None, help="comma-separated CORS origins")
    shared.add_argument("--max-queue", type=int, default=None, help="waiting requests before 429")
    shared.add_argument("--max-prompt-tokens", type=int, default=None)
    shared.add_argument("--max-tokens-limit", type=int, default=None, help="cap on max_tokens")
    shared.add_argument("--request-timeout", type=float, default=None, help="seconds, then abort")
    shared.add_argument("--ssl-certfile", default=None)
    shared.add_argument("--ssl-keyfile", default=None)
    serve.set_defaults(func=cmd_serve)

    chat = sub.add_parser("chat", help="interactive chat in the terminal")
    _add_engine_args(chat)
    chat.add_argument("--url", default=None, help="a running server (default: in-process)")
    chat.add_argument("--api-key", default=None)
    chat.add_argument("--system", default=None)
    chat.add_argument("--max-tokens", type=int, default=CLI_CHAT_MAX_TOKENS)
    chat.add_argument("--temperature", type=float, default=0.7)
    chat.set_defaults(func=cmd_chat)

    plan = sub.add_parser("plan", help="KV-cache sizing: memory for N parallel requests")
    plan.add_argument("--model", default=None)
    plan.add_argument("--context", type=int, default=4096)
    plan.add_argument("--parallel", default="1,2,4,8,16,32")
    plan.add_argument("--memory", default=None, help="e.g. 8GiB (default: this machine's free memory)")
    plan.add_argument("--dtype", default="float32", choices=MODEL_DTYPES)
    plan.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    plan.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    plan.add_argument("--json", action="store_true")
    plan.set_defaults(func=cmd_plan)

    bench = sub.add_parser("bench", help="load benchmark: N concurrent streams, recommends N")
    bench.add_argument("--base-url", default="http://127.0.0.1:8000")
    bench.add_argument("--model", default=None, help="served model name (default: the first listed)")
    bench.add_argument("--api-key", default=None, help="default: $PAGEDLLM_API_KEY or $OPENAI_API_KEY")
    bench.add_argument("--concurrency", default="1,2,4,8")
    bench.add_argument("--requests", type=int, default=None,
                       help="requests per level (default: 3 x N, at least 6)")
    bench.add_argument("--prompt-tokens", default="128:768", help="MIN:MAX prompt length")
    bench.add_argument("--max-tokens", type=int, default=BENCH_MAX_TOKENS)
    bench.add_argument("--shared-prefix-tokens", type=int, default=0)
    bench.add_argument("--slo-ttft-p95", type=float, default=2000.0, help="ms")
    bench.add_argument("--slo-tpot-p95", type=float, default=100.0, help="ms")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--tokenizer", default=None, help="model file whose tokenizer sizes prompts")
    bench.add_argument("--out", default="bench-out", help="folder for bench.json and bench.png")
    bench.add_argument("--launch", action="store_true",
                       help="start a pagedllm server for the run and stop it after")
    bench.add_argument("--launch-args", default="", help="extra arguments for the launched server")
    bench.set_defaults(func=cmd_bench)

    gen = sub.add_parser("generate", help="one-shot generation")
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=CLI_GENERATE_MAX_TOKENS)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    _add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "httpcore", "matplotlib"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from pagedllm.kernels import UnsupportedISAError, capabilities

    try:
        capabilities()  # a bad PAGEDLLM_CPU_ISA is refused here, before any loading
    except UnsupportedISAError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
