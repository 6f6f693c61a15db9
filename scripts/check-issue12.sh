#!/usr/bin/env bash
# Issue 12 on a GPU host (torch with CUDA, triton, nvcc; no network): ~6-8 minutes.
#   OUT=/some/dir bash scripts/check-issue12.sh      (from anywhere; logs under $OUT, default ./check-issue12-out)
# Steps: build the example rules' kernels (shared by everything after), the GPU tests of this issue
# (torch.compile default + fullgraph, CUDA-graph replay of a training step, no-sync mask path, bench end
# to end), the new CPU tests under this torch, token-layout timings, the training example, omnigen bench.
# A short summary table is printed last; the exit status is 1 if any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-check-issue12-out}"
mkdir -p "$out"
export OMNIGEN_CACHE_DIR="${OMNIGEN_CACHE_DIR:-/tmp/omnigen-cache-issue12}"
RULES=examples/rules/transfusion.yaml
source scripts/check_steps.sh  # record, elapsed, print_summary

echo "== environment" | tee "$out/environment.log"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, torch.cuda.get_device_name())"
  nvcc --version | tail -1
  git log -1 --format='commit %h %s' 2>/dev/null; } 2>&1 | tee -a "$out/environment.log"

echo "== build ($RULES: d64/d128 bf16 for this GPU)"
t=$(date +%s)
timeout 240 python3 -m omnigen build --rules "$RULES" > "$out/build.log" 2>&1
rc=$?; tail -6 "$out/build.log"; record build $rc "$(elapsed $t)"

echo "== gpu tests (tests/test_compile_gpu.py)"
t=$(date +%s)
timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_compile_gpu.py > "$out/gpu-tests.log" 2>&1
rc=$?; tail -15 "$out/gpu-tests.log"; record gpu-tests $rc "$(tail -1 "$out/gpu-tests.log" | tr -d '=' | xargs) $(elapsed $t)"

echo "== cpu tests of this issue under this torch (opcheck, fake tensors, compile with emulated kernels, layouts, bench)"
t=$(date +%s)
timeout 240 python3 -m pytest -q -m "not slow" -p no:cacheprovider tests/test_op_library.py tests/test_token_layouts.py \
  tests/test_bench.py > "$out/cpu-tests.log" 2>&1
rc=$?; tail -8 "$out/cpu-tests.log"; record cpu-tests $rc "$(tail -1 "$out/cpu-tests.log" | tr -d '=' | xargs) $(elapsed $t)"

echo "== token layouts (Layout.from_tensors / from_cu_seqlens, B*S = 128K, 4K segments)"
t=$(date +%s)
timeout 60 python3 scripts/bench_token_layouts.py > "$out/token-layouts.log" 2>&1
rc=$?; cat "$out/token-layouts.log"; record token-layouts $rc "$(grep '^cuda' "$out/token-layouts.log" | xargs)"

echo "== training example (omnigen vs FlexAttention, 300 steps each)"
t=$(date +%s)
timeout 330 python3 examples/train_transfusion.py --steps 300 --out "$out/train" > "$out/train.log" 2>&1
rc=$?; tail -12 "$out/train.log"; record train-example $rc "$(grep '^tokens/s' "$out/train.log" | xargs) $(elapsed $t)"
grep -q "within noise" "$out/train.log" || { [ $rc -eq 0 ] && echo "loss curves NOT within noise (see train.log)"; }

echo "== omnigen bench (D=64, S=4096 and 8192)"
t=$(date +%s)
timeout 240 python3 -m omnigen bench --rules "$RULES" --dims 64 --sizes 4096,8192 --rounds 4 \
  --json "$out/bench.json" --png "$out/bench.png" > "$out/bench.log" 2>"$out/bench-progress.log"
rc=$?; cat "$out/bench.log"; record bench $rc "$(grep -c ' omnigen ' "$out/bench.log") omnigen rows, $(grep -c '^skipped' "$out/bench.log") skipped, $(elapsed $t)"

echo
echo "== summary ($(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1))"
print_summary 14
grep -E "^loss curves|^tokens/s" "$out/train.log" 2>/dev/null
exit $status
