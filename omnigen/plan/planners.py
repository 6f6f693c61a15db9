"""Which planner runs (the Triton one where it can) and the tile-size check: shared by `plan()` and masks."""

from __future__ import annotations

from typing import Any


def _check_block(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 16 or value % 16:
        raise ValueError(f"{name} must be a positive multiple of 16, not {value!r}")
    return value


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
