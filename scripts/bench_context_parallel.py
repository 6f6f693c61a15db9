"""Context parallelism on one host's GPUs against one GPU: time, balance, memory and agreement.

    python scripts/bench_context_parallel.py --tokens 131072 --dim 128 --heads 16 --methods balanced zigzag even

One process per GPU (torch.multiprocessing, NCCL; NVLink multicast stays off: NCCL_NVLS_ENABLE=0). Rank 0 first
runs the whole sequence alone (`omnigen.attention` with a mask made once), forward + backward, and keeps its
output and gradients on the host. Then every rank runs `omnigen.distributed.attention` on its shard for each
method, and the script prints, per method: the step time (the slowest rank's forward + backward, median), the
speed-up over one GPU, the planned work max/mean (from the plan) and the measured one (each rank's rectangles
timed alone, no communication), the peak memory per GPU against the single-GPU run (both counting the inputs and
gradients a training step holds), and the largest differences of the output and gradients from the single-GPU
result. Inputs are the same random bf16 tensors on every rank (one seed).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

# Never NVLink multicast on a shared host (the device notes): set before NCCL or torch reads them.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


def _inputs(args, device):
    g = torch.Generator(device=device).manual_seed(args.seed)
    S, H, Hkv, D = args.tokens, args.heads, args.heads_kv or args.heads, args.dim

    def make(heads):
        return torch.randn(1, heads, S, D, generator=g, device=device, dtype=torch.bfloat16)

    return make(H), make(Hkv), make(Hkv), make(H)


def _time(fn, reps: int, warmup: int = 2) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - start) * 1e3)
    return out


def _peak(fn) -> float:
    """Peak allocated GiB while fn runs, counting what is allocated before it (inputs, masks)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**30


def _difference(a: torch.Tensor, b: torch.Tensor) -> dict:
    a, b = a.float(), b.float()
    return {"max_abs": float((a - b).abs().max()), "rel_fro": float((a - b).norm() / b.norm().clamp_min(1e-30)),
            "ref_max_abs": float(b.abs().max())}


def _single_gpu(args, rules, layout, device):
    import omnigen

    q, k, v, d_out = _inputs(args, device)
    mask = omnigen.mask(rules, layout, device=device, head_dim=args.dim, dtype=torch.bfloat16)
    leaves = [x.requires_grad_() for x in (q, k, v)]

    def step():
        for x in leaves:
            x.grad = None
        omnigen.attention(q, k, v, mask).backward(d_out)

    times = _time(step, args.reps)
    peak = _peak(step)
    result = {"ms": statistics.median(times), "times_ms": times, "peak_gib": peak}
    kept = [omnigen.attention(q, k, v, mask).detach().cpu()] + [x.grad.cpu() for x in leaves]
    return result, kept


