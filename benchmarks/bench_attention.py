"""The standard attention workload (DESIGN section 7): omnigen against its peers, one process, one GPU.

For each head dim D and sequence length S (batch B = tokens // S), every batch element gets its own
Transfusion-style layout (images of 256 or 1024 tokens between text runs of 16-512 tokens). Timed:

  omnigen        omnigen.attention with the rules (built on first use)
  flex           torch.compile(flex_attention), block mask built beforehand
  sdpa_dense     SDPA with the dense boolean mask [B, 1, S, S] (memory-efficient backend)
  cudnn_dense    SDPA with the dense boolean mask on the cuDNN backend (where it accepts one)
  flash_causal   SDPA flash on the plain causal mask  } a different, cheaper mask: the speed a
  cudnn_causal   SDPA cuDNN on the plain causal mask  } causal-only kernel reaches

Effective TFLOP/s counts only allowed pairs: forward 4 * D * pairs * Hq / t (pairs summed over the
batch); forward+backward uses 3.5x the forward FLOPs. Each time is the median of many runs after
warm-up (triton.testing.do_bench, L2 flushed between runs). Peak memory is the extra memory one
forward+backward allocates. Output: a table on stdout, --json, and --png a plot.

    python benchmarks/bench_attention.py --dims 128 --sizes 8192 32768 --json out.json --png out.png
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import omnigen  # noqa: E402
from omnigen.mask import rule_tensors  # noqa: E402

TRANSFUSION = omnigen.Rules(name="transfusion", modalities={"text": "causal", "image": "full"})
CAUSAL = omnigen.Rules(name="causal", modalities={"text": "causal"})


def transfusion_layout(seq_len: int, rng: random.Random) -> omnigen.Layout:
    segments, used = [], 0
    while used < seq_len:
        text = min(rng.randint(16, 512), seq_len - used)
        segments.append(("text", text))
        used += text
        image = min(rng.choice((256, 1024)), seq_len - used)
        if image:
            segments.append(("image", image))
            used += image
    return omnigen.Layout.from_segments(segments)


def rules_mask_mod(rules: omnigen.Rules, tables) -> Callable:
    """A FlexAttention mask_mod that evaluates DESIGN section 1 from the per-token tables."""
    rt = rule_tensors(rules, tables.token_segment.device)
    segment, modality, document = tables.token_segment, tables.token_modality, tables.token_doc
    see, causal, window = rt["see"], rt["causal"], rt["window"]
    pad = rules.pad_id

    def mask_mod(b, h, q, k):
        sq, sk = segment[b, q], segment[b, k]
        mq, mk = modality[b, q], modality[b, k]
        policy = see[mq, mk]
        own = torch.where(causal[mq], k <= q, True)
        other = torch.where(sk < sq, policy >= 1, policy == 2)
        ok = torch.where(sq == sk, own, other) & (mq != pad) & (mk != pad)
        if rules.isolated_documents:
            ok = ok & (document[b, q] == document[b, k])
        if rules.has_windows:
            ok = ok & ((window[mq] == 0) | (q - k < window[mq]))
        return ok

    return mask_mod


def random_inputs(B: int, heads: int, S: int, dim: int, seed: int) -> tuple[torch.Tensor, ...]:
    """q, k, v (requiring grad) and dO: bf16 [B, heads, S, dim] from a seeded CUDA generator."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(B, heads, S, dim, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
               for _ in range(3))
    return q, k, v, torch.randn(B, heads, S, dim, device="cuda", dtype=torch.bfloat16, generator=gen)


def bench(fn: Callable, grads: list[torch.Tensor] | None = None) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, grad_to_none=grads, return_mode="median")


