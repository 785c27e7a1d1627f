"""The embedding model served: one thread runs it, taking whatever requests have queued
since its last pass as one batch (continuous batching, as the engine does for generation),
so concurrent requests share forward passes instead of waiting in line one by one.

Requests come from the server's event loop (embed(), a coroutine); results go back to it as
futures resolved on that loop. Bounded: a request that would exceed MAX_QUEUED_INPUTS
waiting is refused at once (the caller answers 503), never queued without limit.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass

import numpy as np

from pagedllm.embeddings import EmbeddingQueueFull
from pagedllm.embeddings.sentence_model import SentenceModel

logger = logging.getLogger("pagedllm")

# Compute threads of the embedding model's thread (see _run).
EMBEDDING_THREADS = 1
# Inputs taken into one pass at most (a pass still splits them into padded chunks).
MAX_BATCH_INPUTS = 256
MAX_QUEUED_INPUTS = 4096


@dataclass
class _Job:
    inputs: list[list[int]]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


@dataclass
class EmbeddingFigures:
    """Counters for /metrics, written by the model's thread only."""
    requests: int = 0
    inputs: int = 0
    tokens: int = 0
    batches: int = 0
    seconds: float = 0.0


class EmbeddingService:
    def __init__(self, model: SentenceModel):
        self.model = model
        self.figures = EmbeddingFigures()
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._queued_inputs = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="pagedllm-embeddings", daemon=True)
        self._thread.start()

    @property
    def name(self) -> str:
        return self.model.name

    @property
    def num_queued_inputs(self) -> int:
        """Inputs waiting or in the pass now (a store keeps the model loaded meanwhile)."""
        return self._queued_inputs

    async def embed(self, inputs: list[list[int]]) -> np.ndarray:
        """Token id lists (checked: each 1..max_tokens ids in the vocabulary) -> vectors."""
        with self._lock:
            if self._queued_inputs + len(inputs) > MAX_QUEUED_INPUTS:
                raise EmbeddingQueueFull(f"{self._queued_inputs} inputs are waiting for the embedding model")
            self._queued_inputs += len(inputs)
        loop = asyncio.get_running_loop()
        job = _Job(inputs, loop, loop.create_future())
        self._jobs.put(job)
        return await job.future

    def shutdown(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        import torch

        # One thread: a second thread running parallel torch work gets an OpenMP team of its
        # own, and with more team threads than cores libgomp stops spinning between parallel
        # regions, which cost the chat engine ~29 % of its tokens/s for the server's life
        # after the first embedding request (BENCHMARKS.md, "Model store").
        torch.set_num_threads(EMBEDDING_THREADS)
        while True:
            first = self._jobs.get()
            if first is None:
                return
            jobs = [first]
            taken = len(first.inputs)
            while taken < MAX_BATCH_INPUTS:  # everything that queued meanwhile joins this pass
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    self._jobs.put(None)
                    break
                jobs.append(job)
                taken += len(job.inputs)
            self._run_batch(jobs)

    def _run_batch(self, jobs: list[_Job]) -> None:
        inputs = [ids for job in jobs for ids in job.inputs]
        started = time.monotonic()
        try:
            vectors = self.model.embed(inputs).numpy()
            error = None
        except Exception as exc:  # noqa: BLE001 - every waiting request gets the error
            logger.exception("embedding batch of %d inputs failed", len(inputs))
            vectors, error = None, exc
        with self._lock:
            self._queued_inputs -= len(inputs)
        f = self.figures
        f.batches += 1
        f.requests += len(jobs)
        f.inputs += len(inputs)
        f.tokens += sum(len(ids) for ids in inputs)
        f.seconds += time.monotonic() - started
        at = 0
        for job in jobs:
            result = None if vectors is None else vectors[at:at + len(job.inputs)]
            at += len(job.inputs)
            job.loop.call_soon_threadsafe(_settle, job.future, result, error)


def _settle(future: asyncio.Future, result, error) -> None:
    if future.done():  # the client went away
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