def _profile(step) -> dict:
    """One step under torch.profiler: GPU time by kernel family (attention, NCCL, the rest), and the time no
    kernel ran on the device, against the step's wall time."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        started = time.perf_counter()
        step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - started) * 1e3
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    families: dict[str, float] = {}
    for e in kernels:
        name = e.name.lower()
        family = ("nccl" if "nccl" in name else "attention" if ("omnigen" in name or "hopper" in name or "flash" in name
                  or "attn" in name or "fwd" in name or "bwd" in name) else "other")
        families[family] = families.get(family, 0.0) + e.device_time / 1e3
    spans = sorted((e.time_range.start, e.time_range.end) for e in kernels if "nccl" not in e.name.lower())
    busy, end = 0.0, None
    for start, stop in spans:  # union of the non-NCCL kernels' intervals (us)
        if end is None or start > end:
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    top: dict[str, float] = {}
    for e in kernels:
        top[e.name[:110]] = top.get(e.name[:110], 0.0) + e.device_time / 1e3
    return {"wall_ms": wall, "kernel_ms_by_family": families, "compute_busy_ms": busy / 1e3,
            "top": sorted(top.items(), key=lambda kv: -kv[1])[:12]}


def _distributed(args, rules, layout, rank, world, device, method, block_tokens, kept):
    import omnigen.distributed as cp
    from omnigen.distributed.attention import rank_work
    from omnigen.distributed.rectangle import default_scale

    started = time.perf_counter()
    shard = cp.plan_shards(rules, layout, world, args.chunk, method=method)
    planned_s = time.perf_counter() - started
    q_all, k_all, v_all, d_all = _inputs(args, device)
    q, k, v, d_out = (shard.scatter(x, rank).contiguous() for x in (q_all, k_all, v_all, d_all))
    del q_all, k_all, v_all, d_all
    torch.cuda.empty_cache()
    leaves = [x.requires_grad_() for x in (q, k, v)]
    started = time.perf_counter()
    scale = default_scale(args.dim, None)
    work = rank_work(shard, rank, q, scale, block_tokens)
    torch.cuda.synchronize()
    rectangles_s = time.perf_counter() - started

    def step():
        for x in leaves:
            x.grad = None
        cp.attention(q, k, v, shard, rules, block_tokens=block_tokens).backward(d_out)

    dist.barrier()
    times = _time(step, args.reps)
    # host time to enqueue one step (no sync at its end): near the step time means the host, not the GPU, paces it
    torch.cuda.synchronize()
    started = time.perf_counter()
    step()
    enqueue_ms = (time.perf_counter() - started) * 1e3
    torch.cuda.synchronize()
    peak = _peak(step)
    # The rank's rectangles alone (no communication): the measured work of the rank.
    pieces = [[tuple(torch.randn(1, k.shape[1], p.tokens, args.dim, device=device, dtype=torch.bfloat16)
                     for _ in range(2)) for p in rnd.receives] for rnd in work.rounds]

    def blocks():
        for rnd, buffers in zip(work.rounds, pieces):
            for piece, (kp, vp) in zip(rnd.receives, buffers):
                for block in piece.blocks:
                    yield block.rows, block.rectangle, kp, vp

    def compute_only():
        with torch.no_grad():
            out, lse = work.own.forward(q, k, v)
            for rows, rectangle, kp, vp in blocks():
                rectangle.forward(q[:, :, rows], kp, vp)
            work.own.backward(d_out, q, k, v, out.to(q.dtype), lse)
            for rows, rectangle, kp, vp in blocks():
                rectangle.backward(d_out[:, :, rows], q[:, :, rows], kp, vp, out[:, :, rows].to(q.dtype),
                                   lse[:, :, rows])

    compute = _time(compute_only, args.reps)
    profile = _profile(step) if args.profile else None
    # Agreement with the single GPU's result.
    out = cp.attention(q, k, v, shard, rules, block_tokens=block_tokens)
    for x in leaves:
        x.grad = None
    out.backward(d_out)
    gathered = [shard.gather(x) for x in (out.detach(), q.grad, k.grad, v.grad)]
    row = {"method": method, "rank": rank, "ms": statistics.median(times), "times_ms": times,
           "compute_ms": statistics.median(compute), "enqueue_ms": enqueue_ms, "peak_gib": peak, "tokens": shard.tokens(rank),
           "planned_work": float(shard.work[rank]), "work_max_over_mean": 1 + shard.imbalance,
           "received_tokens": int(shard.received_tokens[rank]), "plan_shards_s": planned_s,
           "rectangles_s": rectangles_s, "chunk": shard.chunk, "block_tokens": block_tokens,
           "rectangles": 1 + sum(len(p.blocks) for rnd in work.rounds for p in rnd.receives), "profile": profile}
    if rank == 0 and kept is not None:
        row["difference"] = {name: _difference(mine.cpu(), theirs)
                             for name, mine, theirs in zip(("out", "dq", "dk", "dv"), gathered, kept)}
    rows = [None] * world
    dist.all_gather_object(rows, row)
    return rows


def _worker(rank: int, world: int, args, port: int) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    import omnigen
    from omnigen.tune.layouts import synthetic_layout

    rules = omnigen.Rules.load(args.rules)
    layout = synthetic_layout(rules, args.tokens, random.Random(args.seed))
    single, kept = (None, None)
    if rank == 0:
        single, kept = _single_gpu(args, rules, layout, device)
        torch.cuda.empty_cache()
    dist.barrier()
    report = {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__, "world": world,
              "rules": rules.name, "tokens": args.tokens, "heads": args.heads, "heads_kv": args.heads_kv or args.heads,
              "dim": args.dim, "single": single, "methods": {}}
    for method in args.methods:
        for block_tokens in args.block_tokens:
            rows = _distributed(args, rules, layout, rank, world, device, method, block_tokens, kept)
            torch.cuda.empty_cache()
            name = method if len(args.block_tokens) == 1 else f"{method}, blocks of {block_tokens}"
            report["methods"][name] = rows
    if rank == 0:
        _print(report)
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1))
    dist.destroy_process_group()


def _print(report: dict) -> None:
    single = report["single"]
    print(f"{report['gpu']} x{report['world']}, torch {report['torch']}: {report['rules']}, S={report['tokens']}, "
          f"H={report['heads']}/{report['heads_kv']}, D={report['dim']}, bf16, forward+backward")
    print(f"one GPU: {single['ms']:.1f} ms, peak {single['peak_gib']:.2f} GiB")
    print("| method | step ms (slowest rank) | speed-up | planned work max/mean | measured compute max/mean | "
          "peak GiB max (x one GPU) | received tokens max | out rel | dq rel | dk rel | dv rel |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for method, rows in report["methods"].items():
        step = max(r["ms"] for r in rows)
        compute = [r["compute_ms"] for r in rows]
        peak = max(r["peak_gib"] for r in rows)
        diff = rows[0].get("difference", {})
        rel = " | ".join(f"{diff[n]['rel_fro']:.1e}" if n in diff else "-" for n in ("out", "dq", "dk", "dv"))
        print(f"| {method} | {step:.1f} | {single['ms'] / step:.2f}x | {rows[0]['work_max_over_mean']:.3f} | "
              f"{max(compute) / statistics.mean(compute):.3f} | {peak:.2f} ({peak / single['peak_gib']:.2f}x) | "
              f"{max(r['received_tokens'] for r in rows)} | {rel} |")
    for method, rows in report["methods"].items():
        for r in rows:
            if r.get("profile"):
                print(method, "rank", r["rank"], "profile:", json.dumps({k: v for k, v in r["profile"].items()}))
        print(method, "per rank ms:", [round(r["ms"], 1) for r in rows], "compute ms:",
              [round(r["compute_ms"], 1) for r in rows], "enqueue ms:", [round(r["enqueue_ms"], 1) for r in rows],
              "rectangles:", [r["rectangles"] for r in rows], "max abs:",
              {n: round(d["max_abs"], 4) for n, d in rows[0].get("difference", {}).items()})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--rules", default="examples/rules/transfusion.yaml")
    parser.add_argument("--tokens", type=int, default=131072)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--heads-kv", type=int, default=0, help="key/value heads (default: --heads)")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=None, help="tokens per chunk (default: plan_shards')")
    parser.add_argument("--block-tokens", type=int, nargs="+", default=[8192],
                        help="tokens per moved piece of K/V and per block of queries (omnigen.distributed.attention)")
    parser.add_argument("--methods", nargs="+", default=["balanced", "zigzag", "even"])
    parser.add_argument("--world", type=int, default=0, help="GPUs (default: every visible one)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the report here")
    parser.add_argument("--profile", action="store_true", help="also profile one step per rank (torch.profiler)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA GPUs", file=sys.stderr)
        return 2
    world = args.world or torch.cuda.device_count()
    mp.spawn(_worker, args=(world, args, 29400 + random.Random().randrange(500)), nprocs=world)
    return 0


if __name__ == "__main__":
    sys.exit(main())
