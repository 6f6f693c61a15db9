"""Forward only, per kernel family and pinned tile, beside SDPA's causal kernels, in one process.

For kernel work on one GPU: each (rules, D, S) row times omnigen's forward for every --variants entry
(FAMILY:TILE, e.g. sm80:128x64w4 sm90:128x128w12) and SDPA flash / cuDNN on the plain causal mask at the
same shape. Effective TFLOP/s count allowed pairs only (docs/measuring.md); the causal peers count S(S+1)/2.
--persistent on/off/both pins the sm90 forward's scheduling (the `persistent` kernel option; default: the tree's
default); "both" times every sm90 variant as a grid of tiles and as a persistent grid (labelled +p) in one
process. --options NAME=VALUE sets other sm90 kernel options (omnigen.kernels.sm90.options.HopperOptions).

    PYTHONPATH=. python3 scripts/bench_forward.py --variants sm80:128x64w4 sm90:128x128w12 --sizes 8192 32768
    PYTHONPATH=. python3 scripts/bench_forward.py --variants sm90:128x128w12 --persistent both --rules causal
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import omnigen  # noqa: E402
from kernel_workload import RULES, bench, build, random_inputs, standard_batch  # noqa: E402
from bench_backward import add_options_option, parse_options, parse_tile  # noqa: E402


def parse_variant(text: str) -> tuple[str, omnigen.TileConfig]:
    family, _, tile = text.partition(":")
    if family not in omnigen.kernels.FAMILIES or not tile:
        raise argparse.ArgumentTypeError(f"variant {text!r}: expected FAMILY:TILE, e.g. sm90:128x128w12")
    return family, parse_tile(tile)


def persistent_modes(choice: str, family: str) -> list[bool | None]:
    """The sm90 schedulings to time for a variant: None keeps the tree's setting."""
    if family != "sm90" or choice == "default":
        return [None]
    return {"on": [True], "off": [False], "both": [False, True]}[choice]


def build_variant(rules: omnigen.Rules, dim: int, tile: omnigen.TileConfig, family: str, persistent: bool | None,
                  options: dict):
    """build(), with the sm90 forward's scheduling pinned (the `persistent` option) where asked."""
    if persistent is not None:
        options = {**options, "persistent": persistent}
    return build(rules, dim, tile, family, options if family == "sm90" else None)


def sdpa_ms(q, k, v, backend) -> float | None:
    from torch.nn.attention import sdpa_kernel

    try:
        with sdpa_kernel([backend]):
            return bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
    except RuntimeError:
        return None


def main() -> None:
    from torch.nn.attention import SDPBackend

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="+", type=parse_variant, default=[parse_variant("sm80:128x64w4")])
    parser.add_argument("--dims", nargs="+", type=int, default=[128])
    parser.add_argument("--sizes", nargs="+", type=int, default=[8192, 32768])
    parser.add_argument("--rules", choices=tuple(RULES), nargs="+", default=["transfusion", "causal"],
                        help="full: one image a sequence, every pair allowed (no causal or partial tile)")
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--persistent", choices=("default", "on", "off", "both"), default="default",
                        help="the sm90 forward's scheduling: the tree's setting, persistent, one CTA per tile, or both")
    add_options_option(parser)
    args = parser.parse_args()
    options = parse_options(parser, args.options)

    print(f"{'rules':<12} {'D':>4} {'S':>6} {'variant':<22} {'fwd ms':>8} {'TFLOP/s':>8}")
    for dim in args.dims:
        for S in args.sizes:
            B = max(1, args.tokens // S)
            q, k, v, _ = random_inputs(B, args.heads, S, dim, seed=0)
            causal_flops = 4.0 * dim * B * args.heads * S * (S + 1) / 2
            for name, backend in (("sdpa-flash", SDPBackend.FLASH_ATTENTION), ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION)):
                ms = sdpa_ms(q, k, v, backend)
                shown = f"{ms:8.3f} {causal_flops / ms * 1e-9:8.1f}" if ms else "     n/a"
                print(f"{'causal':<12} {dim:>4} {S:>6} {name:<22} {shown}", flush=True)
            for rules_name in args.rules:
                rules = RULES[rules_name]
                _, layout = standard_batch(rules, S, args.tokens, seed=0)
                pairs = omnigen.plan(rules, layout, 128, 64).allowed_pairs
                flops = 4.0 * dim * pairs * args.heads
                for family, tile in args.variants:
                    for persistent in persistent_modes(args.persistent, family):
                        label = f"{family}:{tile.label}" + ("+p" if persistent else "")
                        try:
                            kernel = build_variant(rules, dim, tile, family, persistent, options)
                        except ValueError as exc:
                            print(f"{rules_name:<12} {dim:>4} {S:>6} {label:<22} skipped: {exc}")
                            continue
                        ms = bench(lambda: kernel(q, k, v, layout))
                        print(f"{rules_name:<12} {dim:>4} {S:>6} {label:<22} {ms:8.3f} {flops / ms * 1e-9:8.1f}", flush=True)


if __name__ == "__main__":
    main()
