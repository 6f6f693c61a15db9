"""The sm80 family: mma.sync, ldmatrix and cp.async (Ampere and Ada; on Hopper, sm_90 and the sm_90a variants the
sm90 family has no backward for).

`resources` says which variants fit, `space` which tiles the tuner tries; templates/ and
include/omnigen/sm80/ hold the CUDA. A built module is launched through the shared binding (kernels/launch.py).
"""

from __future__ import annotations

from typing import Any

from ...targets import KernelConfig
from ..family import KernelFamily
from . import resources, space


class Sm80Family(KernelFamily):
    name = "sm80"
    sources = {"kernel": "forward.cu.j2", "backward": "backward.cu.j2", "shared": "shared.cuh.j2"}
    forward_kernel = "forward_kernel"
    backward_kernel = "dkdv_kernel"  # the tuned backward (atomic dQ) is this kernel plus the small Delta one
    resources = resources
    space = space

    def render_context(self, config: KernelConfig) -> dict[str, Any]:
        r = resources.Resources(config)
        t = config.tile
        backward_problems = r.backward_problems()
        problem = ((f"this variant ({config.label}) has no backward kernel: " + "; ".join(backward_problems)).replace('"', "'")
                   if backward_problems else "")
        return {
            "warps": t.warps,
            "stages": t.stages,
            "shared_bytes": r.shared_memory_bytes,
            "keys_per_step": r.keys_per_step,
            "keys_per_step_reason": (
                "The whole kv-tile at once." if r.keys_per_step == t.block_n else
                f"Half-tiles: {t.block_n} keys of fp32 scores would not fit in registers beside "
                f"{t.block_m // t.warps} rows x {config.head_dim} outputs per warp (ptxas spills)."
            ),
            # mma_backward: this template renders its backward kernels; backward_supported: the module has a
            # backward (the binding's flag).
            "mma_backward": not backward_problems,
            "backward_supported": not backward_problems,
            "mma_backward_problem": problem,
            "ordered_dq": False,  # deterministic mode: the dQ kernel overwrites dq_accum (the sm90 family's may add)
            "group_dkdv": False,  # GQA: dK/dV partials per query head, summed by the caller
            "dq_interleaved": False,  # dQ's fp32 columns in order
            "persistent": False,  # the forward: one CTA per tile (the sm90 family's may loop over tiles)
            "partial_bits": False,  # partial tiles: the rules evaluated in the kernel (but see rules_context)
            "backward_problem": problem,
            "step_rows": r.BACKWARD_STEP_ROWS,
            "bwd_warps": r.backward_warps,
            "bwd_step_tiles": r.backward_step_tiles,
            "bwd_step_tiles_reason": (
                "P^T and dS^T side by side: one barrier between the score and gradient layouts per step."
                if r.backward_step_tiles == 2 else
                f"P^T, then dS^T in one buffer: two more barriers per step, {t.block_n * 128 // 1024} KB less "
                "shared memory, so that two CTAs share an SM."
            ),
            "bwd_threads": 32 * r.backward_warps,
            "bwd_shared_bytes": r.backward_shared_bytes,
            "dq_warps": r.dq_warps,
            "dq_threads": 32 * r.dq_warps,
            "dq_shared_bytes": r.dq_shared_bytes,
        }

    def rules_context(self, rules: Any, config: KernelConfig) -> dict[str, Any]:
        # Partial tiles' masks as bits (plan.bits, include/omnigen/sm80/partial_bits.cuh): rendered for the modules of
        # masks made from data (plan.ruleless: their partial tiles exist only as bits), so that every module of a
        # rules file keeps the machine code it had -- on Ampere a rules mask carries no bits anyway (masks._reads_bits).
        from ...plan.ruleless import is_ruleless  # (the plan layer, imported when a module is rendered)

        return {"partial_bits": is_ruleless(rules)}


FAMILY = Sm80Family()
