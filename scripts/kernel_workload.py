"""The pinned-tile scripts' workload and timer, written against omnigen's public API only (build, plan,
Layout, Rules), so that one script times any source tree the same way (PYTHONPATH=tree).

Workload as in docs/measuring.md: B * S = tokens, Transfusion-style layouts (text runs of 16-512 tokens,
images of 256 or 1024), one causal text run per sequence, or one image (every pair allowed); bf16 inputs
from a seeded generator.
Timer: triton.testing.do_bench's median (warm-up 25 ms, 100 ms of runs), as the earlier runs used.
"""
from __future__ import annotations

import random
from typing import Callable

import torch

import omnigen

TRANSFUSION = omnigen.Rules(name="transfusion", modalities={"text": "causal", "image": "full"})
CAUSAL = omnigen.Rules(name="causal", modalities={"text": "causal"})
FULL = omnigen.Rules(name="full", modalities={"image": "full"})  # every pair allowed: full tiles only
RULES = {"transfusion": TRANSFUSION, "causal": CAUSAL, "full": FULL}  # by the scripts' --rules names


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


def standard_batch(rules: omnigen.Rules, S: int, tokens: int, seed: int) -> tuple[int, omnigen.LayoutBatch]:
    """(B, layouts): B = tokens // S sequences, each its own Transfusion layout, or one causal text run (one image
    under the full rules)."""
    rng = random.Random(seed)
    B = max(1, tokens // S)
    modality = "image" if rules is FULL else "text"
    make = transfusion_layout if rules is TRANSFUSION else (lambda n, _: omnigen.Layout.from_segments([(modality, n)]))
    return B, omnigen.Layout.batch([make(S, rng) for _ in range(B)])


def random_inputs(B: int, heads: int, S: int, dim: int, seed: int, heads_kv: int | None = None) -> tuple[torch.Tensor, ...]:
    """q, k, v (requiring grad) and dO, bf16 [B, heads, S, dim] (k and v: heads_kv heads under GQA), never zeros."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(B, h, S, dim, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
               for h in (heads, heads_kv or heads, heads_kv or heads))
    return q, k, v, torch.randn(B, heads, S, dim, device="cuda", dtype=torch.bfloat16, generator=gen)


def bench(fn: Callable) -> float:
    """Median milliseconds of fn."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def with_options(kernel, options: dict):
    """The kernel's variant with these sm90 options (HopperOptions fields, trees with kernel options only): a pinned
    Kernel of its own module."""
    import dataclasses

    from omnigen.jit import cache
    from omnigen.kernels.sm90.options import HopperOptions
    from omnigen.op.kernel import Kernel

    config = dataclasses.replace(kernel.config, options=HopperOptions(**options))
    return Kernel(kernel.rules, config, cache.get_module(kernel.rules, config))


def build(rules: omnigen.Rules, dim: int, tile: omnigen.TileConfig, family: str | None, options: dict | None = None):
    """omnigen.build pinned to a tile (and a kernel family, where this tree knows families); `options` (sm90
    HopperOptions fields) builds that variant of the module (with_options)."""
    if options:
        return with_options(build(rules, dim, tile, family), options)
    if family is None:
        return omnigen.build(rules, dim, torch.bfloat16, tile=tile)
    return omnigen.build(rules, dim, torch.bfloat16, tile=tile, family=family)
