"""Time forward + backward with and without `omnigen.reorder` on fragmented masks (issue 29 item 4), on one GPU.

Three masks, as FlexAttention-style mask_mods made into omnigen masks on the GPU:

- `medusa`: a causal prefix (an eighth of the sequence), then MEDUSA-style candidate trees laid out level by level,
  each level one run per tree: each tree token sees the prefix and its ancestors. At 128 x 128 tiles this is
  compact already (a tile row of nodes touches ~5 tiles of the trees), and reorder declines: the control;
- `medusa_interleaved`: the same trees with the nodes of a level interleaved across trees (the i-th node of every
  tree, then the (i+1)-th), so a tile's ancestors lie in every tile of the level above: fragmented;
- `frames`: interleaved audio and video frames (lengths not multiples of a tile), each modality sees its own frame
  and its own earlier frames within a window of token positions, nothing of the other.

For each mask and S (B * S = --tokens) it reports the reorder decision and the model's estimate, the visited tiles
per kind of both plans, and the median milliseconds of forward + backward of

- `plain`: the call in token order with the original mask;
- `reordered`: the per-call way, `omnigen.attention(q, k, v, found.mask)` with its 8 gathers (q, k, v, out; dOut,
  dQ, dK, dV), and `gathers`: those 8 alone;
- `permuted`: the permute-once way (`found.token_order()`): q, k, v and dOut already in the mask's order (a model
  whose inputs were permuted once per batch computes them there), `order.mask`, no gathers at all;
- `permute_once`: what the permute-once way pays per training step instead: one permutation of a [B, S, d_model]
  activation, forward and backward (`--d-model`, default heads x dim). A model permutes its token ids, positions and
  labels (integers, negligible) or one activation once per step, however many layers it has, so the per-layer
  figure is `permuted + permute_once / L`, reported for each L of `--layers` (L = 1 is the worst case: a
  single attention layer pays the whole permutation).

The reordered calls are timed even when reorder declines (its best proposal, `ReorderCosts(min_gain=0)`), so the
numbers calibrate the cost model's constants (omnigen.plan.reorder.ReorderCosts). All run in the same process,
interleaved round-robin.

Issue 29 asks for >= 1.3x on the fragmented masks (medusa_interleaved, frames) at 8K and 32K, gathers counted:

    PYTHONPATH=. OMNIGEN_CACHE_DIR=/tmp/og python3 scripts/bench_reorder.py --sizes 8192 32768 --dim 128 \\
        --layers 1 12 --out reorder.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import omnigen  # noqa: E402
from omnigen.op.permute import gather_tokens  # noqa: E402
from omnigen.plan.reorder import ReorderCosts  # noqa: E402

DEPTH = 4  # MEDUSA heads: tree levels below the root


def medusa_mod(S: int, device: torch.device, seed: int = 0, interleaved: bool = False):
    """A causal prefix of S/8 tokens, then trees of DEPTH levels (widths x4 per level, random parents) laid out level
    by level over the rest; each tree token sees the prefix and its ancestors (an ancestor table [S, DEPTH + 1], no
    S x S tensor). Within a level the trees' nodes are one run per tree (`interleaved=False`: tree t's level-L nodes,
    then tree t+1's), or interleaved (`interleaved=True`: the i-th node of every tree, then the (i+1)-th), so that a
    tile of nodes has its ancestors spread over every tile of the levels above."""
    gen = torch.Generator().manual_seed(seed)
    prefix = S // 8
    ancestors = torch.full((S, DEPTH + 1), -1, dtype=torch.int64)
    widths = [4 ** level for level in range(DEPTH + 1)]
    per_tree = sum(widths)
    trees = (S - prefix) // per_tree
    position = prefix
    level_start = []
    for level, width in enumerate(widths):  # level by level, every tree's nodes of that level together
        level_start.append(position)
        position += width * trees

    def at(level: int, tree: int, index: int) -> int:
        offset = index * trees + tree if interleaved else tree * widths[level] + index
        return level_start[level] + offset

    for level, width in enumerate(widths):
        for t in range(trees):
            for i in range(width):
                node = at(level, t, i)
                ancestors[node, 0] = node
                if level:
                    parent = at(level - 1, t, int(torch.randint(0, widths[level - 1], (1,), generator=gen)))
                    ancestors[node, 1:] = ancestors[parent, :-1]
    last = position  # tokens past the trees: causal text after them (they see everything before)
    table = ancestors.to(device)

    def mod(b, h, q, k):
        in_tree = (q >= prefix) & (q < last)
        sees_ancestor = (table[q.clamp(max=S - 1)] == k[..., None]).any(-1)
        tree_rule = (k < prefix) | sees_ancestor
        return torch.where(in_tree, tree_rule, k <= q)

    return mod


def medusa_interleaved_mod(S: int, device: torch.device, seed: int = 0):
    """`medusa_mod` with the trees interleaved inside each level."""
    return medusa_mod(S, device, seed, interleaved=True)


def frames_mod(S: int, device: torch.device, audio: int = 80, video: int = 176, window: int = 4096):
    """Interleaved audio / video frames; a token sees its own frame and its modality's earlier frames within
    `window` positions."""
    pattern = torch.cat([torch.zeros(audio, dtype=torch.int64), torch.ones(video, dtype=torch.int64)])
    reps = -(-S // pattern.numel())
    kind = pattern.repeat(reps)[:S].to(device)
    frame = (torch.arange(S, device=device) // pattern.numel()) * 2 + kind

    def mod(b, h, q, k):
        same_kind = kind[q] == kind[k]
        return same_kind & ((frame[q] == frame[k]) | ((k < q) & (q - k < window)))

    return mod


MASKS = {"medusa": medusa_mod, "medusa_interleaved": medusa_interleaved_mod, "frames": frames_mod}


def median_ms(fns: dict, rounds: int, reps: int) -> dict[str, float]:
    """Median milliseconds of each function, interleaved round-robin, CUDA events around `reps` calls."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():  # warm-up
        fn()
    torch.cuda.synchronize()
    for _ in range(rounds):
        for name, fn in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            torch.cuda.synchronize()
            times[name].append(start.elapsed_time(end) / reps)
    return {name: statistics.median(values) for name, values in times.items()}


