#!/usr/bin/env bash
# The twenty-ninth session's options on a GPU host: ~12 minutes in all, so two device calls of at most 10:
#   STEPS="1 2" OUT=/some/dir bash scripts/check-tile-orders.sh    then    STEPS="3 4" OUT=... bash ...
# (logs and JSONs under $OUT, default ./check-tile-orders-out; STEPS defaults to all four)
# 1. their GPU tests (bits_slot_in_tables, leading_kv_tiles, leading_q_tiles / balanced_sections,
#    backward_producer_registers: against float64 and bit for bit the default modules);
# 2. balanced_sections, paired forward (d128 and d64, 4K and 8K, causal and Transfusion): on paper -4% at d128 8K;
# 3. leading_kv_tiles=2 with leading_q_tiles=1 on the windowed masks and causal documents, paired: on paper -16..-21% of
#    the backward on Longformer and the sliding window with globals;
# 4. leading_kv_tiles=2 on causal and Transfusion (the streaming phase's cost, which the paper leaves out), and
#    bits_slot_in_tables=1 at d128, backward_producer_registers=32 at d64, paired.
# A short summary table is printed last; the exit status is 1 if a step failed. Options and predictions:
# benchmarks/RESULTS.md, "Twenty-ninth session".
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-check-tile-orders-out}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export OMNIGEN_CACHE_DIR="${OMNIGEN_CACHE_DIR:-/tmp/omnigen-cache-tile-orders}"
steps=" ${STEPS:-1 2 3 4} "
want() { [[ "$steps" == *" $1 "* ]]; }
source scripts/check_steps.sh  # record, elapsed, print_summary

{ nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
  git log -1 --format='commit %h %s' 2>/dev/null; } 2>&1 | tee "$out/environment.log"

if want 1; then
echo "== 1. GPU tests of the options"
t=$(date +%s)
timeout 240 python3 -m pytest -q -n 12 -m gpu -p no:cacheprovider -W ignore tests/test_kernel_backward_gpu.py \
  tests/test_kernel_forward_gpu.py -k "bits_slot_in_tables or leading_kv_tiles or tile_order_options or producer_registers" \
  > "$out/tests.log" 2>&1
rc=$?; tail -8 "$out/tests.log"; record tests $rc "$(tail -1 "$out/tests.log" | tr -d '=' | xargs) $(elapsed $t)"
fi

if want 2; then
echo "== 2. balanced_sections, forward, paired"
t=$(date +%s)
timeout 150 python3 scripts/ab_trees.py . --paired 8 --new-options balanced_sections=1 --cache "$OMNIGEN_CACHE_DIR/ab" \
  --json "$out/balanced_sections.json" -- --tiles 128x128w12 --dims 128 64 --sizes 4096 8192 \
  --rules causal transfusion --passes forward > "$out/balanced_sections.log" 2>&1
rc=$?; tail -10 "$out/balanced_sections.log"; record balanced_sections $rc "$(elapsed $t)"
fi

if want 3; then
echo "== 3. leading kv-tiles and q-tiles on the windowed masks, paired"
t=$(date +%s)
timeout 180 python3 scripts/bench_mask_options.py --masks global_sliding_window longformer causal_documents \
  --dims 128 --sizes 8192 32768 --options leading_kv_tiles=2 leading_q_tiles=1 --alternations 6 \
  --json "$out/leading_masks.json" > "$out/leading_masks.log" 2>&1
rc=$?; tail -13 "$out/leading_masks.log"; record leading_masks $rc "$(elapsed $t)"
fi

if want 4; then
echo "== 4. leading_kv_tiles=2 and bits_slot_in_tables=1 on causal and Transfusion, paired"
t=$(date +%s)
timeout 100 python3 scripts/ab_trees.py . --paired 6 --new-options leading_kv_tiles=2 --cache "$OMNIGEN_CACHE_DIR/ab" \
  --json "$out/leading_kv_tiles.json" -- --tiles 128x128w12 --dims 128 --sizes 8192 32768 \
  --rules causal transfusion --passes fwd+bwd > "$out/leading_kv_tiles.log" 2>&1
rc=$?; tail -8 "$out/leading_kv_tiles.log"; record leading_kv_tiles $rc "$(elapsed $t)"
timeout 100 python3 scripts/ab_trees.py . --paired 6 --new-options bits_slot_in_tables=1 --cache "$OMNIGEN_CACHE_DIR/ab" \
  --json "$out/bits_slot_in_tables.json" -- --tiles 128x128w12 --dims 128 --sizes 8192 32768 \
  --rules transfusion --passes fwd+bwd > "$out/bits_slot_in_tables.log" 2>&1
rc=$?; tail -6 "$out/bits_slot_in_tables.log"; record bits_slot_in_tables $rc "$(elapsed $t)"
timeout 100 python3 scripts/ab_trees.py . --paired 6 --new-options backward_producer_registers=32 \
  --cache "$OMNIGEN_CACHE_DIR/ab" --json "$out/producer_registers.json" -- --tiles 128x128w12 --dims 64 \
  --sizes 8192 32768 --rules causal transfusion --passes fwd+bwd > "$out/producer_registers.log" 2>&1
rc=$?; tail -6 "$out/producer_registers.log"; record producer_registers $rc "$(elapsed $t)"
fi

echo
echo "== summary ($(head -1 "$out/environment.log"))"
print_summary 22
exit $status
