"""What `pagedllm serve` is asked for beyond the engine (binding, access, limits), and the
per-client connection cap its capacity implies. The engine's settings: pagedllm/config.py."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerConfig:
    """What `pagedllm serve` is asked for beyond the engine: binding, access, limits. Built
    once by the CLI, read by the server; the defaults are a shared server's safe ones."""
    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = 8000
    served_model_name: str | None = None  # None: the model's own name
    # Other names requests may use for it (fnmatch patterns: "claude-*"); answers still say
    # the served name.
    model_aliases: tuple[str, ...] = ()
    api_key_file: str | None = None
    public_metrics: bool = False  # /metrics without a key
    shared_prefix_cache: bool = False  # share cached blocks across users
    # CORS: origins ("http://app.example:3000"), or "localhost": any port on a loopback host
    # (the default, as llama.cpp's server: a team member's local web UI); () for none.
    allowed_origins: tuple[str, ...] = ("localhost",)
    max_queue: int | None = None  # waiting requests; beyond -> 429
    max_body_bytes: int = 4 << 20
    max_prompt_tokens: int | None = None
    # Prompts one request may list (each prompt x n is an engine request); OpenAI's own cap
    # on a list input is 2,048.
    max_prompts_per_request: int = 256
    max_tokens_limit: int | None = None  # cap on a request's max_tokens
    request_timeout: float | None = None  # seconds
    shutdown_grace: float = 30.0  # seconds running requests get on SIGTERM
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    header_timeout: float = 10.0  # seconds a request's headers may take to arrive
    # Open connections per client address; 0: no cap; None: the server's capacity decides
    # (connection_cap: room for as many waiting requests as run at once).
    max_connections_per_client: int | None = None
    log_level: str = "info"  # "debug" also logs /health and /metrics polls
    bench_results: str | None = None  # a folder of `pagedllm bench` outputs for the page
    # Reasoning models: how their thinking is told apart from the answer (reasoning/syntax.py:
    # "auto" reads the chat template), and the thinking tokens a request gets unless it says.
    reasoning_parser: str = "auto"
    reasoning_budget: int | None = None  # None: no limit but max_tokens
    chat_template: str | None = None  # a Jinja template in the model's place (its text)
    # How the model writes tool calls (tool_calls/syntax.py: "auto" reads the chat template).
    tool_call_parser: str = "auto"
    # How this server was started (`pagedllm serve ...`), for `pagedllm bench`'s recommended
    # command: it repeats the model or store options and changes --max-num-seqs alone.
    start_command: str = ""


MIN_CONNECTIONS_PER_CLIENT = 128


def connection_cap(asked: int | None, max_num_seqs: int) -> int:
    """Open connections one client address may hold: as asked (0: no cap), else twice the
    requests that run at once, at least 128, so one client (a benchmark, a gateway) can fill
    the batch and keep as many waiting."""
    if asked is not None:
        return asked
    return max(MIN_CONNECTIONS_PER_CLIENT, 2 * max_num_seqs)
