"""A reordered mask's per-call path (omnigen.reorder, plan/reorder.py): gather q, k, v into the mask's token order,
run the kernels there, gather the output (and the log-sum-exp) back.

Why the permutation travels in the Mask rather than as an argument of `attention`: a reordered mask's plan is the
permuted sequence's, so running it on tensors in the original order would be a silently wrong answer; carrying the
permutation makes that call impossible, and one object per batch serves every layer's call (no host sync, the same
under torch.compile and CUDA graphs: the permutation is a tensor the mask holds, the gathers are plain torch ops).

This path costs eight gathers per forward + backward (q, k, v, out; dOut, dQ, dK, dV: 1.77 ms of a 5 ms call at
4 x 16 x 8192 x 128 bf16 on an H100, benchmarks/RESULTS.md). A model that controls its inputs avoids all of them by
permuting its tokens once per batch (`Reordering.token_order()`, whose mask carries no permutation, so this module
is never reached). The gathers themselves (`take_tokens`, and `permute_tokens` whose backward is the gather by the
inverse) live with the permutation in plan/reorder.py, shared by both ways; here they work on the [B, S, H, D] view
of each [B, H, S, D] tensor (dim 2), so each token's heads are one contiguous row to move and the result has the
heads-inner layout the kernels and the op's outputs use.
"""

from __future__ import annotations

import torch

from ..plan.reorder import permute_tokens, take_tokens


def gather_tokens(x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor | None = None) -> torch.Tensor:
    """x [B, H, S, ...] with its sequence reordered: out[:, :, i] = x[:, :, index[i]] (index [S]), or per batch
    element with index [B, S]. With `inverse` (the inverse permutation of `index`, same shape) the backward is the
    gather by `inverse`; without, autograd's general backward of a gather (any index, repeats allowed)."""
    if inverse is not None:
        return permute_tokens(x, index, inverse, 2)
    return take_tokens(x, index, 2)


def gather_lse(lse: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """lse [B, H, S] reordered along its sequence like `gather_tokens`."""
    if index.dim() == 1:
        return lse.index_select(2, index)
    return torch.gather(lse, 2, index[:, None, :].expand(lse.shape))


def into_mask_order(mask, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """q, k, v in the reordered mask's token order."""
    index, inverse = mask.permutation, mask.inverse_permutation
    return gather_tokens(q, index, inverse), gather_tokens(k, index, inverse), gather_tokens(v, index, inverse)


def back_to_original(mask, out: torch.Tensor, lse: torch.Tensor):
    """The call's outputs in the caller's token order (a gather by the inverse is the scatter)."""
    index, inverse = mask.inverse_permutation, mask.permutation
    return gather_tokens(out, index, inverse), gather_lse(lse, index)
