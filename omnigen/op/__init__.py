"""The differentiable op: `build` a kernel for the rules, call it (or `attention`) like a function.

    kernel = omnigen.build(rules, head_dim=128, dtype=torch.bfloat16)
    out = kernel(q, k, v, layout)                        # q [B, Hq, S, D], k/v [B, Hkv, S, D]
    out = omnigen.attention(q, k, v, layout, rules)      # builds on first use, cached in-process
"""

from .kernel import Kernel, attention, build, forget_kernels

__all__ = ["Kernel", "attention", "build", "forget_kernels"]
