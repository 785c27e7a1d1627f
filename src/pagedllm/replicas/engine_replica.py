"""One engine replica: an LLMEngine with its own KV pool, stepped by its own loop thread,
serving token-level requests from the ingress (already tokenized, limits already checked).

A request streams back its RequestOutputs (and queue positions); when the ingress cancels
the call (client gone, timeout, drain) the stream's exit aborts the request here, so its
blocks are freed within one step, exactly as in the single-process server."""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import socket
import threading
import time

import ray
from ray import serve

from pagedllm.config import EngineConfig
from pagedllm.engine.async_engine import AsyncEngine
from pagedllm.engine.engine import LLMEngine
from pagedllm.core.request import Request
from pagedllm.replicas.board import BOARD_NAME, ReplicaFigures
from pagedllm.replicas.transport import pack

logger = logging.getLogger("pagedllm.replica")
POST_INTERVAL_S = 0.5


class EngineReplica:
    async def __init__(self, engine_config: EngineConfig, threads: int, namespace: str):
        self.threads = threads
        # The engine is built and stepped on one thread of its own: OpenMP keeps a team of
        # workers per thread that starts parallel work, and a second team (the constructor's
        # thread's, then the loop's) made decode steps ~3x slower here (BENCHMARKS.md).
        built: concurrent.futures.Future = concurrent.futures.Future()
        self._loop_thread = threading.Thread(target=self._build_and_run,
                                             args=(engine_config, built),
                                             name="pagedllm-engine", daemon=True)
        self._loop_thread.start()
        self.engine, self.async_engine = await asyncio.wrap_future(built)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.node, self.host = ray.get_runtime_context().get_node_id(), socket.gethostname()
        self._board = ray.get_actor(BOARD_NAME, namespace=namespace)
        self._weights_version = 0
        self._poster = asyncio.get_running_loop().create_task(self._post_figures())
        logger.info("replica %s (pid %d on %s) ready: %d KV blocks, %d thread(s)", self.replica_id,
                    os.getpid(), self.host, self.engine.cache_config.num_blocks, threads)

    def _build_and_run(self, engine_config: EngineConfig, built: concurrent.futures.Future) -> None:
        import torch

        torch.set_num_threads(self.threads)  # per thread under OpenMP: set where steps run
        try:
            engine = LLMEngine(engine_config)
            async_engine = AsyncEngine(engine, start_thread=False)
        except BaseException as exc:  # noqa: BLE001 - the constructor raises it: Serve retries
            built.set_exception(exc)
            return
        built.set_result((engine, async_engine))
        async_engine.run_loop()

    def describe(self) -> dict:
        """What the ingress needs to stand in for this engine (configs, not weights)."""
        engine = self.engine
        return {"model_config": engine.model_config, "model_path": engine.model_path,
                "cache_config": engine.cache_config, "scheduler_config": engine.scheduler_config,
                "dtype": engine.dtype, "kv_memory_bytes": engine.kv_memory_bytes,
                "speculative": engine.speculator.config,
                "cpu": engine.cpu, "threads": self.threads, "replica_id": self.replica_id}

    async def generate(self, request: Request, report_position: bool = False):
        """Stream the request's outputs as packed deltas (transport.py), each item a list;
        ends after the finished one."""
        request.arrival_time = time.monotonic()  # this process's clock
        if request.params.guided is not None:  # matchers do not travel: rebuilt from the spec
            request.grammar = self.engine.grammars.matcher(request.params.guided)
        async for items in self.async_engine.submit(request, report_position).batches():
            yield pack(items)

    def check_health(self) -> None:
        """Ray Serve calls this; raising makes it replace the replica."""
        if self.async_engine.dead:
            raise RuntimeError(f"the engine is unusable: {self.async_engine.dead}")

    async def _post_figures(self) -> None:
        while True:
            try:
                figures = ReplicaFigures(self.replica_id, os.getpid(), self.engine.stats(),
                                         self.engine.waiting_by_user(), self.engine.cache_config,
                                         self.engine.cpu, node=self.node, host=self.host,
                                         snapshot=await self.async_engine.snapshot())
                version, weights = await self._board.post.remote(figures)
                if version != self._weights_version:
                    self._weights_version = version
                    self.async_engine.set_user_policies(weights, {})
            except Exception:  # noqa: BLE001 - the board may restart; figures are best effort
                logger.exception("could not post this replica's figures")
            await asyncio.sleep(POST_INTERVAL_S)

    def __del__(self):
        self.async_engine.shutdown()

