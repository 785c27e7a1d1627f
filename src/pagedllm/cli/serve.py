"""`pagedllm serve`: its options, the frozen ServerConfig they make, and the command."""
from __future__ import annotations

import argparse
import dataclasses
import signal
import sys

from pagedllm.cli.options import add_engine_args, positive_int, positive_seconds, size
from pagedllm.reasoning.syntax import CHOICES as REASONING_PARSERS
from pagedllm.tool_calls.syntax import CHOICES as TOOL_CALL_PARSERS
from pagedllm.server.server_config import ServerConfig
from pagedllm.serving.stall_watch import STALL_AFTER_S

LOG_LEVELS = ("debug", "info", "warning", "error")


def add_serve_args(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("--config", default=None, metavar="FILE",
                       help="a TOML file of serve options (`max-num-seqs = 8`); options given "
                            "on the command line win (example: docs/pagedllm.toml)")
    serve.add_argument("--print-config", action="store_true",
                       help="print the options in effect as a config file and exit")
    add_engine_args(serve)
    _add_http_args(serve.add_argument_group("HTTP"))
    _add_store_args(serve.add_argument_group(
        "model store (several models, loaded on demand; Ollama's behaviour)"))
    _add_shared_args(serve.add_argument_group("shared-server controls"))
    _add_replica_args(serve.add_argument_group(
        "replicas (Ray Serve; needs `pip install pagedllm[ray]`)"))
    serve.set_defaults(func=cmd_serve)


def _add_http_args(http) -> None:
    http.add_argument("--host", default="127.0.0.1",
                      help="address to listen on; anything but loopback needs --api-key-file")
    http.add_argument("--port", type=int, default=8000, help="TCP port")
    http.add_argument("--served-model-name", default=None,
                      help="the model name clients send (default: the model's own name)")
    http.add_argument("--embedding-model", default=None, metavar="NAME|PATH",
                      help="also serve an embedding model at /v1/embeddings and /api/embed: "
                           "all-minilm (all-MiniLM-L6-v2, installed with pagedllm), a "
                           "sentence-transformers folder of a BERT model, or a decoder "
                           "model's GGUF file or folder (see --pooling) (default: none)")
    http.add_argument("--embedding-dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                      help="a BERT embedding model's matrix products: auto (bfloat16 where the "
                           "CPU multiplies bf16 natively, ~2x faster, vectors within cosine "
                           "0.99995 of float32's; else float32), float32 (exact), bfloat16")
    http.add_argument("--pooling", default=None, choices=("last", "mean"),
                      help="with --embedding-model a decoder model (GGUF or folder): pool its "
                           "final hidden states by the last token or the mean of the input's "
                           "(default: the GGUF's pooling_type, else last), L2-normalised")
    http.add_argument("--model-alias", default=None, metavar="NAMES",
                      help="comma-separated other names the model answers to, so a tool with "
                           "a hard-coded name connects; * matches any text (gpt-4o-mini,claude-*); "
                           "default: none")
    http.add_argument("--log-level", default="info", choices=LOG_LEVELS,
                      help="info logs API requests; debug also /health and /metrics polls")
    http.add_argument("--shutdown-grace", type=float, default=30.0,
                      help="seconds running requests get to finish on SIGTERM (/health answers "
                           "503 meanwhile)")
    http.add_argument("--max-body-bytes", type=size, default=ServerConfig.max_body_bytes,
                      help="largest request body (413 beyond)")
    http.add_argument("--header-timeout", type=float, default=10.0,
                      help="seconds a request's headers may take to arrive (slow clients are "
                           "cut off)")
    http.add_argument("--max-connections-per-client", type=int, default=None,
                      help="open connections per client address (0: no cap; behind a proxy "
                           "every client shares its address; default: twice --max-num-seqs, "
                           "at least 128)")
    http.add_argument("--ssl-certfile", default=None, help="TLS certificate (PEM), with --ssl-keyfile (default: plain HTTP)")
    http.add_argument("--ssl-keyfile", default=None, help="TLS private key (PEM), with --ssl-certfile (default: plain HTTP)")
    http.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=False,
                      help="run the engine (scheduler and model steps) in a process of its own, "
                           "this one keeping HTTP, tokenizing and detokenizing; a crashed engine "
                           "process is restarted while the server goes on (default: off, one "
                           "process: see BENCHMARKS.md, \"The engine in its own process\")")
    http.add_argument("--engine-stall-timeout", type=positive_seconds, default=STALL_AFTER_S,
                      metavar="SECONDS",
                      help="with --engine-process: an engine silent this long while requests "
                           "wait counts as stalled (/health and new requests 503 "
                           "engine_stalled, logged), and is restarted after 6 times as long")
    http.add_argument("--reasoning-parser", default="auto", choices=REASONING_PARSERS,
                      help="how a reasoning model's thinking is told from its answer and "
                           "returned apart (OpenAI's reasoning_content, Ollama's thinking, "
                           "Anthropic's thinking blocks): auto reads the chat template and "
                           "vocabulary (vLLM's names); none leaves it in the answer")
    http.add_argument("--reasoning-budget", type=positive_int, default=None, metavar="TOKENS",
                      help="thinking tokens a request gets unless it says (Anthropic's "
                           "thinking.budget_tokens): then the end of the thinking is written "
                           "into the answer and the model answers (default: no limit)")
    http.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                      help="a Jinja chat template (a file, or the template itself) used "
                           "instead of the model's own, for models whose template is wrong "
                           "or missing (default: the model's)")
    http.add_argument("--tool-call-parser", default="auto", choices=TOOL_CALL_PARSERS,
                      help="the syntax the model writes tool calls in, read back into "
                           "tool_calls: auto reads the chat template (vLLM's names; a template "
                           "that renders no tools is given them in Hermes' syntax)")
    http.add_argument("--bench-results", default=None, metavar="DIR",
                      help="a folder of `pagedllm bench --out` results; the page at / shows "
                           "the newest (default: none)")


