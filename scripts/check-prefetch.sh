#!/usr/bin/env bash
# The two L2 prefetch options on a GPU host (thirty-first session, both off by default), ~7 minutes in one device call:
#   OUT=/some/dir bash scripts/check-prefetch.sh            (STEPS: a subset of "1 2 3")
# 1. their GPU tests: the backward with prefetch_next_kv against float64 (attention sinks under GQA, 256 CTAs; plain
#    text, 96), the forward with prefetch_next_q bit for bit the default's output;
# 2. both options against the defaults on the catalogue masks of short columns and rows (causal documents, packed
#    Alpaca) and the windowed ones, paired (the forward's change is prefetch_next_q's, the rest of fwd+bwd's is
#    prefetch_next_kv's: each option touches one pass);
# 3. the same on causal and Transfusion layouts (ab_trees.py with this tree as both).
# A short summary table is printed last; the exit status is 1 if a step failed. Predictions and results:
# benchmarks/RESULTS.md, "Built, not yet run: K/V and Q fetched into L2 ahead of their copies".
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-check-prefetch-out}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export OMNIGEN_CACHE_DIR="${OMNIGEN_CACHE_DIR:-/tmp/omnigen-cache-prefetch}"
steps=" ${STEPS:-1 2 3} "
want() { [[ "$steps" == *" $1 "* ]]; }
source scripts/check_steps.sh  # record, elapsed, print_summary, log_environment
options=(prefetch_next_kv=1 prefetch_next_q=1)

log_environment "$out"

if want 1; then
echo "== 1. GPU tests of the prefetch options"
t=$(date +%s)
timeout 200 python3 -m pytest -q -n 12 -m gpu -p no:cacheprovider -W ignore tests/test_kernel_backward_gpu.py \
  tests/test_kernel_forward_gpu.py -k "prefetch" > "$out/tests.log" 2>&1
rc=$?; tail -4 "$out/tests.log"; record tests $rc "$(tail -1 "$out/tests.log" | tr -d '=' | xargs) $(elapsed $t)"
fi

if want 2; then
echo "== 2. catalogue masks, the options against the defaults, paired"
t=$(date +%s)
timeout 200 python3 scripts/bench_mask_options.py --masks causal_documents packed_alpaca global_sliding_window \
  --dims 128 64 --sizes 8192 32768 --options "${options[@]}" --alternations 6 --json "$out/masks.json" \
  > "$out/masks.log" 2>&1
rc=$?; tail -14 "$out/masks.log"; record masks $rc "$(elapsed $t)"
fi

if want 3; then
echo "== 3. causal and Transfusion layouts, the options against the defaults, paired"
t=$(date +%s)
timeout 200 python3 scripts/ab_trees.py . --paired 6 --new-options "${options[@]}" --cache "$OMNIGEN_CACHE_DIR/ab" \
  --json "$out/layouts.json" -- --tiles 128x128w12 --dims 128 64 --sizes 8192 32768 --rules causal transfusion \
  --passes forward fwd+bwd > "$out/layouts.log" 2>&1
rc=$?; tail -19 "$out/layouts.log"; record layouts $rc "$(elapsed $t)"
fi

echo
echo "== summary ($(head -1 "$out/environment.log"))"
print_summary 10
exit $status
