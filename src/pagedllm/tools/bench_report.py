"""Load-benchmark results: per-level statistics, the SLO recommendation, table, JSON, plot."""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

import numpy as np


@dataclass
class Percentiles:
    p50: float | None
    p95: float | None
    p99: float | None
    mean: float | None

    @classmethod
    def of(cls, values_s: list[float]) -> Percentiles:
        if not values_s:
            return cls(None, None, None, None)
        ms = np.asarray(values_s) * 1000.0
        p50, p95, p99 = np.percentile(ms, [50, 95, 99])
        return cls(float(p50), float(p95), float(p99), float(ms.mean()))


@dataclass
class LevelResult:
    concurrency: int
    num_requests: int
    num_errors: int
    duration_s: float
    requests_per_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    mean_prompt_tokens: float
    mean_output_tokens: float
    ttft_ms: Percentiles
    tpot_ms: Percentiles
    itl_ms: Percentiles
    e2e_ms: Percentiles
    peak_kv_usage: float | None
    peak_server_rss_bytes: int | None
    peak_gpu_memory_mib: float | None
    meets_slo: bool = False
    errors: list[str] | None = None
    # Speculative decoding during the level, from the server's counters: proposals verified,
    # accepted, and the acceptance rate (None where the server does not speculate).
    speculative: dict | None = None


def summarize_level(concurrency: int, records, duration: float, peaks) -> LevelResult:
    ok = [r for r in records if r.error is None]
    out_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok
             if r.ttft is not None and r.output_tokens > 1]
    return LevelResult(
        concurrency=concurrency, num_requests=len(records), num_errors=len(records) - len(ok),
        duration_s=duration, requests_per_s=len(ok) / duration,
        output_tokens_per_s=out_tokens / duration,
        total_tokens_per_s=(out_tokens + prompt_tokens) / duration,
        mean_prompt_tokens=prompt_tokens / len(ok) if ok else 0.0,
        mean_output_tokens=out_tokens / len(ok) if ok else 0.0,
        ttft_ms=Percentiles.of([r.ttft for r in ok if r.ttft is not None]),
        tpot_ms=Percentiles.of(tpots),
        itl_ms=Percentiles.of([gap for r in ok for gap in r.itls]),
        e2e_ms=Percentiles.of([r.e2e for r in ok]),
        peak_kv_usage=peaks.kv_usage, peak_server_rss_bytes=peaks.server_rss_bytes,
        peak_gpu_memory_mib=peaks.gpu_memory_mib,
        errors=sorted({r.error for r in records if r.error})[:5] or None)


def meets_slo(level: LevelResult, slo_ttft_p95_ms: float | None, slo_tpot_p95_ms: float | None) -> bool:
    if level.num_errors or level.ttft_ms.p95 is None:
        return False
    if slo_ttft_p95_ms is not None and level.ttft_ms.p95 > slo_ttft_p95_ms:
        return False
    if slo_tpot_p95_ms is not None and level.tpot_ms.p95 is not None and level.tpot_ms.p95 > slo_tpot_p95_ms:
        return False
    return True


def recommend(levels: list[LevelResult], slo_ttft_p95_ms: float | None,
              slo_tpot_p95_ms: float | None, start_command: str | None = None) -> dict:
    """The highest N whose p95 latencies meet the targets (and had no errors); its command
    is the server's own (`start_command`, as it says it was started) with that N."""
    for level in levels:
        level.meets_slo = meets_slo(level, slo_ttft_p95_ms, slo_tpot_p95_ms)
    passing = [lv.concurrency for lv in levels if lv.meets_slo]
    targets = f"TTFT p95 <= {slo_ttft_p95_ms} ms, TPOT p95 <= {slo_tpot_p95_ms} ms"
    if not passing:
        return {"concurrency": None, "command": None,
                "reason": f"no level met the targets ({targets}); lower the load or relax them"}
    best = max(passing)
    return {"concurrency": best, "command": with_max_num_seqs(start_command, best),
            "reason": f"highest N meeting {targets}"}


def with_max_num_seqs(start_command: str | None, n: int) -> str:
    """`start_command` (default: a bare `pagedllm serve`) with --max-num-seqs set to n and
    every other option kept."""
    import shlex

    words = shlex.split(start_command) if start_command else ["pagedllm", "serve"]
    kept, skip = [], False
    for word in words:
        if skip:
            skip = False
            continue
        if word == "--max-num-seqs":
            skip = True
            continue
        if word.startswith("--max-num-seqs="):
            continue
        kept.append(word)
    return shlex.join([*kept, "--max-num-seqs", str(n)])


