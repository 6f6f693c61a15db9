"""Host time of one attention call: how long the CPU takes to enqueue it, against SDPA (cuDNN) and FlexAttention.

    python benchmarks/host_time.py                          # the two shapes of issue 26, eager and compiled
    python benchmarks/host_time.py --shapes 1x16x8192x128 --reps 50 --json host.json
    OMNIGEN_NATIVE=0 python benchmarks/host_time.py         # omnigen's Python call path, for comparison

What is timed (per call, from bursts of `--burst` calls back to back with no synchronisation, median of `--reps`):
  forward           out = attention(q, k, v, ...) with q/k/v requiring grad (what a training step's forward runs)
  forward+backward  the forward, then out.backward(d_out)
  compiled step     a compiled block of `--layers` layers (projections, attention, residual): forward + backward
Before each burst the GPU is given a sleep kernel long enough that the host never waits for it, so the figure is
the host's alone, in the steady state of a training loop (a synchronisation before every single call made each call
2-3x slower on the H100 machine's virtual CPU, peers alike). The peers' bursts take turns, so a drift in the host's
speed falls on all of them alike. Figures are wall time and the process's CPU time (all threads: the autograd engine
runs the backward on its own). Masks are made beforehand (omnigen.mask, create_block_mask): per-call cost only.

Peers, in the same process on the same GPU: omnigen (Transfusion rules, a mask), SDPA on the cuDNN backend with the
plain causal mask, and compiled flex_attention with the Transfusion block mask.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import omnigen  # noqa: E402
from omnigen.bench import rules_mask_mod  # noqa: E402
from omnigen.tune import layouts as tune_layouts  # noqa: E402

RULES = Path(__file__).resolve().parent.parent / "examples" / "rules" / "transfusion.yaml"
DEFAULT_SHAPES = ("1x16x8192x128", "4x8x4096x64")  # B x H x S x D
SLEEP_CYCLES = 200_000_000  # ~100 ms at 2 GHz: longer than any burst's host time here


def _parse_shape(text: str) -> tuple[int, int, int, int]:
    parts = [int(p) for p in text.lower().split("x")]
    if len(parts) != 4:
        raise argparse.ArgumentTypeError(f"a shape is BxHxSxD, e.g. 1x16x8192x128; not {text!r}")
    return tuple(parts)  # type: ignore[return-value]


def host_times(calls: dict[str, Callable[[], object]], reps: int, burst: int, warmup: int = 3) -> dict[str, dict]:
    """Host time of one call of each, as a training loop sees it: the GPU is given a sleep kernel long enough that
    the host never waits for it, then `burst` calls run back to back and their time is divided by `burst`. Wall
    (perf_counter) and CPU time (process_time: every thread, the autograd engine's included), medians over `reps`
    bursts in microseconds. The calls take turns, one burst of each at a time, so a drift of the host's speed falls
    on all of them alike."""
    for call in calls.values():
        for _ in range(warmup):
            call()
    torch.cuda.synchronize()
    wall: dict[str, list[float]] = {name: [] for name in calls}
    cpu: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(reps):
        for name, call in calls.items():
            torch.cuda._sleep(SLEEP_CYCLES)
            start_cpu, start = time.process_time(), time.perf_counter()
            for _ in range(burst):
                call()
            wall[name].append((time.perf_counter() - start) / burst)
            cpu[name].append((time.process_time() - start_cpu) / burst)
            torch.cuda.synchronize()
    return {name: {"wall_us": statistics.median(wall[name]) * 1e6, "cpu_us": statistics.median(cpu[name]) * 1e6}
            for name in calls}


def profile(call: Callable[[], object], reps: int, top: int = 25) -> str:
    """cProfile of `reps` calls, the `top` functions by their own time: where the host time goes."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(reps):
        call()
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


class Block(torch.nn.Module):
    """`layers` of: x + out_proj(attention(q, k, v)), q/k/v from one projection (what the compiled step times)."""

    def __init__(self, heads: int, dim: int, layers: int, attend: Callable) -> None:
        super().__init__()
        width = heads * dim
        self.heads, self.dim, self.attend = heads, dim, attend
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(width, 3 * width, bias=False) for _ in range(layers))
        self.out = torch.nn.ModuleList(torch.nn.Linear(width, width, bias=False) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, width = x.shape
        for qkv, out in zip(self.qkv, self.out):
            q, k, v = qkv(x).view(B, S, 3, self.heads, self.dim).permute(2, 0, 3, 1, 4)
            x = x + out(self.attend(q, k, v).transpose(1, 2).reshape(B, S, width))
        return x


def peers(rules: omnigen.Rules, B: int, H: int, S: int, D: int) -> dict[str, Callable]:
    """attention(q, k, v) per peer, each with its mask made beforehand."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    layouts = omnigen.Layout.batch(tune_layouts.synthetic_batch(rules, S, B * S, seed=0))
    mask = omnigen.mask(rules, layouts, device="cuda", head_dim=D, dtype=torch.bfloat16)
    tables = layouts.tables(rules, "cuda")
    block_mask = create_block_mask(rules_mask_mod(rules, tables), B, None, S, S, device="cuda")
    flex = torch.compile(flex_attention)

    def cudnn(q, k, v):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    return {
        "omnigen": lambda q, k, v: omnigen.attention(q, k, v, mask),
        "cudnn_causal": cudnn,
        "flex": lambda q, k, v: flex(q, k, v, block_mask=block_mask),
    }


def measure(shape: tuple[int, int, int, int], reps: int, burst: int, layers: int, compiled: bool,
            profile_reps: int = 0) -> list[dict]:
    B, H, S, D = shape
    rules = omnigen.Rules.load(RULES)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, d_out = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_()
    x = torch.randn(B, S, H * D, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
    calls: dict[tuple[str, str], Callable[[], object]] = {}
    for name, attend in peers(rules, B, H, S, D).items():
        calls[name, "forward"] = lambda attend=attend: attend(q, k, v)
        calls[name, "forward_backward"] = lambda attend=attend: attend(q, k, v).backward(d_out)
        if compiled:
            step_model = torch.compile(Block(H, D, layers, attend).to("cuda", torch.bfloat16))
            calls[name, "compiled_step"] = lambda step_model=step_model: step_model(x).sum().backward()
    figures = host_times(calls, reps, burst)
    rows = []
    for name in dict.fromkeys(peer for peer, _ in calls):
        row: dict = {"peer": name, "B": B, "H": H, "S": S, "D": D, "compiled_layers": layers if compiled else 0}
        for (peer, what), f in figures.items():
            if peer == name:
                row[f"{what}_us"], row[f"{what}_cpu_us"] = f["wall_us"], f["cpu_us"]
        rows.append(row)
        print(f"  {name:13s} " + "  ".join(f"{k[:-3]} {v:8.1f}" for k, v in row.items() if k.endswith("_us")),
              flush=True)
    if profile_reps:
        for what in ("forward", "forward_backward"):
            print(f"-- cProfile, omnigen {what}, {profile_reps} calls")
            print(profile(calls["omnigen", what], profile_reps))
        if compiled:
            for peer in ("omnigen", "cudnn_causal"):
                print(f"-- host ops of the compiled step, {peer}, {profile_reps} steps")
                print(host_ops(calls[peer, "compiled_step"], profile_reps))
                print(f"-- cProfile, compiled step, {peer}, {profile_reps} steps")
                print(profile(calls[peer, "compiled_step"], profile_reps, top=15))
    return rows


def host_ops(call: Callable[[], object], reps: int, top: int = 22) -> str:
    """The PyTorch profiler's CPU side of `reps` calls: operators and CUDA runtime calls by their own host time,
    with counts (where a compiled step's host time goes below Python: launches, allocations, copies)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    torch.cuda._sleep(SLEEP_CYCLES)
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            call()
    torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=60)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", type=_parse_shape, default=[_parse_shape(s) for s in DEFAULT_SHAPES],
                        help="BxHxSxD shapes (default: %(default)s)")
    parser.add_argument("--reps", type=int, default=15, help="timed bursts per figure (median)")
    parser.add_argument("--burst", type=int, default=8,
                        help="calls per burst, back to back behind one GPU sleep (few enough that the launch queue "
                             "never fills)")
    parser.add_argument("--layers", type=int, default=4, help="layers of the compiled step")
    parser.add_argument("--no-compiled", action="store_true", help="skip the compiled step")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also print cProfile's top functions over N omnigen calls (forward, forward+backward), "
                             "and for the compiled step of omnigen and cuDNN the profiler's host operators and cProfile")
    parser.add_argument("--json", type=Path, help="write every figure here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("host_time.py needs a CUDA GPU", file=sys.stderr)
        return 2
    try:
        from omnigen.op import native
    except ImportError:  # an omnigen from before the native call path (timed as a baseline)
        native = None

    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
            "omnigen_native": None}
    rows = []
    for shape in args.shapes:
        print(f"B={shape[0]} H={shape[1]} S={shape[2]} D={shape[3]} (host µs, median of {args.reps})", flush=True)
        rows += measure(shape, args.reps, args.burst, args.layers, not args.no_compiled, args.profile)
        info["omnigen_native"] = native is not None and native.loaded()
    why = "not in this omnigen" if native is None else native.problem()
    print(f"omnigen native call path: {'on' if info['omnigen_native'] else f'off ({why})'}")
    for shape in args.shapes:
        B, H, S, D = shape
        by_peer = {r["peer"]: r for r in rows if (r["B"], r["H"], r["S"], r["D"]) == shape}
        base = by_peer.get("cudnn_causal")
        if base and "omnigen" in by_peer:
            ratios = ", ".join(f"{k[:-3]} {by_peer['omnigen'][k] / base[k]:.2f}x" for k in base
                               if k.endswith("_us") and not k.endswith("cpu_us"))
            print(f"{B}x{H}x{S}x{D}: omnigen / SDPA cuDNN host time: {ratios}")
    if args.json:
        args.json.write_text(json.dumps({"info": info, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
