"""Wiring of `pagedllm bench`: arguments, optional server launch, progress bar, outputs."""
from __future__ import annotations

import asyncio
import os
import shlex
import socket
import subprocess
import sys
import time

import httpx

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from pagedllm.tools.bench import (host_busy_percent, make_prompts, run_level, served_model,
                                  spec_counters, spec_during,
                                  server_settings, warm_up)
from pagedllm.tools.bench_report import recommend, render_table, summarize_level, write_json, write_plot
from pagedllm.tokenizer import Tokenizer


def _parse_levels(text: str) -> list[int]:
    levels = sorted({int(v) for v in text.split(",") if v.strip()})
    if not levels or levels[0] < 1:
        raise ValueError("concurrency levels must be positive integers")
    return levels


def _launch(extra: str):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "pagedllm.cli", "serve", "--port", str(port),
                             *shlex.split(extra)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the launched server exited with status {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the launched server did not start within 300 s")


def run_bench(args) -> int:
    # Off a terminal (a log file, CI) rich would cut the table to 80 columns.
    console = Console() if sys.stdout.isatty() else Console(width=200)
    try:
        levels = _parse_levels(args.concurrency)
        low, high = (int(v) for v in args.prompt_tokens.split(":"))
        if not 1 <= low <= high:
            raise ValueError("--prompt-tokens is MIN:MAX with 1 <= MIN <= MAX")
    except ValueError as exc:
        console.print(f"[red]error:[/] {exc}")
        return 2
    api_key = args.api_key or os.environ.get("PAGEDLLM_API_KEY") or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    proc = None
    base_url = args.base_url.rstrip("/")
    if args.launch:
        console.print("launching a pagedllm server for the run...")
        proc, base_url = _launch(args.launch_args)
    try:
        return _run(args, console, levels, (low, high), base_url, headers)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)


BUSY_PERCENT = 25.0  # CPU in use before a level, server idle, above which figures are suspect


class LevelProgress:
    """Progress on a terminal (a bar), or plain lines in a log file (one at each level's start
    and end, so `bench > log` shows where it is)."""

    def __init__(self, console: Console, total: int):
        self.console = console
        self.bar = None
        if console.is_terminal:
            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn(), console=console)
            self.task = self.bar.add_task("bench", total=total)

    def __enter__(self):
        if self.bar is not None:
            self.bar.__enter__()
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.__exit__(*exc)

    def start_level(self, n: int, num_requests: int) -> None:
        if self.bar is not None:
            self.bar.update(self.task, description=f"N={n}")
        else:
            self.console.print(f"N={n}: sending {num_requests} requests, {n} at a time")

    def advance(self) -> None:
        if self.bar is not None:
            self.bar.advance(self.task)

    def level_progress(self, n: int, total: int) -> LevelTally:
        return LevelTally(self, n, total)

    def line(self, text: str) -> None:
        """A progress line: above the bar on a terminal, a plain line in a log."""
        (self.bar.console if self.bar is not None else self.console).print(text)

    def end_level(self, level) -> None:
        if self.bar is None:
            p95 = level.ttft_ms.p95
            self.console.print(f"N={level.concurrency}: done in {level.duration_s:.1f} s, "
                               f"{level.output_tokens_per_s:,.1f} output tok/s, TTFT p95 "
                               f"{'-' if p95 is None else f'{p95:,.0f}'} ms, {level.num_errors} errors")

    def warn(self, message: str) -> None:
        (self.bar.console if self.bar is not None else self.console).print(f"[yellow]warning:[/] {message}")


class LevelTally:
    """One level's progress, said while it runs: a line at each quarter of its requests and
    at least every few seconds (run_level's tick), with requests done, errors and the
    output tokens/s so far, so a long level is never silent."""

    def __init__(self, progress: LevelProgress, n: int, total: int):
        self.progress, self.n, self.total = progress, n, total
        self.num_done = self.num_errors = self.num_chunks = 0
        self.start = time.perf_counter()
        self.quarters_said = 0

    def chunk(self) -> None:
        self.num_chunks += 1

    def done(self, record) -> None:
        self.num_done += 1
        self.num_errors += record.error is not None
        quarter = 4 * self.num_done // self.total
        if quarter > self.quarters_said and self.num_done < self.total:
            self.quarters_said = quarter
            self.say()

    def tick(self) -> None:
        self.say()

    def say(self) -> None:
        elapsed = time.perf_counter() - self.start
        self.progress.line(f"N={self.n}: {self.num_done}/{self.total} done, {self.num_errors} "
                           f"errors, {self.num_chunks / max(elapsed, 1e-9):,.1f} output tok/s "
                           f"so far ({elapsed:.0f} s)")


