"""Planning a million tokens on the GPU: time, peak GPU memory, and equality with the host plan.

    PYTHONPATH=. python3 scripts/plan_gpu_large.py [--tokens 1048576]
"""
from __future__ import annotations

import argparse
import time

import torch

import omnigen

RULES = omnigen.Rules(name="transfusion", modalities={"text": "causal", "image": "full"})


def layouts(n: int) -> dict[str, omnigen.Layout]:
    segments, used = [], 0
    while used < n:
        for modality, length in (("text", 1000), ("image", 1024)):
            length = min(length, n - used)
            if length:
                segments.append((modality, length))
                used += length
    return {"causal": omnigen.Layout.from_segments([("text", n)]), "transfusion": omnigen.Layout.from_segments(segments)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1 << 20)
    args = parser.parse_args()
    for name, layout in layouts(args.tokens).items():
        omnigen.plan(RULES, omnigen.Layout.from_segments([("text", 4096)]), device="cuda")  # warm-up (Triton compile)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        gpu = omnigen.plan(RULES, layout, 128, 128, device="cuda")
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        start = time.perf_counter()
        host = omnigen.plan(RULES, layout, 128, 128)
        host_seconds = time.perf_counter() - start
        same = all(torch.equal(getattr(gpu, f).cpu(), getattr(host, f)) for f in ("fwd_ptr", "fwd_kv", "bwd_ptr", "bwd_q"))
        print(f"{name:<12} {args.tokens} tokens: GPU plan {seconds:.3f} s, peak {peak:.0f} MiB, "
              f"{gpu.fwd_kv.numel()} visited tiles; host {host_seconds:.2f} s; identical schedules: {same}", flush=True)


if __name__ == "__main__":
    main()
