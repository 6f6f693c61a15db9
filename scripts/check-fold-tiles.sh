#!/usr/bin/env bash
# The forward's folded tile boundaries (the fold_tiles option) on a GPU host, in one device call (~6-8 minutes):
#   OUT=/some/dir bash scripts/check-fold-tiles.sh            (STEPS: a subset of "1 2 3")
# 1. the GPU tests of the option: folded against the default module, bit for bit (d64, d128; O by TMA in the finished
#    tile's Q rows and O stored from registers; ping-pong), and once against float64 (short documents);
# 2. the option against the default on causal and Transfusion, forward, d128 and d64, 8K and 32K, paired in one
#    process (scripts/ab_trees.py on this tree with --new-options);
# 3. the same on masks made from data whose q-tiles are short (causal documents, packed Alpaca), paired.
# A short summary table is printed last; the exit status is 1 if a step failed. Predictions and results:
# benchmarks/RESULTS.md, "Built, measured, dropped: the forward's tile boundary folded into one step" and "The folded
# forward's codegen fix". Before spending device time on a change to it: scripts/sass_compare.py with
# --variant "transfusion:bf16:64:128x128x12x2:sm_90a:sm90:fold_tiles=1" should print 8/12 R2UR per step loop.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-check-fold-tiles-out}"
mkdir -p "$out"
export OMNIGEN_CACHE_DIR="${OMNIGEN_CACHE_DIR:-/tmp/omnigen-cache-fold-tiles}"
steps=" ${STEPS:-1 2 3} "
source scripts/check_steps.sh  # record, elapsed, print_summary, log_environment, gpu_tests, want

log_environment "$out"

if want 1; then
echo "== 1. GPU tests of fold_tiles"
gpu_tests "$out" 240 "folded" tests/test_kernel_forward_gpu.py
fi

if want 2; then
echo "== 2. fold_tiles=1 (as new) against the default (as old), causal and Transfusion, forward, paired"
t=$(date +%s)
timeout 200 python3 scripts/ab_trees.py . --paired 6 --new-options fold_tiles=1 --cache "$OMNIGEN_CACHE_DIR/ab" \
  --json "$out/fold_trees.json" -- --tiles 128x128w12 --dims 128 64 --sizes 8192 32768 --rules causal transfusion \
  --passes forward > "$out/fold_trees.log" 2>&1
rc=$?; tail -12 "$out/fold_trees.log"; record fold_paired $rc "$(elapsed $t)"
fi

if want 3; then
echo "== 3. fold_tiles=1 against the default on short q-tiles' masks, forward, paired"
t=$(date +%s)
timeout 150 python3 scripts/bench_mask_options.py --masks causal_documents packed_alpaca --dims 128 64 --sizes 8192 \
  --options fold_tiles=1 --passes forward --alternations 6 --json "$out/fold_masks.json" > "$out/fold_masks.log" 2>&1
rc=$?; tail -8 "$out/fold_masks.log"; record fold_masks $rc "$(elapsed $t)"
fi

echo
echo "== summary ($(head -1 "$out/environment.log"))"
print_summary 22
exit $status
