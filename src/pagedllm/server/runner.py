"""Run the HTTP server: load with a progress bar, print where it listens, drain on SIGTERM.

SIGTERM (or Ctrl-C): stop accepting, let running requests finish for a grace period, then
abort what is left (each stream gets a final chunk with finish_reason "abort"), exit 0.
"""
from __future__ import annotations

import logging
import os
import signal
import threading

import uvicorn
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from pagedllm.config import EngineConfig, ServerConfig
from pagedllm.core import sizing
from pagedllm.core.engine import LLMEngine
from pagedllm.server.app import create_app
from pagedllm.server.auth import is_loopback
from pagedllm.server.connections import guarded_protocol

logger = logging.getLogger("pagedllm.server")
EXIT_ENGINE_DEAD = 70  # EX_SOFTWARE: the engine failed step after step
console = Console(stderr=True)


def load_engine_with_progress(config: EngineConfig) -> LLMEngine:
    with Progress(TextColumn("loading model"), BarColumn(), MofNCompleteColumn(),
                  console=console, transient=True) as progress:
        task = progress.add_task("load", total=None)

        def update(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)

        return LLMEngine(config, load_progress=update)


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
        """SIGTERM / SIGINT: refuse new work, give running requests the grace period, then
        abort what is left; uvicorn stops listening at once and exits when streams end."""
        if not self._drain_started:
            self._drain_started = True
            state = self.pagedllm_state
            state.draining = True
            logger.info("shutting down: %d request(s) in flight get %.0fs to finish",
                        state.async_engine.num_in_flight, self.grace_seconds)
            timer = threading.Timer(self.grace_seconds, state.async_engine.abort_all)
            timer.daemon = True
            timer.start()
        super().handle_exit(sig, frame)


def ready_message(engine: LLMEngine, host: str, port: int, served_name: str, scheme: str = "http") -> str:
    cache = engine.cache_config
    max_len = engine.scheduler_config.max_model_len
    full = sizing.max_full_context_requests(cache.num_blocks, cache.block_size, max_len)
    return (f"pagedllm ready at {scheme}://{host}:{port}/v1 — model {served_name} ({engine.dtype}) — "
            f"KV capacity {engine.capacity_tokens} tokens = {full} concurrent {max_len}-token "
            f"requests — max_num_seqs {engine.scheduler_config.max_num_seqs}")


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


# Test hooks, read only here: sampling fails for requests with this seed; or every engine
# step fails (a broken engine, for the exit-status test).
FAULT_SEED_ENV = "PAGEDLLM_TEST_FAIL_SAMPLING_SEED"
BROKEN_ENGINE_ENV = "PAGEDLLM_TEST_BREAK_ENGINE"


def _inject_faults(engine: LLMEngine) -> None:
    if os.environ.get(FAULT_SEED_ENV):
        seed = int(os.environ[FAULT_SEED_ENV])
        logger.warning("%s=%d: sampling fails for requests with that seed (a test hook)",
                       FAULT_SEED_ENV, seed)

        def fail(request_id, row):
            if row.params.seed == seed:
                raise RuntimeError(f"injected sampling fault for seed {seed}")

        engine.runner.fault_injector = fail
    if os.environ.get(BROKEN_ENGINE_ENV):
        logger.warning("%s: every engine step fails (a test hook)", BROKEN_ENGINE_ENV)

        def broken_step():
            raise RuntimeError("injected engine fault")

        engine.step = broken_step


def serve(engine: LLMEngine, config: ServerConfig) -> int:
    _inject_faults(engine)
    host, port, grace_seconds = config.host, config.port, config.shutdown_grace
    ssl_certfile, ssl_keyfile = config.ssl_certfile, config.ssl_keyfile
    app = create_app(engine, config.served_model_name, config, engine_thread=False)
    state = app.state.pagedllm
    http_config = uvicorn.Config(app, host=host, port=port, log_level="info",
                                 http=guarded_protocol(config.header_timeout,
                                                       config.max_connections_per_client),
                                 timeout_graceful_shutdown=int(grace_seconds) + 5,
                                 ssl_certfile=ssl_certfile, ssl_keyfile=ssl_keyfile)
    scheme = "https" if ssl_certfile else "http"
    server = DrainingServer(http_config, state, grace_seconds,
                            ready_message(engine, host, port, state.served_model_name, scheme))
    http = threading.Thread(target=server.run, name="pagedllm-http", daemon=True)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, server.handle_exit)
    signal.signal(signal.SIGHUP, lambda *_: state.reload_keys())
    http.start()
    # uvicorn's lifespan shutdown stops the loop; if uvicorn dies early, stop too.
    watchdog = threading.Thread(target=lambda: (http.join(), state.async_engine.shutdown()),
                                daemon=True)
    watchdog.start()
    state.async_engine.run_loop()
    if state.async_engine.dead:
        # Unusable: every stream already has its error; exit non-zero so a supervisor
        # (systemd's Restart=, a container's restart policy) starts a fresh process.
        logger.critical("exiting: the engine is unusable (%s)", state.async_engine.dead)
        server.should_exit = True
        http.join(timeout=10)
        return EXIT_ENGINE_DEAD
    http.join(timeout=10)
    return 0 if server.started else 1
