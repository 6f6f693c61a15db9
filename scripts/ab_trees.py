"""Two source trees' kernels on one GPU, in one call: build both at once, alternate their timing rounds, and print a
table of every figure with the mean change.

For kernel work: make the old tree from a commit (`mkdir _base && git archive HEAD omnigen | tar -x -C _base`, which
the device tool carries as an untracked folder), then on the GPU machine

    python3 scripts/ab_trees.py _base --rounds 3 -- --tiles 128x128w12 --dims 64 128 --sizes 8192 32768 \\
        --rules causal transfusion

Everything after `--` goes to scripts/bench_backward.py (this tree's copy times both trees: it uses omnigen's
public API only), run with PYTHONPATH set to each tree and a kernel cache of its own. `--new-options` adds
`--options ...` to the new tree's runs only, to time an option of this tree against the old tree's default (or
`.` as OLD_TREE with `--new-options` to time an option against the same code). Rounds alternate old, new, old, ...
so that a drift of the GPU's clock falls on both. The table's change is the mean of the new rounds over the mean
of the old ones; `all below` / `all above` marks rows where every new figure is below (above) every old one.

Separate processes put each tree's figures several percent apart from round to round (an H100's clock under
load, each process's own memory): too coarse for a 1-2% change. `--paired N` times both trees' modules in one
process instead, this tree's launch code calling either (the trees must share the launch ABI), in N batches each
taking turns, and reports the median of the batches' paired changes with their quartiles.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

BENCH = Path(__file__).resolve().parent / "bench_backward.py"
ROW = re.compile(r"^(?P<rules>\S+)\s+(?P<dim>\d+)\s+(?P<size>\d+)\s+(?P<tile>\S+)\s+(?P<forward>[\d.]+)\s+"
                 r"(?P<backward>[\d.]+|-)\s")


def parse_rows(text: str) -> dict[tuple[str, int, int, str], tuple[float, float | None]]:
    """bench_backward.py's table: (rules, D, S, tile) -> (forward ms, backward ms or None for a forward-only tile)."""
    rows = {}
    for line in text.splitlines():
        match = ROW.match(line)
        if match:
            backward = match["backward"]
            rows[(match["rules"], int(match["dim"]), int(match["size"]), match["tile"])] = (
                float(match["forward"]), None if backward == "-" else float(backward))
    return rows


def summary(old: list[dict], new: list[dict], column: int) -> list[str]:
    """Table lines for one column (0: forward, 1: backward) over the rounds of both trees."""
    lines = [f"{'rules':<12} {'D':>4} {'S':>6} {'tile':<14} {'old ms':<30} {'new ms':<30} {'change':>7}"]
    for key in old[0] if old else []:
        before = [r[key][column] for r in old if key in r and r[key][column] is not None]
        after = [r[key][column] for r in new if key in r and r[key][column] is not None]
        if not before or not after:
            continue
        change = statistics.mean(after) / statistics.mean(before) - 1
        mark = "  all below" if max(after) < min(before) else "  all above" if min(after) > max(before) else ""
        lines.append(f"{key[0]:<12} {key[1]:>4} {key[2]:>6} {key[3]:<14} "
                     f"{' / '.join(f'{x:.3f}' for x in before):<30} {' / '.join(f'{x:.3f}' for x in after):<30} "
                     f"{100 * change:+6.1f}%{mark}")
    return lines


def command(tree: str, bench_args: list[str], cache: str) -> tuple[list[str], dict[str, str]]:
    environment = dict(os.environ, PYTHONPATH=str(Path(tree).resolve()), OMNIGEN_CACHE_DIR=cache, PYTHONUNBUFFERED="1")
    return [sys.executable, str(BENCH), *bench_args], environment


def run(tree: str, bench_args: list[str], cache: str) -> str:
    argv, environment = command(tree, bench_args, cache)
    done = subprocess.run(argv, env=environment, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{tree}: bench_backward.py exited {done.returncode}:\n{done.stdout[-2000:]}{done.stderr[-4000:]}")
    return done.stdout


def paired(trees: dict[str, tuple[str, list[str], str]], batches: int, json_path: Path | None) -> str:
    """The old tree's module files (its own build, --print-modules), then this tree's bench_backward.py timing them
    beside the new tree's modules in one process (--against)."""
    old_tree, old_args, old_cache = trees["old"]
    new_tree, new_args, new_cache = trees["new"]
    modules = Path(new_cache) / "old-modules.jsonl"
    modules.parent.mkdir(parents=True, exist_ok=True)
    modules.write_text(run(old_tree, [*old_args, "--print-modules"], old_cache))
    extra = ["--against", str(modules), "--alternations", str(batches)] + (["--json", str(json_path)] if json_path else [])
    return run(new_tree, [*new_args, *extra], new_cache)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("old", help="the old source tree (a folder holding the omnigen package)")
    parser.add_argument("--new", default=".", help="the new source tree (default: this one)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--paired", type=int, metavar="N", default=0,
                        help="time both trees' modules in one process, N batches each in turns (instead of rounds)")
    parser.add_argument("--new-options", nargs="+", default=[], metavar="NAME=VALUE",
                        help="sm90 options for the new tree's runs only (bench_backward.py's --options)")
    parser.add_argument("--cache", default="/tmp/ab-trees", help="kernel caches: CACHE-old and CACHE-new")
    parser.add_argument("--json", type=Path, help="also write every round's rows here")
    parser.epilog = ("-- then scripts/bench_backward.py's arguments (its --build-only and --options are this script's; "
                     "with --paired, `--passes forward` times a forward-only change in half the time)")
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    bench_args = argv[split + 1:]
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    new_args = bench_args + (["--options", *args.new_options] if args.new_options else [])
    trees = {"old": (args.old, bench_args, f"{args.cache}-old"), "new": (args.new, new_args, f"{args.cache}-new")}
    for tree, _, _ in trees.values():
        if not (Path(tree) / "omnigen" / "__init__.py").is_file():
            parser.error(f"{tree} holds no omnigen package (make it with git archive REV omnigen | tar -x -C DIR)")

    print("building both trees' modules at once", flush=True)
    with ThreadPoolExecutor(2) as pool:
        built = list(pool.map(lambda t: run(t[0], [*t[1], "--build-only"], t[2]), trees.values()))
    print("".join(built), end="", flush=True)
    if args.paired:
        print(f"\none process, {args.paired} batches of each tree in turns; old = {args.old}, new = {args.new}"
              + (f" with {' '.join(args.new_options)}" if args.new_options else ""), flush=True)
        print(paired(trees, args.paired, args.json), end="", flush=True)
        return
    rounds: dict[str, list[dict]] = {"old": [], "new": []}
    for number in range(1, args.rounds + 1):
        for name, (tree, tree_args, cache) in trees.items():
            rows = parse_rows(run(tree, tree_args, cache))
            rounds[name].append(rows)
            figures = ", ".join(f"{k[0]} d{k[1]} {k[2]}: {v[1] if v[1] is not None else v[0]:.3f}" for k, v in rows.items())
            print(f"round {number} {name}: {figures}", flush=True)
    for title, column in (("backward", 1), ("forward", 0)):
        print(f"\n{title} ms, old = {args.old}, new = {args.new}"
              + (f" with {' '.join(args.new_options)}" if args.new_options else ""))
        print("\n".join(summary(rounds["old"], rounds["new"], column)))
    if args.json:
        args.json.write_text(json.dumps({name: [[[*k, *v] for k, v in r.items()] for r in rs]
                                         for name, rs in rounds.items()}, indent=1))


if __name__ == "__main__":
    main()
