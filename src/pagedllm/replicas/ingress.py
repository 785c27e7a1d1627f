"""The ingress deployment: the single-process server's FastAPI app (every route, key check,
limit and error), built over the replicas' EngineClient (front.py), which sends each
request to an engine replica."""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging

import ray
from ray import serve

from pagedllm.server.server_config import ServerConfig, connection_cap
from pagedllm.replicas.board import BOARD_NAME
from pagedllm.replicas.front import ReplicaClient
from pagedllm.server.app import create_app
from pagedllm.server.client_cap import InFlightPerClient
from pagedllm.server.metrics import ServerMetrics
from pagedllm.server.runner import ready_message

logger = logging.getLogger("pagedllm.ingress")
POLL_INTERVAL_S = 0.5


@serve.ingress()
class Ingress:
    async def __init__(self, engine_handle, config: ServerConfig, num_replicas: int,
                       namespace: str):
        description = await engine_handle.describe.remote()
        self.board = ray.get_actor(BOARD_NAME, namespace=namespace)
        self.client = client = ReplicaClient(description, num_replicas, engine_handle,
                                             self.board)
        name = config.served_model_name or client.info.model_config.name
        # --max-queue is per replica, as max_num_seqs is: the deployment queues N times it.
        if config.max_queue is not None:
            config = dataclasses.replace(config, max_queue=config.max_queue * num_replicas)
        metrics = ServerMetrics(client.figures, name, label_names=("replica",))
        self.fastapi_app = create_app(client, name, config, metrics=metrics)
        # Ray Serve's proxy holds the connections: the per-client cap counts requests here.
        self.fastapi_app.add_middleware(InFlightPerClient, limit=connection_cap(
            config.max_connections_per_client, client.info.scheduler_config.max_num_seqs))
        self.server_state = self.fastapi_app.state.pagedllm
        self.server_config = config
        self.replicas = num_replicas
        self._poller = asyncio.get_running_loop().create_task(self._poll_figures())

    def __serve_build_asgi_app__(self):
        return self.fastapi_app

    async def _poll_figures(self) -> None:
        while True:
            try:
                self.client.posted = await self.board.live.remote()
            except Exception:  # noqa: BLE001 - figures are best effort; serving goes on
                logger.exception("could not read the replicas' figures")
            await asyncio.sleep(POLL_INTERVAL_S)

    def reload_keys(self) -> None:
        self.server_state.reload_keys()

    async def drain(self, grace_seconds: float) -> int:
        """Refuse new work (503), give running requests the grace period, abort the rest;
        answers how many were aborted."""
        self.server_state.draining = True
        engine = self.client
        deadline = asyncio.get_running_loop().time() + grace_seconds
        while engine.num_in_flight and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        left = engine.num_in_flight
        engine.abort_all()
        return left

    async def ready_message(self, scheme: str = "http") -> str:
        config = self.server_config
        message = ready_message(self.client.info, config.host, config.port,
                                self.server_state.served_model_name, scheme,
                                len(self.server_state.keys.keys), config.api_key_file)
        # Where each replica runs, once they have posted their figures (twice a second).
        for _ in range(50):
            if len(self.client.posted) >= self.replicas:
                break
            await asyncio.sleep(0.1)
        hosts = collections.Counter(f"{f.host} (node {f.node[:8]})" for f in self.client.posted)
        if hosts:
            message += "\n  replicas: " + ", ".join(f"{n} on {where}" for where, n in sorted(hosts.items()))
        return message
