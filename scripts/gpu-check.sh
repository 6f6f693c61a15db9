#!/usr/bin/env bash
# One round on the GPU machine: environment, gpu tests, benchmarks, tuning; a short table last.
#   bash scripts/gpu-check.sh            (from the repository root; writes logs under $OUT or ./gpu-check-out)
#   STEPS="tests plan" bash scripts/gpu-check.sh     (a subset, to fit one call of the device tool)
# Steps: tests plan build attention tune (default: all). ATTENTION_ARGS overrides the attention sizes.
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
python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tee "$out/gpu-tests.log" | tail -25 || status=1
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

echo
echo "== summary"
want tests && tail -1 "$out/gpu-tests.log"
want plan && tail -8 "$out/bench_plan.log"
want attention && { grep -A40 "^attention," "$out/bench_attention.log"; grep "^tile cost" "$out/bench_attention.log"; }
want tune && { grep -E "^-> |^bf16|^fp16|first tuning run" "$out/tune.log"; grep -E "reusing|second process" "$out/tune-again.log"; }
exit $status
