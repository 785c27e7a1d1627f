"""`pagedllm serve --replicas N`: start (or join) Ray, run the application, take signals.

SIGHUP re-reads the API keys in the ingress; SIGTERM / SIGINT drain (503 for new work,
running requests get --shutdown-grace) and shut the application down."""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading

from pagedllm.config import EngineConfig
from pagedllm.server.server_config import ServerConfig
from pagedllm.replicas.placement import PlacementError, check_placement, ray_nodes

logger = logging.getLogger("pagedllm.replicas")
NAMESPACE = "pagedllm"
APP_NAME = "pagedllm"
ROUTERS = ("prefix", "pow2")
HEAD_RESOURCE = "node:__internal_head__"  # Ray's marker of the head node
# Ray Serve's proxy must answer its readiness check within 5 s, three times, or the
# controller kills it, and serve.start fails with it: on a loaded 2-core host its start takes
# longer. More patience, for the processes of this job (and of a cluster started here).
SERVE_PATIENCE = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
                  "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "30"}  # ours, or Ray Serve's default power-of-two-choices


def default_threads_per_replica(replicas: int) -> int:
    return max(1, (os.cpu_count() or 1) // replicas)


def build_application(engine_config: EngineConfig, config: ServerConfig, replicas: int,
                      threads_per_replica: int, router: str = "prefix",
                      imbalance_threshold: int = 2, per_node: int | None = None):
    """The Serve application: the ingress bound to N engine replicas."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from pagedllm.replicas.engine_replica import EngineReplica
    from pagedllm.replicas.ingress import Ingress
    from pagedllm.replicas.router import PrefixAffinityRouter

    if router not in ROUTERS:
        raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {router!r}")
    options = {}
    if router == "prefix":
        options["request_router_config"] = RequestRouterConfig(
            request_router_class=PrefixAffinityRouter,
            request_router_kwargs={"block_size": engine_config.block_size,
                                   "imbalance_threshold": imbalance_threshold})
    if per_node is not None:
        options["max_replicas_per_node"] = per_node
    # Each replica reserves the CPUs it computes on (placement.py), so Ray spreads them by
    # capacity; the ingress and the board only route and count (num_cpus 0).
    engine = serve.deployment(
        EngineReplica, name="engine", num_replicas=replicas,
        # The ingress bounds the queue (--max-queue, 429); Ray must not hold requests back.
        max_ongoing_requests=100_000, ray_actor_options={"num_cpus": threads_per_replica},
        health_check_period_s=2, health_check_timeout_s=30, **options)
    # The ingress on the head, beside the HTTP proxy (HeadOnly): a worker node that goes
    # takes only its replicas with it.
    ingress = serve.deployment(Ingress, name="ingress", max_ongoing_requests=100_000,
                               ray_actor_options={"num_cpus": 0,
                                                  "resources": {HEAD_RESOURCE: 0.001}})
    return ingress.bind(engine.bind(engine_config, threads_per_replica, NAMESPACE), config,
                        replicas, NAMESPACE)


def ray_token_available() -> bool:
    """Whether this machine holds a Ray auth token (where `ray start --head` writes it, or
    where Ray's environment variables point)."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return True
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token")
    return os.path.isfile(path)


def connect_to_ray(ray_address: str | None) -> None:
    """ray.init, local or joining ray_address. The pinned Ray's `ray start --head` turns on
    token authentication, which a process joining it must be told (RAY_AUTH_MODE=token) even
    with the token in ~/.ray/auth_token. Ray reads that setting once per process, so when a
    cluster refuses this one and a token is here, the command starts again with it set (a
    cluster without authentication is joined as before)."""
    import ray

    patience = {name: os.environ.setdefault(name, value) for name, value in SERVE_PATIENCE.items()}
    try:
        ray.init(address=ray_address, namespace=NAMESPACE, include_dashboard=False,
                 configure_logging=False, log_to_driver=True,
                 runtime_env={"env_vars": patience})
    except ConnectionError:
        if ray_address is None or os.environ.get("RAY_AUTH_MODE") or not ray_token_available():
            raise
        logger.warning("the Ray cluster at %s asks for its token: starting again with "
                       "RAY_AUTH_MODE=token (this machine holds one)", ray_address)
        os.environ["RAY_AUTH_MODE"] = "token"
        os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


class OpenClusterError(RuntimeError):
    """A --ray-address cluster without token authentication (the message says how to fix it)."""


def open_cluster_refusal(ray_address: str | None, token_mode: bool, allow: bool) -> str | None:
    """Why joining this cluster is refused, or None. A cluster started with `ray start` listens
    on its node's network address: without a token anyone who reaches that port can run code
    on every node (Ray's own warning), so it is refused unless the admin says otherwise."""
    if ray_address is None or token_mode or allow:
        return None
    return (f"the Ray cluster at {ray_address} runs without token authentication: anyone who "
            f"can reach its port can run any code on its nodes. Start it with a token (README, "
            f"\"Several machines\"): on the head `ray get-auth-token --generate`, then `ray "
            f"start --head ...`; on each other node `RAY_AUTH_MODE=token RAY_AUTH_TOKEN=<that "
            f"token> ray start --address ...`. On a private network you trust, "
            f"--insecure-ray-cluster joins it as it is.")


def cluster_uses_tokens() -> bool:
    """Whether this process joined its cluster with token authentication (connected: the
    cluster asks for the token exactly when this process's mode is token)."""
    from ray._raylet import AuthenticationMode, get_authentication_mode

    return get_authentication_mode() == AuthenticationMode.TOKEN


def start(engine_config: EngineConfig, config: ServerConfig, replicas: int,
          threads_per_replica: int | None = None, ray_address: str | None = None,
          router: str = "prefix", per_node: int | None = None,
          insecure_cluster: bool = False):
    """Start Ray (or join ray_address), the board and the application; returns the ingress
    handle once every replica is ready, and the board's (the board lives while it is held)."""
    import ray
    from ray import serve

    from pagedllm.replicas.board import BOARD_NAME, ReplicaBoard

    threads = threads_per_replica or default_threads_per_replica(replicas)
    if ray_address is None:
        # Ray runs its workers at nice 15, as for background batch work; here they are the
        # service (a cluster joined with --ray-address keeps what its `ray start` set).
        os.environ.setdefault("RAY_worker_niceness", "0")
    connect_to_ray(ray_address)
    refusal = open_cluster_refusal(ray_address, cluster_uses_tokens(), insecure_cluster)
    if refusal is not None:
        ray.shutdown()
        raise OpenClusterError(refusal)
    if ray_address is not None and not cluster_uses_tokens():
        logger.warning("the Ray cluster at %s runs without token authentication "
                       "(--insecure-ray-cluster)", ray_address)
    try:
        check_placement(ray_nodes(), replicas, threads, per_node)
    except PlacementError:
        ray.shutdown()
        raise
    # The board on the head (this process's node), restarted elsewhere if that node is lost:
    # placed anywhere, it went down with a worker node and took every replica's figures along.
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
    board = ReplicaBoard.options(name=BOARD_NAME, namespace=NAMESPACE, get_if_exists=True,
                                 scheduling_strategy=here, max_restarts=-1).remote()
    # HTTP comes in at the head only (where --host and --port were given): a proxy on every
    # node would also listen there, and two nodes on one machine would fight over the port.
    serve.start(proxy_location="HeadOnly", http_options={"host": config.host, "port": config.port})
    app = build_application(engine_config, config, replicas, threads, router, per_node=per_node)
    return serve.run(app, name=APP_NAME, route_prefix="/"), board


def serve_replicas(engine_config: EngineConfig, config: ServerConfig, replicas: int,
                   threads_per_replica: int | None = None, ray_address: str | None = None,
                   router: str = "prefix", per_node: int | None = None,
                   insecure_cluster: bool = False) -> int:
    import ray
    from ray import serve
    from rich.console import Console

    try:
        handle, _board = start(engine_config, config, replicas, threads_per_replica, ray_address,
                               router, per_node, insecure_cluster)
    except (PlacementError, OpenClusterError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    Console(highlight=False).print(handle.ready_message.remote().result(), soft_wrap=True)
    stop = threading.Event()
    signal.signal(signal.SIGHUP, lambda *_: handle.reload_keys.remote())
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(0.5):  # a timed wait, so the signal handlers get to run
        pass
    try:
        aborted = handle.drain.remote(config.shutdown_grace).result(
            timeout_s=config.shutdown_grace + 10)
        if aborted:
            logger.info("grace period over: aborted %d request(s)", aborted)
    finally:
        serve.delete(APP_NAME)
        serve.shutdown()
        ray.shutdown()
    return 0
