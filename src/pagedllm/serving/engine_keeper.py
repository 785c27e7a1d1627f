"""Keeping the front end's engine process running (`serve --engine-process`): the one that
runs now; when it dies, why (what it said before it went, else how it exited), a pause that
doubles while it keeps dying (RestartBackoff), and a new one. process_client.py fails the
requests the dead one held and tells a new one what it must know again (the users'
policies, adapters loaded or unloaded since the start).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

from pagedllm.config import EngineConfig
from pagedllm.engine.faults import Faults
from pagedllm.serving.client import EngineInfo
from pagedllm.serving.engine_process import EngineProcess, EngineStartError

logger = logging.getLogger("pagedllm.server")


class EngineKeeper:
    def __init__(self, config: EngineConfig, faults: Faults, num_threads: int,
                 backoff: RestartBackoff | None = None, load_progress=None):
        """Starts the first engine process (wait_first waits for its model)."""
        self._config, self._faults, self._num_threads = config, faults, num_threads
        self._backoff = backoff or RestartBackoff()
        self.engine: EngineProcess | None = EngineProcess(config, faults, num_threads,
                                                          load_progress)
        self.dead_reason: str | None = None  # what the engine said before it exited
        self.restarting: str | None = None  # why requests get 503 now, while it restarts
        self.restarts = 0
        self._restart_at = 0.0

    def wait_first(self) -> EngineInfo:
        """The first engine's description once its model is loaded (ModelLoadError, as
        in-process, when it cannot load: the process is closed)."""
        try:
            return self.engine.wait_ready()
        except BaseException:
            self.engine.close(grace=0)
            raise

    def send(self, message) -> bool:
        """False when no engine process would take it: none, or one that has died and not
        yet been seen to (ZMQ may still queue for a peer whose exit it has not noticed)."""
        engine = self.engine
        return engine is not None and engine.process.is_alive() and engine.send(message)

    def on_exit(self, engine: EngineProcess, num_failing: int) -> str:
        """The engine process ended: closed, the next start planned; returns why it ended."""
        ran_for = time.monotonic() - engine.started
        reason = self.dead_reason or f"the engine process (pid {engine.pid}) " \
                                     f"{engine.exit_reason()}"
        self.dead_reason = None
        pause = self._backoff.after_crash(ran_for)
        logger.critical("%s; %d request(s) fail; restarting it%s (crash %d in a row)", reason,
                        num_failing, f" in {pause:g} s" if pause else "",
                        self._backoff.crashes_in_a_row)
        self.restarting = (f"{reason}; the server is restarting it (crash "
                           f"{self._backoff.crashes_in_a_row} in a row)")
        self.engine = None
        engine.close(grace=0)
        self._restart_at = time.monotonic() + pause
        return reason

    def restart(self, stopped: Callable[[], bool],
                brief: Callable[[EngineProcess], None]) -> EngineProcess | None:
        """After the planned pause, a new engine process with its model loaded, told what it
        must know again by `brief` before requests stop getting 503; None when stopped
        meanwhile, or when it could not start (tried again after a longer pause)."""
        while time.monotonic() < self._restart_at and not stopped():
            time.sleep(0.05)
        if stopped():
            return None
        started = time.monotonic()
        try:
            engine = EngineProcess(self._config, self._faults, self._num_threads)
        except Exception as exc:  # noqa: BLE001 - no sockets or no process: try again later
            self._could_not_restart(str(exc), started)
            return None
        try:
            engine.wait_ready(stopped)
        except EngineStartError as exc:
            engine.close(grace=0)
            self._could_not_restart(str(exc), started)
            return None
        self.engine = engine
        self.restarts += 1
        brief(engine)
        self.restarting = None
        logger.warning("engine process restarted (pid %d, restart %d)", engine.pid, self.restarts)
        return engine

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    def _could_not_restart(self, why: str, started: float) -> None:
        pause = self._backoff.after_crash(time.monotonic() - started)
        self._restart_at = time.monotonic() + pause
        self.restarting = f"the engine process could not start again ({why}); next try in " \
                          f"{pause:g} s"
        logger.critical(self.restarting)


class RestartBackoff:
    """The pause before the next start: none after a crash of an engine that ran a while,
    then 1, 2, 4 ... up to `cap` seconds while it keeps dying within `settled` of starting."""

    def __init__(self, cap: float = 30.0, settled: float = 60.0):
        self.cap, self.settled = cap, settled
        self.crashes_in_a_row = 0

    def after_crash(self, ran_for: float) -> float:
        self.crashes_in_a_row = 1 if ran_for >= self.settled else self.crashes_in_a_row + 1
        if self.crashes_in_a_row == 1:
            return 0.0
        return min(self.cap, 2.0 ** (self.crashes_in_a_row - 2))
