"""Exact tile planning: `plan(rules, layout, block_m, block_n)` -> `Plan`, never building the S x S mask.

`host` is the numpy planner (every machine), `gpu` the fused Triton one (a CUDA device with
Triton; identical results), `launch` the thin path that launches Triton's compiled kernels with
less host overhead, `schedule` the `Plan` they both return, `masks` the `Mask` (one layout planned
for several tile shapes in fixed-size tensors: what a call reads without a host sync), `bits` the partial
tiles' masks as bits that a mask carries for the Hopper kernels.
"""

from __future__ import annotations

import torch

from ..layout import AnyLayout, LayoutBatch, as_layout
from ..semantics import CAUSAL, EMPTY, FULL, KIND_NAMES, PARTIAL, SCHEDULE_KINDS
from ..rules import Rules
from . import host
from .host import PlanMemoryError
from .planners import _check_block, _check_device, _gpu_planner
from .schedule import Plan


def plan(
    rules: Rules,
    layout: AnyLayout | str,
    block_m: int = 128,
    block_n: int = 128,
    device: torch.device | str | None = None,
) -> Plan:
    """Classify every (block_m x block_n) tile of the mask exactly and build forward/backward schedules.

    On a CUDA device with Triton the plan is made there (plan_gpu); otherwise on the host with
    vectorised numpy code and the schedules copied to `device`. Memory is O(S + visited tiles) (the
    host path: about 16 bytes per visited tile at its peak, plus bounded temporaries); a plan that
    would not fit raises `PlanMemoryError` (a MemoryError) before allocating.
    """
    if not isinstance(rules, Rules):
        raise TypeError(f"rules must be omnigen.Rules, not {type(rules).__name__}")
    layout = as_layout(layout)
    block_m = _check_block(block_m, "block_m")
    block_n = _check_block(block_n, "block_n")
    device = _check_device(device)
    tables = layout.tables(rules, device)
    B, S = tables.batch_size, tables.seq_len
    if device.type == "cuda" and _gpu_planner() is not None:
        # Same result in a handful of fused launches.
        fwd_ptr, fwd_kv, bwd_ptr, bwd_q, pair_count = _gpu_planner().classify_and_schedule(
            rules, tables, block_m, block_n
        )
    else:
        fwd_ptr, fwd_kv, bwd_ptr, bwd_q, pair_count = host.classify_and_schedule(
            rules, tables if device.type == "cpu" else layout.tables(rules, "cpu"), block_m, block_n, device
        )
    return Plan(
        block_m=block_m,
        block_n=block_n,
        batch_size=B,
        seq_len=S,
        batched=isinstance(layout, LayoutBatch),
        fwd_ptr=fwd_ptr,
        fwd_kv=fwd_kv,
        bwd_ptr=bwd_ptr,
        bwd_q=bwd_q,
        pair_count=pair_count,
        tables=tables,
        rules_hash=rules.mask_hash(),
    )



from .masks import CAPACITY_LIMIT, Mask, make_mask, mask_from_plans

__all__ = ["CAPACITY_LIMIT", "CAUSAL", "EMPTY", "FULL", "KIND_NAMES", "Mask", "PARTIAL", "SCHEDULE_KINDS", "Plan",
           "PlanMemoryError", "make_mask", "mask_from_plans", "plan"]
