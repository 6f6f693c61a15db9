#!/usr/bin/env bash
# Pinned-tile forward/backward of two source trees on one GPU, interleaved (issue 11's A/B).
#   bash scripts/ab-trees.sh OLD_TREE [ROUNDS]     (from the repository root; the new tree is `.`)
# This tree's scripts/bench_backward.py times both (it uses only omnigen's public API); the new tree is
# pinned to the sm80 family (what the old tree built for every arch), so both time the same kernels.
set -uo pipefail
old="$1"; rounds="${2:-2}"
args=(--tiles 128x64w4 --dims 64 128 --sizes 8192 32768)
export PYTHONUNBUFFERED=1
for round in $(seq "$rounds"); do
  echo "== round $round: old ($old)"
  PYTHONPATH="$old" OMNIGEN_CACHE_DIR=/tmp/ab-old python3 scripts/bench_backward.py "${args[@]}"
  echo "== round $round: new"
  PYTHONPATH=. OMNIGEN_CACHE_DIR=/tmp/ab-new python3 scripts/bench_backward.py "${args[@]}" --family sm80
done
