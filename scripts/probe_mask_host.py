"""Host time of making one step's mask in benchmarks/train_step.py (omnigen and FlexAttention), per S, with the
GPU idle (a sync after each), and omnigen's top host functions under cProfile. A probe for issue 26's idle GPU."""
from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import train_step as ts  # noqa: E402


def timed(fn, reps=12):
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        host = time.perf_counter() - t
        torch.cuda.synchronize()
        out.append((host, time.perf_counter() - t))
    return statistics.median(h for h, _ in out) * 1e3, statistics.median(w for _, w in out) * 1e3


def main() -> None:
    rules = ts.omnigen.Rules.load(ts.RULES_PATH)
    cfg = ts.CONFIGS["a"]
    dev = torch.device("cuda")
    for S in [int(x) for x in (sys.argv[1:] or ["8192", "32768"])]:
        B = 32768 // S
        batches = [ts.make_batch(cfg, rules, S, B, i, device=dev) for i in range(4)]
        for name in ("omnigen", "flex"):
            be = ts.make_backend(name, rules, cfg, dev)
            if name == "flex":
                be.prepare(True)
            made = [0]

            def one():
                be.make_mask(batches[made[0] % len(batches)])
                made[0] += 1

            for _ in range(3):
                one()
            host, wall = timed(one)
            print(f"S={S} B={B} {name}: make_mask host {host:.2f} ms, until the GPU is done {wall:.2f} ms", flush=True)
            if name == "omnigen":
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(5):
                    one()
                prof.disable()
                text = io.StringIO()
                pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(28)
                print("\n".join(text.getvalue().splitlines()[:48]), flush=True)


if __name__ == "__main__":
    main()
