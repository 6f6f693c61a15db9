"""omnigen and an SDPA kernel (flash, or cuDNN with --peer cudnn) on the same causal problem, twice each,
for Nsight Compute.

    ncu --clock-control none -k regex:"forward_kernel|flash_fwd" --launch-skip 2 --launch-count 2 \
        --section SpeedOfLight --section WarpStateStats ... python3 scripts/ncu_attention.py
    ncu ... -k regex:"dkdv_kernel|flash_bwd_dq_dk_dv" ... python3 scripts/ncu_attention.py --backward

Each implementation runs once as warm-up (module load, autotuning) and once to be profiled, in the
order omnigen, flash, omnigen, flash, so `--launch-skip 2 --launch-count 2` profiles the second pair.
"""

from __future__ import annotations

import argparse

import torch

import omnigen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--backward", action="store_true", help="also run the backward passes")
    parser.add_argument("--peer", choices=("flash", "cudnn"), default="flash", help="the SDPA backend beside omnigen")
    args = parser.parse_args()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rules = omnigen.Rules(name="causal", modalities={"text": "causal"})
    layout = omnigen.Layout.from_segments([("text", args.seq_len)])
    shape = (args.batch, args.heads, args.seq_len, args.head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=args.backward) for _ in range(3))
    d_out = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    kernel = omnigen.build(rules, head_dim=args.head_dim, dtype=torch.bfloat16)
    for _ in range(2):
        out = kernel(q, k, v, layout)
        if args.backward:
            out.backward(d_out)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION if args.peer == "cudnn" else SDPBackend.FLASH_ATTENTION):
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        if args.backward:
            out.backward(d_out)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
