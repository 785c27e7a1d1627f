"""`pagedllm plan` figures against hand computation; bench statistics and recommendation."""
import json
import subprocess
import sys

import pytest

from pagedllm.core import sizing
from pagedllm.tools.bench import MemoryPeaks, RequestRecord
from pagedllm.tools.bench_report import Percentiles, recommend, summarize_level
from pagedllm.tools.plan import ContextTooLongError, make_plan
from pagedllm.units import parse_bytes


def test_plan_default_model_by_hand():
    # SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64; float32 = 4 bytes.
    plan = make_plan(None, dtype="float32", context=4096, parallels=[1, 2, 8], memory=3 << 29)
    per_token = 2 * 30 * 3 * 64 * 4
    assert plan.kv_bytes_per_token == per_token == 46080
    assert plan.kv_bytes_per_request == 4096 * per_token  # 4096 is whole 16-token blocks
    # Embedding 49152 x 576 in float32, tied head; the rest of the ~135M parameters in float32.
    assert plan.weight_bytes == 134_515_008 * 4
    assert [r.kv_bytes for r in plan.rows] == [n * 4096 * per_token for n in (1, 2, 8)]
    budget = (3 << 29) - plan.weight_bytes
    assert plan.max_parallel == budget // (4096 * per_token)
    assert [r.fits for r in plan.rows] == [True, True, False]
    assert any("8 x 4096 tokens needs" in w for w in plan.warnings)


def test_plan_tiny_hf_model_bfloat16_rounds_to_blocks(tiny_llama_folder):
    # Tiny model: 2 layers, 2 KV heads, head_dim 16; bfloat16 = 2 bytes; 500 -> 32 blocks.
    plan = make_plan(tiny_llama_folder, dtype="bfloat16", context=500, parallels=[3],
                     memory=10 << 20)
    per_token = 2 * 2 * 2 * 16 * 2
    assert plan.kv_bytes_per_token == per_token
    assert plan.kv_bytes_per_request == 32 * 16 * per_token
    assert plan.rows[0].kv_bytes == 3 * 32 * 16 * per_token
    # Embedding 260 x 64 float32 (tied); body: 2 layers of attention, MLP and norms in bf16.
    body = 2 * (64 * 64 + 2 * 32 * 64 + 64 * 64 + 3 * 64 * 128 + 2 * 64) + 64
    assert plan.weight_bytes == 260 * 64 * 4 + body * 2
    assert plan.max_parallel == ((10 << 20) - plan.weight_bytes) // plan.kv_bytes_per_request


def test_engine_uses_the_same_sizing(real_llm):
    engine = real_llm.engine
    per_token = sizing.kv_bytes_per_token(engine.model_config, 4)
    assert engine.cache_config.num_blocks == engine.kv_memory_bytes // (per_token * 16)


def test_plan_refuses_a_context_the_model_cannot_serve(tiny_llama_folder):
    with pytest.raises(ContextTooLongError, match="1000 tokens is longer than .*512"):
        make_plan(tiny_llama_folder, dtype="bfloat16", context=1000, parallels=[1], memory=1 << 30)


