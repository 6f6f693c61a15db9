#!/usr/bin/env bash
# The tile orders' defaults on a GPU host (thirtieth session: balanced_sections on, leading_q_tiles / leading_kv_tiles
# at most 2 and decided from the plan), ~6 minutes in one device call:
#   mkdir _base && git archive <commit before> omnigen | tar -x -C _base      (the old tree, carried untracked)
#   OUT=/some/dir bash scripts/check-tile-orders.sh                            (STEPS: a subset of "1 2 3 4")
# 1. the GPU tests of the tile-order options (at most 0, 1, 3 leading lines and balanced_sections off against the
#    defaults, bit for bit; attention sinks, whose first lines lead, and Transfusion, whose do not);
# 2. the leading lines on the windowed masks with global tokens, the defaults against leading_kv_tiles=0
#    leading_q_tiles=0, paired (no other catalogue mask leads: tests/test_sm90_grid_order.py and RESULTS.md);
# 3. the old tree (_base) against this one on causal and Transfusion, paired: balanced_sections' forward gain and the
#    cost of reading the plan's first lines at each CTA's start (none lead there);
# 4. omnigen bench --mask on the two windowed masks, FlexAttention in the same process.
# A short summary table is printed last; the exit status is 1 if a step failed. Predictions and results:
# benchmarks/RESULTS.md, "Thirtieth session: the tile-order options, run".
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-check-tile-orders-out}"
mkdir -p "$out"
export OMNIGEN_CACHE_DIR="${OMNIGEN_CACHE_DIR:-/tmp/omnigen-cache-tile-orders}"
steps=" ${STEPS:-1 2 3 4} "
source scripts/check_steps.sh  # record, elapsed, print_summary, log_environment, gpu_tests, want

log_environment "$out"

if want 1; then
echo "== 1. GPU tests of the tile-order options"
gpu_tests "$out" 240 "leading_kv_tiles or tile_order_options" tests/test_kernel_backward_gpu.py \
  tests/test_kernel_forward_gpu.py
fi

if want 2; then
echo "== 2. leading lines on the windowed masks: the defaults (as old) against none (as new), paired"
t=$(date +%s)
timeout 150 python3 scripts/bench_mask_options.py --masks global_sliding_window longformer --dims 128 64 \
  --sizes 8192 32768 --options leading_kv_tiles=0 leading_q_tiles=0 --alternations 6 \
  --json "$out/leading_masks.json" > "$out/leading_masks.log" 2>&1
rc=$?; tail -17 "$out/leading_masks.log"; record leading_masks $rc "$(elapsed $t)"
fi

if want 3; then
echo "== 3. the old tree against this one, causal and Transfusion, paired"
t=$(date +%s)
if [ -d _base/omnigen ]; then
  timeout 200 python3 scripts/ab_trees.py _base --paired 6 --cache "$OMNIGEN_CACHE_DIR/ab" --json "$out/trees.json" \
    -- --tiles 128x128w12 --dims 128 64 --sizes 8192 32768 --rules causal transfusion --passes forward fwd+bwd \
    > "$out/trees.log" 2>&1
  rc=$?
else
  echo "no _base/omnigen: make the old tree first (see the top of this script)" > "$out/trees.log"; rc=2
fi
tail -19 "$out/trees.log"; record old_tree $rc "$(elapsed $t)"
fi

if want 4; then
echo "== 4. omnigen bench --mask, the windowed masks with FlexAttention"
t=$(date +%s)
timeout 200 python3 -m omnigen bench --mask global_sliding_window,longformer --dims 128,64 --sizes 8192,32768 \
  --json "$out/masks_windowed.json" > "$out/masks_windowed.log" 2>&1
rc=$?; tail -14 "$out/masks_windowed.log"; record masks_vs_flex $rc "$(elapsed $t)"
fi

echo
echo "== summary ($(head -1 "$out/environment.log"))"
print_summary 22
exit $status