def write_json(path: str, settings: dict, levels: list[LevelResult], recommendation: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump({"settings": settings, "levels": [asdict(lv) for lv in levels],
                   "recommendation": recommendation}, f, indent=2)


def write_plot(path: str, levels: list[LevelResult], settings: dict, recommendation: dict) -> None:
    """Three panels against N: throughput; p95 latencies with the targets as lines; peak KV
    use and server memory. The recommended N is marked on each; the server's setup is in
    the title."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = [lv.concurrency for lv in levels]
    best = recommendation.get("concurrency")
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(15, 4.6))
    left.plot(ns, [lv.total_tokens_per_s for lv in levels], "o-", label="total tokens/s")
    left.plot(ns, [lv.output_tokens_per_s for lv in levels], "s-", label="output tokens/s")
    left.set_ylabel("tokens/s")
    left.set_title("throughput")
    middle.plot(ns, [lv.ttft_ms.p95 or 0 for lv in levels], "o-", color="C0", label="TTFT p95")
    middle.plot(ns, [lv.tpot_ms.p95 or 0 for lv in levels], "s-", color="C1", label="TPOT p95")
    for target, color, name in ((settings.get("slo_ttft_p95_ms"), "C0", "TTFT target"),
                                (settings.get("slo_tpot_p95_ms"), "C1", "TPOT target")):
        if target:
            middle.axhline(target, color=color, linestyle=":", label=f"{name} {target:g} ms")
    middle.set_ylabel("ms")
    middle.set_yscale("log")
    middle.set_title("p95 latency")
    _plot_memory(right, ns, levels)
    for ax in (left, middle, right):
        ax.set_xlabel("concurrent requests (N)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.grid(alpha=0.3)
        if best:
            ax.axvline(best, color="green", alpha=0.6, linewidth=2, label=f"recommended N={best}")
        ax.legend(loc="upper left", fontsize=8)
    fig.suptitle(_plot_title(settings), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_memory(right, ns: list[int], levels: list[LevelResult]) -> None:
    """Peak KV use against N, and the server's memory (and the GPU's) on a second axis."""
    kv = [None if lv.peak_kv_usage is None else lv.peak_kv_usage * 100 for lv in levels]
    right.plot(ns, [v or 0 for v in kv], "o-", color="C2", label="peak KV-cache use (%)")
    right.set_ylabel("% of the KV pool")
    right.set_ylim(0, 105)
    right.set_title("memory")
    rss = [lv.peak_server_rss_bytes for lv in levels]
    gpu = [lv.peak_gpu_memory_mib for lv in levels]
    if any(rss) or any(gpu):
        twin = right.twinx()
        tops = []
        if any(rss):
            gib = [(r or 0) / 2**30 for r in rss]
            twin.plot(ns, gib, "s--", color="C3", label="server RSS (GiB)")
            tops.append(max(gib))
        if any(gpu):  # the seed's "watch GPU memory as N grows" (nvidia-smi's used memory)
            gpu_gib = [(g or 0) / 1024 for g in gpu]
            twin.plot(ns, gpu_gib, "^-.", color="C4", label="GPU memory used (GiB)")
            tops.append(max(gpu_gib))
        twin.set_ylabel("GiB")
        # From 0, as the KV axis: a rise of 30 MB on a 1 GiB server is a rise, not a cliff.
        twin.set_ylim(0, max(tops) * 1.15)
        twin.legend(loc="lower right", fontsize=8)


def _plot_title(settings: dict) -> str:
    """The model and address, then the server's setup and the load."""
    server = settings.get("server") or {}
    setup = ", ".join(f"{k} {v}" for k, v in (
        ("max_model_len", server.get("max_model_len")), ("KV blocks", server.get("num_blocks")),
        ("block size", server.get("block_size")), ("KV dtype", server.get("cache_dtype")),
        *device_words(server)) if v is not None)
    load = (f"prompts {settings.get('prompt_tokens')} tokens, {settings.get('max_tokens')} out"
            if settings.get("prompt_tokens") else "")
    return (f"{settings.get('model', '')} at {settings.get('base_url', '')}\n"
            f"{setup}{'; ' if setup and load else ''}{load}")


def device_words(server: dict) -> tuple[tuple[str, str | None], ...]:
    """Where the server's model runs, for the chart's header: the GPU by name and memory
    where it says it runs on one, else the CPU's kernel level."""
    if server.get("device") == "cuda":
        return (("GPU", server.get("gpu") or "cuda"),)
    return (("CPU", server.get("cpu_isa")),)


def render_table(levels: list[LevelResult]):
    from rich.table import Table

    def f(value, digits=0):
        return "-" if value is None else f"{value:,.{digits}f}"

    table = Table("N", "req/s", "out tok/s", "total tok/s", "TTFT p50/p95 ms", "TPOT p50/p95 ms",
                  "ITL p95 ms", "E2E p95 ms", "KV peak", "RSS peak", "GPU peak", "SLO")
    for lv in levels:
        table.add_row(
            str(lv.concurrency), f(lv.requests_per_s, 2), f(lv.output_tokens_per_s, 1),
            f(lv.total_tokens_per_s, 1), f"{f(lv.ttft_ms.p50)} / {f(lv.ttft_ms.p95)}",
            f"{f(lv.tpot_ms.p50, 1)} / {f(lv.tpot_ms.p95, 1)}", f(lv.itl_ms.p95, 1),
            f(lv.e2e_ms.p95), "-" if lv.peak_kv_usage is None else f"{lv.peak_kv_usage:.0%}",
            "-" if lv.peak_server_rss_bytes is None else f"{lv.peak_server_rss_bytes / 2**30:.2f} GiB",
            "-" if lv.peak_gpu_memory_mib is None else f"{lv.peak_gpu_memory_mib / 1024:.2f} GiB",
            "[green]yes[/]" if lv.meets_slo else "[red]no[/]" + (f" ({lv.num_errors} err)" if lv.num_errors else ""))
    return table
