#!/usr/bin/env bash
# A Hopper backward option against the default kernels, in steps that fit the device tool's 10-minute calls:
#   OUT=/some/dir OPTIONS="persistent_backward=2" TESTS="persistent_backward" STEPS="1 2" bash scripts/check-backward-option.sh
# then STEPS="3", STEPS="4 5". OPTIONS_D128 / OPTIONS_D64 set the options per head dim where they differ (default: OPTIONS);
# the persistent backward of the thirty-second session ran as OPTIONS_D128="persistent_backward=2"
# OPTIONS_D64="persistent_backward=0" (off at d64: a positive change is what the default gains there).
# 1. the option's GPU tests (tests/test_kernel_backward_gpu.py -k "$TESTS");
# 2. / 3. d128 / d64 on the catalogue masks of short columns and rows (causal documents, packed Alpaca) and the
#    windowed one, at 8K and 32K, paired (scripts/bench_mask_options.py), forward and fwd+bwd;
# 4. / 5. d128 / d64 on causal and Transfusion layouts (ab_trees.py with this tree as both), fwd+bwd.
# A short summary table is printed last; the exit status is 1 if a step failed. Predictions and results:
# benchmarks/RESULTS.md.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-check-backward-option-out}"
options="${OPTIONS:?OPTIONS=NAME=VALUE ... (the option against the default)}"
options_d128="${OPTIONS_D128:-$options}" options_d64="${OPTIONS_D64:-$options}"
mkdir -p "$out"
export OMNIGEN_CACHE_DIR="${OMNIGEN_CACHE_DIR:-/tmp/omnigen-cache-backward-option}"
steps=" ${STEPS:-1 2 3} "
source scripts/check_steps.sh  # record, elapsed, print_summary, log_environment, gpu_tests, want

log_environment "$out"

if want 1; then
echo "== 1. GPU tests: -k ${TESTS:?TESTS=the -k expression of the GPU tests of the option}"
gpu_tests "$out" 300 "$TESTS" tests/test_kernel_backward_gpu.py
fi

masks() {  # step name, head dim, options...
  local name=$1 dim=$2; shift 2
  t=$(date +%s)
  timeout 240 python3 scripts/bench_mask_options.py --masks causal_documents packed_alpaca global_sliding_window \
    --dims "$dim" --sizes 8192 32768 --options "$@" --alternations 6 --json "$out/$name.json" > "$out/$name.log" 2>&1
  rc=$?; tail -7 "$out/$name.log"; record "$name" $rc "$(elapsed $t)"
}
layouts() {  # step name, head dim, options...
  local name=$1 dim=$2; shift 2
  t=$(date +%s)
  timeout 300 python3 scripts/ab_trees.py . --paired 6 --new-options "$@" --cache "$OMNIGEN_CACHE_DIR/ab-$name" \
    --json "$out/$name.json" -- --tiles 128x128w12 --dims "$dim" --sizes 8192 32768 --rules causal transfusion \
    --passes fwd+bwd > "$out/$name.log" 2>&1
  rc=$?; tail -5 "$out/$name.log"; record "$name" $rc "$(elapsed $t)"
}
# (word splitting of the option lists is wanted: NAME=VALUE words)
if want 2; then echo "== 2. d128: $options_d128 on catalogue masks, paired"; masks masks_d128 128 $options_d128; fi
if want 3; then echo "== 3. d64: $options_d64 on catalogue masks, paired"; masks masks_d64 64 $options_d64; fi
if want 4; then echo "== 4. d128: $options_d128 on causal and Transfusion, paired"; layouts layouts_d128 128 $options_d128; fi
if want 5; then echo "== 5. d64: $options_d64 on causal and Transfusion, paired"; layouts layouts_d64 64 $options_d64; fi

echo
echo "== summary ($(head -1 "$out/environment.log"))"
print_summary 20
exit $status
