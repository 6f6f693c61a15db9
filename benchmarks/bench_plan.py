"""Planning time and metadata size for S = 4K ... 128K, on the CPU and (with CUDA) on the GPU
side by side with FlexAttention's `create_block_mask` for the same mask, in the same process.

Layouts are Transfusion-style, one document: text runs of 16-72 tokens between 256-token
images, about one segment per 150 tokens. Each timed call plans a *fresh* Layout object, so the
O(S) per-token tables are rebuilt every time, as they would be for each new training batch.

    python benchmarks/bench_plan.py                 # CPU, and GPU if available
    python benchmarks/bench_plan.py --json out.json --sizes 4096 32768
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import omnigen  # noqa: E402

RULES = omnigen.Rules(name="transfusion", modalities={"text": "causal", "image": "full"})
SIZES = (4096, 8192, 16384, 32768, 65536, 131072)


def transfusion_segments(seq_len: int, seed: int = 0) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    segments, used = [], 0
    while used < seq_len:
        for modality, length in (("text", rng.randint(16, 72)), ("image", 256)):
            length = min(length, seq_len - used)
            if length:
                segments.append((modality, length))
                used += length
    return segments


def time_calls(fn, repeats: int, sync=lambda: None) -> float:
    """Median wall time of fn() in milliseconds, after two warm-up calls."""
    return time_alternating({"": fn}, repeats, sync, rounds=1)[""]


def time_alternating(fns: dict, repeats: int, sync, rounds: int = 5) -> dict:
    """Median wall time (ms) of each function over `repeats` calls, taken in `rounds` blocks per
    function in turn: drift of the host and GPU clocks falls on all of them alike, while each block
    (after one untimed call) runs in the steady state of its own function."""
    for fn in fns.values():
        fn()
    sync()
    samples = {name: [] for name in fns}
    per_block = max(1, repeats // rounds)
    for _ in range(rounds):
        for name, fn in fns.items():
            fn()
            sync()
            for _ in range(per_block):
                start = time.perf_counter()
                fn()
                sync()
                samples[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(values) for name, values in samples.items()}


def plan_fresh(segments, device, block=128):
    return omnigen.plan(RULES, omnigen.Layout.from_segments(segments), block, block, device=device)


def flex_block_mask(segments, seq_len, device):
    """create_block_mask for the same Transfusion mask, from per-token tensors already on the GPU."""
    from torch.nn.attention.flex_attention import create_block_mask

    tables = omnigen.Layout.from_segments(segments).tables(RULES, device)
    segment = tables.token_segment[0]
    is_image = tables.token_modality[0] == RULES.modality_id("image")

    def transfusion(b, h, q, k):
        same_image = (segment[q] == segment[k]) & is_image[q]
        return (k <= q) | same_image

    return lambda: create_block_mask(transfusion, None, None, seq_len, seq_len, device=device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="*", default=list(SIZES))
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--json", type=Path, help="write the results here as JSON")
    parser.add_argument("--no-flex", action="store_true", help="skip FlexAttention's create_block_mask")
    args = parser.parse_args()
    import torch  # here, not at the top: plan_memory.py imports transfusion_segments in processes that never use torch

    rows = []
    cuda = torch.cuda.is_available()
    device_name = torch.cuda.get_device_name() if cuda else "none"
    for S in args.sizes:
        segments = transfusion_segments(S)
        p = plan_fresh(segments, "cpu")
        row = {
            "seq_len": S,
            "segments": len(segments),
            "tiles_visited": p.num_tiles,
            "partial_fraction": round(p.partial_fraction, 4),
            "metadata_mb": round(p.nbytes() / 2**20, 3),
            "tables_mb": round(p.tables.nbytes() / 2**20, 3),
            "cpu_ms": round(time_calls(lambda: plan_fresh(segments, "cpu"), max(10, args.repeats // (S // 4096))), 3),
        }
        if cuda:
            sync = torch.cuda.synchronize
            timed = {"gpu_ms": lambda: plan_fresh(segments, "cuda")}
            if not args.no_flex:
                try:
                    make = flex_block_mask(segments, S, "cuda")
                    first = time.perf_counter()
                    make()
                    sync()
                    row["flex_first_call_s"] = round(time.perf_counter() - first, 2)
                    timed["flex_ms"] = make
                except torch.OutOfMemoryError:  # create_block_mask evaluates the mask densely
                    row["flex_ms"] = "out of memory"
                    torch.cuda.empty_cache()
            # Same process, same GPU, blocks of calls interleaved: omnigen's plan and create_block_mask.
            row.update({name: round(ms, 3) for name, ms in time_alternating(timed, args.repeats, sync).items()})
            if "flex_ms" in timed:
                row["speedup_vs_flex"] = round(row["flex_ms"] / row["gpu_ms"], 1)
        rows.append(row)
        print(json.dumps(row), flush=True)

    columns = ["seq_len", "segments", "tiles_visited", "metadata_mb", "cpu_ms"]
    if cuda:
        columns += ["gpu_ms", "flex_ms", "speedup_vs_flex"]
    print(f"\nplanning, block 128x128, torch {torch.__version__}, GPU: {device_name}")
    print(" | ".join(f"{c:>15}" for c in columns))
    for row in rows:
        print(" | ".join(f"{row.get(c, '-')!s:>15}" for c in columns))
    if args.json:
        args.json.write_text(json.dumps({"gpu": device_name, "torch": torch.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
