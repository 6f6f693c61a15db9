"""Which planner runs (the Triton one where it can), the tile-size and device checks: shared by `plan()`
and masks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import cuda_problem

if TYPE_CHECKING:
    import torch


def _check_block(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 16 or value % 16:
        raise ValueError(f"{name} must be a positive multiple of 16, not {value!r}")
    return value


# What to do on a machine without CUDA, by what is being made (the plan is the same on the CPU).
PLAN_ON_CPU = "plan on the CPU with device='cpu' (the default), which gives the same plan"


def _check_device(device: Any, no_cuda_advice: str = PLAN_ON_CPU) -> torch.device:
    """`device` as a torch.device that exists here (a CUDA one with its index: what tensors made there report),
    else a ValueError saying what to do; `no_cuda_advice` ends the message where CUDA is asked for and missing."""
    import torch

    if device is None:
        return torch.device("cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device={device!r} is not a device: pass 'cpu', 'cuda', 'cuda:N' "
                         f"or a torch.device ({str(exc).splitlines()[0].rstrip(' -')})") from None
    if device.type == "cuda":
        problem = cuda_problem()
        if problem:
            raise ValueError(f"device={str(device)!r}: {problem}; {no_cuda_advice}") from None
        if device.index is None:
            return torch.device("cuda", torch.cuda.current_device())
        if device.index >= torch.cuda.device_count():  # (cached by torch)
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
