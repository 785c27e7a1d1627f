"""One engine-core process (its life: serving/core_process.py) and the two ZMQ sockets to it,
seen from the front end: started (spawned: the server's threads are never forked), waited
for until its model is loaded, stopped. A restart is a new EngineProcess with sockets of its own, so nothing meant for a
dead engine reaches the next one. The sockets are ipc:// files in a folder only this user
can open (mkdtemp's 0700).
"""
from __future__ import annotations

import logging
import multiprocessing
import shutil
import signal
import tempfile
import threading
import time

import zmq

from pagedllm.config import EngineConfig
from pagedllm.engine import wire
from pagedllm.engine.faults import Faults
from pagedllm.errors import AdapterError, ModelLoadError
from pagedllm.serving.client import EngineInfo
from pagedllm.serving.core_process import PROCESS_NAME, engine_core_main

__all__ = ["PROCESS_NAME", "EngineProcess", "EngineStartError"]

logger = logging.getLogger("pagedllm.engine_process")


class EngineStartError(RuntimeError):
    """The engine process could not load its model, or died before it was ready."""


class EngineProcess:
    def __init__(self, config: EngineConfig, faults: Faults, num_threads: int,
                 load_progress=None):
        self.folder = tempfile.mkdtemp(prefix="pagedllm-engine-")
        self.context = zmq.Context()
        self.to_engine = self.context.socket(zmq.PUSH)
        self.from_engine = self.context.socket(zmq.PULL)
        to_address = f"ipc://{self.folder}/to-engine"
        from_address = f"ipc://{self.folder}/from-engine"
        # Never block a sender: nothing queues for a peer that is not (or no longer) there,
        # and a busy engine's backlog is not capped (it takes it all between two steps).
        self.to_engine.setsockopt(zmq.IMMEDIATE, 1)
        self.to_engine.setsockopt(zmq.SNDHWM, 0)
        self.from_engine.setsockopt(zmq.RCVHWM, 0)
        self.to_engine.bind(to_address)
        self.from_engine.bind(from_address)
        self._send_lock = threading.Lock()  # the event loop and the run() thread both send
        spawn = multiprocessing.get_context("spawn")
        self._ready, child_end = spawn.Pipe(duplex=False)
        self.process = spawn.Process(
            target=engine_core_main, name="pagedllm-engine-core",
            args=(config, to_address, from_address, child_end, faults, num_threads,
                  load_progress))
        self.process.start()
        child_end.close()
        self.started = time.monotonic()

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def wait_ready(self, should_stop=lambda: False) -> EngineInfo:
        """The engine's description once its model is loaded; ModelLoadError for a model it
        cannot load, EngineStartError for any other failure or a death before it was ready."""
        while not should_stop():
            if self._ready.poll(0.2):
                try:
                    kind, payload = self._ready.recv()
                except EOFError:
                    break
                if kind == "ready":
                    # Its connection may still be on its way: ready once a send would go.
                    if self.to_engine.poll(30_000, zmq.POLLOUT):
                        return payload
                    break
                self.process.join(10)
                if kind == "load_error":
                    raise ModelLoadError(*payload)
                if kind == "adapter_error":
                    raise AdapterError(payload)
                raise EngineStartError(payload)
            if not self.process.is_alive():
                break
        raise EngineStartError(f"the engine process {self.exit_reason() or 'was stopped'} "
                               f"before its model was loaded")

    def send(self, message) -> bool:
        """False when the engine is not there to take it (dead, or not connected)."""
        data = wire.encoder.encode(message)
        with self._send_lock:
            try:
                self.to_engine.send(data, zmq.NOBLOCK)
            except (zmq.Again, zmq.ZMQError):
                return False
        return True

    def exit_reason(self) -> str | None:
        """How the process ended, in words; None while it runs."""
        code = self.process.exitcode
        if code is None:
            return None
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return f"was killed by {name}"
        return f"exited with code {code}"

    def close(self, grace: float = 5.0) -> None:
        """Ask the process to stop, then make sure it has; free the sockets and their files."""
        if self.process.is_alive():
            self.send(wire.Stop())
            self.process.join(grace)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(grace)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.to_engine.close(linger=0)
        self.from_engine.close(linger=0)
        self.context.term()
        self._ready.close()
        shutil.rmtree(self.folder, ignore_errors=True)