def _add_store_args(store) -> None:
    store.add_argument("--models-dir", default=None, metavar="DIR",
                       help="serve every model in DIR (each *.gguf file, each Hugging Face "
                            "folder), by its file or folder name, each loaded on its first "
                            "request; [models] entries in --config add more, with their own "
                            "options (default: the one --model)")
    store.add_argument("--max-loaded-models", type=positive_int, default=3,
                       help="with a store: models loaded at once; a new one unloads the least "
                            "recently used idle one (Ollama's OLLAMA_MAX_LOADED_MODELS)")
    store.add_argument("--keep-alive", default="5m",
                       help="with a store: how long an idle model stays loaded (\"5m\", "
                            "\"1h\", seconds; 0 unloads once idle, -1 never); a request's "
                            "keep_alive wins (Ollama's OLLAMA_KEEP_ALIVE)")


def _add_shared_args(shared) -> None:
    shared.add_argument("--api-key-file", default=None,
                        help="lines of `NAME KEY [weight=W] [max_concurrent=C] "
                             "[tokens_per_minute=T]`, re-read on SIGHUP; manage it with "
                             "`pagedllm keys` (default: no keys, loopback only)")
    shared.add_argument("--insecure-no-auth", action="store_true",
                        help="allow a non-loopback bind without API keys")
    shared.add_argument("--public-metrics", action="store_true", help="/metrics without a key")
    shared.add_argument("--shared-prefix-cache", action="store_true",
                        help="share cached prompt blocks across users (otherwise salted per user)")
    shared.add_argument("--allowed-origins", default=None,
                        help="comma-separated CORS origins; `localhost` is any port on a "
                             "loopback host, `none` no origin (default: localhost, as "
                             "llama.cpp's server)")
    shared.add_argument("--max-queue", type=int, default=None,
                        help="waiting requests before 429 (default: unbounded)")
    shared.add_argument("--max-prompt-tokens", type=positive_int, default=None,
                        help="longest prompt accepted (default: the context)")
    shared.add_argument("--max-prompts-per-request", type=positive_int,
                        default=ServerConfig.max_prompts_per_request,
                        help="prompts one /v1/completions request may list")
    shared.add_argument("--max-tokens-limit", type=positive_int, default=None,
                        help="cap on a request's max_tokens (default: the context)")
    shared.add_argument("--request-timeout", type=float, default=None,
                        help="seconds a request may run before it is cut short (default: none)")


def _add_replica_args(scale) -> None:
    scale.add_argument("--replicas", type=positive_int, default=None,
                       help="run N engine replicas behind one ingress on Ray Serve, each with "
                            "its own KV pool (default: one engine in this process, no Ray)")
    scale.add_argument("--ray-address", default=None, metavar="ADDRESS",
                       help="join this Ray cluster (`ray start --head` prints it) instead of "
                            "starting a local one (default: a local one)")
    scale.add_argument("--insecure-ray-cluster", action="store_true",
                       help="join a --ray-address cluster that runs without token "
                            "authentication (anyone who reaches its port can run code on its "
                            "nodes): only on a private network you trust (default: refused)")
    scale.add_argument("--threads-per-replica", type=positive_int, default=None,
                       help="compute threads of each replica (default: this machine's cores "
                            "divided among the replicas)")
    scale.add_argument("--replicas-per-node", type=positive_int, default=None,
                       help="at most this many replicas on one Ray node (default: as many as "
                            "its CPUs hold, each replica reserving --threads-per-replica)")
    scale.add_argument("--router", default="prefix", choices=("prefix", "pow2"),
                       help="prefix: to the replica holding the request's leading KV blocks "
                            "unless it is busier; pow2: Ray Serve's power of two choices")


