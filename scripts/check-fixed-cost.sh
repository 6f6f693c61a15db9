#!/usr/bin/env bash
# The persistent backward (the persistent_backward option: a grid of one CTA per SM taking kv-tile columns from a
# counter, against the backward's fixed cost per CTA; on at d64 since the thirty-second session, built for d128 too).
# Two device calls within the 10-minute limit:  OUT=/some/dir STEPS="1 2 3" bash scripts/check-fixed-cost.sh, then
# STEPS="4 5" (each step's timeout below).
# 1. its GPU tests: against float64 (attention sinks under GQA, 256 columns; plain text, 96) at d64 and d128, and on
#    2,048 columns (padding's empty ones among them) bit for bit the grid's dK/dV;
# 2. / 3. on the catalogue masks of short columns and rows (causal documents, packed Alpaca) and the windowed one,
#    paired: at d128 persistent_backward=2 against the default (off there), at d64 persistent_backward=0 against the
#    default (on there: a positive change is what the default gains);
# 4. / 5. the same on causal and Transfusion layouts (ab_trees.py with this tree as both), fwd+bwd.
# A short summary table is printed last; the exit status is 1 if a step failed. Predictions and results:
# benchmarks/RESULTS.md, "Built, not yet run: the persistent backward" and "Thirty-second session".
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-check-fixed-cost-out}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export OMNIGEN_CACHE_DIR="${OMNIGEN_CACHE_DIR:-/tmp/omnigen-cache-fixed-cost}"
steps=" ${STEPS:-1 2 3} "
want() { [[ "$steps" == *" $1 "* ]]; }
source scripts/check_steps.sh  # record, elapsed, print_summary, log_environment, gpu_tests

log_environment "$out"

if want 1; then
echo "== 1. GPU tests of the persistent backward"
gpu_tests "$out" 300 "persistent_backward" tests/test_kernel_backward_gpu.py
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
if want 2; then echo "== 2. d128: persistent_backward=2 on catalogue masks, paired"; masks masks_d128 128 persistent_backward=2; fi
if want 3; then echo "== 3. d64: persistent_backward=0 on catalogue masks, paired"; masks masks_d64 64 persistent_backward=0; fi
if want 4; then echo "== 4. d128: persistent_backward=2 on causal and Transfusion, paired"; layouts layouts_d128 128 persistent_backward=2; fi
if want 5; then echo "== 5. d64: persistent_backward=0 on causal and Transfusion, paired"; layouts layouts_d64 64 persistent_backward=0; fi

echo
echo "== summary ($(head -1 "$out/environment.log"))"
print_summary 20
exit $status
