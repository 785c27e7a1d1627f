"""The documented fault-injection seam: failures a test asks the engine to have, so that the
paths that handle them (one request failing alone, an engine that fails step after step and
makes the server exit) are tested through the real server. Off unless asked for; nothing
else in the engine knows of tests.

A server process reads them from its environment (`Faults.from_env`):
  PAGEDLLM_TEST_FAIL_SAMPLING_SEED=N   sampling fails for requests with seed N
  PAGEDLLM_TEST_BREAK_ENGINE=1         every engine step fails
  PAGEDLLM_TEST_LOAD_DELAY=S           loading the model takes S seconds longer
  PAGEDLLM_TEST_LOAD_GATE=PATH         loading the model waits until PATH exists (a test
                                       opens the gate when it has seen the loading phase)
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger("pagedllm")

FAULT_SEED_ENV = "PAGEDLLM_TEST_FAIL_SAMPLING_SEED"
BROKEN_ENGINE_ENV = "PAGEDLLM_TEST_BREAK_ENGINE"
LOAD_DELAY_ENV = "PAGEDLLM_TEST_LOAD_DELAY"
LOAD_GATE_ENV = "PAGEDLLM_TEST_LOAD_GATE"
GATE_PATIENCE_S = 600.0  # a gate nobody opens: the load goes on after this


@dataclass(frozen=True)
class Faults:
    fail_sampling_seed: int | None = None
    break_every_step: bool = False
    load_delay: float = 0.0  # seconds added to the model's load
    load_gate: str | None = None  # the load waits until this path exists
    step_delay: float = 0.0  # seconds each step takes longer (catching an answer mid-way)

    @classmethod
    def from_env(cls) -> Faults:
        seed = os.environ.get(FAULT_SEED_ENV)
        faults = cls(int(seed) if seed else None, bool(os.environ.get(BROKEN_ENGINE_ENV)),
                     float(os.environ.get(LOAD_DELAY_ENV) or 0),
                     os.environ.get(LOAD_GATE_ENV) or None)
        if faults.load_delay:
            logger.warning("%s=%g: the load waits that long (a test hook)", LOAD_DELAY_ENV,
                           faults.load_delay)
        if faults.load_gate:
            logger.warning("%s=%s: the load waits until that file exists (a test hook)",
                           LOAD_GATE_ENV, faults.load_gate)
        if faults.fail_sampling_seed is not None:
            logger.warning("%s=%d: sampling fails for requests with that seed (a test hook)",
                           FAULT_SEED_ENV, faults.fail_sampling_seed)
        if faults.break_every_step:
            logger.warning("%s: every engine step fails (a test hook)", BROKEN_ENGINE_ENV)
        return faults

    def hold_load(self) -> None:
        """Called before the model loads: the delay, then the gate, where asked for."""
        time.sleep(self.load_delay)
        deadline = time.monotonic() + GATE_PATIENCE_S
        while self.load_gate and not os.path.exists(self.load_gate) and time.monotonic() < deadline:
            time.sleep(0.05)

    def before_step(self) -> None:
        if self.step_delay:
            time.sleep(self.step_delay)
        if self.break_every_step:
            raise RuntimeError("injected engine fault")

    def sampling_fault(self) -> Callable | None:
        """The model runner's hook, called with (request id, SamplingRow) before sampling;
        raising fails that request alone."""
        seed = self.fail_sampling_seed
        if seed is None:
            return None

        def fail(request_id, row):
            if row.params.seed == seed:
                raise RuntimeError(f"injected sampling fault for seed {seed}")

        return fail
