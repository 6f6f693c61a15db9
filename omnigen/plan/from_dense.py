"""`mask_from_dense`: a boolean [B, S, S] or [S, S] mask (Binary Block Masking's input) as a `Mask`.

The mask is read once, a slab of block-rows at a time, for every tile shape: exact counts per tile (allowed pairs,
those above the diagonal, those on or below it) give its kind, and the partial tiles' blocks become bits
(`omnigen.plan.ruleless.classify_shapes`). The mask is planned on
its own device (`device` moves it first): CPU tensors on the CPU, CUDA tensors on the GPU with torch operations.
"""

from __future__ import annotations

from typing import Iterable

import torch

from ..errors import InputError, type_name
from .masks import Mask
from .planners import _check_device
from .ruleless import check_capacity_choice, classify_shapes, ruleless_mask, tile_shapes


def dense_problems(mask: object, name: str = "mask") -> list[str]:
    """Every problem of `mask` as a dense boolean mask [B, S, S] or [S, S]."""
    if not isinstance(mask, torch.Tensor):
        fix = f"torch.from_numpy({name})" if type(mask).__module__ == "numpy" else f"torch.as_tensor({name})"
        return [f"{name} must be a boolean torch.Tensor [B, S, S] or [S, S] (True = may attend), not "
                f"{type_name(mask)} (convert it with {fix})"]
    problems = []
    if mask.dtype != torch.bool:
        problems.append(f"{name} must be torch.bool (True = may attend), not {mask.dtype}; for an additive float mask "
                        f"pass {name} == 0, for 0/1 integers {name}.bool()")
    if mask.dim() not in (2, 3):
        problems.append(f"{name} must have 2 or 3 dimensions ([S, S] or [B, S, S]), got shape {tuple(mask.shape)}; "
                        f"a [B, H, S, S] mask must be the same for every head: pass {name}[:, 0]")
    elif mask.shape[-1] != mask.shape[-2]:
        problems.append(f"{name} must be square in its last two dimensions (queries x keys of one sequence), got "
                        f"shape {tuple(mask.shape)}")
    elif mask.shape[-1] == 0 or (mask.dim() == 3 and mask.shape[0] == 0):
        problems.append(f"{name} is empty (shape {tuple(mask.shape)}): it needs at least one token")
    return problems


def mask_from_dense(
    mask: torch.Tensor,
    *,
    device: torch.device | str | None = None,
    head_dim: int | None = None,
    dtype: torch.dtype | None = None,
    tiles: Iterable[tuple[int, int]] | None = None,
    batch: int | None = None,
    partial_bits: int | str = "exact",
) -> Mask:
    """A `Mask` from a dense boolean mask, [B, S, S] or [S, S] (True: the query may attend to the key).

    Tiles are classified exactly (empty, full, causal where a tile's mask is exactly k <= q, else partial) and every
    partial tile's mask is kept as bits, for the forward and the backward (O(S + partial tiles) memory). `tiles`:
    the (block_m, block_n) shapes to plan; else those kernels may run for `head_dim` / `dtype` (as `omnigen.mask`).
    `device`: where the mask is planned and lives (default: the tensor's). `batch` repeats an [S, S] mask over a
    batch. `partial_bits`: "exact" (default, one slot per partial tile), "all" or a number of slots >= the partial
    tiles (fixed tensor sizes for CUDA graphs)."""
    problems = dense_problems(mask)
    if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int) or batch < 1):
        problems.append(f"batch must be a positive integer, not {batch!r}")
    elif batch is not None and not problems and mask.dim() == 3 and mask.shape[0] != batch:
        problems.append(f"batch={batch}, but mask holds {mask.shape[0]} batch elements")
    if problems:
        raise InputError(problems)
    check_capacity_choice(partial_bits)
    device = _check_device(device) if device is not None else mask.device
    mask = mask.to(device)
    batched = mask.dim() == 3 or (batch is not None and batch > 1)
    if mask.dim() == 2:
        mask = mask[None].expand(batch or 1, -1, -1)  # a view: one [S, S] tensor for every element
    B, S = mask.shape[0], mask.shape[-1]
    shapes = tile_shapes(S, device, tiles, head_dim, dtype)
    plans = classify_shapes(lambda b0, b1, r0, r1: mask[b0:b1, r0:r1], B, S, shapes, device)  # read once
    return ruleless_mask(plans, B, S, batched, device, partial_bits, made_by="mask_from_dense")
