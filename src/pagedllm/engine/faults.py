"""The documented fault-injection seam: failures a test asks the engine to have, so that the
paths that handle them (one request failing alone, an engine that fails step after step and
makes the server exit) are tested through the real server. Off unless asked for; nothing
else in the engine knows of tests.

A server process reads them from its environment (`Faults.from_env`):
  PAGEDLLM_TEST_FAIL_SAMPLING_SEED=N   sampling fails for requests with seed N
  PAGEDLLM_TEST_BREAK_ENGINE=1         every engine step fails
  PAGEDLLM_TEST_LOAD_DELAY=S           loading the model takes S seconds longer
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger("pagedllm")

FAULT_SEED_ENV = "PAGEDLLM_TEST_FAIL_SAMPLING_SEED"
BROKEN_ENGINE_ENV = "PAGEDLLM_TEST_BREAK_ENGINE"
LOAD_DELAY_ENV = "PAGEDLLM_TEST_LOAD_DELAY"


@dataclass(frozen=True)
class Faults:
    fail_sampling_seed: int | None = None
    break_every_step: bool = False
    load_delay: float = 0.0  # seconds added to the model's load

    @classmethod
    def from_env(cls) -> Faults:
        seed = os.environ.get(FAULT_SEED_ENV)
        faults = cls(int(seed) if seed else None, bool(os.environ.get(BROKEN_ENGINE_ENV)),
                     float(os.environ.get(LOAD_DELAY_ENV) or 0))
        if faults.load_delay:
            logger.warning("%s=%g: the load waits that long (a test hook)", LOAD_DELAY_ENV,
                           faults.load_delay)
        if faults.fail_sampling_seed is not None:
            logger.warning("%s=%d: sampling fails for requests with that seed (a test hook)",
                           FAULT_SEED_ENV, faults.fail_sampling_seed)
        if faults.break_every_step:
            logger.warning("%s: every engine step fails (a test hook)", BROKEN_ENGINE_ENV)
        return faults

    def before_step(self) -> None:
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
