"""Attention on the CPU (issue 28 item 3): omnigen's PyTorch path against SDPA with the dense boolean mask.

Each measurement runs in a fresh Python process, so its peak RSS (`ru_maxrss`) is its own: it builds the
layout and the inputs (B = 1, Hq = Hkv = heads, float32, random normals), makes the mask beforehand (omnigen: the
plan, `omnigen.mask(..., device="cpu")`; SDPA: `rules.dense_mask(layout)`, S x S bools), runs the call once
untimed, then times `--reps` calls (median) of the forward and of forward + backward. "above inputs" is the peak
RSS minus the RSS after the inputs and the mask were made and before the first call: what the attention itself
took.

Layouts: the Transfusion rules on docs/measuring.md's synthetic workload (`omnigen.tune.layouts.synthetic_layout`:
text runs of 16-512 tokens between images of 256 or 1024 tokens, one document). Tokens/s = S / seconds per call;
effective GFLOP/s counts allowed pairs only (forward 4 * D * pairs * heads; forward + backward 3.5x that).

    python benchmarks/cpu_attention.py                                  # S = 2K, 4K, 8K beside SDPA; 32K alone
    python benchmarks/cpu_attention.py --sizes 4096 --peers omnigen sdpa --heads 1 --dim 128 --threads 2
    python benchmarks/cpu_attention.py --json cpu.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RULES_FILE = ROOT / "examples" / "rules" / "transfusion.yaml"

CHILD = r"""
import json, random, resource, statistics, sys, time
sys.path.insert(0, {root!r})
import torch
import omnigen
from omnigen.tune.layouts import synthetic_layout

torch.set_num_threads({threads})
peer, S, heads, dim, reps = {peer!r}, {size}, {heads}, {dim}, {reps}
rules = omnigen.Rules.load({rules!r})
layout = synthetic_layout(rules, S, random.Random("transfusion:%d:0" % S))
pairs = omnigen.plan(rules, layout, 128, 128).allowed_pairs
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, heads, S, dim, generator=g).requires_grad_(True) for _ in range(3))
d_out = torch.randn(1, heads, S, dim, generator=g)
if peer == "omnigen":
    mask = omnigen.mask(rules, layout, device="cpu")
    call = lambda: omnigen.attention(q, k, v, mask)
else:
    mask = rules.dense_mask(layout)
    call = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()

def forward():
    with torch.no_grad():
        call()

def forward_backward():
    q.grad = k.grad = v.grad = None
    call().backward(d_out)

inputs_rss = rss()
result = dict(peer=peer, S=S, heads=heads, dim=dim, threads={threads}, pairs=pairs)
for name, fn in (("fwd", forward), ("fwd_bwd", forward_backward)):
    if name not in {passes!r}:
        continue
    fn()  # warm-up: imports, the first plan of a plain layout, allocator growth
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    result[name + "_s"] = statistics.median(times)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
result.update(peak_rss_mib=peak / 2**20, above_inputs_mib=(peak - inputs_rss) / 2**20)
print(json.dumps(result))
"""


def measure(peer: str, size: int, heads: int, dim: int, reps: int, threads: int, passes: tuple[str, ...]) -> dict:
    code = CHILD.format(root=str(ROOT), rules=str(RULES_FILE), peer=peer, size=size, heads=heads, dim=dim,
                        reps=reps, threads=threads, passes=passes)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return dict(peer=peer, S=size, heads=heads, dim=dim, threads=threads, skipped=last[:200])
    return json.loads(done.stdout.strip().splitlines()[-1])


def _row(r: dict) -> str:
    if "skipped" in r:
        return f"| {r['peer']} | {r['S']} | {r['heads']} x {r['dim']} | {r['threads']} | skipped: {r['skipped']} | | | |"
    cells = []
    for name, factor in (("fwd", 4.0), ("fwd_bwd", 14.0)):
        t = r.get(name + "_s")
        if t is None:
            cells.append("—")
        else:
            gflops = factor * r["dim"] * r["pairs"] * r["heads"] / t / 1e9
            cells.append(f"{t:.3f} s, {r['S'] / t:,.0f} tok/s, {gflops:.1f} GFLOP/s")
    return (f"| {r['peer']} | {r['S']} | {r['heads']} x {r['dim']} | {r['threads']} | {cells[0]} | {cells[1]} | "
            f"{r['peak_rss_mib']:.0f} | {r['above_inputs_mib']:.0f} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--long", type=int, nargs="*", default=[32768],
                        help="sizes run by omnigen alone (SDPA's dense mask would not fit or take too long)")
    parser.add_argument("--peers", nargs="+", default=["omnigen", "sdpa"], choices=["omnigen", "sdpa"])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--long-heads", type=int, default=1)
    parser.add_argument("--threads", type=int, nargs="+", default=[1])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    rows = []
    print("| peer | S | heads x D | threads | forward | forward + backward | peak RSS MiB | above inputs MiB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    plan = [(peer, size, args.heads, args.reps) for size in args.sizes for peer in args.peers]
    plan += [("omnigen", size, args.long_heads, 1) for size in args.long]
    for threads in args.threads:
        for peer, size, heads, reps in plan:
            row = measure(peer, size, heads, args.dim, reps, threads, ("fwd", "fwd_bwd"))
            rows.append(row)
            print(_row(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
