"""The backward of `omnigen::attention`, registered with `torch.library.register_autograd`.

The forward op's inputs already hold everything the backward needs: the mask's schedules for every tile
shape (the backward runs its own tuned tile shape, which may differ from the forward's) and the token
tables. The backward saves q, k, v, out and lse (none of them tile-specific) and calls
`omnigen::attention_backward`, itself an op, so `torch.compile` (AOTAutograd) sees the backward as one
node too and eager and compiled gradients come from the same kernels.
"""

from __future__ import annotations

import torch

from .library import attention_backward_op, attention_op

# inputs of omnigen::attention, in order (the backward returns one gradient per input)
_INPUTS = ("q", "k", "v", "schedules", "tiles", "token_segment", "token_modality", "token_doc", "kernel", "scale",
           "deterministic")


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, schedules, tiles, token_segment, token_modality, token_doc, kernel, scale, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, token_segment, token_modality, token_doc, *schedules)
    ctx.tiles, ctx.kernel, ctx.scale, ctx.deterministic = list(tiles), kernel, scale, deterministic
    ctx.mark_non_differentiable(lse)


def _backward(ctx, d_out, _d_lse):
    q, k, v, out, lse, token_segment, token_modality, token_doc, *schedules = ctx.saved_tensors
    if d_out is None:  # pragma: no cover - autograd materialises zeros by default
        d_out = torch.zeros_like(out)
    dq, dk, dv = attention_backward_op(d_out, q, k, v, out, lse, schedules, ctx.tiles, token_segment, token_modality,
                                       token_doc, ctx.kernel, ctx.scale, ctx.deterministic)
    # one gradient per input, lists as lists: q, k, v, then none for the schedules and the rest
    return (dq, dk, dv, [None] * len(schedules)) + (None,) * (len(_INPUTS) - 4)


attention_op.register_autograd(_backward, setup_context=_setup_context)
