#!/usr/bin/env bash
# The one command to run when a GPU machine is lent (DEVELOPERS.md; issue 32): the GPU path's
# tests compiled for the GPU, with results as JSON under $OUT. It uses the machine's own
# Python, torch and Triton (nothing is downloaded there); pagedllm itself from this tree.
# What runs today: the Triton paged attention against the torch reference on CUDA tensors,
# and its time per call at a decode-sized and a prefill-sized step. The CUDA backend proper
# (weights on the GPU, CUDA graphs, the engine's tests there) is not built yet.
set -u
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD/tests:${PYTHONPATH:-}"
export PAGEDLLM_TEST_DEVICE=cuda
python3 - <<'PY' > "$OUT/environment.json"
import json, torch, triton
print(json.dumps({"torch": torch.__version__, "triton": triton.__version__,
                  "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(0)
                  if torch.cuda.is_available() else None}))
PY
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_triton_attention.py \
    --junitxml="$OUT/triton_attention.xml" > "$OUT/triton_attention.log" 2>&1
echo "pytest exit: $?" >> "$OUT/triton_attention.log"
timeout 120 python3 - <<'PY' > "$OUT/triton_attention_timing.json"
import json, time, torch
from pagedllm.attention import AttentionMetadata
from pagedllm.attention.triton_paged import paged_attention
results = {}
for name, (num_seqs, ctx, new) in {"decode 64 x 1024": (64, 1024, 1),
                                    "prefill 4 x 512": (4, 0, 512)}.items():
    bs, heads, kv, d = 16, 32, 8, 128
    lens = [ctx + new] * num_seqs
    blocks_per = -(-lens[0] // bs)
    tables = [list(range(i * blocks_per, (i + 1) * blocks_per)) for i in range(num_seqs)]
    kc = torch.randn(num_seqs * blocks_per, bs, kv, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    starts = [i * new for i in range(num_seqs + 1)]
    slots = [t[p // bs] * bs + p % bs for t in tables for p in range(ctx, ctx + new)]
    meta = AttentionMetadata.build(slots, starts, lens, tables, bs)
    q = torch.randn(starts[-1], heads, d, device="cuda", dtype=torch.bfloat16)
    paged_attention(q, kc, vc, meta, d ** -0.5)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        paged_attention(q, kc, vc, meta, d ** -0.5)
    torch.cuda.synchronize()
    results[name] = {"ms_per_call": (time.perf_counter() - t) / 20 * 1000}
print(json.dumps(results))
PY
cat "$OUT"/*.json
tail -3 "$OUT/triton_attention.log"
