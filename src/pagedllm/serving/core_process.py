"""The engine-core process's whole life (`serve --engine-process`): load the model, say
ready (or why not), then move engine/wire.py messages between the front end's sockets and
the engine core (engine/core.py), busy-looping while there is work and never waiting on HTTP
(vLLM V1's EngineCore process, SGLang's scheduler process).

Its front end (serving/process_client.py) starts it (serving/engine_process.py), sends it
requests as token ids and reads each step's new token ids back. Between steps it takes every
message waiting without blocking; with nothing to run it blocks on its socket, and notices a
front end that went away, so it never outlives the server.
"""
from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import time

import torch
import zmq

from pagedllm.config import EngineConfig
from pagedllm.core.request import FinishReason, RequestOutput
from pagedllm.engine import wire
from pagedllm.engine.faults import Faults
from pagedllm.errors import AdapterError, ModelLoadError

logger = logging.getLogger("pagedllm.engine_core")
PROCESS_NAME = "pagedllm-engine"
IDLE_POLL_MS = 500  # how often an idle engine looks whether its front end is still there
# A busy engine is heard from at least this often, outputs or not (a long prefill): its
# front end takes silence while requests wait as a stall (serving/stall_watch.py).
HEARTBEAT_S = 1.0
EXIT_GAVE_UP = 70  # steps failed in a row: the front end restarts it


def engine_core_main(config: EngineConfig, to_engine: str, from_engine: str, ready,
                     faults: Faults, num_threads: int, load_progress=None) -> None:
    """The child's entry: load, say ready (or why not) on the `ready` pipe, then serve the
    sockets until told to stop or the front end is gone. load_progress: a context-manager
    factory yielding a (done, total) callback (the CLI's progress bar on the terminal)."""
    # Ctrl-C reaches the whole process group: the front end drains, then stops this one.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _name_process(PROCESS_NAME)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parent = os.getppid()
    torch.set_num_threads(num_threads)  # the front end's count (--threads, or every core)
    from pagedllm.engine.core import EngineCore
    from pagedllm.serving.local import engine_info

    engine = _load(config, faults, load_progress, ready)
    if engine is None:
        return
    engine.grammars.validate_in_child = False  # the front end did, before it sent them
    context = zmq.Context()
    inbox, outbox = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    inbox.setsockopt(zmq.RCVHWM, 0)
    outbox.setsockopt(zmq.SNDHWM, 0)
    inbox.connect(to_engine)
    outbox.connect(from_engine)
    ready.send(("ready", engine_info(engine, f"{num_threads} compute thread(s) in the "
                                             f"engine process (--threads)", num_threads)))
    try:
        code = CoreSockets(EngineCore(engine), inbox, outbox, parent).run()
    finally:
        inbox.close(linger=0)
        outbox.close(linger=1000)  # a last message (EngineDead) still goes out
        context.term()
        if os.getppid() != parent:  # a front end killed outright left its socket folder
            shutil.rmtree(os.path.dirname(to_engine.removeprefix("ipc://")), ignore_errors=True)
    sys.exit(code)


def _load(config: EngineConfig, faults: Faults, load_progress, ready):
    """The engine, or None once the front end was told why it could not load."""
    from pagedllm.engine.engine import LLMEngine

    try:
        faults.hold_load()
        if load_progress is None:
            return LLMEngine(config, faults=faults, detokenize=False)
        with load_progress() as update:
            return LLMEngine(config, faults=faults, detokenize=False, load_progress=update)
    except ModelLoadError as exc:  # said as in-process: the file and the problem
        ready.send(("load_error", (exc.path, exc.problem)))
    except AdapterError as exc:  # a --lora adapter that cannot be served: said as in-process
        ready.send(("adapter_error", str(exc)))
    except BaseException as exc:  # noqa: BLE001 - the front end says it and decides
        ready.send(("error", f"{type(exc).__name__}: {exc}"))
    return None


def _name_process(name: str) -> None:
    """The name `ps`, `top` and psutil show (Linux's prctl PR_SET_NAME; elsewhere none)."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


class CoreSockets:
    """The engine core's process transport: messages in from the inbox, one StepOutputs a
    loop out (token ids only: the front end detokenizes)."""

    def __init__(self, core, inbox, outbox, parent_pid: int):
        self.core = core
        self.inbox, self.outbox = inbox, outbox
        self.parent_pid = parent_pid
        self.last_sent = time.monotonic()

    def run(self) -> int:
        """Until Stop (0), the front end's exit (0), or steps failing in a row (70)."""
        core = self.core
        while not core.stopped:
            if not core.has_work:
                if not self.inbox.poll(IDLE_POLL_MS):
                    if os.getppid() != self.parent_pid:
                        logger.warning("the front end is gone: the engine process ends")
                        return 0
                    continue
            elif os.getppid() != self.parent_pid:  # busy, but nobody to answer any more
                logger.warning("the front end is gone: the engine process ends")
                return 0
            self._take_messages()
            if core.has_work:
                core.step()
            self._send()
            if core.dead is not None:
                self.outbox.send(wire.encoder.encode(wire.EngineDead(core.dead)))
                return EXIT_GAVE_UP
        return 0

    def _take_messages(self) -> None:
        while True:
            try:
                raw = self.inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.core.apply(wire.to_engine.decode(raw))

    def _send(self) -> None:
        out = self.core.take()
        for reply in out.replies:
            self.outbox.send(wire.encoder.encode(reply))
        deltas = [_delta(output) for output in out.outputs]
        deltas += [wire.TokenDelta(request_id, [], FinishReason.ERROR.value, error=out.error)
                   for request_id in out.failed]
        positions = self.core.positions()
        now = time.monotonic()
        if not deltas and positions is None and (now - self.last_sent < HEARTBEAT_S
                                                 or not self.core.has_work):
            return
        self.last_sent = now
        engine = self.core.engine
        self.outbox.send(wire.encoder.encode(wire.StepOutputs(
            deltas, positions, engine.stats(), engine.waiting_by_user())))


def _delta(output: RequestOutput) -> wire.TokenDelta:
    return wire.TokenDelta(output.request_id, output.new_token_ids, output.finish_reason,
                           output.num_cached_tokens, output.new_logprobs, output.queue_time,
                           output.error)
