"""A kernel option on masks made from data, timed against the default in turns: for each catalogue mask
(omnigen.mask_catalogue, made by `omnigen.mask_from_mod` as `omnigen bench --mask` makes it), the default sm90 variant
and the same variant with --options, forward and forward+backward, in paired batches on one GPU.

`omnigen bench --mask` times the default kernels against FlexAttention; this script says what an option would change
there before it becomes a default (e.g. the backward's leading_kv_tiles on the windowed masks). Change = median of the
batches' new / old - 1, with its quartiles (bench_backward.py's paired_ms and paired_change).

    PYTHONPATH=. python3 scripts/bench_mask_options.py --masks global_sliding_window longformer causal_documents \\
        --dims 128 --sizes 8192 32768 --options leading_kv_tiles=2
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import omnigen  # noqa: E402
from bench_backward import add_options_option, paired_change, paired_ms, parse_options  # noqa: E402
from kernel_workload import random_inputs, with_options  # noqa: E402
from omnigen.mask_catalogue import NAMES, catalogue_mask  # noqa: E402


def time_mask(name: str, S: int, dim: int, args: argparse.Namespace, options: dict) -> list[dict]:
    """One (mask, S, D): its rows printed, its batches returned."""
    B = max(1, args.tokens // S)
    mask = omnigen.mask_from_mod(catalogue_mask(name, B, S, "cuda").mask_mod, B, S, "cuda", head_dim=dim,
                                 dtype=torch.bfloat16)
    q, k, v, d_o = random_inputs(B, args.heads, S, dim, seed=0)
    default = omnigen.build(mask.rules, dim, torch.bfloat16)
    kernels = {"old": default, "new": with_options(default, options)}

    def forward(kernel):
        return lambda: kernel(q, k, v, mask)

    def both(kernel):
        return lambda: torch.autograd.grad(kernel(q, k, v, mask), (q, k, v), d_o)

    rows = []
    for pass_name, make in (("forward", forward), ("fwd+bwd", both)):
        if pass_name not in args.passes:
            continue
        times = paired_ms({side: make(kernel) for side, kernel in kernels.items()}, args.alternations)
        change, low, high = paired_change(times["old"], times["new"])
        print(f"{name:<22} {dim:>4} {S:>6} {pass_name:<8} {statistics.median(times['old']):10.3f} "
              f"{statistics.median(times['new']):10.3f} {100 * change:+7.2f}% [{100 * low:+.2f}, {100 * high:+.2f}]",
              flush=True)
        rows.append({"mask": name, "dim": dim, "S": S, "pass": pass_name, "options": options, **times})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--masks", nargs="+", default=["all"], help=f"catalogue names or 'all' ({', '.join(NAMES)})")
    parser.add_argument("--dims", nargs="+", type=int, default=[128])
    parser.add_argument("--sizes", nargs="+", type=int, default=[8192, 32768])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--alternations", type=int, default=8, help="timed batches of each variant per figure")
    parser.add_argument("--passes", nargs="+", choices=("forward", "fwd+bwd"), default=["forward", "fwd+bwd"])
    parser.add_argument("--json", type=Path, help="write every batch's figures here")
    add_options_option(parser)
    args = parser.parse_args()
    options = parse_options(parser, args.options)
    if not options:
        parser.error("--options NAME=VALUE ...: the option(s) to time against the default")
    masks = list(NAMES) if args.masks == ["all"] else args.masks
    unknown = sorted(set(masks) - set(NAMES))
    if unknown:
        parser.error(f"--masks {', '.join(unknown)}: not in the catalogue ({', '.join(NAMES)})")
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    print(f"options {options}; {args.alternations} paired batches a figure; GPU {torch.cuda.get_device_name()}")
    print(f"{'mask':<22} {'D':>4} {'S':>6} {'pass':<8} {'default ms':>10} {'option ms':>10} {'change':>8} "
          f"{'quartiles':>18}")
    record = []
    for name in masks:
        for S in args.sizes:
            for dim in args.dims:
                record += time_mask(name, S, dim, args, options)
                torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
