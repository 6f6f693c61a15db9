"""Host planning memory and time against sequence length: tokens -> peak RSS, seconds.

Each point runs in a fresh Python process (so its peak RSS is its own): it parses the rules,
builds the layout, plans it on the CPU with 128x128 tiles and reads the plan's statistics (tile
counts, allowed pairs), as `omnigen plan` does. Peak RSS is the child's `ru_maxrss`; "above
baseline" subtracts the same command's peak at 1K tokens (the interpreter, torch and numpy).

Layouts: `causal` is one text segment of S tokens (`text:S`, the Transfusion rules); `transfusion`
is bench_plan.py's Transfusion-style layout (text runs of 16-72 tokens between 256-token images,
one document).

`--command` picks what each point runs: `api` (the default) is `omnigen.plan` and the plan's statistics;
`plan` and `show-png` are the commands `omnigen plan` and `omnigen show --png FILE`, run in the child
through click's test runner (a Transfusion layout of 4M tokens is ~140 KB of text, more than one
command-line argument may hold), timed and measured the same way.

    python benchmarks/plan_memory.py                       # 1K .. 1M, both layouts, a table
    python benchmarks/plan_memory.py --sizes 1024 262144 --json out.json --png docs/plan_memory.png
    python benchmarks/plan_memory.py --command show-png --sizes 1048576 --layouts causal
    python benchmarks/plan_memory.py --command plan --sizes 1048576 4194304 --root /tmp/old   # another checkout
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIZES = (1024, 16384, 65536, 131072, 262144, 524288, 1048576)
LAYOUTS = ("causal", "transfusion")
COMMANDS = ("api", "plan", "show-png")

CHILD = r"""
import json, os, resource, sys, tempfile, time
sys.path.insert(0, {root!r})
sys.path.insert(0, {bench!r})
from bench_plan import transfusion_segments
kind, S, command, rules_path = {kind!r}, {size}, {command!r}, {rules!r}
segments = [("text", S)] if kind == "causal" else transfusion_segments(S)
start = time.perf_counter()
if command == "api":
    import omnigen
    rules = omnigen.Rules.load(rules_path)
    try:
        layout = omnigen.Layout.from_segments(segments)
        plan = omnigen.plan(rules, layout, 128, 128)
        counts, pairs = plan.counts(), plan.allowed_pairs
        result = {{"tiles_visited": plan.num_tiles, "metadata_bytes": plan.nbytes()}}
    except MemoryError as exc:
        result = {{"refused": str(exc)}}
else:
    from click.testing import CliRunner
    from omnigen.cli import cli
    args = [command.split("-")[0], "--rules", rules_path, "--layout", " ".join(f"{{m}}:{{n}}" for m, n in segments)]
    with tempfile.TemporaryDirectory() as folder:
        if command == "show-png":
            args += ["--png", os.path.join(folder, "mask.png"), "--width", "100"]
        done = CliRunner().invoke(cli, args)
    if done.exit_code == 0:
        result = {{"output_lines": len(done.output.splitlines())}}
    elif done.exit_code == 2:
        result = {{"refused": " ".join(done.output.split())}}
    else:
        raise SystemExit(done.output[-2000:] + repr(done.exception))
result["seconds"] = time.perf_counter() - start
result["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
result["imported_torch"] = "torch" in sys.modules
print(json.dumps(result))
"""


def measure(kind: str, size: int, timeout: float, command: str = "api", root: Path = ROOT) -> dict:
    code = CHILD.format(root=str(root), bench=str(root / "benchmarks"), kind=kind, size=size, command=command,
                        rules=str(root / "examples/rules/transfusion.yaml"))
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"over {timeout:.0f} s"}
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["?"])[-1]
        return {"error": f"exit {done.returncode}: {tail}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="*", default=list(SIZES))
    parser.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=LAYOUTS)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--command", choices=COMMANDS, default="api",
                        help="what a point runs: omnigen.plan (api), `omnigen plan`, `omnigen show --png`")
    parser.add_argument("--root", type=Path, default=ROOT, help="checkout to run (default: this one)")
    parser.add_argument("--json", type=Path, help="write the points here")
    parser.add_argument("--png", type=Path, help="draw the curve here (needs matplotlib)")
    args = parser.parse_args()

    rows = []
    for kind in args.layouts:
        baseline = measure(kind, 1024, args.timeout, args.command, args.root.resolve())["peak_rss"]
        for size in args.sizes:
            row = {"layout": kind, "tokens": size, "command": args.command,
                   **measure(kind, size, args.timeout, args.command, args.root.resolve())}
            if "peak_rss" in row:
                row["above_baseline_mb"] = round((row["peak_rss"] - baseline) / 2**20, 1)
            rows.append(row)
            print(json.dumps(row), flush=True)

    print(f"\n{'layout':>12} | {'tokens':>9} | {'visited tiles':>13} | {'peak RSS MB':>11} | "
          f"{'above 1K MB':>11} | {'seconds':>7}")
    for row in rows:
        peak = f"{row['peak_rss'] / 2**20:.0f}" if "peak_rss" in row else "-"
        note = row.get("error") or row.get("refused") or ""
        print(f"{row['layout']:>12} | {row['tokens']:>9,} | {row.get('tiles_visited', '-')!s:>13} | {peak:>11} | "
              f"{row.get('above_baseline_mb', '-')!s:>11} | {row.get('seconds', 0):>7.2f} {note}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    if args.png:
        draw(rows, args.png)


def draw(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem, sec) = plt.subplots(1, 2, figsize=(10, 3.8))
    for kind, marker in zip(LAYOUTS, "os"):
        points = [r for r in rows if r["layout"] == kind and "above_baseline_mb" in r]
        if not points:
            continue
        tokens = [r["tokens"] for r in points]
        mem.plot(tokens, [max(r["above_baseline_mb"], 0.1) for r in points], marker=marker, label=kind)
        sec.plot(tokens, [r["seconds"] for r in points], marker=marker, label=kind)
    for ax, title in ((mem, "peak RSS above the 1K-token run (MB)"), (sec, "layout + plan + stats (s)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens (128x128 tiles)")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle("omnigen host planner (numpy), 2-core CPU", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
