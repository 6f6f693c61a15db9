#!/usr/bin/env bash
# The options built against the backward's fixed cost per CTA and the forward's per tile (thirty-first session, all off
# by default): prefetch_next_kv, prefetch_next_q (L2 prefetches) and persistent_backward (a counter-fed grid). Three
# device calls within the 10-minute limit:  OUT=/some/dir STEPS="1 2" bash scripts/check-fixed-cost.sh, then
# STEPS="3 5", then STEPS="4" (each step's timeout below).
# 1. their GPU tests: the backward options against float64 (attention sinks under GQA, 256 columns; plain text, 96)
#    and the persistent backward on 2,048 columns against the default module; the forward with prefetch_next_q bit
#    for bit the default's output;
# 2. both prefetches against the defaults on the catalogue masks of short columns and rows (causal documents, packed
#    Alpaca) and the windowed one, paired (the forward's change is prefetch_next_q's, the rest of fwd+bwd's
#    prefetch_next_kv's: each touches one pass);
# 3. persistent_backward the same way;
# 4. / 5. the prefetches / persistent_backward on causal and Transfusion layouts (ab_trees.py with this tree as both).
# A short summary table is printed last; the exit status is 1 if a step failed. Predictions and results:
# benchmarks/RESULTS.md, "Built, not yet run: K/V and Q fetched into L2 ahead of their copies" and "Built, not yet
# run: the persistent backward".
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-check-fixed-cost-out}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export OMNIGEN_CACHE_DIR="${OMNIGEN_CACHE_DIR:-/tmp/omnigen-cache-fixed-cost}"
steps=" ${STEPS:-1 2 3} "
want() { [[ "$steps" == *" $1 "* ]]; }
source scripts/check_steps.sh  # record, elapsed, print_summary, log_environment, gpu_tests
prefetches=(prefetch_next_kv=1 prefetch_next_q=1)

log_environment "$out"

if want 1; then
echo "== 1. GPU tests of the options"
gpu_tests "$out" 300 "prefetch or persistent_backward" tests/test_kernel_backward_gpu.py tests/test_kernel_forward_gpu.py
fi

masks() {  # step name, options...
  local name=$1; shift
  t=$(date +%s)
  timeout 240 python3 scripts/bench_mask_options.py --masks causal_documents packed_alpaca global_sliding_window \
    --dims 128 64 --sizes 8192 32768 --options "$@" --alternations 6 --json "$out/$name.json" > "$out/$name.log" 2>&1
  rc=$?; tail -14 "$out/$name.log"; record "$name" $rc "$(elapsed $t)"
}
layouts() {  # step name, options...
  local name=$1; shift
  t=$(date +%s)
  timeout 300 python3 scripts/ab_trees.py . --paired 6 --new-options "$@" --cache "$OMNIGEN_CACHE_DIR/ab-$name" \
    --json "$out/$name.json" -- --tiles 128x128w12 --dims 128 64 --sizes 8192 32768 --rules causal transfusion \
    --passes forward fwd+bwd > "$out/$name.log" 2>&1
  rc=$?; tail -19 "$out/$name.log"; record "$name" $rc "$(elapsed $t)"
}
if want 2; then echo "== 2. the prefetches on catalogue masks, paired"; masks masks_prefetch "${prefetches[@]}"; fi
if want 3; then echo "== 3. the persistent backward on catalogue masks, paired"; masks masks_persistent persistent_backward=1; fi
if want 4; then echo "== 4. the prefetches on causal and Transfusion, paired"; layouts layouts_prefetch "${prefetches[@]}"; fi
if want 5; then echo "== 5. the persistent backward on causal and Transfusion, paired"; layouts layouts_persistent persistent_backward=1; fi

echo
echo "== summary ($(head -1 "$out/environment.log"))"
print_summary 20
exit $status
