"""Time omnigen's forward and backward per pinned tile, for kernel work on one GPU.

`omnigen bench` compares omnigen with its peers at the tuned tiles; this script holds the tile fixed
so that two versions of the templates can be compared (run it once per source tree, e.g.
`PYTHONPATH=old-tree python3 scripts/bench_backward.py` and `PYTHONPATH=. python3 ...`, each with its own
OMNIGEN_CACHE_DIR). Workload as in bench_attention: Transfusion layouts (or the plain causal mask, or every pair),
B * S = --tokens, bf16. Prints milliseconds and effective TFLOP/s (allowed pairs only; backward = 2.5x
the forward FLOPs).

    python3 scripts/bench_backward.py --tiles 128x64w4 64x128w4 --dims 128 --sizes 8192 32768

`--print-modules` builds and prints each (rules, dim, tile) module's file as a JSON line; `--against FILE` (such
lines from another tree) times that tree's modules and this tree's in one process, alternating call batches, and
prints each figure's paired change (scripts/ab_trees.py --paired runs both for you).
`--versus TILE` pairs every --tiles entry with TILE of this tree the same way: is a wider or deeper tile
faster, measured in turns rather than in separate rounds.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import omnigen  # noqa: E402
from kernel_workload import RULES, bench, build, random_inputs, standard_batch  # noqa: E402


def parse_tile(text: str) -> omnigen.TileConfig:
    match = re.fullmatch(r"(\d+)x(\d+)w(\d+)(?:s(\d+))?", text)
    if not match:
        raise argparse.ArgumentTypeError(f"tile {text!r}: expected BLOCK_MxBLOCK_NwWARPS[sSTAGES], e.g. 128x64w4")
    m, n, w, s = match.groups()
    return omnigen.TileConfig(block_m=int(m), block_n=int(n), warps=int(w), stages=int(s or 2))


def add_options_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--options", nargs="+", default=[], metavar="NAME=VALUE",
                        help="sm90 kernel options (omnigen.kernels.sm90.options.HopperOptions) of the variants built, "
                             "e.g. persistent=0 ordered_section_pairs=16 (0/1 for booleans)")


def parse_options(parser: argparse.ArgumentParser, texts: list[str]) -> dict[str, bool | int]:
    """--options NAME=VALUE ...: HopperOptions fields, typed as the dataclass declares them."""
    if not texts:
        return {}
    import dataclasses

    from omnigen.kernels.sm90.options import HopperOptions

    types = {f.name: f.type for f in dataclasses.fields(HopperOptions)}
    out: dict[str, bool | int] = {}
    for text in texts:
        name, _, value = text.partition("=")
        if name not in types or not re.fullmatch(r"-?\d+", value):
            parser.error(f"--options {text}: expected NAME=INTEGER with NAME one of {', '.join(types)}")
        out[name] = bool(int(value)) if types[name] in (bool, "bool") else int(value)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiles", nargs="+", type=parse_tile, default=[parse_tile("128x64w4")])
    parser.add_argument("--dims", nargs="+", type=int, default=[128])
    parser.add_argument("--sizes", nargs="+", type=int, default=[8192, 32768])
    parser.add_argument("--rules", choices=tuple(RULES), nargs="+", default=["transfusion", "causal"],
                        help="full: one image a sequence, every pair allowed (no causal or partial tile)")
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--heads-kv", type=int, default=None, help="kv heads (GQA; default: --heads)")
    parser.add_argument("--family", default=None, help="kernel family (default: the GPU arch's own), e.g. sm80")
    parser.add_argument("--deterministic", action="store_true", help="time the backward's deterministic mode")
    parser.add_argument("--build-only", action="store_true",
                        help="build every (rules, dim, tile) module at once (threads; nvcc in parallel) and exit")
    parser.add_argument("--print-modules", action="store_true",
                        help="build every (rules, dim, tile) module and print its file as a JSON line, then exit")
    parser.add_argument("--against", type=Path, metavar="FILE",
                        help="another tree's --print-modules lines: time its modules beside this tree's, alternating")
    parser.add_argument("--versus", type=parse_tile, metavar="TILE",
                        help="time every --tiles entry against this tile of the same tree, alternating (is a wider "
                             "or deeper tile faster?); forward alone where either tile has no backward")
    parser.add_argument("--alternations", type=int, default=12,
                        help="with --against or --versus: timed batches of each side per figure (default 12)")
    parser.add_argument("--json", type=Path, help="with --against or --versus: write every batch's figures here")
    parser.add_argument("--passes", nargs="+", choices=("forward", "fwd+bwd"), default=["forward", "fwd+bwd"],
                        help="with --against or --versus: the passes timed (forward alone, for a change to the forward only, "
                             "takes half the time)")
    add_options_option(parser)
    args = parser.parse_args()
    options = parse_options(parser, args.options)
    if args.print_modules:
        for rules_name in args.rules:
            for dim in args.dims:
                for tile in args.tiles:
                    module = build(RULES[rules_name], dim, tile, args.family, options).module
                    print(json.dumps({"rules": rules_name, "dim": dim, "tile": tile.label, "file": module.__file__,
                                      "name": module.__name__}), flush=True)
        return
    if args.against and args.versus:
        parser.error("--against and --versus: one old side at a time")
    if args.against:
        found = [json.loads(line) for line in args.against.read_text().splitlines() if line.startswith("{")]
        lines = {(d["rules"], d["dim"], d["tile"]): d for d in found}
        paired(args, options, lambda rules_name, dim, tile, new: load_other_module(lines[(rules_name, dim, tile.label)],
                                                                                   new))
        return
    if args.versus:
        paired(args, options, lambda rules_name, dim, tile, new: build(RULES[rules_name], dim, args.versus,
                                                                       args.family, options))
        return

    if args.build_only:
        from concurrent.futures import ThreadPoolExecutor

        jobs = [(RULES[r], d, t) for r in args.rules for d in args.dims for t in args.tiles]
        with ThreadPoolExecutor(len(jobs)) as pool:
            list(pool.map(lambda job: build(*job, args.family, options), jobs))
        print(f"built {len(jobs)} modules")
        return
    print(f"{'rules':<12} {'D':>4} {'S':>6} {'tile':<14} {'fwd ms':>8} {'bwd ms':>8} {'fwd TF':>7} {'bwd TF':>7} {'f+b TF':>7}")
    for rules_name in args.rules:
        rules = RULES[rules_name]
        for dim in args.dims:
            for S in args.sizes:
                B, layout = standard_batch(rules, S, args.tokens, seed=0)
                pairs = omnigen.plan(rules, layout, 128, 64).allowed_pairs
                flops = 4.0 * dim * pairs * args.heads
                q, k, v, d_o = random_inputs(B, args.heads, S, dim, seed=0, heads_kv=args.heads_kv)
                for tile in args.tiles:
                    kernel = build(rules, dim, tile, args.family, options)
                    forward_ms = bench(lambda: kernel(q, k, v, layout))
                    row = f"{rules_name:<12} {dim:>4} {S:>6} {tile.label:<14} {forward_ms:8.3f}"
                    if not kernel.module.HAS_BACKWARD:  # a forward-only tile: its forward alone
                        print(f"{row} {'-':>8} {flops / forward_ms * 1e-9:7.1f} {'-':>7} {'-':>7}", flush=True)
                        continue
                    both_ms = bench(lambda: torch.autograd.grad(
                        kernel(q, k, v, layout, deterministic=args.deterministic), (q, k, v), d_o))
                    backward_ms = both_ms - forward_ms
                    print(f"{row} {backward_ms:8.3f} {flops / forward_ms * 1e-9:7.1f} {2.5 * flops / backward_ms * 1e-9:7.1f} "
                          f"{3.5 * flops / both_ms * 1e-9:7.1f}", flush=True)


def load_other_module(line: dict, kernel):
    """The other tree's module of `line` (--print-modules), wrapped as this tree's Kernel of the same config; it must
    speak this tree's launch ABI (the binding's entry points and argument records)."""
    from omnigen.jit.cache import import_extension
    from omnigen.op.kernel import Kernel

    module = import_extension(Path(line["file"]), line["name"])
    ours, theirs = getattr(kernel.module, "LAUNCH_ABI", None), getattr(module, "LAUNCH_ABI", None)
    if ours != theirs:
        raise SystemExit(f"{line['file']}: launch ABI {theirs}, this tree's {ours}: time the trees in separate "
                         "processes (ab_trees.py without --paired)")
    return Kernel(kernel.rules, kernel.config, module)


def paired_ms(functions: dict[str, Callable[[], object]], alternations: int) -> dict[str, list[float]]:
    """Milliseconds a call of each function, `alternations` batches each (do_bench's median over ~40 ms), the
    functions taking turns and swapping who goes first every batch: a drift of the clock falls on both alike."""
    from triton.testing import do_bench

    names = list(functions)
    times: dict[str, list[float]] = {name: [] for name in names}
    for batch in range(alternations):
        for name in names if batch % 2 == 0 else names[::-1]:
            times[name].append(do_bench(functions[name], warmup=5, rep=40, return_mode="median"))
    return times


def paired_change(old: list[float], new: list[float]) -> tuple[float, float, float]:
    """(median, lower quartile, upper quartile) of the batches' new / old - 1: the change and its spread."""
    ratios = sorted(b / a - 1 for a, b in zip(old, new))
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return statistics.median(ratios), quartiles[0], quartiles[2]


def paired(args, options: dict, old_kernel: Callable) -> None:
    """Each figure of the old side's kernel (`old_kernel(rules_name, dim, tile, new)`: the other tree's module of the
    same tile, or this tree's --versus tile) and this tree's --tiles kernel (new), timed in turns."""
    print(f"{'rules':<12} {'D':>4} {'S':>6} {'tile':<14} {'pass':<8} {'old ms':>8} {'new ms':>8} {'change':>7} "
          f"{'quartiles':>16}")
    record = []
    for rules_name in args.rules:
        rules = RULES[rules_name]
        for dim in args.dims:
            for S in args.sizes:
                B, layout = standard_batch(rules, S, args.tokens, seed=0)
                q, k, v, d_o = random_inputs(B, args.heads, S, dim, seed=0, heads_kv=args.heads_kv)
                for tile in args.tiles:
                    new = build(rules, dim, tile, args.family, options)
                    old = old_kernel(rules_name, dim, tile, new)
                    # One mask for both trees (the same tensors, the same memory); each tile its own plan.
                    masks = {"new": new.mask(layout)}
                    masks["old"] = masks["new"] if old.config.tile == new.config.tile else old.mask(layout)

                    def both(call, old=old, new=new, masks=masks):  # the pass as each side's call
                        return {"old": lambda: call(old, masks["old"]), "new": lambda: call(new, masks["new"])}

                    passes = {}
                    if "forward" in args.passes:
                        passes["forward"] = both(lambda kernel, mask: kernel(q, k, v, mask))
                    if new.module.HAS_BACKWARD and old.module.HAS_BACKWARD and "fwd+bwd" in args.passes:
                        passes["fwd+bwd"] = both(lambda kernel, mask: torch.autograd.grad(
                            kernel(q, k, v, mask, deterministic=args.deterministic), (q, k, v), d_o))
                    for pass_name, functions in passes.items():
                        times = paired_ms(functions, args.alternations)
                        change, low, high = paired_change(times["old"], times["new"])
                        print(f"{rules_name:<12} {dim:>4} {S:>6} {tile.label:<14} {pass_name:<8} "
                              f"{statistics.median(times['old']):8.3f} {statistics.median(times['new']):8.3f} "
                              f"{100 * change:+6.2f}% [{100 * low:+.2f}, {100 * high:+.2f}]", flush=True)
                        record.append({"rules": rules_name, "dim": dim, "S": S, "tile": tile.label, "pass": pass_name,
                                       **times})
    if args.json:
        args.json.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