def peak_extra_memory(fn: Callable) -> float:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def candidates(rules, batch, q, k, v, S):
    """name -> (forward callable, allowed pairs of the mask it computes)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    F = torch.nn.functional
    B = q.shape[0]
    tables = batch.tables(rules, "cuda")
    out: dict[str, tuple[Callable, int]] = {}
    pairs = omnigen.plan(rules, batch, 128, 128, device="cuda").allowed_pairs
    causal_pairs = B * S * (S + 1) // 2

    out["omnigen"] = (lambda: omnigen.attention(q, k, v, batch, rules), pairs)

    block_mask = create_block_mask(rules_mask_mod(rules, tables), B, None, S, S, device="cuda")
    flex = torch.compile(flex_attention, dynamic=False)
    out["flex"] = (lambda: flex(q, k, v, block_mask=block_mask), pairs)

    dense = rules.dense_mask(batch, device="cuda")
    dense = (dense if dense.dim() == 3 else dense[None])[:, None]  # [B, 1, S, S]

    def sdpa_with(backend, **kwargs):
        def run():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, **kwargs)

        return run

    out["sdpa_dense"] = (sdpa_with(SDPBackend.EFFICIENT_ATTENTION, attn_mask=dense), pairs)
    out["cudnn_dense"] = (sdpa_with(SDPBackend.CUDNN_ATTENTION, attn_mask=dense), pairs)
    out["flash_causal"] = (sdpa_with(SDPBackend.FLASH_ATTENTION, is_causal=True), causal_pairs)
    out["cudnn_causal"] = (sdpa_with(SDPBackend.CUDNN_ATTENTION, is_causal=True), causal_pairs)
    return out


def standard_batch(rules, S: int, tokens: int, seed: int) -> tuple[int, omnigen.LayoutBatch]:
    """(B, layouts) of the workload: B = tokens // S elements, each its own Transfusion-style layout for
    TRANSFUSION, one causal text run for the other rules."""
    rng = random.Random(seed)
    B = max(1, tokens // S)
    layout_fn = transfusion_layout if rules is TRANSFUSION else (lambda n, _: omnigen.Layout.from_segments([("text", n)]))
    return B, omnigen.Layout.batch([layout_fn(S, rng) for _ in range(B)])


def measure(rules, dim: int, S: int, tokens: int, heads: int, seed: int) -> list[dict]:
    B, batch = standard_batch(rules, S, tokens, seed)
    q, k, v, d_out = random_inputs(B, heads, S, dim, seed)
    rows = []
    for name, (forward, pairs) in candidates(rules, batch, q, k, v, S).items():
        row = {"rules": rules.name, "impl": name, "D": dim, "S": S, "B": B, "H": heads, "pairs": pairs}
        try:
            forward()  # compile / warm up; may raise where a backend refuses the inputs
            flops = 4.0 * dim * pairs * heads
            fwd_ms = bench(forward)
            both_ms = bench(lambda: forward().backward(d_out), grads=[q, k, v])
            row.update(
                fwd_ms=round(fwd_ms, 4),
                fwd_bwd_ms=round(both_ms, 4),
                fwd_tflops=round(flops / fwd_ms / 1e9, 1),
                fwd_bwd_tflops=round(3.5 * flops / both_ms / 1e9, 1),
                peak_mib=round(peak_extra_memory(lambda: forward().backward(d_out)), 1),
            )
        except Exception as exc:  # a peer that cannot run this shape is reported, not fatal
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
        q.grad = k.grad = v.grad = None
    flex = {(r["D"], r["S"]): r for r in rows if r["impl"] == "flex" and "fwd_ms" in r}
    for r in rows:
        ref = flex.get((r["D"], r["S"]))
        if ref and "fwd_ms" in r:
            r["fwd_vs_flex"] = round(ref["fwd_ms"] / r["fwd_ms"], 2)
            r["fwd_bwd_vs_flex"] = round(ref["fwd_bwd_ms"] / r["fwd_bwd_ms"], 2)
    return rows


TILE_COST = omnigen.Rules(
    name="tile_cost", modalities={"a": "full", "b": "full"}, see={"default": "all", "a -> b": "none"}, documents="shared"
)


def tile_cost(dim: int, S: int, tokens: int, heads: int, seed: int) -> dict:
    """What a partial tile costs against a full one: the same kernel, grid and number of visited tiles.

    One layout is a single `a` segment (every tile full); the other alternates `a` and `b` every 40
    tokens with `a -> b: none`, so every tile mixes allowed and masked pairs (every tile partial).
    """
    B = max(1, tokens // S)
    alternating = [("a" if i % 2 == 0 else "b", 40) for i in range(S // 40)]
    if S % 40:
        alternating.append(("a", S % 40))
    layouts = {
        "full": omnigen.Layout.batch([omnigen.Layout.from_segments([("a", S)])] * B),
        "partial": omnigen.Layout.batch([omnigen.Layout.from_segments(alternating)] * B),
    }
    q, k, v, d_out = random_inputs(B, heads, S, dim, seed)
    row: dict = {"D": dim, "S": S, "B": B, "H": heads}
    for name, layout in layouts.items():
        forward = lambda layout=layout: omnigen.attention(q, k, v, layout, TILE_COST)  # noqa: E731
        forward()
        row[f"{name}_fwd_ms"] = round(bench(forward), 4)
        row[f"{name}_fwd_bwd_ms"] = round(bench(lambda: forward().backward(d_out), grads=[q, k, v]), 4)
        q.grad = k.grad = v.grad = None
    row["partial_over_full_fwd"] = round(row["partial_fwd_ms"] / row["full_fwd_ms"], 3)
    row["partial_over_full_fwd_bwd"] = round(row["partial_fwd_bwd_ms"] / row["full_fwd_bwd_ms"], 3)
    print(json.dumps({"tile_cost": row}), flush=True)
    return row


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dims = sorted({r["D"] for r in rows})
    fig, axes = plt.subplots(len(dims), 2, figsize=(12, 4 * len(dims)), squeeze=False)
    for row_axes, dim in zip(axes, dims):
        for ax, metric, title in zip(row_axes, ("fwd_tflops", "fwd_bwd_tflops"), ("forward", "forward + backward")):
            for impl in sorted({r["impl"] for r in rows}):
                points = sorted((r["S"], r[metric]) for r in rows if r["impl"] == impl and r["D"] == dim and metric in r)
                if points:
                    ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=impl)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{title}, D={dim}, bf16")
            ax.set_ylabel("effective TFLOP/s (allowed pairs only)")
            ax.set_xlabel("sequence length")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dims", type=int, nargs="*", default=[64, 128])
    parser.add_argument("--sizes", type=int, nargs="*", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--tokens", type=int, default=32768, help="B * S per measurement (default 32768)")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--rules", choices=("transfusion", "causal", "both"), default="both")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tile-cost", action="store_true",
                        help="also time an all-partial layout against an all-full one (same tiles, same kernel)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--png", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_attention needs a CUDA GPU")
    torch._dynamo.config.cache_size_limit = 64  # one compiled flex_attention per shape, never eager fallback
    rule_sets = {"transfusion": [TRANSFUSION], "causal": [CAUSAL], "both": [TRANSFUSION, CAUSAL]}[args.rules]
    rows = []
    for rules in rule_sets:
        for dim in args.dims:
            for S in args.sizes:
                rows += measure(rules, dim, S, args.tokens, args.heads, args.seed)
                torch.cuda.empty_cache()

    costs = [tile_cost(dim, 8192, args.tokens, args.heads, args.seed) for dim in args.dims] if args.tile_cost else []

    print(f"\nattention, bf16, H={args.heads}, B*S={args.tokens}, GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    header = ("rules", "impl", "D", "S", "fwd_tflops", "fwd_bwd_tflops", "fwd_vs_flex", "fwd_bwd_vs_flex", "peak_mib")
    print(" | ".join(f"{h:>14}" for h in header))
    for r in rows:
        cells = [r.get(h, r.get("error", "-")[:14] if h == "fwd_tflops" else "-") for h in header]
        print(" | ".join(f"{c!s:>14}" for c in cells))
    for c in costs:
        print(f"tile cost, D={c['D']} S={c['S']}: partial / full = {c['partial_over_full_fwd']} forward, "
              f"{c['partial_over_full_fwd_bwd']} forward+backward")
    if args.json:
        args.json.write_text(json.dumps(
            {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows, "tile_cost": costs}, indent=1
        ))
    if args.png:
        plot(rows, args.png)


if __name__ == "__main__":
    main()
