#!/bin/bash
# Fresh clone -> ready line: benchmarks/fresh_clone.sh COMMIT clones this checkout at COMMIT into
# /tmp, runs `make serve` with an empty kernel cache and prints the seconds until `pagedllm
# ready` (BENCHMARKS.md, "From clone to first token"). Port 8000 must be free.
set -u
commit=$1; dir=/tmp/fresh_$commit
rm -rf $dir /tmp/te_fresh_$commit; git clone -q "$(git rev-parse --show-toplevel)" $dir && cd $dir && git checkout -q $commit
export TORCH_EXTENSIONS_DIR=/tmp/te_fresh_$commit
start=$(date +%s.%N)
make serve > make.log 2>&1 &
pid=$!
while ! grep -q "pagedllm ready" make.log 2>/dev/null; do
  sleep 0.5
  if ! kill -0 $pid 2>/dev/null; then echo "$commit: FAILED"; tail -5 make.log; exit 1; fi
done
end=$(date +%s.%N)
echo "$commit: fresh clone -> ready line in $(echo "$end - $start" | bc) s"
grep -n "built in\|compiling\|pagedllm ready" make.log | head -12
pkill -f "$dir/.venv/bin/pagedllm serve"; pkill -f "^.venv/bin/pagedllm serve"; wait $pid
