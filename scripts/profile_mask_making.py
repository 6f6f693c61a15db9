"""Where making a mask from a mask_mod spends its time on a GPU: the PyTorch profiler over `omnigen.mask_from_mod`
(and FlexAttention's `create_block_mask` beside it), operators by their GPU time and by their host time, with the
host syncs counted. For issue 29's "making a mask <= create_block_mask".

    PYTHONPATH=. python3 scripts/profile_mask_making.py --masks global_sliding_window causal_documents --size 8192

With --compare-compiled it makes each mask with the mod evaluated eagerly and compiled (mask_from_mod's compile_mod
False / True), checks that the two masks are bit-identical, and times create_block_mask with _compile=True beside its
default; each maker's first call (the compilation) is printed apart.

With --compare-fused it makes each mask twice, through the torch path (plan/classify_gpu.py's ENABLED off) and the
Triton path (on), checks that the two masks are bit-identical, and prints one summary line per maker (ms, launches,
syncs, GPU ms) before the tables (--rows 0: the summaries only).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import omnigen  # noqa: E402
from omnigen.mask_catalogue import NAMES, catalogue_mask  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_mask_making import digest, timed  # noqa: E402
from omnigen.plan import classify_gpu  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--masks", nargs="+", default=["global_sliding_window", "causal_documents"], choices=NAMES)
    parser.add_argument("--size", type=int, default=8192)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--rows", type=int, default=18, help="operators shown per table")
    parser.add_argument("--compare-fused", action="store_true",
                        help="omnigen's torch path and its Triton path (classify_gpu.ENABLED off / on), both checked "
                             "bit-identical, beside create_block_mask")
    parser.add_argument("--compare-compiled", action="store_true",
                        help="the mod evaluated eagerly and compiled (compile_mod False / True), both checked "
                             "bit-identical, beside create_block_mask and create_block_mask(_compile=True)")
    parser.add_argument("--eval-elements", type=int, default=None,
                        help="pairs per slab and per call of the mod on the GPU (ruleless.GPU_SLAB_ELEMENTS and "
                             "from_mod.EVAL_ELEMENTS, default 2^26): fewer slabs, fewer launches of the mod, larger "
                             "temporaries (8 bytes a pair each)")
    args = parser.parse_args(argv)
    if args.eval_elements is not None:
        from omnigen.plan import from_mod, ruleless
        ruleless.GPU_SLAB_ELEMENTS = from_mod.EVAL_ELEMENTS = args.eval_elements
    if not torch.cuda.is_available():
        print("profile_mask_making.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from torch.nn.attention.flex_attention import create_block_mask
    from torch.profiler import ProfilerActivity, profile

    # create_block_mask(_compile=True) compiles once per mod: past Dynamo's default limit of 8 it would fall back
    # to eager and time that instead
    torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
    S, B = args.size, max(1, args.tokens // args.size)
    for name in args.masks:
        mod = catalogue_mask(name, B, S, "cuda").mask_mod

        def omnigen_maker(fused: bool | None, compiled: bool | None = None):
            def make():
                saved = classify_gpu.ENABLED
                classify_gpu.ENABLED = saved if fused is None else fused
                try:
                    return omnigen.mask_from_mod(mod, B, S, "cuda", head_dim=args.head_dim, dtype=torch.bfloat16,
                                                 compile_mod=compiled)
                finally:
                    classify_gpu.ENABLED = saved
            return make

        if args.compare_fused:
            makers = {"omnigen-torch": omnigen_maker(False), "omnigen-triton": omnigen_maker(True)}
        elif args.compare_compiled:
            makers = {"omnigen-eager": omnigen_maker(None, False), "omnigen-compiled": omnigen_maker(None, True)}
        else:
            makers = {"omnigen": omnigen_maker(None)}
        makers["flex"] = lambda: create_block_mask(mod, B, None, S, S, device="cuda")
        if args.compare_compiled:
            makers["flex-compiled"] = lambda: create_block_mask(mod, B, None, S, S, device="cuda", _compile=True)
        firsts = {}
        for who, make in makers.items():  # first calls apart: compilation, kernels, caches
            torch.cuda.synchronize()
            start = time.perf_counter()
            firsts[who] = make()
            torch.cuda.synchronize()
            print(f"== {name} S={S} B={B} {who}: first call {(time.perf_counter() - start) * 1e3:.1f} ms")
        for a, b in (("omnigen-torch", "omnigen-triton"), ("omnigen-eager", "omnigen-compiled")):
            if a in firsts:
                print(f"== {name} S={S} B={B}: {a} and {b} masks bit-identical: "
                      f"{digest(firsts[a]) == digest(firsts[b])}")
        for who, make in makers.items():
            ms, _ = timed(make, torch.device("cuda"), 5)  # after one untimed call: kernels, caches
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                make()
                torch.cuda.synchronize()
            events = prof.key_averages()
            syncs = sum(e.count for e in events if e.key in ("aten::_local_scalar_dense", "aten::nonzero",
                                                               "cudaStreamSynchronize", "cudaDeviceSynchronize"))
            launches = sum(e.count for e in events if "LaunchKernel" in e.key)
            # the kernels themselves (an operator's row repeats its kernels' time)
            gpu_ms = sum(e.device_time for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA) / 1e3
            print(f"== {name} S={S} B={B} {who}: {ms:.2f} ms median of 5; profiled run: {launches} launches, "
                  f"{syncs} syncs, {gpu_ms:.2f} ms of GPU time")
            for sort in ("self_cuda_time_total", "self_cpu_time_total") if args.rows > 0 else ():
                print(events.table(sort_by=sort, row_limit=args.rows, max_name_column_width=50))
    return 0


if __name__ == "__main__":
    sys.exit(main())
