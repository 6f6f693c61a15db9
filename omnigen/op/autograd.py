"""The autograd function behind `Kernel.__call__`: one plan serves the forward and, when the tuner picked
the same tile shape, the backward."""

from __future__ import annotations

from typing import Any

import torch

from ..kernels import family_of
from ..plan import Plan


def has_backward(module: Any) -> bool:
    return bool(getattr(module, "HAS_BACKWARD", hasattr(module, "backward")))


class Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, kernel: Any, layout: Any, choice: Any, p: Plan, scale: float, deterministic: bool):
        out, lse = family_of(choice.forward).forward(kernel.module_for(choice.forward), p, q, k, v, scale)
        # The backward needs only q, k, v, out and lse (not tile-specific), plus the layout to plan for
        # its own tile shape when the tuner gave it a different one.
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kernel, ctx.layout, ctx.choice, ctx.plan = kernel, layout, choice, p
        ctx.scale, ctx.deterministic = scale, deterministic
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, d_out, _d_lse):
        kernel = ctx.kernel
        config = ctx.choice.backward
        module = kernel.module_for(config)
        if not has_backward(module):
            raise RuntimeError(f"{module.MODULE_NAME} has no backward kernel: "
                               f"{getattr(module, 'BACKWARD_PROBLEM', None) or 'rebuild with a newer omnigen'}")
        q, k, v, out, lse = ctx.saved_tensors
        p: Plan = ctx.plan
        if (p.block_m, p.block_n) != (config.tile.block_m, config.tile.block_n):
            p = kernel.plan(ctx.layout, q.shape[0], q.device, config.tile)
        dq, dk, dv = family_of(config).backward(module, p, q, k, v, out, lse, d_out, ctx.scale, ctx.deterministic)
        return dq, dk, dv, None, None, None, None, None, None
