"""Where the time of one GPU plan goes, on the host and on the device (a diagnostic, not a benchmark).

    PYTHONPATH=. python3 scripts/profile_plan_gpu.py --sizes 8192 16384

For each size: the median wall time of each stage of `omnigen.plan(..., device="cuda")` for a fresh
Transfusion layout (Layout construction, GPU tables, classify_and_schedule), then cProfile's top
entries over many calls, so host-side Python shows up by function.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_plan import RULES, time_calls, transfusion_segments  # noqa: E402

import omnigen  # noqa: E402
from omnigen.plan import gpu as plan_gpu  # noqa: E402


def median_us(fn, repeats: int = 200) -> float:
    return 1e3 * time_calls(fn, repeats, torch.cuda.synchronize)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="*", default=[8192, 16384])
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    device = torch.device("cuda")
    for size in args.sizes:
        segments = transfusion_segments(size)
        layout = omnigen.Layout.from_segments(segments)
        tables = layout.tables(RULES, device)
        stages = {
            "Layout.from_segments": lambda: omnigen.Layout.from_segments(segments),
            "layout + tables(cuda)": lambda: omnigen.Layout.from_segments(segments).tables(RULES, device),
            "classify_and_schedule": lambda: plan_gpu.classify_and_schedule(RULES, tables, 128, 128),
            "plan (fresh layout)": lambda: omnigen.plan(RULES, omnigen.Layout.from_segments(segments), 128, 128, device=device),
        }
        print(f"== S = {size}: {len(segments)} segments")
        for name, fn in stages.items():
            print(f"  {name:28s} {median_us(fn):8.1f} us")
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(200):
            omnigen.plan(RULES, omnigen.Layout.from_segments(segments), 128, 128, device=device)
        torch.cuda.synchronize()
        profiler.disable()
        stats = pstats.Stats(profiler)
        stats.sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
