"""Wall time of the command line, start to exit: `omnigen --help`, `show --help`, `plan --help`, and
`show` / `plan` on the Transfusion rules (issue 28: each <= 0.5 s on a CPU machine, median of 5).

Every run is a fresh `python -m omnigen ...` process, timed from spawn to exit with its output
captured (not printed). The commands take turns (round-robin), after one untimed warm-up round
that also writes the .pyc files (PYTHONDONTWRITEBYTECODE is dropped for the children, as on a
normal install, where the sources are compiled once). Three reference rows give the floors: the interpreter
alone (`python -c pass`), `python -c "import numpy"` -- what `show` and `plan` import besides click and
yaml (they print the host planner's numpy summary, never importing torch) -- and `python -c "import torch"`,
what they cost before they stopped importing it.

    python benchmarks/cli_startup.py                     # this checkout, 5 runs each, a table
    python benchmarks/cli_startup.py --json out.json     # also the figures as JSON
    python benchmarks/cli_startup.py --root /tmp/old     # another checkout (e.g. `git archive` of an older commit)
    python benchmarks/cli_startup.py --compare /tmp/old  # this checkout and another, their runs interleaved
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
    "python -c 'import numpy'": ["-c", "import numpy"],
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


def _environment(root: Path) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
               COLUMNS="100")
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def measure(root: Path, repeats: int, warmup: int, references: bool, compare: Path | None = None) -> list[dict]:
    """Rows of figures per command; with `compare`, that checkout's commands too (named "<command> [compare]"),
    each round running both, so that both see the machine's load alike."""
    runs = {name: ([sys.executable, "-m", "omnigen", *args], root) for name, args in COMMANDS.items()}
    if compare is not None:
        runs.update({f"{name} [compare]": ([sys.executable, "-m", "omnigen", *args], compare)
                     for name, args in COMMANDS.items()})
    if references:
        runs.update({name: ([sys.executable, *args], root) for name, args in REFERENCES.items()})
    environments = {folder: _environment(folder) for folder in {root, compare} if folder is not None}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for round_ in range(warmup + repeats):
        for name, (argv, folder) in runs.items():
            seconds = run_once(argv, folder, environments[folder])
            if round_ >= warmup:
                times[name].append(seconds)
    rows = []
    for name, values in times.items():
        row = {"command": name, "median_s": statistics.median(values), "min_s": min(values), "max_s": max(values),
               "runs_s": values, "reference": name in REFERENCES, "root": str(runs[name][1])}
        if not row["reference"]:
            row["within_target"] = row["median_s"] <= TARGET_S
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    lines = [f"{'command':<40} {'median s':>9} {'min s':>7} {'max s':>7}  <= {TARGET_S} s"]
    for row in rows:
        verdict = "(floor)" if row["reference"] else ("yes" if row["within_target"] else "NO")
        lines.append(f"{row['command']:<40} {row['median_s']:>9.3f} {row['min_s']:>7.3f} {row['max_s']:>7.3f}  "
                     f"{verdict}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per command (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default 1)")
    parser.add_argument("--root", type=Path, default=ROOT, help="checkout to run (default: this one)")
    parser.add_argument("--compare", type=Path, help="another checkout, run in the same rounds (e.g. an older commit)")
    parser.add_argument("--no-reference", action="store_true",
                        help="leave out the python / import numpy / import torch rows")
    parser.add_argument("--json", metavar="FILE", help="also write the figures to FILE as JSON")
    args = parser.parse_args()

    root = args.root.resolve()
    compare = args.compare.resolve() if args.compare else None
    rows = measure(root, args.repeats, args.warmup, not args.no_reference, compare)
    header = (f"{root}" + (f" (and [compare] {compare})" if compare else "") + f" -- python {platform.python_version()}, {os.cpu_count()} CPUs, "
              f"median of {args.repeats} runs per command (+{args.warmup} warm-up)")
    print(header)
    print(table(rows))
    if args.json:
        result = {"root": str(root), "compare": str(compare) if compare else None, "python": platform.python_version(), "machine": platform.machine(),
                  "cpus": os.cpu_count(), "repeats": args.repeats, "warmup": args.warmup, "target_s": TARGET_S,
                  "rows": rows}
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
