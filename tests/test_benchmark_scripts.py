"""Every script under benchmarks/ runs in the suite, so none rots unnoticed (one once called a
method that no longer existed): each with --smoke (benchmarks/timing.py: tiny sizes, one
repeat, on the bundled model), its output parsed for the table and ratio it exists to print.
The figures of a smoke run mean nothing; the test asserts that the script ran its whole path.

SMOKE lists the scripts run here: a new script must come with its entry."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.join(ROOT, "benchmarks")
RATIO = r"\d+\.\d+ ?x"  # a speed-up or ratio as the scripts print them

# script -> (extra arguments, patterns its output must hold)
SMOKE = {
    "attention_kernels.py": ([], [r"decode, 30 layers:", r"S= 2 L=  40 .*" + RATIO,
                                  r"prefill chunk, one layer:", r"16 tokens from   32 .*" + RATIO]),
    "attention_options.py": ([], [r"Gemma 2 2B, global +decode, 2 x 48 tokens .*" + RATIO,
                                  r"Gemma 3 1B, sliding 512 +prefill, 16 after 32 .*" + RATIO]),
    "cpu_levels.py": ([], [r"q4_q8_gemm +8 .*", r"decode attention int8 2x40 +2 "]),
    "decode_step.py": ([], [r"^ +2 +[\d.]+ +[\d.]+ +[\d.]+ +" + RATIO]),
    "int8_activations.py": ([], [r"^exact +[\d.]+ +[\d.]+ +[\d.]+ +1\.00x",
                                 r"^int8 everywhere .*" + RATIO]),
    "kv_cache_int8.py": ([], [r"^ +2 sequences .*" + RATIO, r"tokens in the pool: auto [\d,]+",
                              r"^int8 +one token each +[\d.]+ +[\d.]+"]),
    "linear_kernels.py": ([], [r"^ +8 +[\d.]+ .*" + RATIO, r"output head 49152 x 576",
                               r"top-16 exact recomputation"]),
    "sampler_speed.py": ([], [r"^ +16 +[\d.]+ +[\d.]+ +[\d.]+x \| +[\d.]+ +[\d.]+ +[\d.]+x"]),
    "window_kv.py": ([], [r"gemma-3-27b +\d+ tokens: .*GiB ->",
                          r"measured, one 2,000-token request .*\(\d+\.\dx\)"]),
    "kv_memory.py": ([], [r"paged, peak in use: +[\d.]+ GiB \(\d+ blocks of 16\)",
                          r"contiguous, full 512-token context x 4: .*x more"]),
    "prompt_refusal.py": ([], [r"refused: at least [\d,]+ tokens\); [\d,]+x less work"]),
    "gguf_header.py": ([], [r"ratio \d+\.\dx", r"`pagedllm plan` \(a new process\): +[\d.]+ s"]),
    "kernel_builds.py": ([], [r"^1\.7B Q6_K +q6_gemm +rows +8: base +[\d.]+ ms, this tree +[\d.]+ ms, "
                              r"speed-up " + RATIO + ", same bits: yes", r"^135M +q4_i16_gemm +rows +1: "]),
    "k_quant_kernels.py": ([], [r"Q4_K two-level: [\d.]+x; int16 activations on it: [\d.]+x; "
                                r"Q6_K 6-bit: [\d.]+x"]),
    "offline_throughput.py": ([], [r"batched [\d,]+ tok/s \(median of 1; bfloat16, 2 threads\)"]),
    "offline_batching.py": ([], [r"ratio \(all at once / one at a time\): [\d.]+x; identical "
                                 r"outputs both ways: 3/3"]),
    "prefix_cache_ttft.py": ([], [r"prefix caching on : TTFT median +[\d.]+ ms",
                                  r"ratio off/on: [\d.]+x"]),
    "step_thread.py": ([], [r"second thread / engine's thread: [\d.]+x"]),
    "engine_thread.py": ([], [r"helper thread [\d.]+ ms/step, main thread [\d.]+ ms/step; "
                              r"ratio [\d.]+x"]),
    "vs_transformers.py": ([], [r"pagedllm vs transformers one at a time: +[\d.]+x",
                                r"pagedllm vs transformers static batch: +[\d.]+x"]),
    "host_overhead.py": ([], [r"N=2: engine alone [\d,]+ tok/s; one process [\d,]+ \([\d.]+x "
                              r"alone, .*--engine-process [\d,]+ .*two processes / one: [\d.]+x"]),
    "step_split.py": ([], [r"round 1: [\d,]+ tok/s, \d+ steps; ms a step: step [\d.]+, plan "
                           r"[\d.]+, inputs [\d.]+, model [\d.]+"]),
    "gpu_attention.py": ([], [r"qwen3-1.7b prefill 2x40: .* torch SDPA's time"]),
    "embeddings.py": ([], [r"lowest cosine to sentence-transformers: [\d.]+",
                           r"batch  64: sentence-transformers +\d+ texts/s, pagedllm +\d+ "
                           r"texts/s +ratio [\d.]+x", r"server, 16 clients at once: .*ratio [\d.]+x"]),
    "structured_output.py": ([], [r"no schema +[\d.]+ tok/s +time vs no schema 1\.000x",
                                  r"50-property schema: compile \+ first mask [\d.]+ ms",
                                  r"guided: \d/2 answers parse and validate"]),
    "soak_memory.py": ([], [r"round 1: [\d,]+ MiB \(\+0 MiB over round 1\)"]),
    "decode_kernels.py": ([], [r"N=1: kernels per layer \d+ \(torch layer ops\) -> \d+ \(Triton\)"
                               r".*: [\d.]+x fewer",
                               r"an MoE layer, 128 experts, 8 a token, N=1: \d+ launches"]),
    "prefill_attention.py": ([], [r"40 tokens: SDPA \d+ ms, kernel \d+ ms \([\d.]+x\)"]),
    "profile_load.py": ([], [r"budget 256: [\d.]+ s, \d+ total tok/s", r"ncalls +tottime"]),
    "grammar_libraries.py": ([], [r"^llguidance +\d+ +[\d.]+ +[\d.]+ +[\d.]+ \([\d.]+\)"]),
    "model_store.py": ([], [r"first: first request [\d.]+ s \(load \+ answer\)",
                            r"ratio two at once / one alone: [\d.]+x"]),
    "page_overhead.py": ([], [r"one engine snapshot of a 16,384-block pool, half in use: [\d.]+ ms",
                              r"median open / closed: [\d.]+ \("]),
    "quality_gate.py": ([], [r"held-out text: 16 tokens",
                             r"^float32 +[\d.]+ +[\d.]+ +\d+/\d+ +2/\d+"]),
    "amx_prefill.py": ([], [r"^default: \S+ .* against \S+", r"n8_tok_s: [\d.]+ on, [\d.]+ off: "
                                                                  r"[\d.]+x"]),
    "gpu_decode.py": ([], [r"^default N=2: \{", r'"tpot_over_transformers": \{\s+"1": [\d.]+']),
    "load_per_level.py": ([], [r"^portable +1 +\d+ .* 1\.00x$"]),
    "lora.py": ([], [r"N=2: base alone \d+ tok/s; 2 adapters mixed \d+ tok/s = [\d.]+x the base",
                     r"2 servers of merged models.*LoRA serving [\d.]+x the throughput"]),
    "lora_engine.py": ([], [r"^2 adapters mixed: \d+ tok/s = [\d.]+x the base",
                            r"^one adapter for all: \d+ tok/s"]),
    "moe_active_params.py": ([], [r"MoE / dense-active: b=1 [\d.]+x, b=8 [\d.]+x"]),
    "realistic_size.py": ([], [r"projections \+ head at one row, all layers: [\d.]+ ms",
                               r"^N=1: total tok/s [\d.]+x llama.cpp's",
                               r"over 1 paired rounds .*output tok/s [\d.]+x"]),
    "replica_routing.py": ([], [r"^distinct: hit rate .* with prefix routing",
                                r"2 replicas x 1 thread / 1 replica x 2 threads: [\d.]+x"]),
    "speculative.py": ([], [r"ratio ngram/off: TPOT p50 at N=1 [\d.]+x",
                            r"identical outputs: \w+; ratio ngram/off [\d.]+x",
                            r"^ +2 +[\d.]+ +[\d.]+ +[\d.]+$"]),
}
# Covered by a test of its own.
ELSEWHERE = {"roof.py": "tests/test_roof.py"}
HELPERS = {"timing.py"}  # imported by the scripts, not one


def test_every_script_is_smoke_run_or_listed():
    scripts = {name for name in os.listdir(BENCHMARKS) if name.endswith(".py")}
    listed = set(SMOKE) | set(ELSEWHERE) | HELPERS
    assert scripts - listed == set(), "a new benchmark script needs its entry in SMOKE"
    assert listed - scripts == set(), "a script listed here is gone: drop its entry"


@pytest.mark.parametrize("script", sorted(SMOKE))
def test_the_script_runs_its_whole_path(script):
    arguments, patterns = SMOKE[script]
    run = subprocess.run([sys.executable, os.path.join(BENCHMARKS, script), "--smoke", *arguments],
                         cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    for pattern in patterns:
        assert re.search(pattern, run.stdout, re.M), (pattern, run.stdout[-3000:])
