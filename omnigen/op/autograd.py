"""The backward of `omnigen::attention`, registered with `torch.library.register_autograd`.

The forward op's inputs already hold everything the backward needs: the mask's schedules for every tile
shape (the backward runs its own tuned tile shape, which may differ from the forward's) and the token
tables. The backward saves q, k, v, out and lse (none of them tile-specific) and calls
`omnigen::attention_backward`, itself an op, so `torch.compile` (AOTAutograd) sees the backward as one
node too and eager and compiled gradients come from the same kernels.

This formula is the ops' autograd on CPU and meta tensors, and on CUDA tensors where the op shim is not loaded.
The shim (op/native/ops.cpp) registers the same formula in C++ for CUDA tensors, where it takes precedence: the
Python one sits between the dispatcher and the kernel on every call, compiled graphs included.

In eager mode without the shim `omnigen.attention` goes through `EagerAttention`, a plain autograd.Function around
the same two ops: torch.library's Python autograd layer cost ~130 us of host time a forward on top of a Function's
~30 (RESULTS.md, 2026-11-24). The ops, their kernels and the saved tensors are the same every way.
"""

from __future__ import annotations

import torch

from ..plan.masks import PER_SHAPE
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
    ctx.set_materialize_grads(False)  # lse has no gradient: no zeros made for it (a fill launch every backward)


def _gradients(ctx, d_out) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v, out, lse, token_segment, token_modality, token_doc, *schedules = ctx.saved_tensors
    if d_out is None:  # the output was not used (grads are not materialised)
        d_out = torch.zeros_like(out)
    return _ATTENTION_BACKWARD(d_out, q, k, v, out, lse, schedules, ctx.tiles, token_segment, token_modality,
                               token_doc, ctx.kernel, ctx.scale, ctx.deterministic)


def _backward(ctx, d_out, _d_lse):
    dq, dk, dv = _gradients(ctx, d_out)
    # one gradient per input, lists as lists: q, k, v, then none for the schedules (PER_SHAPE a tile shape), the rest
    return (dq, dk, dv, [None] * (PER_SHAPE * (len(ctx.tiles) // 2))) + (None,) * (len(_INPUTS) - 4)


attention_op.register_autograd(_backward, setup_context=_setup_context)
# The ops' overloads, called without the custom-op objects' Python wrappers.
ATTENTION = torch.ops.omnigen.attention.default
_ATTENTION_BACKWARD = torch.ops.omnigen.attention_backward.default
_BelowAutograd = torch._C._AutoDispatchBelowAutograd


class EagerAttention(torch.autograd.Function):
    """`omnigen::attention` with a plain Function's autograd (eager calls; see the module docstring). Takes the
    op's inputs in the op's order and returns (out, lse). Its forward takes `ctx` itself: a Function with a separate
    setup_context has every call's arguments bound to the forward's signature by `inspect` (tens of microseconds)."""

    @staticmethod
    def forward(ctx, *inputs):
        # This Function is the autograd (CPU tensors, or CUDA without the shim, whose C++ autograd kernel.py calls
        # instead): the op is dispatched below the autograd keys, where torch.library's Python autograd layer would
        # only step aside. A dispatch mode still sees the op: the Python key is below autograd.
        with _BelowAutograd():
            output = ATTENTION(*inputs)
        _setup_context(ctx, inputs, output)
        return output

    @staticmethod
    def backward(ctx, d_out, _d_lse):
        with _BelowAutograd():
            gradients = _gradients(ctx, d_out)
        return gradients + (None,) * (len(_INPUTS) - 3)  # none for the non-tensor inputs
