"""What tuning buys through the public API: a tuned kernel against the default config, same process, same GPU.

For each head dim and sequence length (B = tokens // S, the rules' synthetic layouts -- the ones the
tuner timed on), times forward and forward+backward of

  default   omnigen.build(rules, D, tile=<default tile>)   (pinned: the tuning database is not read)
  tuned     omnigen.build(rules, D)                       (dispatches to the database's choice for S)

with triton.testing.do_bench (L2 flushed, median), alternating default/tuned/default/tuned and
averaging the two medians of each. Run `omnigen build --rules RULES --tune` first.

    python benchmarks/bench_tuned.py --rules examples/rules/transfusion.yaml --dims 64 128 --sizes 8192 32768
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import omnigen  # noqa: E402
from omnigen.tune import layouts as tune_layouts  # noqa: E402
from omnigen.tune import space as tune_space  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rules", default="examples/rules/transfusion.yaml")
    parser.add_argument("--dims", type=int, nargs="*", default=[64, 128])
    parser.add_argument("--sizes", type=int, nargs="*", default=[8192, 32768])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=16)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_tuned needs a CUDA GPU")
    from triton.testing import do_bench

    rules = omnigen.Rules.load(args.rules)
    arch = omnigen.jit.toolchain.visible_gpu_arch()
    print(f"{rules.name}, bf16, H={args.heads}, B*S={args.tokens}, GPU: {torch.cuda.get_device_name()}")
    print(" | ".join(["D", "S", "tuned fwd / bwd tile", "default fwd ms", "tuned fwd ms", "default fwd+bwd ms",
                      "tuned fwd+bwd ms", "fwd+bwd speedup"]))
    for dim in args.dims:
        default_tile = tune_space.default_config(rules, dim, "bf16", arch).tile
        kernels = {"default": omnigen.build(rules, dim, tile=default_tile), "tuned": omnigen.build(rules, dim)}
        if not kernels["tuned"].tuned:
            print(f"d{dim}: nothing tuned for this GPU; run omnigen build --rules {args.rules} --tune")
            continue
        for S in args.sizes:
            batch = omnigen.Layout.batch(tune_layouts.synthetic_batch(rules, S, args.tokens))
            B = batch.batch_size
            q, k, v = (torch.randn(B, args.heads, S, dim, device="cuda", dtype=torch.bfloat16).requires_grad_()
                       for _ in range(3))
            d_out = torch.randn_like(q)
            times = {name: {"fwd": [], "both": []} for name in kernels}
            for _ in range(2):
                for name, kernel in kernels.items():
                    with torch.no_grad():
                        times[name]["fwd"].append(do_bench(lambda: kernel(q, k, v, batch), return_mode="median"))
                    times[name]["both"].append(do_bench(lambda: kernel(q, k, v, batch).backward(d_out),
                                                        grad_to_none=[q, k, v], return_mode="median"))
            mean = {name: {part: sum(ts) / len(ts) for part, ts in parts.items()} for name, parts in times.items()}
            choice = kernels["tuned"].choice(S)
            print(" | ".join(str(cell) for cell in [
                dim, S, f"{choice.forward.tile.label} / {choice.backward.tile.label}",
                f"{mean['default']['fwd']:.3f}", f"{mean['tuned']['fwd']:.3f}",
                f"{mean['default']['both']:.3f}", f"{mean['tuned']['both']:.3f}",
                f"{mean['default']['both'] / mean['tuned']['both']:.3f}x"]), flush=True)
            del q, k, v, d_out
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
