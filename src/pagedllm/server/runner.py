"""Run the HTTP server: load with a progress bar, print where it listens, drain on SIGTERM.

SIGTERM (or Ctrl-C): refuse new work with 503 (/health too, so a load balancer stops sending)
while still listening, let running requests finish for a grace period, then cut what is left
short (each stream gets a final chunk, finish_reason "length" and an error saying why), exit 0.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time

import uvicorn
from rich.console import Console

from pagedllm.server.server_config import ServerConfig
from pagedllm.core import sizing
from pagedllm.server.app import create_app
from pagedllm.server.auth import is_loopback
from pagedllm.server.connections import guarded_protocol
from pagedllm.serving.client import EngineClient, EngineInfo

logger = logging.getLogger("pagedllm.server")
EXIT_ENGINE_DEAD = 70  # EX_SOFTWARE: the engine failed step after step
console = Console(stderr=True)


class DrainingServer(uvicorn.Server):
    """uvicorn on a helper thread; the main thread runs the engine and takes the signals."""

    def __init__(self, config: uvicorn.Config, state, grace_seconds: float, ready_message: str):
        super().__init__(config)
        self.pagedllm_state = state
        self.grace_seconds = grace_seconds
        self.ready_message = ready_message
        self._drain_started = False

    async def startup(self, sockets=None):
        await super().startup(sockets)
        if self.started:
            console.print(self.ready_message, soft_wrap=True)

    def handle_exit(self, sig, frame):
        """SIGTERM / SIGINT: refuse new work (503, /health too) while still listening, give
        running requests the grace period, abort what is left, then stop uvicorn, which exits
        when the last streams have ended. A second signal stops at once."""
        if self._drain_started:
            return super().handle_exit(sig, frame)
        self._drain_started = True
        state = self.pagedllm_state
        state.draining = True
        logger.info("shutting down: %d request(s) in flight get %.0fs to finish",
                    state.client.num_in_flight, self.grace_seconds)
        threading.Thread(target=self._drain, args=(sig, frame), name="pagedllm-drain",
                         daemon=True).start()

    def _drain(self, sig, frame) -> None:
        engine = self.pagedllm_state.client
        deadline = time.monotonic() + self.grace_seconds
        while engine.num_in_flight and time.monotonic() < deadline and not self.should_exit:
            time.sleep(0.05)
        if engine.num_in_flight:
            logger.info("grace period over: aborting %d request(s)", engine.num_in_flight)
            engine.abort_all()
        super().handle_exit(sig, frame)


def ready_message(info: EngineInfo | None, host: str, port: int, served_name: str,
                  scheme: str = "http", keys: int | None = None, key_file: str | None = None,
                  embeddings=None, pool=None, chat_syntax: str | None = None) -> str:
    """What an admin needs to see once: where, what model (or store), how much fits, who
    may use it."""
    wildcard = host in ("0.0.0.0", "::", "")
    shown_host = socket.gethostname() if wildcard else (f"[{host}]" if ":" in host else host)
    where = f"{scheme}://{shown_host}:{port}"
    lines = [f"pagedllm ready: the page at {where}/"
             + (f", listening on every interface ({host})" if wildcard else "")]
    # Each base URL as its clients take it: OpenAI's with /v1; Anthropic's and Ollama's
    # clients add their own paths (/v1/messages, /api/chat) to the bare address.
    lines.append(f"  base URLs: OpenAI {where}/v1, Anthropic and Ollama {where}")
    if info is None:  # a model store (`pool`): what it holds and its bounds
        lines += _store_lines(pool)
    else:
        lines += _model_lines(info, served_name)
    if embeddings is not None:
        model = embeddings.model
        lines.append(f"  embeddings: {embeddings.name} ({model.dimensions} dimensions, up to "
                     f"{model.max_tokens} tokens an input, {model.dtype} products) at "
                     f"/v1/embeddings and /api/embed")
    if chat_syntax:
        lines.append(chat_syntax)
    lines.append("  API keys: " + (
        f"on, {keys} key(s) from {key_file}" if key_file else
        "off (loopback only: anyone on this machine may use it)" if is_loopback(host) else
        "off: ANYONE who can reach this address may use it"))
    spec = info.speculative if info is not None else pool.base_config.speculative
    if spec.method != "off":
        source = f"draft model {spec.draft_model}" if spec.method == "draft" else spec.method
        lines.append(f"  speculative decoding: {source}, up to {spec.num_speculative_tokens} "
                     f"proposed tokens a step (a request may say \"speculative\": \"off\")")
    if info is not None and info.device == "cuda":
        lines.append(f"  device: cuda ({info.device_name or 'GPU'}); host: {info.compute} of "
                     f"{os.cpu_count()} cores")
    elif info is not None:
        lines.append(f"  device: {info.device}; CPU: {info.cpu.summary} kernels, {info.compute} of "
                     f"{os.cpu_count()} cores")
    else:
        device = "cuda" if pool.base_config.device == "cuda" else "cpu"
        lines.append(f"  device: {device}; {pool.num_threads} compute "
                     f"thread(s) (--threads) of {os.cpu_count()} cores: the first model loaded "
                     f"holds them, the others one each")
    return "\n".join(lines)


def chat_syntax_lines(state) -> str | None:
    """How the model's tool calls and thinking are read (what `auto` chose), for one model."""
    if state.pool is not None:
        return None
    tools = state.template_tools()
    how = ("--tool-call-parser" if state.config.tool_call_parser != "auto" else
           "auto: from the chat template" if tools.renders_tools else
           "auto: the chat template renders no tools, so pagedllm writes them into the system "
           "prompt")
    lines = [f"  tool-call parser: {tools.syntax.name} ({how})"]
    reasoning = reasoning_line(state)
    return "\n".join(lines + ([reasoning] if reasoning else []))


