"""The one model's engine for `serve`, loaded under a progress bar: in this process, or in
a process of its own (--engine-process, serving/process_client.py), which draws the bar on
the same terminal."""
from __future__ import annotations

import contextlib


def load_with_progress(config, engine_process: bool = False, threads: int | None = None,
                       stall_after: float | None = None):
    """One engine, in this process or in one of its own (--engine-process), loaded under a
    progress bar; test faults only where the environment asks for them (engine/faults.py).
    stall_after: --engine-stall-timeout (serving/stall_watch.py)."""
    from pagedllm.engine.faults import Faults

    faults = Faults.from_env()
    if engine_process:
        from pagedllm.serving.process_client import ProcessEngineClient

        # --threads (else every core, as in one process: BENCHMARKS.md, "The engine in its
        # own process", has what fewer would give).
        from pagedllm.serving.stall_watch import StallWatch

        watch = None if stall_after is None else StallWatch(stall_after, 6 * stall_after)
        return ProcessEngineClient(config, faults, load_progress=load_progress_bar,
                                   num_threads=threads, stall_watch=watch)
    from pagedllm.serving.local import LocalEngineClient

    with load_progress_bar() as update:
        faults.hold_load()
        return LocalEngineClient.load(config, update, faults)


@contextlib.contextmanager
def load_progress_bar():
    """A progress bar on stderr while a model loads; yields its (done, total) callback. A
    module-level function, so the engine process (spawned) draws it too."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    with Progress(TextColumn("loading model"), BarColumn(), MofNCompleteColumn(),
                  console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("load", total=None)

        def update(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)

        yield update
