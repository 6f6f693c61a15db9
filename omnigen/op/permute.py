"""A reordered mask's call (omnigen.reorder, plan/reorder.py): gather q, k, v into the mask's token order, run the
kernels there, scatter the output (and the log-sum-exp) back.

Why the permutation travels in the Mask rather than as an argument of `attention`: a reordered mask's plan is the
permuted sequence's, so running it on tensors in the original order would be a silently wrong answer; carrying the
permutation makes that call impossible, and one object per batch serves every layer's call (no host sync, the same
under torch.compile and CUDA graphs: the permutation is a tensor the mask holds, the gathers are plain torch ops).

The gathers are `index_select` / `gather` along the sequence, which autograd differentiates (their backward adds
each gradient row into its source row: for a permutation, a scatter), so dQ, dK, dV come back in the original order
without code of ours. They work on the [B, S, H, D] view of each tensor: a model's q, k, v are usually that layout
transposed, so each token's heads are one contiguous row to move, and the result has the layout the kernels and the
op's outputs use (heads inner).
"""

from __future__ import annotations

import torch


def gather_tokens(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [B, H, S, ...] with its sequence reordered: out[:, :, i] = x[:, :, index[i]] (index [S]), or per batch
    element with index [B, S]."""
    rows = x.transpose(1, 2)  # [B, S, H, ...]
    if index.dim() == 1:
        return rows.index_select(1, index).transpose(1, 2)
    shape = index.shape + (1,) * (rows.dim() - 2)
    return torch.gather(rows, 1, index.view(shape).expand(rows.shape)).transpose(1, 2)


def gather_lse(lse: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """lse [B, H, S] reordered along its sequence like `gather_tokens`."""
    if index.dim() == 1:
        return lse.index_select(2, index)
    return torch.gather(lse, 2, index[:, None, :].expand(lse.shape))


def into_mask_order(mask, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """q, k, v in the reordered mask's token order."""
    index = mask.permutation
    return gather_tokens(q, index), gather_tokens(k, index), gather_tokens(v, index)


def back_to_original(mask, out: torch.Tensor, lse: torch.Tensor):
    """The call's outputs in the caller's token order (a gather by the inverse is the scatter)."""
    index = mask.inverse_permutation
    return gather_tokens(out, index), gather_lse(lse, index)