def reasoning_line(state) -> str | None:
    """The reasoning parser in use (the one `auto` chose), for a model that thinks or when
    one was asked for by name."""
    asked, syntax = state.config.reasoning_parser, state.reasoning_syntax()
    if syntax is None:
        return None if asked == "auto" else f"  reasoning parser: none (--reasoning-parser {asked})"
    budget = state.config.reasoning_budget
    how = "auto: from the chat template" if asked == "auto" else "--reasoning-parser"
    return (f"  reasoning parser: {syntax.name} ({how}): thinking between {syntax.start} and "
            f"{syntax.end} comes back apart from the answer"
            + (f"; at most {budget} thinking tokens unless a request says"
               if budget else ""))


def _store_lines(pool) -> list[str]:
    from pagedllm.core.residency import FOREVER

    names = pool.catalog.names
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    keep = ("forever" if pool.keep_alive == FOREVER else f"{pool.keep_alive:g} s")
    memory = ("" if pool.max_memory is None
              else f", within {pool.max_memory / 2**20:,.0f} MiB (--max-memory)")
    return [f"  model store: {len(names)} model(s): {shown}",
            f"  each loaded on its first request, at most {pool.max_loaded_models} at once "
            f"(--max-loaded-models){memory}; idle ones unloaded after {keep} (--keep-alive, or "
            f"a request's keep_alive)"]


def _model_lines(info: EngineInfo, served_name: str) -> list[str]:
    cache, scheduler = info.cache_config, info.scheduler_config
    lines = []
    longest = info.model_config.max_position_embeddings
    cut = (f" (the model's is {longest:,}: raise --kv-cache-memory to serve more)"
           if scheduler.max_model_len < longest else "")
    lines.append(f"  model {served_name}: {info.dtype}, KV cache {cache.cache_dtype}, "
                 f"context up to {scheduler.max_model_len:,} tokens{cut}")
    full = sizing.max_full_context_requests(cache.num_blocks, cache.block_size, scheduler.max_model_len)
    lines.append(f"  KV cache {info.kv_memory_bytes / 2**20:,.0f} MiB = {info.capacity_tokens:,} "
                 f"tokens; {scheduler.max_num_seqs} requests run in parallel (max_num_seqs), "
                 f"{full} of them at the full context at once")
    return lines


