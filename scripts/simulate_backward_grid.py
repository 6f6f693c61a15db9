"""How long a Hopper backward grid takes on paper: one CTA per SM, each work tile (a kv-tile's column) costing a fixed
amount plus a per-step amount, dispatched in several orders. With --forward, the forward's work tiles instead (a
q-tile's row of kv-tiles; sections of as many pairs as keep K and V in 5/8 of a 50 MB L2, last q-tile first inside
each, and `leading` counting q-tiles: the leading_q_tiles option).

  grid       one CTA per tile, the hardware starting the next tile in grid order wherever a CTA finishes (today's)
  leading F  the same, the grid starting with every (head, batch) pair's first F kv-tiles (the leading_kv_tiles option)
  static     a persistent grid, CTA b walking tiles b, b + SMs, ... (the persistent grid tried on 2026-11-27)
  dynamic    a persistent grid taking tiles in grid order from a counter (the forward's way)
  LPT        every tile longest first, no sections: the bound any order could reach (it ignores L2)
  ideal      the work spread evenly over the SMs
  counter    (--masks with --persistent-fixed-us) a persistent grid taking tiles in grid order from a counter, each
             tile after a CTA's first paying --persistent-fixed-us instead of --fixed-us
  chunks N   (--masks with --chunks) each CTA walks N consecutive tiles of the grid order, the tiles after its first
             paying --persistent-fixed-us: a kernel that loops over a few tiles without a counter

Tiles come from real plans: the plain causal mask's columns (the default), or with --masks the columns of omnigen's
mask catalogue (omnigen.mask_catalogue) and of the example rules' synthetic layouts (`transfusion`), each planned on
this machine's CPU at 128 x 128 tiles, in the atomic order's sections (2 pairs at d128). --per-step-us and --fixed-us
come from benchmarks/RESULTS.md's fit ("The backward's fixed cost per CTA"). What it leaves out: L2 (which (head,
batch) pairs run together), and the pipeline's own overlap.

    python scripts/simulate_backward_grid.py --sizes 4096 8192 32768 --fixed-us 8 --persistent-fixed-us 4
    python scripts/simulate_backward_grid.py --masks all --sizes 8192 32768 --leading 1 2
    python scripts/simulate_backward_grid.py --masks all --sizes 8192 32768 --leading 1 --forward \
        --fixed-us 3 --per-step-us 1.9
    python scripts/simulate_backward_grid.py --masks causal causal_documents --sizes 8192 --leading 2 \
        --persistent-fixed-us 4 --chunks 2 4
"""
from __future__ import annotations

import argparse
import heapq
import sys
from pathlib import Path


def causal_steps(seq_len: int, batch: int, heads: int, block: int = 128, section: int = 2) -> list[int]:
    """Each tile's steps (two 64-row steps a q-tile) in the sectioned grid order on the plain causal mask: kv-tile j's
    column holds q-tiles j.. (longest column first)."""
    tiles = seq_len // block
    return grid_order([[2 * (tiles - j) for j in range(tiles)]] * batch, heads, section)


def sectioned_order(tiles: list[list[int]], heads: int, section: int, leading: int, descending: bool) -> list[int]:
    """`tiles[b][j]` of every (head, batch) pair (head fastest) in the kernels' order (LeadingSectionedIndex): every
    pair's first `leading` tiles (tile 0 of each pair, then 1, ...), then sections of `section` pairs, tiles slowest
    inside each, ascending (the backward's kv-tiles) or `descending` (the forward's q-tiles, last first)."""
    pairs = [(head, b) for b in range(len(tiles)) for head in range(heads)]
    count = len(tiles[0])
    lead = min(leading, count)
    rest = range(count - 1, lead - 1, -1) if descending else range(lead, count)
    out = [tiles[b][j] for j in range(lead) for _, b in pairs]
    for first in range(0, len(pairs), section):
        for j in rest:
            out += [tiles[b][j] for _, b in pairs[first:first + section]]
    return out


def grid_order(columns: list[list[int]], heads: int, section: int = 2, leading: int = 0) -> list[int]:
    """Steps of every backward CTA in launch order: `columns[b][j]`, kv-tile j's steps in batch element b."""
    return sectioned_order(columns, heads, section, leading, descending=False)


def forward_order(rows: list[list[int]], heads: int, section: int, leading: int = 0) -> list[int]:
    """Kv-steps of every forward work tile in the sm90 forward's tile order (`rows[b][i]`: q-tile i's)."""
    return sectioned_order(rows, heads, section, leading, descending=True)


