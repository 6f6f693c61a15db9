"""How long a Hopper backward grid takes on paper: one CTA per SM, each work tile (a kv-tile's column) costing a fixed
amount plus a per-step amount, dispatched three ways.

  grid      one CTA per tile, the hardware starting the next tile in grid order wherever a CTA finishes (today's)
  static    a persistent grid, CTA b walking tiles b, b + SMs, ... (the persistent grid tried on 2026-11-27)
  dynamic   a persistent grid taking tiles in grid order from a counter (the forward's way)

The persistent ways may pay a smaller fixed cost per tile (--persistent-fixed-us: K/V loaded while the last tile's
dK/dV are stored). Tiles are the plain causal mask's columns in the atomic order's sections (2 pairs at d128);
--per-step-us and --fixed-us come from benchmarks/RESULTS.md's fit ("The backward's fixed cost per CTA"). What it
leaves out: L2 (which (head, batch) pairs run together), and the pipeline's own overlap.

    python scripts/simulate_backward_grid.py --sizes 4096 8192 32768 --fixed-us 8 --persistent-fixed-us 4
"""
from __future__ import annotations

import argparse
import heapq


def causal_steps(seq_len: int, batch: int, heads: int, block: int = 128, section: int = 2) -> list[int]:
    """Each tile's steps (two 64-row steps a q-tile) in the sectioned grid order: sections of `section` (head,
    batch) pairs, kv-tiles slowest inside each (longest column first)."""
    tiles, pairs, out = seq_len // block, batch * heads, []
    for first in range(0, pairs, section):
        for kv_tile in range(tiles):
            out += [2 * (tiles - kv_tile)] * min(section, pairs - first)
    return out


def next_free(costs: list[float], sms: int) -> float:
    """Makespan when each tile starts on whichever SM frees first, in order."""
    free, end = [0.0] * sms, 0.0
    for cost in costs:
        finish = heapq.heappop(free) + cost
        end = max(end, finish)
        heapq.heappush(free, finish)
    return end


def round_robin(costs: list[float], sms: int) -> float:
    """Makespan when SM b takes tiles b, b + sms, ..."""
    loads = [0.0] * sms
    for index, cost in enumerate(costs):
        loads[index % sms] += cost
    return max(loads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192, 32768])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--sms", type=int, default=132)
    parser.add_argument("--per-step-us", type=float, default=2.46)
    parser.add_argument("--fixed-us", type=float, default=8.0)
    parser.add_argument("--persistent-fixed-us", type=float, default=None, help="default: --fixed-us")
    args = parser.parse_args()
    persistent_fixed = args.fixed_us if args.persistent_fixed_us is None else args.persistent_fixed_us
    print(f"{'S':>6} {'grid ms':>8} {'static ms':>10} {'dynamic ms':>11}")
    for seq_len in args.sizes:
        steps = causal_steps(seq_len, max(1, args.tokens // seq_len), args.heads)
        grid = next_free([args.fixed_us + args.per_step_us * s for s in steps], args.sms)
        persistent = [persistent_fixed + args.per_step_us * s for s in steps]
        static, dynamic = round_robin(persistent, args.sms), next_free(persistent, args.sms)
        print(f"{seq_len:>6} {grid / 1e3:8.2f} {static / 1e3:7.2f} ({static / grid - 1:+.0%}) "
              f"{dynamic / 1e3:7.2f} ({dynamic / grid - 1:+.1%})")


if __name__ == "__main__":
    main()
