"""What a kernel pays per work tile and per step, from one process on one GPU: omnigen's sm90 forward and backward
against cuDNN's (SDPA's cuDNN backend, the plain causal mask), fitted over sequence lengths at fixed B·S.

At B·S = 32K every S has about the same number of work tiles (forward: q-tiles x heads x batch; backward:
kv-tiles x heads x batch), while the steps of each tile grow with S on the causal mask. So a least-squares line
through time x SMs (µs of one SM) against (tiles, steps) separates a per-step cost from a fixed cost per tile:
launch or hand-over, the first step's unoverlapped softmax, the last product's drain, the epilogue's stores. The
8K ratios to cuDNN are where that fixed cost shows (RESULTS.md, "The backward's fixed cost per CTA").

    python3 scripts/fixed_cost.py --dims 64 128 --sizes 2048 4096 8192 16384 32768 --json fixed.json

cuDNN's counts are omnigen's plan's (128 x 128 tiles, 64-row backward steps): its own tiling differs, so its
columns compare totals, and its fit says how much of its time does not grow with the steps. `--rules full` runs
one image a sequence (every pair allowed, cuDNN without the causal flag): steps without a causal diagonal.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import omnigen  # noqa: E402
from kernel_workload import CAUSAL, FULL, bench, random_inputs, standard_batch  # noqa: E402

BACKWARD_STEP_ROWS = 64  # the Hopper backward's query rows a step


@dataclass(frozen=True)
class Counts:
    """Work of one call in the units the fit uses: tiles and steps over every (batch, head)."""

    forward_tiles: int  # (batch, head, q-tile) with any kv-tile to visit
    forward_steps: int  # visited (q-tile, kv-tile) pairs
    backward_tiles: int  # (batch, head, kv-tile) with any q-tile to visit
    backward_steps: int  # visited pairs x q-tile rows / BACKWARD_STEP_ROWS


def counts(plan, heads: int) -> Counts:
    """A plan's tiles and steps, for `heads` query heads (the schedules are per batch element, shared by heads)."""
    def rows(ptr: torch.Tensor) -> torch.Tensor:  # visited entries of each schedule row: last - first
        ptr = ptr.cpu().long()
        return ptr[3::3] - ptr[0:-1:3]

    forward, backward = rows(plan.fwd_ptr), rows(plan.bwd_ptr)
    steps_per_tile = plan.block_m // BACKWARD_STEP_ROWS
    return Counts(forward_tiles=heads * int((forward > 0).sum()), forward_steps=heads * int(forward.sum()),
                  backward_tiles=heads * int((backward > 0).sum()),
                  backward_steps=heads * steps_per_tile * int(backward.sum()))


def fit(units: list[int], steps: list[int], sm_microseconds: list[float]) -> tuple[float, float, float]:
    """Least squares of µs·SM = per_unit x units + per_step x steps: (per_unit, per_step, largest |residual| as a
    fraction of its point)."""
    a = torch.tensor([[float(u), float(s)] for u, s in zip(units, steps)], dtype=torch.float64)
    b = torch.tensor(sm_microseconds, dtype=torch.float64)
    solution = torch.linalg.lstsq(a, b[:, None]).solution[:, 0]
    residual = ((a @ solution - b).abs() / b).max()
    return float(solution[0]), float(solution[1]), float(residual)


def cudnn_call(q, k, v, causal: bool):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dims", nargs="+", type=int, default=[128])
    parser.add_argument("--sizes", nargs="+", type=int, default=[2048, 4096, 8192, 16384, 32768])
    parser.add_argument("--rules", choices=("causal", "full"), default="causal")
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--no-cudnn", action="store_true", help="omnigen only")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if len(args.sizes) < 3:
        parser.error("--sizes: at least three, for a fit of two costs with a residual")
    rules = CAUSAL if args.rules == "causal" else FULL
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    peers = ["omnigen"] + ([] if args.no_cudnn else ["cudnn"])
    print(f"{torch.cuda.get_device_name()}, {sms} SMs, rules {args.rules}, B*S = {args.tokens}, H = {args.heads}, bf16")
    out = []
    for dim in args.dims:
        kernel = omnigen.build(rules, dim, torch.bfloat16)
        tile = kernel.config.tile
        points = []
        for S in args.sizes:
            B, layout = standard_batch(rules, S, args.tokens, seed=0)
            work = counts(omnigen.plan(rules, layout, tile.block_m, tile.block_n), args.heads)
            q, k, v, d_o = random_inputs(B, args.heads, S, dim, seed=0)
            mask = omnigen.mask(rules, layout, device="cuda", head_dim=dim, dtype=torch.bfloat16)
            calls = {"omnigen": lambda: omnigen.attention(q, k, v, mask)}
            if "cudnn" in peers:
                calls["cudnn"] = cudnn_call(q, k, v, rules is CAUSAL)
            point = {"S": S, "B": B, **asdict(work)}
            for peer, call in calls.items():
                forward = bench(call)
                both = bench(lambda: torch.autograd.grad(call(), (q, k, v), d_o))
                point[f"{peer}_forward_ms"], point[f"{peer}_backward_ms"] = forward, both - forward
            points.append(point)
            print(f"d{dim} S={S}: " + ", ".join(f"{key} {value:.3f}" if isinstance(value, float) else f"{key} {value}"
                                                for key, value in point.items()), flush=True)
        for peer in peers:
            for direction in ("forward", "backward"):
                units = [p[f"{direction}_tiles"] for p in points]
                steps = [p[f"{direction}_steps"] for p in points]
                sm_us = [p[f"{peer}_{direction}_ms"] * 1e3 * sms for p in points]
                per_tile, per_step, residual = fit(units, steps, sm_us)
                print(f"d{dim} {peer:<8} {direction:<9} {per_tile:7.2f} µs a tile, {per_step:6.3f} µs a step "
                      f"(largest residual {100 * residual:.1f}%)")
                out.append({"dim": dim, "peer": peer, "direction": direction, "per_tile_us": per_tile,
                            "per_step_us": per_step, "residual": residual, "points": points})
    if args.json:
        args.json.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "sms": sms, "rules": args.rules,
                                         "tokens": args.tokens, "heads": args.heads, "fits": out}, indent=1))


if __name__ == "__main__":
    main()
