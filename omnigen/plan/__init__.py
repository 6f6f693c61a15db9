"""Exact tile planning: `plan(rules, layout, block_m, block_n)` -> `Plan`, never building the S x S mask.

`host` is the numpy planner (every machine), `gpu` the fused Triton one (a CUDA device with
Triton; identical results), `launch` the thin path that launches Triton's compiled kernels with
less host overhead, `schedule` the `Plan` they both return.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import cuda_problem
from ..layout import AnyLayout, LayoutBatch, as_layout
from ..mask import CAUSAL, EMPTY, FULL, KIND_NAMES, PARTIAL, SCHEDULE_KINDS
from ..rules import Rules
from . import host
from .host import PlanMemoryError
from .schedule import Plan


def _check_block(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 16 or value % 16:
        raise ValueError(f"{name} must be a positive multiple of 16, not {value!r}")
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


def _check_device(device: Any) -> torch.device:
    """`device` as a torch.device that exists here, else a ValueError saying what to do."""
    if device is None:
        return torch.device("cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device={device!r} is not a device: pass 'cpu' (the default), 'cuda', 'cuda:N' "
                         f"or a torch.device ({str(exc).splitlines()[0].rstrip(' -')})") from None
    if device.type == "cuda":
        problem = cuda_problem()
        if problem:
            raise ValueError(f"device={str(device)!r}: {problem}; plan on the CPU with device='cpu' (the default), "
                             f"which gives the same plan") from None
        if device.index is not None and device.index >= torch.cuda.device_count():  # (cached by torch)
            raise ValueError(f"device={str(device)!r}, but only {torch.cuda.device_count()} CUDA device(s) are "
                             f"visible (cuda:0 .. cuda:{torch.cuda.device_count() - 1})")
    return device


def _gpu_planner():
    """The Triton planner module, or None where Triton is missing (then the host path runs)."""
    global _GPU_PLANNER
    if _GPU_PLANNER is False:
        try:
            from . import gpu

            _GPU_PLANNER = gpu if gpu.available() else None
        except ImportError:
            _GPU_PLANNER = None
    return _GPU_PLANNER


_GPU_PLANNER = False


__all__ = ["CAUSAL", "EMPTY", "FULL", "KIND_NAMES", "PARTIAL", "SCHEDULE_KINDS", "Plan", "PlanMemoryError", "plan"]
