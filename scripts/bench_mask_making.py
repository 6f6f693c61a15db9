"""Time making masks from data (issue 29: "making a mask <= FlexAttention's create_block_mask time for the same mod").

For catalogue masks (omnigen.mask_catalogue) it times `omnigen.mask_from_mod` (and, with --sources, mask_from_dense /
mask_from_intervals) and counts, with torch.profiler, what costs a GPU: aten ops (each a kernel launch or more on
CUDA) and host syncs (aten::item / _local_scalar_dense, aten::nonzero: ops whose result size or value the host must
wait for). On a CPU the op counts are the proxy for the GPU's launch and sync costs; on CUDA the times are the real
thing, beside FlexAttention's create_block_mask when it is importable (--flex).

    PYTHONPATH=. python3 scripts/bench_mask_making.py --sizes 4096 8192 --tokens 8192 --device cpu
    PYTHONPATH=. python3 scripts/bench_mask_making.py --sizes 8192 32768 --tokens 32768 --device cuda --flex \\
        --head-dim 128 --out /tmp/making.json

With --digest it also prints a hash of each mask's schedules and bits, so two versions of the makers can be compared
for bit-identical results.

With --slab-elements it times the same makes with slabs of 2^N pairs for each N given (the makers' budget on the
device: ruleless's slab and from_mod's evaluation call), in alternating rounds, and checks that every budget makes the
bit-identical mask: fewer, larger slabs cost fewer compiled calls and launches on the host, and more memory while
the mask is made.

    PYTHONPATH=. python3 scripts/bench_mask_making.py --sizes 8192 32768 --tokens 32768 --device cuda \
        --masks random_eviction global_sliding_window causal_documents --slab-elements 26 27 28 --no-profile
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import omnigen  # noqa: E402
from omnigen.mask_catalogue import NAMES, catalogue_mask  # noqa: E402
from omnigen.plan import from_mod, ruleless  # noqa: E402

# nonzero_static is no wait: its size is given
SYNC_OPS = ("aten::_local_scalar_dense", "aten::nonzero")
# Ops that only make tensor metadata or memory (no kernel on a GPU).
METADATA_OPS = frozenset(f"aten::{name}" for name in (
    "empty", "empty_strided", "as_strided", "view", "reshape", "_reshape_alias", "_unsafe_view", "unsqueeze", "squeeze",
    "slice", "select", "expand", "permute", "transpose", "t", "unbind", "split", "alias", "detach", "resize_",
    "lift_fresh", "view_as", "expand_as", "narrow", "_to_copy_meta", "set_", "to", "contiguous", "result_type"))
DEFAULT_MASKS = ("causal_documents", "global_sliding_window", "random_eviction", "medusa_tree", "qk_sparse")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(make: Callable[[], Any], device: torch.device, runs: int) -> tuple[float, Any]:
    """(median ms of make() between device syncs, after one untimed call; the last result)."""
    made = make()
    times = []
    for _ in range(runs):
        _sync(device)
        start = time.perf_counter()
        made = make()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), made


def op_counts(make: Callable[[], Any], device: torch.device) -> dict[str, int]:
    """aten ops called by make() (top-level and nested alike) and those of them that make the host wait: item / int /
    bool of a tensor and nonzero (aten ops), and Tensor.tolist (no aten op of its own: counted by wrapping it)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    tolist, calls = torch.Tensor.tolist, [0]

    def counted(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return tolist(self, *args, **kwargs)

    torch.Tensor.tolist = counted
    try:
        with torch.profiler.profile(activities=activities) as prof:
            make()
            _sync(device)
    finally:
        torch.Tensor.tolist = tolist
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    syncs = sum(1 for e in events if e.name in SYNC_OPS) + calls[0]
    # launches: ops that do work themselves, i.e. no aten op below them (views count too: cheap on a GPU, but free
    # of launches only when they do not copy; an upper bound on launches either way)
    leaves = [e for e in events if not any(c.name.startswith("aten::") for c in e.cpu_children)]
    # kernel launches on a GPU, about: ops at the bottom of the call tree that compute (not views or allocations)
    launches = sum(1 for e in leaves if e.name not in METADATA_OPS)
    return {"aten_ops": len(events), "launches": launches, "syncs": syncs}


@contextlib.contextmanager
def slab_budget(log2: int, device: torch.device):
    """Slabs (and, on a GPU, the mod's evaluation calls, compiled or not) of 2^log2 pairs on `device` while inside."""
    names = (("SLAB_ELEMENTS", ruleless), ("CPU_EVAL_ELEMENTS", from_mod)) if device.type == "cpu" else \
        (("GPU_SLAB_ELEMENTS", ruleless), ("EVAL_ELEMENTS", from_mod), ("COMPILED_SLAB_ELEMENTS", from_mod))
    saved = [(module, name, getattr(module, name)) for name, module in names]
    for module, name, _ in saved:
        setattr(module, name, 1 << log2)
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def by_slab_budget(make: Callable[[], Any], device: torch.device, runs: int, budgets: list[int],
                   rounds: int = 3) -> tuple[dict[str, float], bool]:
    """({"2^N": median ms of make() over `rounds` alternating rounds of `runs`}, whether every budget made the same
    mask (digest))."""
    times: dict[int, list[float]] = {n: [] for n in budgets}
    digests = set()
    for n in budgets:  # each budget's first (compiling) call apart
        with slab_budget(n, device):
            digests.add(digest(make()))
    for _ in range(rounds):
        for n in budgets:
            with slab_budget(n, device):
                for _ in range(runs):
                    _sync(device)
                    start = time.perf_counter()
                    make()
                    _sync(device)
                    times[n].append((time.perf_counter() - start) * 1e3)
    return {f"2^{n}": round(statistics.median(t), 2) for n, t in times.items()}, len(digests) == 1


def digest(mask) -> str:
    """A hash of every schedule tensor and bit of a mask: equal digests, bit-identical masks."""
    h = hashlib.sha256()
    for t in mask.schedules:
        h.update(str((t.dtype, tuple(t.shape))).encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    for shape in mask.tiles:
        h.update(str(shape).encode())
        h.update(str(mask.plan(*shape).allowed_pairs).encode())
    return h.hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--masks", nargs="+", default=list(DEFAULT_MASKS), help=f"catalogue names ({', '.join(NAMES)})")
    parser.add_argument("--sizes", nargs="+", type=int, default=[4096, 8192])
    parser.add_argument("--tokens", type=int, default=8192, help="B * S")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tiles", default="128x64,128x128", help="tile shapes, or 'default' (the kernels')")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--sources", nargs="+", default=["mod"], choices=["mod", "dense", "intervals"])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--no-profile", action="store_true", help="skip the op counts")
    parser.add_argument("--digest", action="store_true")
    parser.add_argument("--flex", action="store_true", help="also time FlexAttention's create_block_mask")
    parser.add_argument("--slab-elements", nargs="+", type=int, metavar="N",
                        help="also time slabs of 2^N pairs for each N, in alternating rounds (see above)")
    parser.add_argument("--out", help="write the rows as JSON")
    args = parser.parse_args()
    device = torch.device(args.device)
    tiles = None if args.tiles == "default" else [tuple(int(x) for x in t.split("x")) for t in args.tiles.split(",")]
    rows = []
    for S in args.sizes:
        B = max(1, args.tokens // S)
        for name in args.masks:
            made = catalogue_mask(name, B, S, device)
            for source in args.sources:
                if source == "intervals" and made.intervals is None:
                    continue
                kwargs: dict[str, Any] = {"head_dim": args.head_dim, "dtype": torch.bfloat16}
                if tiles is not None:
                    kwargs["tiles"] = tiles
                if source == "mod":
                    make = lambda: omnigen.mask_from_mod(made.mask_mod, B, S, device, **kwargs)  # noqa: E731
                elif source == "dense":
                    dense = made.dense()
                    make = lambda: omnigen.mask_from_dense(dense, **kwargs)  # noqa: E731
                else:
                    lts, lte, uts, ute = made.intervals
                    make = lambda: omnigen.mask_from_intervals(lts, lte, uts, ute, **kwargs)  # noqa: E731
                ms, mask = timed(make, device, args.runs)
                row: dict[str, Any] = {"mask": name, "source": source, "S": S, "B": B, "tiles": [list(t) for t in mask.tiles],
                                       "make_ms": round(ms, 2),
                                       "partial_tiles": sum(mask.plan(*t).counts()["partial"] for t in mask.tiles)}
                if not args.no_profile:
                    row.update(op_counts(make, device))
                if args.digest:
                    row["digest"] = digest(mask)
                if args.slab_elements:
                    row["make_ms_by_slab"], row["same_mask_every_slab"] = by_slab_budget(
                        make, device, args.runs, args.slab_elements)
                if args.flex and source == "mod":
                    from torch.nn.attention.flex_attention import create_block_mask
                    flex_ms, _ = timed(lambda: create_block_mask(made.mask_mod, B, None, S, S, device=device),
                                       device, args.runs)
                    row["flex_ms"] = round(flex_ms, 2)
                    row["make_vs_flex"] = round(flex_ms / ms, 2)
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
