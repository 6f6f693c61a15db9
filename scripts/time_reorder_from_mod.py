"""Time `omnigen.reorder(mask_mod, B, S)` with the mod evaluated eagerly and compiled (issue 29 item 4).

reorder evaluates the mod again over blocks of rows when it scores and builds a permutation. For each mask of
bench_reorder.MASKS and S (B * S = --tokens): the call's seconds, twice in a row (the first pays any compilation),
with the evaluator eager (the mask itself made as mask_from_mod makes it by default), then compiled; the decisions
must agree.

    PYTHONPATH=. python3 scripts/time_reorder_from_mod.py --sizes 8192 32768
"""
from __future__ import annotations

import argparse
import functools
import importlib
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import omnigen  # noqa: E402
from bench_reorder import MASKS  # noqa: E402

# By name: `omnigen.plan` and `omnigen.reorder` are also the package's functions.
reorder_module = importlib.import_module("omnigen.plan.reorder")
eager_evaluator = functools.partial(reorder_module._mod_evaluator, compiled=False)


def timed(mod, B: int, S: int) -> tuple[list[float], object]:
    seconds, found = [], None
    for _ in range(2):
        torch.cuda.synchronize()
        start = time.perf_counter()
        found = omnigen.reorder(mod, B, S)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return seconds, found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--masks", nargs="+", default=["medusa_interleaved", "frames"], choices=list(MASKS))
    parser.add_argument("--sizes", nargs="+", type=int, default=[8192, 32768])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    compiled_evaluator = reorder_module._mod_evaluator
    rows = []
    for name in args.masks:
        for S in args.sizes:
            B = max(1, args.tokens // S)
            mod = MASKS[name](S, torch.device("cuda"))
            reorder_module._mod_evaluator = eager_evaluator
            eager, eager_found = timed(mod, B, S)
            reorder_module._mod_evaluator = compiled_evaluator
            compiled, compiled_found = timed(mod, B, S)
            same = bool(eager_found) == bool(compiled_found) and (
                not eager_found or torch.equal(eager_found.permutation, compiled_found.permutation))
            row = {"mask": name, "S": S, "B": B, "eager_s": eager, "compiled_s": compiled,
                   "accepted": bool(compiled_found), "same_decision": same}
            rows.append(row)
            print(f"{name:20s} S={S:6d} eager {eager[0]:.2f}/{eager[1]:.2f} s  compiled {compiled[0]:.2f}/"
                  f"{compiled[1]:.2f} s  accepted={row['accepted']} same={same}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
