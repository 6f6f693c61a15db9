"""Attention on the CPU (issue 28 item 3): omnigen's PyTorch path against SDPA with the dense boolean mask.

Two kinds of measurement, each in a fresh Python process:

- speed (per S and thread count): omnigen and SDPA in the same process, interleaved round-robin in rotated order
  for `--rounds` rounds (the forward, then forward + backward), the median per peer, and their ratio. On a shared
  machine the load moves a lot between minutes; interleaving gives both peers the same load, so the ratio is
  the figure to quote (docs/measuring.md).
- memory (per peer and S): one forward + backward; peak RSS (`ru_maxrss`), and "above inputs": the peak minus
  the RSS after the inputs and the mask were made, what the attention itself took.

Inputs: B = 1, Hq = Hkv = heads, float32 random normals; the mask made beforehand (omnigen:
`omnigen.mask(..., device="cpu")`, the plan; SDPA: `rules.dense_mask(layout)`, S x S bools), one untimed call
first. Layouts: the Transfusion rules on docs/measuring.md's synthetic workload
(`omnigen.tune.layouts.synthetic_layout`: text runs of 16-512 tokens between images of 256 or 1024 tokens).
Tokens/s = S / seconds per call; effective GFLOP/s counts allowed pairs only (forward 4 * D * pairs * heads;
forward + backward 3.5x that).

    python benchmarks/cpu_attention.py                          # 2K-8K beside SDPA, 1 and 2 threads; 32K memory
    python benchmarks/cpu_attention.py --sizes 4096 --threads 2 --rounds 5 --memory
    python benchmarks/cpu_attention.py --json cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RULES_FILE = ROOT / "examples" / "rules" / "transfusion.yaml"
PEERS = ("omnigen", "sdpa")

COMMON = r"""
import json, random, resource, statistics, sys, time
sys.path.insert(0, {root!r})
import torch
import omnigen
from omnigen.tune.layouts import synthetic_layout

torch.set_num_threads({threads})
S, heads, dim = {size}, {heads}, {dim}
rules = omnigen.Rules.load({rules!r})
layout = synthetic_layout(rules, S, random.Random("transfusion:%d:0" % S))
pairs = omnigen.plan(rules, layout, 128, 128).allowed_pairs
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, heads, S, dim, generator=g).requires_grad_(True) for _ in range(3))
d_out = torch.randn(1, heads, S, dim, generator=g)

def caller(peer):
    if peer == "omnigen":
        mask = omnigen.mask(rules, layout, device="cpu")
        return lambda: omnigen.attention(q, k, v, mask)
    mask = rules.dense_mask(layout)
    return lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

def forward(call):
    with torch.no_grad():
        call()

def forward_backward(call):
    q.grad = k.grad = v.grad = None
    call().backward(d_out)

def load():
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])

result = dict(S=S, heads=heads, dim=dim, threads={threads}, pairs=pairs, load_before=load())
"""

SPEED = COMMON + r"""
peers = {peers!r}
calls = {{peer: caller(peer) for peer in peers}}
times = {{(peer, name): [] for peer in peers for name in ("fwd", "fwd_bwd")}}
for peer in peers:
    forward(calls[peer]); forward_backward(calls[peer])  # warm-up
for round_ in range({rounds}):
    for peer in peers[round_ % len(peers):] + peers[:round_ % len(peers)]:
        for name, fn in (("fwd", forward), ("fwd_bwd", forward_backward)):
            start = time.perf_counter()
            fn(calls[peer])
            times[(peer, name)].append(time.perf_counter() - start)
for (peer, name), values in times.items():
    result[f"{{peer}}_{{name}}_s"] = statistics.median(values)
result["load_after"] = load()
print(json.dumps(result))
"""

MEMORY = COMMON + r"""
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()

call = caller({peer!r})
inputs_rss = rss()
start = time.perf_counter()
forward_backward(call)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
result.update(peer={peer!r}, seconds=time.perf_counter() - start, peak_rss_mib=peak / 2**20,
              above_inputs_mib=(peak - inputs_rss) / 2**20)
