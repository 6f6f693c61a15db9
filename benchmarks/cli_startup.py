"""Wall time of the command line, start to exit: `omnigen --help`, `show --help`, `plan --help`, and
`show` / `plan` on the Transfusion rules (issue 28: each <= 0.5 s on a CPU machine, median of 5).

Every run is a fresh `python -m omnigen ...` process, timed from spawn to exit with its output
captured (not printed). The commands take turns (round-robin), after one untimed warm-up round
that also writes the .pyc files (PYTHONDONTWRITEBYTECODE is dropped for the children, as on a
normal install, where the sources are compiled once). Two reference rows give the floors: the interpreter alone
(`python -c pass`) and `python -c "import torch"` -- `show` and `plan` import torch, because the
layout tables and the host planner work on torch tensors.

    python benchmarks/cli_startup.py                     # this checkout, 5 runs each, a table
    python benchmarks/cli_startup.py --json out.json     # also the figures as JSON
    python benchmarks/cli_startup.py --root /tmp/old     # another checkout (e.g. `git archive` of an older commit)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RULES = "examples/rules/transfusion.yaml"
TARGET_S = 0.5

# name -> arguments after `python -m omnigen`
COMMANDS = {
    "omnigen --help": ["--help"],
    "omnigen show --help": ["show", "--help"],
    "omnigen plan --help": ["plan", "--help"],
    "omnigen show (320 tokens)": ["show", "--rules", RULES, "--layout", "text:40 image:256 text:24@1"],
    "omnigen plan (8,024 tokens)": ["plan", "--rules", RULES, "--layout", "text:4000 image:1024 text:3000"],
}
# name -> arguments after `python`: what no command can go below
REFERENCES = {
    "python -c pass": ["-c", "pass"],
    "python -c 'import torch'": ["-c", "import torch"],
}


def run_once(argv: list[str], root: Path, env: dict[str, str]) -> float:
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=root, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["?"])[-1]
        raise SystemExit(f"{' '.join(argv)} exited {done.returncode}: {tail}")
    return seconds


def measure(root: Path, repeats: int, warmup: int, references: bool) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
               COLUMNS="100")
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    runs = {name: [sys.executable, "-m", "omnigen", *args] for name, args in COMMANDS.items()}
    if references:
        runs.update({name: [sys.executable, *args] for name, args in REFERENCES.items()})
    times: dict[str, list[float]] = {name: [] for name in runs}
    for round_ in range(warmup + repeats):
        for name, argv in runs.items():
            seconds = run_once(argv, root, env)
            if round_ >= warmup:
                times[name].append(seconds)
    rows = []
    for name, values in times.items():
        row = {"command": name, "median_s": statistics.median(values), "min_s": min(values), "max_s": max(values),
               "runs_s": values, "reference": name in REFERENCES}
        if not row["reference"]:
            row["within_target"] = row["median_s"] <= TARGET_S
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    lines = [f"{'command':<30} {'median s':>9} {'min s':>7} {'max s':>7}  <= {TARGET_S} s"]
    for row in rows:
        verdict = "(floor)" if row["reference"] else ("yes" if row["within_target"] else "NO")
        lines.append(f"{row['command']:<30} {row['median_s']:>9.3f} {row['min_s']:>7.3f} {row['max_s']:>7.3f}  "
                     f"{verdict}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per command (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default 1)")
    parser.add_argument("--root", type=Path, default=ROOT, help="checkout to run (default: this one)")
    parser.add_argument("--no-reference", action="store_true", help="leave out the python / import torch rows")
    parser.add_argument("--json", metavar="FILE", help="also write the figures to FILE as JSON")
    args = parser.parse_args()

    root = args.root.resolve()
    rows = measure(root, args.repeats, args.warmup, not args.no_reference)
    header = (f"{root} -- python {platform.python_version()}, {os.cpu_count()} CPUs, "
              f"median of {args.repeats} runs per command (+{args.warmup} warm-up)")
    print(header)
    print(table(rows))
    if args.json:
        result = {"root": str(root), "python": platform.python_version(), "machine": platform.machine(),
                  "cpus": os.cpu_count(), "repeats": args.repeats, "warmup": args.warmup, "target_s": TARGET_S,
                  "rows": rows}
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