def _connection_cap(client: EngineClient, config: ServerConfig) -> int:
    from pagedllm.server.server_config import connection_cap

    pool = getattr(client, "catalog", None)  # a store: its base settings' batch
    seqs = (client.info.scheduler_config.max_num_seqs if client.info is not None else
            client.base_config.max_num_seqs if pool is not None else 0)
    return connection_cap(config.max_connections_per_client,
                          seqs if isinstance(seqs, int) else 0)


class PollFilter(logging.Filter):
    """Keeps health checks and metric scrapes (every few seconds, all day) out of the access
    log; --log-level debug shows them."""

    QUIET_PATHS = ("/health", "/metrics")

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            return args[2].split("?")[0] not in self.QUIET_PATHS
        return True


def port_in_use(host: str, port: int) -> str | None:
    """Why (host, port) cannot be listened on now, or None: checked before the model loads,
    so a busy port is said in a second, not after a minute of loading."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host.strip("[]"), port))
        except OSError as exc:
            return (f"cannot listen on {host}:{port} ({exc.strerror or exc}); another server "
                    f"may hold the port: choose another with --port")
    return None


def check_binding(host: str, api_key_file: str | None, insecure_no_auth: bool) -> str | None:
    """Why this bind is refused, or None. Off loopback, a server needs keys."""
    if is_loopback(host) or api_key_file:
        return None
    if insecure_no_auth:
        console.print(f"[bold red]WARNING: serving on {host} with NO API KEYS: anyone who can "
                      f"reach this address can use the model and read /metrics.[/]")
        return None
    return (f"refusing to listen on {host} without API keys: anyone on the network could use "
            f"the server. Create a key file with one `NAME KEY` line per user, e.g.\n"
            f"  echo \"alice $(python3 -c 'import secrets; print(secrets.token_urlsafe(24))')\" > keys.txt\n"
            f"and pass --api-key-file keys.txt (or --insecure-no-auth if you really mean it).")


def serve(client: EngineClient, config: ServerConfig, embeddings=None) -> int:
    """Serve HTTP from a helper thread while the engine client runs on this (the main)
    thread, until SIGTERM/SIGINT and the drain; SIGHUP reloads the API keys."""
    host, port, grace_seconds = config.host, config.port, config.shutdown_grace
    ssl_certfile, ssl_keyfile = config.ssl_certfile, config.ssl_keyfile
    app = create_app(client, config.served_model_name, config, embeddings=embeddings)
    state = app.state.pagedllm
    http_config = uvicorn.Config(app, host=host, port=port, log_level=config.log_level,
                                 http=guarded_protocol(config.header_timeout,
                                                       _connection_cap(client, config)),
                                 timeout_graceful_shutdown=int(grace_seconds) + 5,
                                 ssl_certfile=ssl_certfile, ssl_keyfile=ssl_keyfile)
    scheme = "https" if ssl_certfile else "http"
    if config.log_level != "debug":
        logging.getLogger("uvicorn.access").addFilter(PollFilter())
    server = DrainingServer(http_config, state, grace_seconds,
                            ready_message(client.info, host, port, state.served_model_name, scheme,
                                          len(state.keys.keys), config.api_key_file, embeddings,
                                          state.pool, chat_syntax_lines(state)))
    http = threading.Thread(target=server.run, name="pagedllm-http", daemon=True)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, server.handle_exit)
    signal.signal(signal.SIGHUP, lambda *_: state.reload_keys())
    http.start()
    # uvicorn's lifespan shutdown stops the loop; if uvicorn dies early, stop too.
    watchdog = threading.Thread(target=lambda: (http.join(), client.shutdown()), daemon=True)
    watchdog.start()
    client.run()
    if client.dead:
        # Unusable: every stream already has its error; exit non-zero so a supervisor
        # (systemd's Restart=, a container's restart policy) starts a fresh process.
        logger.critical("exiting: the engine is unusable (%s)", client.dead)
        server.should_exit = True
        http.join(timeout=10)
        return EXIT_ENGINE_DEAD
    http.join(timeout=10)
    return 0 if server.started else 1
