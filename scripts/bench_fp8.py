"""Time the FP8 forward against omnigen's bf16 forward (and SDPA cuDNN's on the plain causal mask), with errors.

For each rules (plain causal, Transfusion) and S, B * S = --tokens, H = 16, D = 128: the bf16 inputs, their
per-tensor e4m3 copies (largest magnitude at 448) and their dequantised values. Timed in one process (median of
triton's do_bench): omnigen bf16 forward; the FP8 forward as a user calls it (V's transposed copy included); that
copy alone; on the causal mask, SDPA's cuDNN forward in bf16. Errors against float64 attention of the dequantised
inputs (the first batch element, --error-heads heads): relative RMS and worst element over the largest, for the
FP8 forward and for the bf16 forward of the same (dequantised, bf16) values.

    PYTHONPATH=. python3 scripts/bench_fp8.py --sizes 8192 32768 --json fp8.json

`--fp8-options` times more FP8 variants of the first tile, one per set of sm90 kernel options, in the same process:

    PYTHONPATH=. python3 scripts/bench_fp8.py --fp8-options pingpong=1 softmax_chains=2 pingpong=1,softmax_chains=2
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import omnigen  # noqa: E402
from bench_backward import parse_options, parse_tile  # noqa: E402
from kernel_workload import RULES, bench, standard_batch, with_options  # noqa: E402
from omnigen.op.fp8 import transpose_values  # noqa: E402
from omnigen.reference import attention_reference  # noqa: E402

E4M3_MAX = 448.0


def quantised(t: torch.Tensor) -> tuple[torch.Tensor, float]:
    descale = float(t.float().abs().amax()) / E4M3_MAX
    return (t.float() / descale).to(torch.float8_e4m3fn), descale


def errors(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    diff = out.double() - ref
    return {"relative_rms": float(diff.pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()),
            "worst_over_max": float(diff.abs().max() / ref.abs().max())}


def run(rules_name: str, S: int, tokens: int, heads: int, error_heads: int, seed: int,
        fp8_tiles: list[omnigen.TileConfig], option_sets: list[dict]) -> dict:
    rules = RULES[rules_name]
    B, layouts = standard_batch(rules, S, tokens, seed)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(B, heads, S, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    (q8, dq), (k8, dk), (v8, dv) = (quantised(t) for t in (q, k, v))
    # The bf16 kernel runs the dequantised values (as bf16), so both see the same inputs up to bf16 rounding.
    qd, kd, vd = (t.float().mul(d).to(torch.bfloat16) for t, d in ((q8, dq), (k8, dk), (v8, dv)))
    bf16 = omnigen.build(rules, 128, torch.bfloat16)
    fp8s = {tile.label: omnigen.build(rules, 128, torch.float8_e4m3fn, tile=tile) for tile in fp8_tiles}
    fp8 = next(iter(fp8s.values()))
    for options in option_sets:
        variant = with_options(fp8, options)
        fp8s[variant.config.label] = variant
    mask = omnigen.mask(rules, layouts, "cuda", tiles=[(t.block_m, t.block_n) for t in fp8_tiles] + bf16.tile_shapes(S))
    row = {"rules": rules_name, "S": S, "B": B, "heads": heads, "bf16_variant": bf16.config.label,
           "fp8_variant": fp8.config.label}
    with torch.no_grad():
        row["bf16_ms"] = bench(lambda: bf16(qd, kd, vd, mask))
        row["fp8_ms_by_tile"] = {label: bench(lambda: kernel(q8, k8, v8, mask, descale=(dq, dk, dv)))
                                 for label, kernel in fp8s.items()}
        row["fp8_ms"] = row["fp8_ms_by_tile"][fp8_tiles[0].label]
        row["transpose_ms"] = bench(lambda: transpose_values(v8))
        if rules_name == "causal":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                row["cudnn_bf16_ms"] = bench(lambda: torch.nn.functional.scaled_dot_product_attention(
                    qd, kd, vd, is_causal=True))
        flops = 4 * 128 * mask.allowed_pairs * heads  # allowed pairs only (docs/measuring.md)
        row["bf16_tflops"] = flops / row["bf16_ms"] / 1e9
        row["fp8_tflops"] = flops / row["fp8_ms"] / 1e9
        first = slice(0, error_heads)
        ref, _ = attention_reference(q8[:1, first].double() * dq, k8[:1, first].double() * dk,
                                     v8[:1, first].double() * dv, layouts.layouts[0], rules)
        out8 = fp8(q8, k8, v8, mask, descale=(dq, dk, dv))
        out16 = bf16(qd, kd, vd, mask)
        row["fp8_error"] = errors(out8[:1, first], ref)
        row["bf16_error"] = errors(out16[:1, first], ref)
    row["fp8_over_bf16"] = row["bf16_ms"] / row["fp8_ms"]
    if "cudnn_bf16_ms" in row:
        row["fp8_over_cudnn_bf16"] = row["cudnn_bf16_ms"] / row["fp8_ms"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rules", nargs="+", default=["causal", "transfusion"], choices=sorted(RULES))
    parser.add_argument("--sizes", nargs="+", type=int, default=[8192, 32768])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--error-heads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fp8-tiles", nargs="+", default=["128x192w12s2", "128x128w12s2"],
                        help="the FP8 variants' tiles, MxNwWsS (block_n 64, 128 or 192); the first gives fp8_ms")
    parser.add_argument("--fp8-options", nargs="+", default=[], metavar="NAME=VALUE[,NAME=VALUE]",
                        help="sm90 option sets, each timed as one more FP8 variant of the first tile "
                             "(e.g. pingpong=1 softmax_chains=2,pingpong=1)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    fp8_tiles = [parse_tile(text) for text in args.fp8_tiles]
    option_sets = [parse_options(parser, text.split(",")) for text in args.fp8_options]
    rows = []
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("rules        S      bf16 ms  fp8 ms  (V^T ms)  fp8/bf16  cudnn bf16 ms  fp8 err rms/worst  bf16 err rms/worst")
    for rules_name in args.rules:
        for S in args.sizes:
            row = run(rules_name, S, args.tokens, args.heads, args.error_heads, args.seed, fp8_tiles, option_sets)
            rows.append(row)
            cudnn = f"{row['cudnn_bf16_ms']:.3f}" if "cudnn_bf16_ms" in row else "-"
            e8, e16 = row["fp8_error"], row["bf16_error"]
            print(f"{rules_name:12s} {S:6d} {row['bf16_ms']:8.3f} {row['fp8_ms']:7.3f} ({row['transpose_ms']:.3f})"
                  f"  {row['fp8_over_bf16']:7.2f}x  {cudnn:>13s}  {e8['relative_rms']:.4f}/{e8['worst_over_max']:.4f}"
                  f"      {e16['relative_rms']:.4f}/{e16['worst_over_max']:.4f}", flush=True)
            if len(row["fp8_ms_by_tile"]) > 1:
                print("    fp8 ms by variant: " + ", ".join(f"{k} {v:.3f}" for k, v in row["fp8_ms_by_tile"].items()))
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                         "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
