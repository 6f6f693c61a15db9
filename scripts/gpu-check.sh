#!/usr/bin/env bash
# One round on the GPU machine: environment, gpu tests, benchmarks, tuning; a short table last.
#   bash scripts/gpu-check.sh            (from the repository root; writes logs under $OUT or ./gpu-check-out)
#   STEPS="tests plan" bash scripts/gpu-check.sh     (a subset, to fit one call of the device tool)
# Steps: tests plan build attention tune (default: all), and context (context parallelism on every visible GPU:
# the multi-GPU tests, then scripts/bench_context_parallel.py on 2 GPUs at 128K and on 4 at 256K where there are
# 4; CP2_ARGS and CP4_ARGS replace each one's methods and repetitions, CP_ARGS adds arguments to both).
# ATTENTION_ARGS overrides the attention sizes. TESTS_PART=1, 2 or 3 runs a third of the gpu tests (1: the backward
# kernels' file, 2: the forward kernels', 3: every other file), for a cold kernel cache, where the whole suite's builds
# and runs take longer than one call of the device tool (the thirtieth session's ran past 420 s at 97%); the tests
# run in PYTEST_WORKERS processes (default 12) where pytest-xdist is installed.
# Runs from the source tree (no install needed): PYTHONPATH=. and a private kernel cache.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-check-out}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export OMNIGEN_CACHE_DIR="${OMNIGEN_CACHE_DIR:-/tmp/omnigen-cache}"
status=0
steps=" ${STEPS:-tests plan build attention tune} "
want() { [[ "$steps" == *" $1 "* ]]; }

echo "== environment"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader || true
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
nvcc --version | tail -1
git log -1 --format='commit %h %s' 2>/dev/null || true

if want tests; then
echo "== gpu tests"
kernel_tests="tests/test_kernel_backward_gpu.py tests/test_kernel_forward_gpu.py"
case "${TESTS_PART:-}" in
  "") test_paths=(tests) ;;
  1) test_paths=(tests/test_kernel_backward_gpu.py) ;;
  2) test_paths=(tests/test_kernel_forward_gpu.py) ;;
  3) test_paths=(tests); for f in $kernel_tests; do test_paths+=(--ignore "$f"); done ;;
  *) echo "TESTS_PART must be 1, 2 or 3, not $TESTS_PART" >&2; exit 2 ;;
esac
workers=(); python3 -c "import xdist" 2>/dev/null && workers=(-n "${PYTEST_WORKERS:-12}")  # pytest-xdist where present
python3 -m pytest -q -m gpu "${workers[@]}" -p no:cacheprovider "${test_paths[@]}" 2>&1 \
  | tee "$out/gpu-tests.log" | tail -25 || status=1
grep -qE "[0-9]+ failed|error" "$out/gpu-tests.log" && status=1
fi

if want plan; then
echo "== planning benchmark"
python3 benchmarks/bench_plan.py --json "$out/bench_plan.json" 2>&1 | tee "$out/bench_plan.log" | tail -9 || status=1
fi

if want build; then
echo "== build benchmark"
python3 benchmarks/bench_build.py --json "$out/bench_build.json" 2>&1 | tee "$out/bench_build.log" | tail -6 || status=1
fi

if want attention; then
echo "== attention benchmark"
python3 benchmarks/bench_attention.py ${ATTENTION_ARGS:---dims 128 --sizes 8192 16384 32768 --tile-cost} \
  --json "$out/bench_attention.json" --png "$out/bench_attention.png" 2>&1 | tee "$out/bench_attention.log" | tail -40 || status=1
fi

if want tune; then
echo "== tuning (omnigen build --tune, cold cache, then a second process that must reuse the results)"
tune_cache="$(mktemp -d /tmp/omnigen-tune.XXXXXX)"
start=$(date +%s)
OMNIGEN_CACHE_DIR="$tune_cache" python3 -m omnigen build --rules examples/rules/transfusion.yaml --tune \
  2>&1 | tee "$out/tune.log" | grep -vE "^(building|timing)" | tail -80 || status=1
echo "first tuning run: $(( $(date +%s) - start )) s (compile + verify + time)" | tee -a "$out/tune.log"
start=$(date +%s)
OMNIGEN_CACHE_DIR="$tune_cache" python3 -m omnigen build --rules examples/rules/transfusion.yaml --tune \
  > "$out/tune-again.log" 2>&1 || status=1
echo "second process: $(( $(date +%s) - start )) s" | tee -a "$out/tune-again.log"
grep -q "tuning: reusing" "$out/tune-again.log" || { echo "the second process did not reuse the tuning results"; status=1; }
OMNIGEN_CACHE_DIR="$tune_cache" python3 -m omnigen cache list > "$out/tune-cache-list.log" 2>&1 || status=1
cp "$tune_cache/tuning.json" "$out/tuning.json" 2>/dev/null || true
fi

if want context; then
# NVLink multicast stays off on a shared host (the device notes); the bench sets these too
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
echo "== context parallelism ($gpus GPUs)"
nvidia-smi topo -m 2>/dev/null | head -8 || true
python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_lse_merge.py tests/test_distributed_gpu.py 2>&1 \
  | tee "$out/cp-tests.log" | tail -5
grep -qE "[0-9]+ failed|error" "$out/cp-tests.log" && status=1
if [ "$gpus" -ge 2 ]; then
  CUDA_VISIBLE_DEVICES=0,1 python3 scripts/bench_context_parallel.py --world 2 --tokens 131072 \
    ${CP2_ARGS:---methods balanced zigzag} ${CP_ARGS:-} --json "$out/cp2.json" 2>&1 | tee "$out/cp2.log" | tail -8 || status=1
fi
if [ "$gpus" -ge 4 ]; then
  python3 scripts/bench_context_parallel.py --world 4 --tokens 262144 \
    ${CP4_ARGS:---reps 3 --methods balanced zigzag even} ${CP_ARGS:-} --json "$out/cp4.json" 2>&1 | tee "$out/cp4.log" | tail -12 || status=1
fi
fi

echo
echo "== summary"
want tests && tail -1 "$out/gpu-tests.log"
want plan && tail -8 "$out/bench_plan.log"
want attention && { grep -A40 "^attention," "$out/bench_attention.log"; grep "^tile cost" "$out/bench_attention.log"; }
want context && { tail -1 "$out/cp-tests.log"; grep -hE "^\| (balanced|zigzag|even)[ ,]|^one GPU|x[0-9], torch" "$out"/cp[24].log 2>/dev/null; }
want tune && { grep -E "^-> |^bf16|^fp16|first tuning run" "$out/tune.log"; grep -E "reusing|second process" "$out/tune-again.log"; }
exit $status
