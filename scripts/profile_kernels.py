"""Where one forward+backward's GPU time goes: every CUDA kernel of the call, omnigen against its peers.

For each workload (rules, head dim, S; B * S = --tokens, H = --heads, bf16) it warms each peer up, then runs
--reps forward+backward calls under the PyTorch profiler and prints, per peer, each kernel's GPU microseconds a
call (summed over launches of that name) with the call's kernel total and its wall time. What it is for: the
passes around the main kernels (Delta, zeroing the fp32 dQ, converting it, layout copies) and what they cost
beside the peer's.

    PYTHONPATH=. python3 scripts/profile_kernels.py --rules causal --dims 128 64 --sizes 8192 32768
"""
from __future__ import annotations

import argparse
import collections
import json
import time

import torch

import omnigen
from omnigen import bench


def kernel_times(fn, reps: int) -> tuple[dict[str, tuple[float, int]], float]:
    """name -> (GPU µs a launch, launches recorded), and the wall ms a call, over `reps` calls of fn under the
    profiler. (Launches recorded, not made: on torch 2.11 the profiler kept 2 of 5 launches of omnigen's main
    kernels and all of the small ones, so a call's figure is each kernel's mean times its launches a call.)"""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - start) * 1e3 / reps
    totals: dict[str, float] = collections.defaultdict(float)
    counts: dict[str, int] = collections.defaultdict(int)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] += event.device_time
            counts[event.name] += 1
    return {name: (totals[name] / counts[name], counts[name]) for name in totals}, wall_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rules", default="causal", help="causal, or a rules YAML path (e.g. examples/rules/transfusion.yaml)")
    parser.add_argument("--dims", type=int, nargs="+", default=[128])
    parser.add_argument("--sizes", type=int, nargs="+", default=[8192])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--heads-kv", type=int, default=0)
    parser.add_argument("--peers", nargs="+", default=["omnigen", "cudnn_causal"])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--json", help="write the tables here")
    args = parser.parse_args()
    if args.rules == "causal":
        rules = omnigen.Rules(name="causal", modalities={"text": "causal"})
    else:
        rules = omnigen.Rules.load(args.rules)
    report = []
    for work in bench.workloads(rules, dims=args.dims, sizes=args.sizes, tokens=args.tokens, heads=args.heads,
                                heads_kv=args.heads_kv):
        q, k, v, d_out = bench.random_inputs(work.batch, work.heads, work.seq_len, work.dim, 0, work.heads_kv)
        candidates, skipped = bench.peers(work, q, k, v, only=tuple(args.peers))
        for item in skipped:
            print("skipped", item)
        for name, (forward, _pairs) in candidates.items():
            def fwd_bwd(forward=forward):
                return torch.autograd.grad(forward(), (q, k, v), d_out)

            for _ in range(3):
                fwd_bwd()
            times, wall_ms = kernel_times(fwd_bwd, args.reps)
            print(f"\n== {rules.name} D={work.dim} S={work.seq_len} B={work.batch} {name}: wall {wall_ms:.3f} ms a call; "
                  "each kernel's mean a launch (launches recorded in the calls)")
            for kernel, (us, launches) in sorted(times.items(), key=lambda item: -item[1][0]):
                print(f"  {us:10.1f} us x {launches:3d}  {kernel[:140]}")
            report.append({"rules": rules.name, "D": work.dim, "S": work.seq_len, "B": work.batch, "impl": name,
                           "reps": args.reps, "kernels_us_and_launches": times, "wall_ms": wall_ms})
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=1)


if __name__ == "__main__":
    main()
