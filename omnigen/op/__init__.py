"""The differentiable op: `build` a kernel for the rules, call it (or `attention`) like a function.

    kernel = omnigen.build(rules, head_dim=128, dtype=torch.bfloat16)
    out = kernel(q, k, v, layout)                        # q [B, Hq, S, D], k/v [B, Hkv, S, D]
    out = omnigen.attention(q, k, v, layout, rules)      # builds on first use, cached in-process
    mask = omnigen.mask(rules, layout, device="cuda")    # once per batch; then no host sync per call
    out = omnigen.attention(q, k, v, mask)

`library` defines the torch.library ops (`torch.ops.omnigen.attention`, `.attention_backward`),
`autograd` registers the backward, `checks` the argument checks, `kernel` the user-facing functions, `cpu` what
the ops run on CPU tensors (a plan-driven PyTorch path, for tests and debugging).
"""

from ..plan.from_dense import mask_from_dense
from ..plan.from_intervals import mask_from_intervals
from ..plan.from_mod import mask_from_mod
from ..plan.reorder import reorder
from .kernel import Kernel, attention, build, candidate_tile_shapes, forget_kernels, kernel_for, mask

# The makers of masks from data live in omnigen.plan; the public names come from here, so that using one loads the
# op layer, which tells the makers the kernels' tile shapes (plan.ruleless.set_default_tiles).
__all__ = ["Kernel", "attention", "build", "candidate_tile_shapes", "forget_kernels", "kernel_for", "mask",
           "mask_from_dense", "mask_from_intervals", "mask_from_mod", "reorder"]