def test_plan_cli_json_and_errors(tiny_llama_folder):
    out = subprocess.run([sys.executable, "-m", "pagedllm.cli", "plan", "--model", tiny_llama_folder,
                          "--context", "512", "--parallel", "1,4", "--memory", "1MiB", "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert [r["parallel"] for r in data["rows"]] == [1, 4]
    assert data["memory_bytes"] == 1 << 20
    bad = subprocess.run([sys.executable, "-m", "pagedllm.cli", "plan", "--parallel", "x"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--parallel" in bad.stderr
    missing = subprocess.run([sys.executable, "-m", "pagedllm.cli", "plan", "--model", "/nope.gguf"],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "/nope.gguf" in missing.stderr


def test_plan_for_a_gpu(tiny_llama_folder, monkeypatch):
    """--device cuda: the card's share by --gpu-memory-utilization (here a stand-in card of
    80 GiB), or --memory for a card elsewhere; without either, a clear error."""
    import torch

    from pagedllm.tools.plan import NoGPUError, make_plan, serve_command

    has_gpu = torch.cuda.is_available()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (70 << 30, 80 << 30))
    plan = make_plan(tiny_llama_folder, dtype="bfloat16", context=512, parallels=[1],
                     memory=None, device="cuda", gpu_memory_utilization=0.5)
    assert plan.memory_bytes == 40 << 30 and plan.device == "cuda"
    assert "--device cuda" in serve_command(plan)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(NoGPUError, match="--memory"):
        make_plan(tiny_llama_folder, dtype="bfloat16", context=512, parallels=[1], memory=None,
                  device="cuda")
    elsewhere = subprocess.run([sys.executable, "-m", "pagedllm.cli", "plan", "--model",
                                tiny_llama_folder, "--context", "512", "--device", "cuda",
                                "--memory", "80GiB", "--json"],
                               capture_output=True, text=True, timeout=60)
    assert elsewhere.returncode == 0 and json.loads(elsewhere.stdout)["device"] == "cuda"
    here = subprocess.run([sys.executable, "-m", "pagedllm.cli", "plan", "--device", "cuda"],
                          capture_output=True, text=True, timeout=60)
    if not has_gpu:
        assert here.returncode == 2 and "no usable CUDA GPU" in here.stderr


def test_parse_bytes():
    assert parse_bytes("8GiB") == 8 << 30
    assert parse_bytes("512MiB") == 512 << 20
    assert parse_bytes("2GB") == 2 * 10**9
    assert parse_bytes("1000") == 1000
    with pytest.raises(ValueError):
        parse_bytes("lots")


def level(n, ttft_p95, tpot_p95, errors=0):
    records = [RequestRecord(100, 10, ttft=ttft_p95 / 1000, e2e=ttft_p95 / 1000 + 9 * tpot_p95 / 1000)
               for _ in range(5)]
    records += [RequestRecord(100, error="HTTP 500") for _ in range(errors)]
    return summarize_level(n, records, 2.0, MemoryPeaks())


def test_recommendation_picks_highest_level_meeting_targets():
    levels = [level(1, 100, 20), level(2, 150, 30), level(4, 400, 45), level(8, 900, 80)]
    rec = recommend(levels, slo_ttft_p95_ms=500, slo_tpot_p95_ms=50)
    assert rec["concurrency"] == 4 and rec["command"] == "pagedllm serve --max-num-seqs 4"
    assert [lv.meets_slo for lv in levels] == [True, True, True, False]


def test_recommendation_when_no_level_meets_it():
    rec = recommend([level(1, 3000, 20), level(2, 4000, 30)], 500, 50)
    assert rec["concurrency"] is None and "no level met" in rec["reason"]


def test_recommendation_skips_levels_with_errors():
    rec = recommend([level(1, 100, 10), level(2, 100, 10, errors=1)], 500, 50)
    assert rec["concurrency"] == 1


def test_level_statistics():
    lv = level(2, 200, 40)
    assert lv.num_requests == 5 and lv.num_errors == 0
    assert lv.ttft_ms.p95 == pytest.approx(200)
    assert lv.tpot_ms.p50 == pytest.approx(40)
    assert lv.output_tokens_per_s == pytest.approx(25.0)
    assert lv.total_tokens_per_s == pytest.approx(275.0)
    assert Percentiles.of([]).p50 is None


def test_bench_against_a_real_server(server, tmp_path):
    out = subprocess.run([sys.executable, "-m", "pagedllm.cli", "bench", "--base-url", server.url,
                          "--concurrency", "1,2", "--requests", "3", "--prompt-tokens", "32:64",
                          "--max-tokens", "8", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "recommended" in out.stdout or "no recommendation" in out.stdout
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["settings"]["model"] == "smollm2"
    assert [lv["concurrency"] for lv in data["levels"]] == [1, 2]
    for lv in data["levels"]:
        assert lv["num_requests"] == 3 and lv["num_errors"] == 0
        assert lv["mean_output_tokens"] == 8
        assert 32 <= lv["mean_prompt_tokens"] <= 70
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            assert set(lv[key]) == {"p50", "p95", "p99", "mean"} and lv[key]["p95"] > 0
        for key in ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s"):
            assert lv[key] > 0
        assert lv["peak_kv_usage"] is not None and lv["peak_server_rss_bytes"] > 0
        assert "meets_slo" in lv
    assert set(data["recommendation"]) == {"concurrency", "command", "reason"}
    assert (tmp_path / "bench.png").stat().st_size > 1000
    # Off a terminal (here: a pipe) it says where it is, level by level, and the table is
    # not cut to 80 columns.
    assert "N=1: sending 3 requests, 1 at a time" in out.stdout
    assert "N=2: done in" in out.stdout and "…" not in out.stdout
    assert "warming up with 2 short request(s)" in out.stdout
    server_setup = data["settings"]["server"]
    from pagedllm.kernels import capabilities

    assert int(server_setup["num_blocks"]) > 0
    assert server_setup["cpu_isa"] == capabilities().summary  # "avx512+amx" on an AMX host
    assert set(data["settings"]["host_cpu_busy_percent_before_level"]) == {"1", "2"}


def test_bench_plot_marks_targets_and_recommendation(tmp_path):
    """The PNG's panels, target lines and the recommended N (read back from matplotlib)."""
    import matplotlib
    matplotlib.use("Agg")
    from unittest import mock

    import matplotlib.pyplot as plt

    from pagedllm.tools.bench_report import write_plot

    levels = [level(1, 100, 10), level(2, 300, 20), level(4, 3000, 40)]
    levels[0].peak_kv_usage, levels[0].peak_server_rss_bytes = 0.2, 1 << 30
    levels[2].peak_server_rss_bytes = (1 << 30) + (30 << 20)  # a small rise
    settings = {"model": "m", "base_url": "u", "slo_ttft_p95_ms": 2000.0, "slo_tpot_p95_ms": 100.0,
                "server": {"num_blocks": "99", "cpu_isa": "avx2"}, "prompt_tokens": [8, 16],
                "max_tokens": 8}
    figures = []
    with mock.patch.object(plt, "close", side_effect=figures.append):
        write_plot(str(tmp_path / "b.png"), levels, settings, {"concurrency": 2})
    [fig] = figures
    labels = {text.get_text() for ax in fig.axes for text in ax.get_legend().get_texts()
              if ax.get_legend() is not None}
    assert {"TTFT target 2000 ms", "TPOT target 100 ms", "recommended N=2"} <= labels
    assert "KV blocks 99" in fig._suptitle.get_text() and "CPU avx2" in fig._suptitle.get_text()
    assert (tmp_path / "b.png").stat().st_size > 1000
    [rss_axis] = [ax for ax in fig.axes if ax.get_ylabel() == "GiB"]
    low, high = rss_axis.get_ylim()
    assert low == 0 and high > 1.03  # the 30 MB rise is a few percent of the axis
    plt.close(fig)


def test_bench_plot_and_table_show_gpu_memory(tmp_path):
    """Where nvidia-smi answered, each level's GPU memory is drawn and tabled."""
    import matplotlib
    matplotlib.use("Agg")
    from unittest import mock

    import matplotlib.pyplot as plt
    from rich.console import Console

    from pagedllm.tools.bench_report import render_table, write_plot

    levels = [level(1, 100, 10), level(8, 300, 20)]
    levels[0].peak_gpu_memory_mib, levels[1].peak_gpu_memory_mib = 20480.0, 24576.0
    figures = []
    with mock.patch.object(plt, "close", side_effect=figures.append):
        write_plot(str(tmp_path / "g.png"), levels, {"model": "m"}, {"concurrency": 8})
    [fig] = figures
    [axis] = [ax for ax in fig.axes if ax.get_ylabel() == "GiB"]
    assert [t.get_text() for t in axis.get_legend().get_texts()] == ["GPU memory used (GiB)"]
    assert list(axis.get_lines()[0].get_ydata()) == [20.0, 24.0]
    plt.close(fig)
    console = Console(record=True, width=200)
    console.print(render_table(levels))
    text = console.export_text()
    assert "GPU peak" in text and "24.00 GiB" in text


def test_bench_bad_arguments():
    out = subprocess.run([sys.executable, "-m", "pagedllm.cli", "bench", "--concurrency", "0"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    out = subprocess.run([sys.executable, "-m", "pagedllm.cli", "bench", "--base-url",
                          "http://127.0.0.1:9", "--concurrency", "1"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "cannot reach" in out.stdout


def test_plans_serve_command_names_the_model_and_round_trips(tiny_llama_folder):
    """The printed command serves what was planned when pasted: the model included."""
    import shlex

    from pagedllm.cli import build_parser, server_config  # noqa: F401  (the real parser)
    from pagedllm.cli.options import engine_config
    from pagedllm.tools.plan import serve_command

    plan = make_plan(tiny_llama_folder, dtype="float32", context=256, parallels=[2],
                     memory=64 << 20)
    words = shlex.split(serve_command(plan))
    assert words[:2] == ["pagedllm", "serve"]
    args = build_parser().parse_args(words[1:])
    config = engine_config(args)
    assert args.model == tiny_llama_folder and config.model == tiny_llama_folder
    assert args.max_model_len == 256 and args.dtype == "float32"
    assert "--model" not in serve_command(make_plan(None, dtype="bfloat16", context=256,
                                                    parallels=[1], memory=1 << 30))


def test_the_default_kv_cache_is_sized_for_the_model():
    """No budget given: room for 4 full-context requests, within half of what is available,
    never below the old floor (a tenth of available, up to 512 MiB)."""
    gib = 1 << 30
    request = 200 << 20  # one full-context request of a 1.7B model at 8k tokens, roughly
    assert sizing.default_kv_memory(24 * gib, request) == 4 * request  # fits: 4 requests
    assert sizing.default_kv_memory(1 * gib, request) == gib // 2  # half of what is there
    assert sizing.default_kv_memory(24 * gib, 1 << 20) == 512 << 20  # the floor
    assert sizing.default_kv_memory(2 * gib, 1 << 20) == int(2 * gib * 0.1)


def test_a_context_cut_by_the_kv_cache_is_said_with_the_flag_that_raises_it(
        tiny_llama_folder, caplog):
    from pagedllm import LLM

    with caplog.at_level("WARNING", logger="pagedllm"):
        engine = LLM(tiny_llama_folder, dtype="float32", kv_cache_memory=64 << 10).engine
    longest = engine.model_config.max_position_embeddings
    assert engine.scheduler_config.max_model_len < longest
    assert f"less than the model's context of {longest}" in caplog.text
    assert "--kv-cache-memory" in caplog.text


def test_bench_says_how_a_level_goes_and_repeats_the_servers_command(server, tmp_path):
    """Progress lines within a level (at each quarter of its requests), and a recommended
    command that is the server's own start command with --max-num-seqs changed."""
    out = subprocess.run([sys.executable, "-m", "pagedllm.cli", "bench", "--base-url", server.url,
                          "--concurrency", "1", "--requests", "8", "--prompt-tokens", "16:32",
                          "--max-tokens", "4", "--out", str(tmp_path), "--warmup", "0",
                          "--slo-ttft-p95", "600000", "--slo-tpot-p95", "600000"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    for done in (2, 4, 6):
        assert f"N=1: {done}/8 done, 0 errors" in out.stdout
    data = json.loads((tmp_path / "bench.json").read_text())
    command = data["recommendation"]["command"]
    assert command.startswith("pagedllm serve ") and command.endswith("--max-num-seqs 1")
    assert "--served-model-name smollm2" in command and "--dtype float32" in command
    assert command.count("--max-num-seqs") == 1  # the server's own 16 replaced, not repeated
    assert "recommended: N = 1" in out.stdout


def test_an_interrupted_bench_keeps_the_levels_that_finished(server, tmp_path):
    import signal

    bench = subprocess.Popen([sys.executable, "-m", "pagedllm.cli", "bench", "--base-url",
                              server.url, "--concurrency", "1,2", "--requests", "2",
                              "--prompt-tokens", "16:32", "--max-tokens", "40", "--warmup", "0",
                              "--out", str(tmp_path)], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True,
                             # Ctrl-C as at a terminal: a suite started in the background
                             # (`make test &`) ignores SIGINT, and its children inherit that.
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen = []
    for line in bench.stdout:
        seen.append(line)
        if line.startswith("N=2: sending"):  # the first level is done, the second running
            bench.send_signal(signal.SIGINT)
            break
    rest = bench.communicate(timeout=300)[0]
    assert bench.returncode == 130, "".join(seen) + rest
    assert "interrupted: writing the 1 level(s) that finished" in rest
    data = json.loads((tmp_path / "bench.json").read_text())
    assert [lv["concurrency"] for lv in data["levels"]] == [1]
    assert (tmp_path / "bench.png").stat().st_size > 1000


def test_recommended_commands_keep_the_servers_options():
    from pagedllm.tools.bench_report import with_max_num_seqs

    assert with_max_num_seqs(None, 8) == "pagedllm serve --max-num-seqs 8"
    assert with_max_num_seqs("pagedllm serve --models-dir /srv/my\\ models --max-num-seqs 4 "
                             "--port 9000", 16) == \
        "pagedllm serve --models-dir '/srv/my models' --port 9000 --max-num-seqs 16"
    assert with_max_num_seqs("pagedllm serve --max-num-seqs=4 --model m.gguf", 2) == \
        "pagedllm serve --model m.gguf --max-num-seqs 2"


def test_the_start_command_and_the_connection_cap():
    from pagedllm.cli.serve import start_command
    from pagedllm.server.server_config import connection_cap

    assert start_command(["serve", "--model", "a b.gguf", "--port", "9000"]) == \
        "pagedllm serve --model 'a b.gguf' --port 9000"
    assert start_command(["--config", "x.toml", "serve"]) == "pagedllm serve"
    assert connection_cap(None, 16) == 128  # at least 128
    assert connection_cap(None, 256) == 512  # a GPU's 256 requests: room for 256 more waiting
    assert connection_cap(0, 256) == 0 and connection_cap(10, 256) == 10  # as asked


def test_a_gpu_server_is_named_in_the_chart_and_a_refused_level_says_what_to_raise(tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    from unittest import mock

    import matplotlib.pyplot as plt
    from rich.console import Console

    from pagedllm.tools.bench_cli import _connection_cap_hint
    from pagedllm.tools.bench_report import device_words, write_plot

    gpu = {"device": "cuda", "gpu": "NVIDIA H200, 140 GiB", "cpu_isa": "avx512"}
    assert device_words(gpu) == (("GPU", "NVIDIA H200, 140 GiB"),)
    assert device_words({"device": "cuda"}) == (("GPU", "cuda"),)  # a remote card: no name
    assert device_words({"device": "cpu", "cpu_isa": "avx2"}) == (("CPU", "avx2"),)
    figures = []
    with mock.patch.object(plt, "close", side_effect=figures.append):
        write_plot(str(tmp_path / "g.png"), [level(1, 100, 10)], {"server": gpu},
                   {"concurrency": 1})
    title = figures[0]._suptitle.get_text()
    assert "GPU NVIDIA H200, 140 GiB" in title and "avx512" not in title
    plt.close(figures[0])
    refused = level(128, 100, 10)
    refused.errors = ['HTTP 429: b\'{"error":{"message":"too many open connections","type":'
                      '"rate_limit_error","param":null,"code":"too_many_connections"}}\'']
    console = Console(record=True, width=300)
    _connection_cap_hint(console, [level(8, 100, 10), refused])
    text = console.export_text()
    assert "N=128" in text and "--max-connections-per-client 256" in text and "N=8" not in text


def test_plan_uses_serves_defaults_leaves_room_and_prints_one_command_line():
    """`plan | grep 'pagedllm serve'` finds the whole command: one line off a terminal,
    sizes in units, serve's own context, a memory that leaves the machine room."""
    import shlex

    from pagedllm.cli import build_parser
    from pagedllm.tools.plan import shared_machine_memory
    from pagedllm.units import parse_bytes

    done = subprocess.run(f"{sys.executable} -m pagedllm.cli plan | grep 'pagedllm serve'",
                          shell=True, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    [line] = done.stdout.splitlines()
    words = shlex.split(line)
    assert words[:2] == ["pagedllm", "serve"]
    args = build_parser().parse_args(words[1:])
    assert args.max_model_len == 8192  # serve's default: the model's context
    kv = words[words.index("--kv-cache-memory") + 1]
    assert kv.endswith(("MiB", "GiB")) and parse_bytes(kv) % (1 << 20) == 0
    whole = subprocess.run([sys.executable, "-m", "pagedllm.cli", "plan"], capture_output=True,
                           text=True, timeout=120).stdout
    assert "context 8192 tokens" in whole and "half of what this machine has available" in whole
    gib = 1 << 30
    assert shared_machine_memory(2 * gib, 22 * gib) == 12 * gib  # weights + half the rest
    assert shared_machine_memory(30 * gib, 22 * gib) == 30 * gib  # nothing left to halve
