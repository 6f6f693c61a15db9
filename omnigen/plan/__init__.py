"""Exact tile planning: `plan(rules, layout, block_m, block_n)` -> `Plan`, never building the S x S mask.

`host` is the numpy planner (every machine), `gpu` the fused Triton one (a CUDA device with
Triton; identical results), `launch` the thin path that launches Triton's compiled kernels with
less host overhead, `schedule` the `Plan` they both return (`summary`: its statistics, and the same made
without torch or schedules for the command line), `masks` the `Mask` (one layout planned
for several tile shapes in fixed-size tensors: what a call reads without a host sync), `bits` the partial
tiles' masks as bits that a mask carries for the Hopper kernels.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ..layout import AnyLayout, LayoutBatch, as_layout
from ..rules import Rules
from ..semantics import CAUSAL, EMPTY, FULL, KIND_NAMES, PARTIAL, SCHEDULE_KINDS
from . import host
from .host import PlanMemoryError
from .planners import _check_block, _check_device, _gpu_planner
from .summary import PlanStatistics, PlanSummary, summarize

if TYPE_CHECKING:
    import torch

    from .masks import CAPACITY_LIMIT, Mask, make_mask, mask_from_plans
    from .schedule import Plan

# Names whose modules import torch: imported on first use (PEP 562), so that `summarize` -- the command line's
# `show` and `plan` -- runs without torch.
_LAZY = {"Plan": "schedule", **dict.fromkeys(("CAPACITY_LIMIT", "Mask", "make_mask", "mask_from_plans"), "masks")}


def __getattr__(name: str) -> object:
    source = _LAZY.get(name)
    if source is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{source}"), name)
    globals()[name] = value
    return value


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
    from .schedule import Plan

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
            rules, layout.host_tables(rules), block_m, block_n, device
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



__all__ = ["CAPACITY_LIMIT", "CAUSAL", "EMPTY", "FULL", "KIND_NAMES", "Mask", "PARTIAL", "SCHEDULE_KINDS", "Plan",
           "PlanMemoryError", "PlanStatistics", "PlanSummary", "make_mask", "mask_from_plans", "plan", "summarize"]
