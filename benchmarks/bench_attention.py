"""The standard attention workload (docs/measuring.md): omnigen against its peers, one process, one GPU.

A thin caller of `omnigen.bench` (the implementation `omnigen bench` runs too): the built-in
Transfusion rules (text causal, image full; images of 256 or 1024 tokens between text runs of 16-512)
and plain causal rules, or any rules file. Peers, timing and the FLOP count are described there.

    python benchmarks/bench_attention.py --dims 128 --sizes 8192 32768 --json out.json --png out.png
    python benchmarks/bench_attention.py --rules-file examples/rules/transfusion.yaml --tile-cost
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import omnigen  # noqa: E402
from omnigen import bench  # noqa: E402
from omnigen.tune import timing  # noqa: E402

TRANSFUSION = omnigen.Rules(name="transfusion", modalities={"text": "causal", "image": "full"})
CAUSAL = omnigen.Rules(name="causal", modalities={"text": "causal"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dims", type=int, nargs="*", default=list(bench.DEFAULT_DIMS))
    parser.add_argument("--sizes", type=int, nargs="*", default=list(bench.DEFAULT_SIZES))
    parser.add_argument("--tokens", type=int, default=bench.DEFAULT_TOKENS, help="B * S per measurement")
    parser.add_argument("--heads", type=int, default=bench.DEFAULT_HEADS)
    parser.add_argument("--rules", choices=("transfusion", "causal", "both"), default="both")
    parser.add_argument("--rules-file", type=Path, help="time these rules instead of the built-in ones")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--settle-ms", type=float, default=timing.BENCH_SETTLE_MS,
                        help="untimed running of each peer before its timed runs in every round (omnigen.tune.timing)")
    parser.add_argument("--tile-cost", action="store_true",
                        help="also time an all-partial layout against an all-full one (same tiles, same kernel)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--png", type=Path)
    args = parser.parse_args()
    if args.rules_file:
        rule_sets = [omnigen.Rules.load(args.rules_file)]
    else:
        rule_sets = {"transfusion": [TRANSFUSION], "causal": [CAUSAL], "both": [TRANSFUSION, CAUSAL]}[args.rules]
    result = bench.Result()
    try:
        for rules in rule_sets:
            part = bench.run(rules, dims=args.dims, sizes=args.sizes, tokens=args.tokens, heads=args.heads,
                             seed=args.seed, settle_ms=args.settle_ms,
                             on_row=lambda row: print(json.dumps(row), flush=True))
            result.rows += part.rows
            result.skipped += part.skipped
            result.info = {**part.info, "rules": ", ".join(r.name for r in rule_sets)}
    except bench.NoGPU as exc:
        sys.exit(f"bench_attention: {exc}")
    costs = [bench.tile_cost(dim, 8192, args.tokens, args.heads, args.seed) for dim in args.dims] if args.tile_cost else []
    print()
    print(bench.table(result))
    for c in costs:
        print(f"tile cost, D={c['D']} S={c['S']}: partial / full = {c['partial_bits_over_full_fwd']} forward, "
              f"{c['partial_bits_over_full_fwd_bwd']} forward+backward with the tiles' bits made once per layout; "
              f"{c['partial_over_full_fwd']} / {c['partial_over_full_fwd_bwd']} evaluated in the kernel")
    if args.json:
        data = json.loads(result.to_json())
        data["tile_cost"] = costs
        args.json.write_text(json.dumps(data, indent=1))
    if args.png:
        bench.plot(result.rows, args.png)


if __name__ == "__main__":
    main()