def server_config(args) -> ServerConfig:
    """The command line's server settings as one frozen ServerConfig."""
    return ServerConfig(
        host=args.host, port=args.port, served_model_name=args.served_model_name,
        api_key_file=args.api_key_file, public_metrics=args.public_metrics,
        shared_prefix_cache=args.shared_prefix_cache,
        model_aliases=_names(args.model_alias), allowed_origins=_origins(args.allowed_origins),
        max_queue=args.max_queue, max_prompt_tokens=args.max_prompt_tokens,
        max_prompts_per_request=args.max_prompts_per_request,
        max_tokens_limit=args.max_tokens_limit, request_timeout=args.request_timeout,
        shutdown_grace=args.shutdown_grace, ssl_certfile=args.ssl_certfile,
        ssl_keyfile=args.ssl_keyfile, header_timeout=args.header_timeout,
        max_connections_per_client=args.max_connections_per_client,
        max_body_bytes=args.max_body_bytes, log_level=args.log_level,
        bench_results=args.bench_results, reasoning_parser=args.reasoning_parser,
        reasoning_budget=args.reasoning_budget, chat_template=args.chat_template,
        tool_call_parser=args.tool_call_parser)


def start_command(argv: list[str] | None = None) -> str:
    """`pagedllm serve` and the options it was given, as one line a shell takes back."""
    import shlex

    argv = sys.argv[1:] if argv is None else argv
    if "serve" in argv:
        argv = argv[argv.index("serve") + 1:]
    return shlex.join(["pagedllm", "serve", *argv])


def _origins(text: str | None) -> tuple[str, ...]:
    """--allowed-origins: None is the default (loopback origins), `none` no origin at all."""
    if text is None:
        return ServerConfig.allowed_origins
    return () if text.strip().lower() == "none" else _names(text)


def _names(text: str | None) -> tuple[str, ...]:
    return tuple(n.strip() for n in (text or "").split(",") if n.strip())


def cmd_serve(args) -> int:
    from pagedllm.cli.embedding_model import EmbeddingModelError, load_embeddings
    from pagedllm.cli.engine_loading import load_with_progress
    from pagedllm.cli.serve_checks import (MODEL_HINT, SetupError, adapter_name_clash,
                                           check_engine_setup, check_server_setup)
    from pagedllm.cli.serve_store import serve_store, store_table
    from pagedllm.errors import AdapterError, ModelLoadError
    from pagedllm.server.loading import LoadingServer
    from pagedllm.server.runner import serve

    try:  # refuse a bad setup before spending time loading the model
        check_server_setup(args)
        engine_settings = check_engine_setup(args)
    except SetupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    config = dataclasses.replace(server_config(args), start_command=start_command())
    if args.models_dir is not None or store_table(args):
        return serve_store(args, engine_settings, config)
    if args.replicas is not None:
        return _serve_replicas(args, engine_settings, config)
    # `pagedllm keys` may signal a reload while the model loads: SIGHUP's default would end
    # the process, and the key file is read once loading ends anyway.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        # Until the model is ready the port answers 503 "loading" (server/loading.py).
        with LoadingServer(args.host, args.port, args.ssl_certfile, args.ssl_keyfile):
            client = load_with_progress(engine_settings, args.engine_process, args.threads,
                                        args.engine_stall_timeout)
            embeddings = load_embeddings(args.embedding_model, args.pooling, args.embedding_dtype)
    except ModelLoadError as exc:
        print(f"error: {exc}; {MODEL_HINT}", file=sys.stderr)
        return 2
    except (EmbeddingModelError, AdapterError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    clash = adapter_name_clash(client, config, args.lora or ())
    if clash is not None:
        print(f"error: --lora: {clash}", file=sys.stderr)
        client.shutdown()
        return 2
    return serve(client, config, embeddings)


def _serve_replicas(args, engine_settings, config) -> int:
    if args.threads:
        print("error: with --replicas, give --threads-per-replica instead of --threads",
              file=sys.stderr)
        return 2
    try:
        from pagedllm.replicas.launch import serve_replicas
    except ImportError as exc:
        print(f"error: --replicas needs Ray Serve ({exc}); install it with "
              f"`pip install 'pagedllm[ray]'`", file=sys.stderr)
        return 2
    return serve_replicas(engine_settings, config, args.replicas, args.threads_per_replica,
                          args.ray_address, args.router, args.replicas_per_node,
                          args.insecure_ray_cluster)
