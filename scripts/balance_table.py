"""Context parallelism on paper (issue 31): how `omnigen.distributed.plan_shards` deals a long sequence to ranks.

For each rules file, one synthetic layout of --tokens tokens (`omnigen.tune.layouts.synthetic_layout`, seeded), and
for each world size of --ranks and each method (balanced, even, zigzag), one `plan_shards` call. It prints a
Markdown table, one row per (rules, ranks, method):

- `chunk`: the tokens per chunk plan_shards chose (its default: 128 x 2^k up to 2048, >= 8 chunks a rank);
- `work max/mean`: the busiest rank's planned work over the mean (1.0 is perfect balance). Work is the exact plan's
  tiles weighted by `omnigen.distributed.TILE_COST` (a model: empty 0, full 1, causal 1.1, partial 1.25), not a
  timing;
- `recv MiB max` / `recv MiB mean`: the K and V each rank must receive from the others for its queries
  (`Shard.received_bytes`: tokens x 2 (K and V) x --heads-kv x --head-dim x --element-size), the busiest receiver
  and the mean over ranks;
- `plan s`: the wall time of that plan_shards call (it plans the whole mask at 128 x 128 tiles on the CPU).

Why: balancing work and limiting traffic pull against each other. An even split of the tokens leaves causal-ish
masks' last ranks with most of the work; zigzag fixes that for one causal sequence; balanced evens out any mask
but scatters chunks, so a rank's queries may need keys from everywhere. Nothing here needs a GPU.

    python scripts/balance_table.py                          # 1M tokens, 8/16/64 ranks, three example rules
    python scripts/balance_table.py --tokens 65536 --ranks 4 8 --rules examples/rules/transfusion.yaml \\
        --json balance.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import omnigen  # noqa: E402
from omnigen.distributed import TILE_COST, plan_shards  # noqa: E402
from omnigen.distributed.balance import METHODS  # noqa: E402
from omnigen.semantics import CAUSAL, EMPTY, FULL, PARTIAL  # noqa: E402
from omnigen.tune.layouts import synthetic_layout  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_RULES = ("examples/rules/transfusion.yaml", "examples/rules/three_modalities.yaml",
                 "examples/rules/causal_documents.yaml")
COLUMNS = ("rules", "ranks", "method", "chunk", "work max/mean", "recv MiB max", "recv MiB mean", "plan s")
MIB = 2 ** 20


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Columns: " + ", ".join(COLUMNS) + ". Work is tiles weighted by omnigen.distributed.TILE_COST "
               "(a cost model, not a timing); received bytes count K and V at the given heads, dim and element size.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1 << 20, help="sequence length S (one sequence, B = 1)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 64], help="world sizes to plan for")
    parser.add_argument("--rules", nargs="+", default=list(DEFAULT_RULES),
                        help="rules files (YAML); relative paths are read from the working directory, "
                             "then from the repository root")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS),
                        help="plan_shards methods to compare")
    parser.add_argument("--chunk", type=int, default=None,
                        help="tokens per chunk (a multiple of 16); default: plan_shards' own choice per world size")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic layouts (random.Random(seed))")
    parser.add_argument("--heads-kv", type=int, default=8, help="K/V heads, for the received bytes")
    parser.add_argument("--head-dim", type=int, default=128, help="head dimension, for the received bytes")
    parser.add_argument("--element-size", type=int, default=2, help="bytes per element (bf16: 2)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the rows as JSON here")
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> argparse.Namespace:
    args = parser.parse_args(argv)
    for name in ("tokens", "heads_kv", "head_dim", "element_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be positive, not {getattr(args, name)}")
    if any(p < 1 for p in args.ranks):
        parser.error(f"--ranks must be positive, not {args.ranks}")
    args.rules = [_rules_path(parser, path) for path in args.rules]
    return args


def _rules_path(parser: argparse.ArgumentParser, path: str) -> Path:
    for candidate in (Path(path), ROOT / path):
        if candidate.is_file():
            return candidate
    parser.error(f"no rules file {path}")
    raise AssertionError  # parser.error exits


def plan_rows(rules: omnigen.Rules, layout: Any, ranks: Sequence[int], methods: Sequence[str], chunk: int | None,
              heads_kv: int, head_dim: int, element_size: int) -> list[dict[str, Any]]:
    """One plan_shards call per (world size, method): the table's rows for one rules file and layout."""
    rows = []
    for world_size in ranks:
        for method in methods:
            start = time.perf_counter()
            shard = plan_shards(rules, layout, world_size, chunk, method=method)
            seconds = time.perf_counter() - start
            summary = shard.summary()
            received = shard.received_bytes(heads_kv, head_dim, element_size)
            rows.append({
                "rules": rules.name, "ranks": world_size, "method": method, "chunk": shard.chunk,
                "chunks": shard.num_chunks, "seq_len": shard.seq_len,
                "work_max_over_mean": summary["work_max_over_mean"], "work": summary["work"],
                "received_tokens_max": summary["received_max_tokens"],
                "received_tokens_mean": summary["received_mean_tokens"],
                "received_mib_max": float(received.max()) / MIB, "received_mib_mean": float(received.mean()) / MIB,
                "plan_seconds": seconds,
            })
    return rows


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "| " + " | ".join("---" for _ in COLUMNS) + " |"]
    for row in rows:
        cells = (row["rules"], str(row["ranks"]), row["method"], str(row["chunk"]), f"{row['work_max_over_mean']:.4f}",
                 f"{row['received_mib_max']:,.0f}", f"{row['received_mib_mean']:,.0f}", f"{row['plan_seconds']:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Plan, print the table (and write --json); returns the rows."""
    parser = build_parser()
    args = parse_args(parser, argv)
    per_token = 2 * args.heads_kv * args.head_dim * args.element_size
    costs = {EMPTY: "empty", FULL: "full", CAUSAL: "causal", PARTIAL: "partial"}
    print(f"S = {args.tokens:,} tokens, seed {args.seed}; K+V {args.heads_kv} heads x {args.head_dim} x "
          f"{args.element_size} B = {per_token:,} B a token ({args.tokens * per_token / MIB:,.0f} MiB for the whole "
          f"sequence); tile cost " + ", ".join(f"{costs[k]} {v:g}" for k, v in TILE_COST.items()), flush=True)
    rows: list[dict[str, Any]] = []
    for path in args.rules:
        rules = omnigen.Rules.load(path)
        layout = synthetic_layout(rules, args.tokens, random.Random(args.seed))
        try:
            rows += plan_rows(rules, layout, args.ranks, args.methods, args.chunk,
                              args.heads_kv, args.head_dim, args.element_size)
        except ValueError as exc:  # too few chunks for a world size, a bad --chunk
            parser.error(f"{path}: {exc}")
    print(markdown(rows))
    if args.json is not None:
        settings = {"tokens": args.tokens, "seed": args.seed, "heads_kv": args.heads_kv, "head_dim": args.head_dim,
                    "element_size": args.element_size, "chunk": args.chunk, "rules": [str(p) for p in args.rules],
                    "tile_cost": {costs[k]: v for k, v in TILE_COST.items()}}
        args.json.write_text(json.dumps({"settings": settings, "rows": rows}, indent=1) + "\n")
        print(f"wrote {args.json}")
    return rows


if __name__ == "__main__":
    main()