def _run(args, console, levels, lengths, base_url, headers) -> int:
    try:
        model = args.model or served_model(base_url, headers)
    except Exception as exc:  # noqa: BLE001 - report any connection problem plainly
        console.print(f"[red]error:[/] cannot reach {base_url}/v1/models: {exc}")
        return 2
    server = server_settings(base_url, headers)
    # Prompts are sized with a local tokenizer (the default model's unless told).
    tokenizer = Tokenizer.from_model_path(args.tokenizer)
    per_level = {n: args.requests or max(6, 3 * n) for n in levels}
    results, busy = [], {}  # filled level by level (kept when interrupted)
    if args.warmup:
        console.print(f"warming up with {args.warmup} short request(s)...")
        asyncio.run(warm_up(base_url, model, args.warmup, headers))
    interrupted = _run_levels(args, console, levels, lengths, base_url, headers, model,
                              tokenizer, per_level, results, busy)
    if not results:
        console.print("[yellow]interrupted before any level finished: nothing written[/]")
        return 130
    _report(args, console, results, base_url, model, levels, per_level, lengths, server, busy)
    return 130 if interrupted else 0


def _run_levels(args, console, levels, lengths, base_url, headers, model, tokenizer,
                per_level, results: list, busy: dict) -> bool:
    """Each level's requests, its summary appended to `results` as it ends; True when
    interrupted (Ctrl-C): what finished is still worth its files."""
    with LevelProgress(console, sum(per_level.values())) as progress:
        try:
            for index, n in enumerate(levels):
                busy[n] = host_busy_percent()
                if busy[n] > BUSY_PERCENT:
                    progress.warn(f"this machine's CPU was {busy[n]:.0f}% busy before N={n} "
                                  f"with the server idle: other work is running, and its "
                                  f"figures will look worse than they are")
                progress.start_level(n, per_level[n])
                prompts = make_prompts(tokenizer, per_level[n], lengths,
                                       args.shared_prefix_tokens,
                                       seed=args.seed * 1000 + index, load=args.load)
                counted = spec_counters(base_url, headers)
                records, duration, peaks = asyncio.run(run_level(
                    base_url, model, n, prompts, args.max_tokens, headers,
                    on_done=progress.advance, progress=progress.level_progress(n, per_level[n])))
                results.append(summarize_level(n, records, duration, peaks))
                results[-1].speculative = spec_during(counted, spec_counters(base_url, headers))
                progress.end_level(results[-1])
        except KeyboardInterrupt:
            progress.line(f"interrupted: writing the {len(results)} level(s) that finished")
            return True
    return False


def _report(args, console, results, base_url, model, levels, per_level, lengths, server,
            busy) -> None:
    """The table, the recommendation, bench.json and bench.png."""
    _connection_cap_hint(console, results)
    recommendation = recommend(results, args.slo_ttft_p95, args.slo_tpot_p95,
                               server.get("command"))
    console.print(render_table(results))
    for level in results:
        for error in level.errors or []:
            console.print(f"[yellow]N={level.concurrency} error:[/] {error}")
    settings = {"base_url": base_url, "model": model, "concurrency": levels,
                "requests_per_level": per_level, "prompt_tokens": list(lengths),
                "max_tokens": args.max_tokens, "shared_prefix_tokens": args.shared_prefix_tokens,
                "load": args.load,
                "slo_ttft_p95_ms": args.slo_ttft_p95, "slo_tpot_p95_ms": args.slo_tpot_p95,
                "seed": args.seed, "warmup_requests": args.warmup, "server": server,
                "host_cpu_busy_percent_before_level": busy}
    os.makedirs(args.out, exist_ok=True)
    json_path, png_path = os.path.join(args.out, "bench.json"), os.path.join(args.out, "bench.png")
    write_json(json_path, settings, results, recommendation)
    write_plot(png_path, results, settings, recommendation)
    if recommendation["concurrency"]:
        console.print(f"recommended: N = [bold]{recommendation['concurrency']}[/] "
                      f"({recommendation['reason']}): {recommendation['command']}")
    else:
        console.print(f"[yellow]no recommendation:[/] {recommendation['reason']}")
    console.print(f"wrote {json_path} and {png_path}")


def _connection_cap_hint(console, results) -> None:
    """A level refused for the per-client connection cap says which option to raise."""
    for level in results:
        if any("too_many_connections" in error for error in level.errors or []):
            console.print(f"[yellow]N={level.concurrency}:[/] the server caps the connections "
                          f"one client may open below {level.concurrency}: start it with "
                          f"--max-connections-per-client {2 * level.concurrency} (or 0: no cap) "
                          f"to measure this level")
