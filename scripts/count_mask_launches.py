"""Count, on a CPU, what making a mask from a mask_mod would launch and wait for on a GPU: the torch path against the
Triton path (omnigen/plan/classify_gpu.py, run by Triton's interpreter), at the GPU's slab and batch sizes.

A launch: an aten operator that computes (a TorchDispatchMode sees every one; views and allocations excluded) or a
Triton kernel launch. A sync: an operator whose result the host must read (item, nonzero, equal, tolist). The counts do
not depend on the mask's length beyond its slabs, so a short one with the GPU's slab budget scaled down to give the
same number of slabs as the GPU's 8K x 4 (4 slabs) counts what the GPU would launch.

    TRITON_INTERPRET=1 PYTHONPATH=. python3 scripts/count_mask_launches.py --masks global_sliding_window medusa_tree
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from pathlib import Path
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import omnigen  # noqa: E402
from omnigen.mask_catalogue import NAMES, catalogue_mask  # noqa: E402
from omnigen.plan import classify_gpu, from_mod, launch, ruleless, tile_bits  # noqa: E402

METADATA = frozenset(("empty", "empty_strided", "as_strided", "view", "reshape", "_reshape_alias", "_unsafe_view",
                      "unsqueeze", "squeeze", "slice", "select", "expand", "permute", "transpose", "t", "unbind", "split",
                      "alias", "detach", "lift_fresh", "view_as", "expand_as", "narrow", "set_", "split_with_sizes",
                      "_to_copy_meta", "resize_", "split_with_sizes_copy"))
SYNCS = frozenset(("_local_scalar_dense", "nonzero", "equal", "is_nonzero", "item"))


class _Counter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.syncs = 0
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._overloadpacket.__name__
        if not self.paused:
            if name in SYNCS:
                self.syncs += 1
            if name not in METADATA:
                self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def count(make: Callable[[], Any]) -> dict[str, Any]:
    """{launches, syncs, triton, top ops} of one make()."""
    counter = _Counter()
    triton_launches = [0]
    call, tolist = launch.Launcher.__call__, torch.Tensor.tolist

    def launched(self, *args: Any, **kwargs: Any) -> None:  # one launch; the interpreter's own copies not counted
        triton_launches[0] += 1
        counter.paused = True
        try:
            call(self, *args, **kwargs)
        finally:
            counter.paused = False

    def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        counter.syncs += 1
        return tolist(self, *args, **kwargs)

    launch.Launcher.__call__, torch.Tensor.tolist = launched, read
    try:
        with counter:
            make()
    finally:
        launch.Launcher.__call__, torch.Tensor.tolist = call, tolist
    aten = sum(counter.ops.values())
    return {"launches": aten + triton_launches[0], "aten": aten, "triton": triton_launches[0], "syncs": counter.syncs,
            "top": counter.ops.most_common(8), "all": counter.ops}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--masks", nargs="+", default=["global_sliding_window", "random_eviction", "medusa_tree"],
                        choices=NAMES)
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--slabs", type=int, default=4, help="slabs to split the mask into (the GPU's 8K x 4: 4)")
    parser.add_argument("--tiles", default="128x64,128x128")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("set TRITON_INTERPRET=1 (the Triton path runs in Triton's interpreter on a CPU)", file=sys.stderr)
        return 2
    S, B = args.size, args.batch
    tiles = [tuple(int(x) for x in t.split("x")) for t in args.tiles.split(",")]
    # The GPU's sizes: one mod call per slab, batches of packing as large as a GPU's, `--slabs` slabs.
    budget = max(1, B * S * S // args.slabs)
    ruleless.slab_elements = lambda device: budget
    ruleless.pack_elements = tile_bits.pack_elements = lambda device: tile_bits.GPU_PACK_ELEMENTS
    from_mod.CPU_EVAL_ELEMENTS = from_mod.EVAL_ELEMENTS
    for name in args.masks:
        mod = catalogue_mask(name, B, S, "cpu").mask_mod
        make = lambda: omnigen.mask_from_mod(mod, B, S, "cpu", tiles=tiles)  # noqa: E731
        for path, on in (("torch", False), ("triton", True)):
            original = classify_gpu.supported
            classify_gpu.supported = lambda device: on
            try:
                make()  # the interpreter's first call, and every cache
                print(f"{name} S={S} B={B} {path}: {count(make)}", flush=True)
            finally:
                classify_gpu.supported = original
    return 0


if __name__ == "__main__":
    sys.exit(main())
