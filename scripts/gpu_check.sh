#!/usr/bin/env bash
# The one command to run when a GPU machine is lent (DEVELOPERS.md; issue 32), under 8 minutes,
# results under $OUT. It uses the machine's own Python, torch and Triton (nothing is
# downloaded there): the two packages it lacks (gguf, llguidance) come as wheels in
# gpu-wheels/ (`make gpu-wheels` here; carry it: run(carry=["gpu-wheels"])), pagedllm itself
# from this tree. It runs:
#   1. the GPU's tests (PAGEDLLM_TEST_DEVICE=cuda: tests/test_generic_backend.py,
#      test_int4_triton.py, test_triton_layer_ops.py, test_triton_attention.py,
#      test_launch_count.py, test_moe_triton.py, test_fp8_linear.py): float32 logits equal transformers' for each family, bf16
#      close, no leaked blocks, graph replay equal to eager, sampling on the card as on the
#      host, the Triton kernels' results (int8 caches too), kernels per decode layer;
#   2. benchmarks/gpu_decode.py with CUDA graphs on the 1.7B shape (random weights, the
#      default model's tokenizer from gpu-wheels/tokenizer.gguf) at N = 1, 8, 32, 128 (TTFT,
#      TPOT, tokens/s, GPU memory, decode against the copy-bandwidth floor): the engine alone;
#   3. benchmarks/host_overhead.py on the same file (issue 45): `pagedllm serve` in one
#      process and with --engine-process under a streamed load at N = 1, 8, 32, 128, 256,
#      512-token answers (tokens/s, TTFT, TPOT, the server's CPU per 1,000 tokens) beside
#      the engine alone, in one run; the engine alone and the engine process each with
#      and without overlapped steps (--overlap-ab: the host plans step t+1 while the GPU
#      runs step t; issue 45);
#   4. benchmarks/gpu_attention.py: the attention kernel alone, decode against the bytes it
#      must read (the copy bandwidth's share) and prefill against torch's SDPA (issue 46);
#   5. scripts/gpu_profile_decode.py: eager decode steps kernel by kernel.
# (Measured in earlier runs and left out for time: transformers' generate as a baseline,
# dense against --gpu-4bit-weights, eager steps; `benchmarks/gpu_decode.py --help`.)
# (scripts/gpu_probe_gemma2.py, the module-by-module Gemma 2 probe, is run by hand.)
#
# A rehearsal on a machine without a GPU (`DRY=1 PYTHON=.venv/bin/python scripts/gpu_check.sh`)
# runs the same steps on the CPU's generic path with small sizes and installs nothing: it
# checks the script itself before GPU minutes are spent on it.
set -u
OUT=${OUT:-gpu-out}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD/tests:${PYTHONPATH:-}"
if [ "${DRY:-0}" = 1 ]; then
    DEVICE=torch-cpu
    BENCH_ARGS=(--device torch-cpu --levels 1,2 --tokens 4 --prompt-tokens 16 --models default
                --random-default --work "$OUT/models")
    SERVED_ARGS=(--concurrency 1,2 --max-tokens 8)  # the tiny model, on this CPU
else
    DEVICE=cuda
    BENCH_ARGS=(--work /tmp/pagedllm-gpu)
    SERVED_ARGS=(--model /tmp/pagedllm-gpu/smollm2-1.7b-random-F16.gguf --concurrency 1,8,32,128,256
                 --max-tokens 512 --serve-args "--device cuda" --overlap-ab)
    export PAGEDLLM_NO_KERNELS=1  # the GPU path needs no C++ CPU kernels: none compiled there
    if [ -d gpu-wheels ]; then  # only what the machine lacks: its own torch stack stays
        for wheel in gpu-wheels/*.whl; do
            name=$(basename "$wheel" | cut -d- -f1)
            "$PYTHON" -c "import importlib.metadata as m; m.version('$name')" 2>/dev/null \
                || "$PYTHON" -m pip install --no-index --no-deps "$wheel" >> "$OUT/pip.log" 2>&1
        done
    fi
fi
export PAGEDLLM_TEST_DEVICE=$DEVICE
if [ -f gpu-wheels/tokenizer.gguf ]; then  # the default model's package cannot travel
    BENCH_ARGS+=(--tokenizer-from gpu-wheels/tokenizer.gguf)
fi
"$PYTHON" - <<'PY' > "$OUT/environment.json"
import json, torch, triton
print(json.dumps({"torch": torch.__version__, "triton": triton.__version__,
                  "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(0)
                  if torch.cuda.is_available() else None}))
PY
# Most wanted first (a run cut short by its limit keeps what is done): the GPU tests (the
# Triton kernels compiled there for the first time), the benchmark as served (CUDA graphs,
# the default), the 4-bit A/B, the profile, eager for comparison.
timeout 110 "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_generic_backend.py \
    tests/test_int4_triton.py tests/test_triton_layer_ops.py tests/test_triton_attention.py \
    tests/test_launch_count.py tests/test_moe_triton.py tests/test_fp8_linear.py \
    tests/test_lora_model.py::test_the_triton_kernels_equal_the_per_token_reference --junitxml="$OUT/gpu_tests.xml" > "$OUT/gpu_tests.log" 2>&1
echo "pytest exit: $?" >> "$OUT/gpu_tests.log"
# The attention kernel alone against the bytes it must read and torch's SDPA (issue 46).
ATTENTION_ARGS=(--json "$OUT/gpu_attention.json")
[ "$DEVICE" = cuda ] || ATTENTION_ARGS+=(--smoke)
timeout 40 "$PYTHON" benchmarks/gpu_attention.py "${ATTENTION_ARGS[@]}" > "$OUT/gpu_attention.log" 2>&1
echo "exit: $?" >> "$OUT/gpu_attention.log"
if [ "$DEVICE" = cuda ]; then  # graphs are captured on a GPU only
    timeout 100 "$PYTHON" benchmarks/gpu_decode.py "${BENCH_ARGS[@]}" --cuda-graphs \
        --models 1.7b --json "$OUT/gpu_decode_graphs.json" > "$OUT/gpu_decode_graphs.log" 2>&1
    echo "exit: $?" >> "$OUT/gpu_decode_graphs.log"
else
    timeout 50 "$PYTHON" benchmarks/gpu_decode.py "${BENCH_ARGS[@]}" \
        --json "$OUT/gpu_decode.json" > "$OUT/gpu_decode.log" 2>&1
    echo "exit: $?" >> "$OUT/gpu_decode.log"
fi
# As a user runs it: the server (one process, and the engine in its own) under streamed load.
timeout 200 "$PYTHON" benchmarks/host_overhead.py "${SERVED_ARGS[@]}" --json "$OUT/served.json" \
    > "$OUT/served.log" 2>&1
echo "exit: $?" >> "$OUT/served.log"
if [ "$DEVICE" = cuda ]; then  # the 1.7B file the benchmark wrote, eager steps kernel by kernel
    timeout 30 "$PYTHON" scripts/gpu_profile_decode.py > "$OUT/decode_profile.log" 2>&1
    echo "exit: $?" >> "$OUT/decode_profile.log"
fi
cat "$OUT"/environment.json
grep -E "N=|copy|wrote|exit|Error|transformers|prefill" "$OUT"/gpu_decode*.log "$OUT"/served.log \
    "$OUT"/gpu_attention.log
tail -n 3 "$OUT/gpu_tests.log"
[ -f "$OUT/decode_profile.log" ] && cut -c1-600 "$OUT/decode_profile.log"
