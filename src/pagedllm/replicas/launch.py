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
from pagedllm.replicas.cluster_auth import ClusterJoinError, prepare_to_join
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


def connect_to_ray(ray_address: str | None, insecure_cluster: bool = False) -> bool:
    """ray.init, local or joining ray_address; True when the cluster asks for a token. A
    joined cluster is probed first (cluster_auth.py): an open one is refused unless
    insecure_cluster, and this process joins a token cluster in token mode, which Ray reads
    at import, so Ray is imported only after the probe."""
    uses_tokens = ray_address is None or prepare_to_join(ray_address, insecure_cluster)
    import ray

    patience = {name: os.environ.setdefault(name, value) for name, value in SERVE_PATIENCE.items()}
    ray.init(address=ray_address, namespace=NAMESPACE, include_dashboard=False,
             configure_logging=False, log_to_driver=True, runtime_env={"env_vars": patience})
    return uses_tokens


def start(engine_config: EngineConfig, config: ServerConfig, replicas: int,
          threads_per_replica: int | None = None, ray_address: str | None = None,
          router: str = "prefix", per_node: int | None = None,
          insecure_cluster: bool = False):
    """Start Ray (or join ray_address), the board and the application; returns the ingress
    handle once every replica is ready, and the board's (the board lives while it is held)."""
    threads = threads_per_replica or default_threads_per_replica(replicas)
    if ray_address is None:
        # Ray runs its workers at nice 15, as for background batch work; here they are the
        # service (a cluster joined with --ray-address keeps what its `ray start` set).
        os.environ.setdefault("RAY_worker_niceness", "0")
    if not connect_to_ray(ray_address, insecure_cluster):
        logger.warning("the Ray cluster at %s runs without token authentication "
                       "(--insecure-ray-cluster)", ray_address)
    import ray
    from ray import serve

    from pagedllm.replicas.board import BOARD_NAME, ReplicaBoard

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
    from rich.console import Console

    try:  # (Ray is imported by start, once it knows the cluster's authentication mode)
        handle, _board = start(engine_config, config, replicas, threads_per_replica, ray_address,
                               router, per_node, insecure_cluster)
    except (PlacementError, ClusterJoinError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    import ray
    from ray import serve

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