def counts(mask: omnigen.Mask) -> dict[str, int]:
    return mask.plan(*mask.tiles[0]).counts()


def run_one(name: str, S: int, args) -> dict:
    device = torch.device("cuda")
    B = max(1, args.tokens // S)
    dtype = torch.bfloat16
    mod = MASKS[name](S, device)
    made = time.perf_counter()
    mask = omnigen.mask_from_mod(mod, B, S, device=device, head_dim=args.dim, dtype=dtype)
    made = time.perf_counter() - made
    took = time.perf_counter()
    decision = omnigen.reorder(mask, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.dim, dtype=dtype,
                               granularity=args.granularity)
    took = time.perf_counter() - took
    # The decision when the model permutes once per step (gathers priced per step over the most layers asked for).
    once = omnigen.reorder(mask, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.dim, dtype=dtype,
                           granularity=args.granularity, layers=max(args.layers))
    forced = decision if decision else omnigen.reorder(
        mask, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.dim, dtype=dtype, granularity=args.granularity,
        costs=ReorderCosts(min_gain=0.0))
    row = {"mask": name, "S": S, "B": B, "heads": args.heads, "kv_heads": args.kv_heads or args.heads, "dim": args.dim,
           "accepted": bool(decision), "reason": decision.reason, "method": forced.method,
           "accepted_permute_once": bool(once), "permute_once_reason": once.reason,
           "estimated_gain": forced.gain, "costs": {f"{m}x{n}": c for (m, n), c in forced.costs.items()},
           "mask_s": round(made, 3), "reorder_s": round(took, 3), "plain_tiles": counts(mask),
           "reordered_tiles": counts(forced.mask) if forced.mask is not None else None}
    print(f"{name} S={S} B={B}: {decision!r} (mask {made:.2f} s, reorder {took:.2f} s); permuting once for "
          f"{max(args.layers)} layers: {once!r}", flush=True)
    if forced.mask is None:
        return row
    gen = torch.Generator(device=device).manual_seed(0)
    Hkv = args.kv_heads or args.heads
    q = torch.randn(B, S, args.heads, args.dim, device=device, dtype=dtype, generator=gen).transpose(1, 2)
    k, v = (torch.randn(B, S, Hkv, args.dim, device=device, dtype=dtype, generator=gen).transpose(1, 2)
            for _ in range(2))
    for t in (q, k, v):
        t.requires_grad_()
    d_out = torch.randn(B, args.heads, S, args.dim, device=device, dtype=dtype, generator=gen)

    def step(which):
        def call():
            out = omnigen.attention(q, k, v, which)
            torch.autograd.grad(out, (q, k, v), d_out)
        return call

    index = forced.mask.permutation
    big = [torch.randn(B, S, args.heads, args.dim, device=device, dtype=dtype).transpose(1, 2) for _ in range(4)]
    small = [torch.randn(B, S, Hkv, args.dim, device=device, dtype=dtype).transpose(1, 2) for _ in range(4)]

    def gathers():  # the 8 gathers / scatters a reordered forward + backward adds
        for t in big + small:
            gather_tokens(t, index)

    # The permute-once way: the same q, k, v, dOut moved into the mask's order before timing (a model computes them
    # there from inputs permuted once per batch), run with the mask that carries no permutation.
    order = forced.token_order()
    qp, kp, vp = (order.permute(t.detach(), dim=2).requires_grad_() for t in (q, k, v))
    d_out_p = order.permute(d_out, dim=2)

    def permuted():
        out = omnigen.attention(qp, kp, vp, order.mask)
        torch.autograd.grad(out, (qp, kp, vp), d_out_p)

    d_model = args.d_model or args.heads * args.dim
    activation = torch.randn(B, S, d_model, device=device, dtype=dtype, requires_grad=True)
    d_activation = torch.randn(B, S, d_model, device=device, dtype=dtype)

    def permute_once():  # one [B, S, d_model] activation into the mask's order: its forward and its backward
        torch.autograd.grad(order.permute(activation), activation, d_activation)

    with torch.no_grad():
        plain_out = omnigen.attention(q, k, v, mask)
        reordered_out = omnigen.attention(q, k, v, forced.mask)
        permuted_out = order.unpermute(omnigen.attention(qp, kp, vp, order.mask), dim=2)
    row["max_abs_difference"] = float((plain_out.float() - reordered_out.float()).abs().max())
    row["max_abs_difference_permuted"] = float((plain_out.float() - permuted_out.float()).abs().max())
    ms = median_ms({"plain": step(mask), "reordered": step(forced.mask), "gathers": gathers, "permuted": permuted,
                    "permute_once": permute_once}, args.rounds, args.reps)
    row.update({f"{key}_ms": round(value, 4) for key, value in ms.items()})
    row["d_model"] = d_model
    row["measured_speedup"] = round(ms["plain"] / ms["reordered"], 3)
    row["permuted_speedup"] = round(ms["plain"] / ms["permuted"], 3)  # the kernels' gain alone
    # per attention layer of an L-layer model that permutes once per step
    row["model_speedup"] = {str(L): round(ms["plain"] / (ms["permuted"] + ms["permute_once"] / L), 3)
                            for L in args.layers}
    per_layer = ", ".join(f"L={L}: {x:.2f}x" for L, x in row["model_speedup"].items())
    print(f"  plain {ms['plain']:.3f} ms; per-call gathers {ms['reordered']:.3f} ms (gathers {ms['gathers']:.3f} ms): "
          f"{row['measured_speedup']:.2f}x measured, {forced.gain:.2f}x estimated", flush=True)
    print(f"  permute once: attention {ms['permuted']:.3f} ms ({row['permuted_speedup']:.2f}x), one [B, S, {d_model}] "
          f"permutation fwd+bwd {ms['permute_once']:.3f} ms per step; per layer {per_layer}", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--masks", nargs="+", default=list(MASKS), choices=list(MASKS))
    parser.add_argument("--sizes", nargs="+", type=int, default=[8192, 16384, 32768])
    parser.add_argument("--tokens", type=int, default=32768, help="B * S")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=None)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--granularity", type=int, default=None, help="tokens per atom of reorder's graph")
    parser.add_argument("--layers", nargs="+", type=int, default=[1, 12],
                        help="attention layers a model's one permutation per step is divided over (permute-once)")
    parser.add_argument("--d-model", type=int, default=None,
                        help="width of the activation permuted once per step (default heads x dim)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--pytorch-gathers", action="store_true",
                        help="gather tokens with PyTorch's index_select / indexing only, not omnigen/plan/row_gather.py's "
                             "Triton kernel (to time one against the other)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    if any(L < 1 for L in args.layers):
        parser.error("--layers takes positive layer counts")
    if not torch.cuda.is_available():
        raise SystemExit("bench_reorder needs a CUDA GPU")
    from omnigen.plan import row_gather
    row_gather.ENABLED = not args.pytorch_gathers
    rows = [run_one(name, S, args) for name in args.masks for S in args.sizes]
    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "row_gather": row_gather.ENABLED,
            "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(info, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
