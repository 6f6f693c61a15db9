#!/usr/bin/env bash
# Issue 30's acceptance figures on one GPU, in steps that fit the device tool's 10-minute calls, then the table of
# every criterion (scripts/issue30_table.py):
#   OUT=/some/dir STEPS="0 1" bash scripts/check-issue30.sh      then STEPS="2 3", STEPS="4 5", STEPS="6", STEPS="table"
# 0. every bf16/fp16 variant steps 1-4 time (both rules, d64/d128/d256, sm_90a) in one parallel build, so that the
#    bench steps find them cached instead of building two at a time (each step still builds what it lacks)
# 1. bf16 MHA, d64 and d128: plain causal rules and Transfusion against SDPA cuDNN causal, 8K and 32K
# 2. the same at d256
# 3. GQA 16/4 (d64, d128, both rules)            4. fp16 (d64, d128, both rules)
# 5. FP8 forward at d128 against our bf16 forward (scripts/bench_fp8.py: errors against float64 too)
# 6. the whole gpu test suite (TESTS_PART=1, 2 or 3 of scripts/gpu-check.sh: the issue asks it to pass on the final tree)
# Every bench step runs omnigen and cuDNN in one process, 3 round-robin rounds, each peer timed after 250 ms of its
# own load (omnigen bench). The JSONs, logs and table land in $OUT; the table is printed at the end of every run.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-check-issue30-out}"
mkdir -p "$out"
export OMNIGEN_CACHE_DIR="${OMNIGEN_CACHE_DIR:-/tmp/omnigen-cache-issue30}"
steps=" ${STEPS:-0 1} "
source scripts/check_steps.sh  # record, elapsed, print_summary, log_environment, want

log_environment "$out"

rules_file() {  # causal or transfusion: its rules file
  if [ "$1" = transfusion ]; then echo examples/rules/transfusion.yaml; else echo benchmarks/rules/causal.yaml; fi
}

bench() {  # name, dims, extra options...
  local name=$1 dims=$2 t rules
  shift 2
  for rules in causal transfusion; do
    t=$(date +%s)
    timeout 280 python3 -m omnigen bench --rules "$(rules_file $rules)" --dims "$dims" --sizes 8192,32768 \
      --peers omnigen,cudnn_causal --rounds 3 "$@" --json "$out/${name}_$rules.json" > "$out/${name}_$rules.log" 2>&1
    local rc=$?
    grep -E " (omnigen|cudnn_causal) " "$out/${name}_$rules.log" | tail -8
    record "${name}_$rules" $rc "$(elapsed "$t")"
  done
}

if want 0; then
  echo "== 0. build: both rules, d64/d128/d256, bf16 and fp16, sm_90a"
  for rules in causal transfusion; do
    t=$(date +%s)
    # the same rules with a kernel section naming every variant (a variant does not depend on that section)
    python3 -c 'import sys, yaml
data = yaml.safe_load(open(sys.argv[1]))
data["kernel"] = {"head_dims": [64, 128, 256], "dtypes": ["bf16", "fp16"]}
yaml.safe_dump(data, open(sys.argv[2], "w"), sort_keys=False)' "$(rules_file $rules)" "$out/build_$rules.yaml"
    timeout 280 python3 -m omnigen build --rules "$out/build_$rules.yaml" --arch sm_90a > "$out/build_$rules.log" 2>&1
    rc=$?; tail -3 "$out/build_$rules.log"; record "build_$rules" $rc "$(elapsed "$t")"
  done
fi
if want 1; then echo "== 1. bf16 MHA, d64 and d128"; bench bf16 64,128; fi
if want 2; then echo "== 2. bf16 MHA, d256"; bench d256 256; fi
if want 3; then echo "== 3. GQA 16/4, d64 and d128"; bench gqa 64,128 --heads-kv 4; fi
if want 4; then echo "== 4. fp16, d64 and d128"; bench fp16 64,128 --dtype fp16; fi
if want 5; then
  echo "== 5. FP8 forward, d128"
  t=$(date +%s)
  timeout 400 python3 scripts/bench_fp8.py --rules causal transfusion --sizes 8192 32768 --json "$out/fp8.json" \
    > "$out/fp8.log" 2>&1
  rc=$?; tail -8 "$out/fp8.log"; record fp8 $rc "$(elapsed "$t")"
fi
if want 6; then
  echo "== 6. gpu tests, part ${TESTS_PART:-all}"
  t=$(date +%s)
  OUT="$out/gpu-check" STEPS=tests bash scripts/gpu-check.sh > "$out/gpu-tests.log" 2>&1
  rc=$?; tail -4 "$out/gpu-tests.log"; record "gpu_tests${TESTS_PART:+_part$TESTS_PART}" $rc "$(elapsed "$t")"
fi

echo
echo "== issue 30's criteria, from every JSON in $out so far"
python3 scripts/issue30_table.py "$out" | tee "$out/table.md"
echo
echo "== summary ($(head -1 "$out/environment.log"))"
print_summary 22
exit $status