print(json.dumps(result))
"""


def _child(code: str) -> dict:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ))
    if done.returncode != 0:
        return {"skipped": ((done.stderr.strip().splitlines() or ["no output"])[-1])[:200]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def speed(size: int, heads: int, dim: int, threads: int, rounds: int, peers: tuple[str, ...]) -> dict:
    code = SPEED.format(root=str(ROOT), rules=str(RULES_FILE), size=size, heads=heads, dim=dim, threads=threads,
                        rounds=rounds, peers=peers)
    return {"kind": "speed", "S": size, "heads": heads, "dim": dim, "threads": threads, **_child(code)}


def memory(peer: str, size: int, heads: int, dim: int, threads: int) -> dict:
    code = MEMORY.format(root=str(ROOT), rules=str(RULES_FILE), size=size, heads=heads, dim=dim, threads=threads,
                         peer=peer)
    return {"kind": "memory", "peer": peer, "S": size, "heads": heads, "dim": dim, "threads": threads, **_child(code)}


def _gflops(r: dict, seconds: float, backward: bool) -> float:
    return (14.0 if backward else 4.0) * r["dim"] * r["pairs"] * r["heads"] / seconds / 1e9


def speed_row(r: dict) -> str:
    head = f"| {r['S']} | {r['heads']} x {r['dim']} | {r['threads']} |"
    if "skipped" in r:
        return f"{head} skipped: {r['skipped']} |"
    cells = []
    for name, backward in (("fwd", False), ("fwd_bwd", True)):
        for peer in PEERS:
            t = r.get(f"{peer}_{name}_s")
            cells.append("—" if t is None else
                         f"{t:.3f} s, {r['S'] / t:,.0f} tok/s, {_gflops(r, t, backward):.1f} GFLOP/s")
        ours, theirs = r.get(f"omnigen_{name}_s"), r.get(f"sdpa_{name}_s")
        cells.append(f"{theirs / ours:.2f}×" if ours and theirs else "—")
    return f"{head} {' | '.join(cells)} | {r['load_before']} / {r['load_after']} |"


def memory_row(r: dict) -> str:
    head = f"| {r['peer']} | {r['S']} | {r['heads']} x {r['dim']} |"
    if "skipped" in r:
        return f"{head} skipped: {r['skipped']} | | |"
    return f"{head} {r['peak_rss_mib']:.0f} | {r['above_inputs_mib']:.0f} | {r['seconds']:.1f} |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="*", default=[2048, 4096, 8192])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--peers", nargs="+", default=list(PEERS), choices=PEERS)
    parser.add_argument("--memory", type=int, nargs="*", default=[8192, 32768],
                        help="sizes whose peak RSS is measured (SDPA only up to --sdpa-memory-max)")
    parser.add_argument("--memory-heads", type=int, nargs="+", default=[1])
    parser.add_argument("--memory-dims", type=int, nargs="+", default=[64])
    parser.add_argument("--sdpa-memory-max", type=int, default=8192)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    rows = []
    if args.sizes:
        print("| S | heads x D | threads | omnigen forward | SDPA forward | omnigen / SDPA speed | omnigen fwd+bwd | "
              "SDPA fwd+bwd | omnigen / SDPA speed | load avg before / after |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for size in args.sizes:
            for threads in args.threads:
                row = speed(size, args.heads, args.dim, threads, args.rounds, tuple(args.peers))
                rows.append(row)
                print(speed_row(row), flush=True)
    if args.memory:
        print("\n| peer | S | heads x D | peak RSS MiB | above inputs MiB | one fwd+bwd, s |")
        print("| --- | --- | --- | --- | --- | --- |")
        for size in args.memory:
            for heads in args.memory_heads:
                for dim in args.memory_dims:
                    for peer in args.peers:
                        if peer == "sdpa" and size > args.sdpa_memory_max:
                            continue
                        row = memory(peer, size, heads, dim, 1)
                        rows.append(row)
                        print(memory_row(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