def balanced_section(pairs: int, most: int, unit: int = 1) -> int:
    """The shared header's balanced_section (the balanced_sections option): of the section sizes from half of `most`
    up to `most`, multiples of `unit` (a GQA group), the one whose last section holds the most pairs, the larger size
    on a tie."""
    best, best_last = most, pairs % most or most
    for size in range(most - unit, max(0, (most + 1) // 2 - 1), -unit):
        last = pairs % size or size
        if last > best_last:
            best, best_last = size, last
    return best


def next_free(costs: list[float], sms: int) -> float:
    """Makespan when each tile starts on whichever SM frees first, in order."""
    free, end = [0.0] * sms, 0.0
    for cost in costs:
        finish = heapq.heappop(free) + cost
        end = max(end, finish)
        heapq.heappush(free, finish)
    return end


def persistent_counter(steps: list[int], sms: int, first_us: float, later_us: float, per_step_us: float) -> float:
    """Makespan of min(sms, tiles) CTAs taking tiles in order from a counter (CTA b starts with tile b): a CTA's first
    tile pays `first_us` of fixed cost, every later one `later_us` (empty tiles: nothing but the counter). As
    next_free, which also starts the first `sms` tiles one an SM and each later one on the SM that frees first."""
    return next_free([(first_us if i < sms else later_us if s else 0.0) + per_step_us * s
                      for i, s in enumerate(steps)], sms)


def chunked(steps: list[int], sms: int, chunk: int, first_us: float, later_us: float, per_step_us: float) -> float:
    """Makespan of a grid whose CTA c walks tiles c * chunk ... c * chunk + chunk - 1 of the order, the first paying
    `first_us` of fixed cost and the rest `later_us`, CTAs starting wherever an SM frees, in order."""
    costs = []
    for first in range(0, len(steps), chunk):
        part = [s for s in steps[first:first + chunk] if s]
        costs.append(first_us + later_us * (len(part) - 1) + per_step_us * sum(part) if part else 0.5)
    return next_free(costs, sms)


def round_robin(costs: list[float], sms: int) -> float:
    """Makespan when SM b takes tiles b, b + sms, ..."""
    loads = [0.0] * sms
    for index, cost in enumerate(costs):
        loads[index % sms] += cost
    return max(loads)


def mask_columns(name: str, batch: int, seq_len: int, forward: bool = False, block_n: int = 128) -> list[list[int]]:
    """Steps of each kv-tile's column of the backward plan (128 x 128 tiles; forward: kv-steps of each q-tile's row)
    of a catalogue mask, `causal`, or `transfusion` (examples/rules/transfusion.yaml's synthetic layouts), per batch
    element."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import omnigen
    from omnigen.mask_catalogue import catalogue_mask
    from omnigen.tune import layouts as tune_layouts

    if name == "causal":
        rules = omnigen.Rules(name="causal", modalities={"text": "causal"})
        layouts = [omnigen.Layout.from_segments([("text", seq_len)])] * batch
    elif name == "transfusion":
        rules = omnigen.Rules.load(Path(__file__).resolve().parent.parent / "examples/rules/transfusion.yaml")
        layouts = tune_layouts.synthetic_batch(rules, seq_len, batch * seq_len, 0)
    else:
        made = catalogue_mask(name, batch, seq_len, "cpu")
        mask = omnigen.mask_from_mod(made.mask_mod, batch, seq_len, "cpu", tiles=[(128, block_n)])
        return _columns(mask.plan(128, block_n), batch, forward)
    layout = layouts[0] if batch == 1 else omnigen.Layout.batch(layouts)
    return _columns(omnigen.plan(rules, layout, block_m=128, block_n=block_n), batch, forward)


def _columns(plan, batch: int, forward: bool) -> list[list[int]]:
    # bwd_ptr (fwd_ptr): per column (row) first, causal, partial, then the next one's first (its end); the backward
    # walks two 64-row steps a q-tile, the forward one kv-tile a step
    ptr = (plan.fwd_ptr if forward else plan.bwd_ptr).long().tolist()
    tiles, per_entry = (plan.num_q_tiles, 1) if forward else (plan.num_kv_tiles, 2)
    return [[per_entry * (ptr[3 * (b * tiles + j) + 3] - ptr[3 * (b * tiles + j)]) for j in range(tiles)]
            for b in range(batch)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192, 32768])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--sms", type=int, default=132)
    parser.add_argument("--per-step-us", type=float, default=2.46)
    parser.add_argument("--fixed-us", type=float, default=8.0)
    parser.add_argument("--persistent-fixed-us", type=float, default=None, help="default: --fixed-us")
    parser.add_argument("--masks", nargs="+", default=None,
                        help="catalogue masks, 'causal', 'transfusion', or 'all' (every one): the grid orders of each "
                             "mask's real columns instead of the persistent grids on the causal mask")
    parser.add_argument("--leading", type=int, nargs="+", default=[1, 2],
                        help="with --masks: leading kv-tiles (--forward: q-tiles) to try")
    parser.add_argument("--forward", action="store_true", help="with --masks: the forward's work tiles and order")
    parser.add_argument("--head-dim", type=int, default=128, help="with --forward: sizes the L2 sections")
    parser.add_argument("--block-n", type=int, default=128, help="with --masks: the plans' kv-tile (d256: 64)")
    parser.add_argument("--chunks", type=int, nargs="+", default=[],
                        help="with --masks (backward): tiles walked by each CTA of a chunked grid, to try")
    parser.add_argument("--l2-mib", type=float, default=50.0,
                        help="with --forward: the L2 the sections fit, MiB (H100: 50, H200: 60)")
    args = parser.parse_args()
    if args.masks:
        from omnigen.mask_catalogue import NAMES

        names = [*NAMES, "transfusion", "causal"] if args.masks == ["all"] else args.masks
        for seq_len in args.sizes:
            batch = max(1, args.tokens // seq_len)
            print(f"S = {seq_len}, B = {batch}: ms on paper; the orders' change against the grid's")
            persistent = args.persistent_fixed_us is not None and not args.forward
            labels = [f"leading {f}" for f in args.leading] + (["balanced"] if args.forward else [])
            labels += (["counter"] if persistent else []) + [f"chunks {n}" for n in ([] if args.forward else args.chunks)]
            print(f"{'mask':<22} {'grid':>7} " + " ".join(f"{label:>10}" for label in labels) +
                  f" {'LPT':>7} {'ideal':>7}  longest / mean column (steps)")
            # the forward's sections: pairs whose K and V fit 5/8 of L2 (tile_order in forward.cu.j2)
            l2_bytes = int(args.l2_mib * 2**20)
            section = max(1, min(batch * args.heads, l2_bytes * 5 // 8 // (seq_len * args.head_dim * 2 * 2)))
            balanced = balanced_section(batch * args.heads, section)
            if args.forward:
                print(f"forward sections of {section} pairs; balanced: {balanced}")
            for name in names:
                columns = mask_columns(name, batch, seq_len, args.forward, args.block_n)

                def cost(steps: int) -> float:
                    return args.fixed_us + args.per_step_us * steps if steps else 0.5  # an empty column: its start

                def order(lead: int) -> list[int]:
                    if args.forward:
                        return forward_order(columns, args.heads, section, lead)
                    return grid_order(columns, args.heads, leading=lead)

                grid = next_free([cost(s) for s in order(0)], args.sms)
                leading = [next_free([cost(s) for s in order(f)], args.sms) for f in args.leading]
                if args.forward:  # the balanced sections, as one more column
                    leading.append(next_free([cost(s) for s in forward_order(columns, args.heads, balanced)], args.sms))
                else:  # the persistent grids over the order with the largest lead tried (the default's 2)
                    steps = order(max(args.leading, default=0))
                    later = args.fixed_us if args.persistent_fixed_us is None else args.persistent_fixed_us
                    if persistent:
                        leading.append(persistent_counter(steps, args.sms, args.fixed_us, later, args.per_step_us))
                    leading += [chunked(steps, args.sms, n, args.fixed_us, later, args.per_step_us) for n in args.chunks]
                every = [cost(s) for s in order(0)]
                lpt = next_free(sorted(every, reverse=True), args.sms)
                ideal = sum(every) / args.sms
                flat = [s for c in columns for s in c]
                print(f"{name:<22} {grid / 1e3:7.3f} " + " ".join(f"{t / grid - 1:>+10.1%}" for t in leading) +
                      f" {lpt / grid - 1:>+7.1%} {ideal / grid - 1:>+7.1%}  {max(flat)} / {sum(flat) / len(flat):.1f}")
        return
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
