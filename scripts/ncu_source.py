"""Where a kernel's warps stall, per SASS instruction, from Nsight Compute's source page (no GPU needed to read it).

On the GPU machine, profile with the source counters and export the page as CSV:

    ncu --clock-control none --section SourceCounters --section WarpStateStats -k regex:"dkdv_kernel|flash_bprop" \\
        --launch-skip 2 --launch-count 2 -o rep python3 scripts/ncu_attention.py --backward --peer cudnn
    ncu -i rep.ncu-rep --page source --csv --print-source sass > source.csv

then here:

    python scripts/ncu_source.py source.csv                 # every kernel: stall reasons, code by execution count
    python scripts/ncu_source.py source.csv --kernel 0 --top 30 --range 560:1420

Execution counts group the code by how often it runs: in the Hopper backward a full step's instructions run
(consumer warps x CTA steps) times, the code once a CTA (consumer warps x CTAs) times. Samples are warp states
sampled at a fixed interval, so a region's share of its class's samples is its share of those warps' time.
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import io
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def kernels(path: Path) -> list[tuple[str, list[dict[str, object]]]]:
    """(kernel name, its instructions) per kernel of the CSV; each instruction's source, samples, execution count and
    samples by stall reason."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as handle:
        lines = handle.read().split("\n")
    starts = [i for i, line in enumerate(lines) if line.startswith('"Kernel Name"')]
    out = []
    for start, end in zip(starts, starts[1:] + [len(lines)]):
        name = next(csv.reader([lines[start]]))[1]
        rows = list(csv.reader(io.StringIO("\n".join(lines[start + 1:end]))))
        header = rows[0]
        column = {key: i for i, key in enumerate(header)}
        reasons = [key for key in header if key.startswith("stall_") and "Not Issued" not in key]

        def number(row: list[str], key: str) -> float:
            try:
                return float(row[column[key]].replace(",", "") or 0)
            except (ValueError, IndexError):
                return 0.0

        instructions = []
        for row in rows[1:]:
            if len(row) < len(header):
                continue
            instructions.append({
                "source": row[column["Source"]].strip(),
                "samples": number(row, SAMPLES),
                "executed": int(number(row, EXECUTED)),
                "reasons": {key[len("stall_"):]: number(row, key) for key in reasons},
            })
        out.append((name, instructions))
    return out


def opcode(source: str) -> str:
    words = source.split()
    if not words:
        return ""
    return (words[1] if words[0].startswith("@") and len(words) > 1 else words[0]).split(".")[0]


def describe(name: str, instructions: list[dict[str, object]], top: int, ranges: list[tuple[int, int]]) -> None:
    total = sum(i["samples"] for i in instructions) or 1.0
    print(f"== {name[:140]}")
    print(f"   {len(instructions)} instructions, {int(total)} samples")
    reasons: collections.Counter = collections.Counter()
    for instruction in instructions:
        reasons.update(instruction["reasons"])
    print("   stall reasons: " + ", ".join(f"{k} {v / total:.1%}" for k, v in reasons.most_common(8)))
    classes: collections.Counter = collections.Counter()
    for instruction in instructions:
        classes[instruction["executed"]] += instruction["samples"]
    print("   samples by execution count (code that runs this many warp-times):")
    for executed, samples in classes.most_common(8):
        first = next(i for i, x in enumerate(instructions) if x["executed"] == executed)
        last = max(i for i, x in enumerate(instructions) if x["executed"] == executed)
        print(f"     {executed:>12,}  {samples / total:6.1%}  (instructions {first}-{last})")
    if top:
        print(f"   the {top} instructions with most samples:")
        ranked = sorted(range(len(instructions)), key=lambda i: -instructions[i]["samples"])[:top]
        for i in ranked:
            x = instructions[i]
            why = ", ".join(f"{k} {v / total:.2%}" for k, v in collections.Counter(x["reasons"]).most_common(2) if v)
            print(f"     {i:5d} {x['samples'] / total:6.2%}  {x['source'][:72]:72s} {why}")
    for low, high in ranges:
        part = instructions[low:high]
        samples = sum(x["samples"] for x in part)
        ops = collections.Counter(opcode(x["source"]) for x in part)
        print(f"   instructions {low}-{high}: {samples / total:.1%} of the samples; opcodes: "
              + ", ".join(f"{k} {v}" for k, v in ops.most_common(12)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv", type=Path, help="ncu --page source --csv --print-source sass output (.gz too)")
    parser.add_argument("--kernel", type=int, default=None, help="only the kernel at this position in the CSV")
    parser.add_argument("--top", type=int, default=20, help="instructions with the most samples to list")
    parser.add_argument("--range", action="append", default=[], metavar="LOW:HIGH",
                        help="summarise instructions LOW..HIGH-1 (samples and opcodes); repeatable")
    args = parser.parse_args()
    ranges = [tuple(int(x) for x in text.split(":")) for text in args.range]
    for position, (name, instructions) in enumerate(kernels(args.csv)):
        if args.kernel is None or args.kernel == position:
            describe(name, instructions, args.top, ranges)


if __name__ == "__main__":
    main()
