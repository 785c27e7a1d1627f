"""Overlapped steps (vLLM's async scheduling, SGLang's overlap scheduler): the host plans and
prepares step t+1 while the device runs step t, so the device does not wait for the host.

The scheduler plans ahead (core/scheduler.py: a token sampled in the step still running is a
PLACEHOLDER the model runner takes from that step's ids on the device), the runner launches,
samples and collects apart (engine/launched_step.py), and the engine collects step t after
step t+1's model call is made (engine/engine.py). The tokens are exactly those of steps run
one at a time (tests/test_overlapped_steps.py); a request that finishes in step t costs one
wasted row in step t+1.

Not while any request speculates: its proposals follow its last known token, which a
pending one is not; the engine then collects the step in flight and plans step by step.
"""
from __future__ import annotations

from pagedllm.core.scheduler import Scheduler
from pagedllm.core.speculation import Speculator


class StepOverlap:
    def __init__(self, enabled: bool, speculator: Speculator):
        """enabled: on a GPU (a model call only queues kernels, and the host plans the next
        step meanwhile). On a CPU the model call is the whole step, made on the engine's
        thread: the steps run in the same order and give the same tokens, but nothing
        overlaps; a second thread for the model calls measured slower on two cores
        (BENCHMARKS.md, "Overlapped steps"), so it is off there by default."""
        self.enabled = enabled
        self.speculator = speculator

    def applies(self, scheduler: Scheduler) -> bool:
        """Whether the next step may be planned ahead: on, and nobody speculates."""
        if not self.enabled:
            return False
        method = self.speculator.method
        return all(method(request) == "off" for request in scheduler.requests.values())
