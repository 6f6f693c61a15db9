"""The op's argument checks: every mistake a caller can make gets a sentence naming the argument.

They read only shapes, dtypes, devices and plain attributes, so `torch.compile` traces them without a
graph break (alignment, which needs data pointers, is checked inside the op).
"""

from __future__ import annotations

import math
from typing import Any

import torch

# Device types the kernels run on. Tests that stand a CPU emulator in for the kernels add "cpu".
DEVICE_TYPES: tuple[str, ...] = ("cuda",)


def check_tensors(q, k, v, scale, dtype: torch.dtype | None = None, head_dim: int | None = None) -> float:
    """q, k, v as SDPA takes them; returns the scale (default 1/sqrt(D)). `dtype`/`head_dim`: what a built
    kernel accepts (None: checked when the kernel is built, inside the op)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, not {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dimensions [B, H, S, D] (SDPA layout), got shape {tuple(t.shape)}")
        if t.device.type not in DEVICE_TYPES:
            raise ValueError(f"{name} is on {t.device}; omnigen kernels run on CUDA tensors")
        if dtype is not None and t.dtype != dtype:
            raise TypeError(
                f"{name} is {t.dtype}, but this kernel was built for {dtype} "
                f"(build another with omnigen.build(..., dtype={t.dtype}))"
            )
        if dtype is None and t.dtype not in (torch.bfloat16, torch.float16):
            raise TypeError(f"{name} is {t.dtype}; omnigen kernels take torch.bfloat16 or torch.float16")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    B, Hq, S, D = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[0] != B or k.shape[2] != S or k.shape[3] != D:
        raise ValueError(f"k/v shape {tuple(k.shape)} does not match q shape {tuple(q.shape)} in B, S or D")
    Hkv = k.shape[1]
    if Hkv < 1 or Hq % Hkv:
        raise ValueError(f"q heads ({Hq}) must be a multiple of k/v heads ({Hkv})")
    if head_dim is not None and D != head_dim:
        raise ValueError(
            f"head dim {D} was not built: this kernel has head_dim {head_dim} "
            f"(build one with omnigen.build(rules, head_dim={D}, ...))"
        )
    if scale is None:
        return 1.0 / math.sqrt(D)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    return float(scale)


def check_mask(mask: Any, q: torch.Tensor, rules_key: str, rules_name: str) -> None:
    """A mask (plan/masks.py) against the call: its rules, batch, length and device."""
    if mask.rules_key != rules_key:
        raise ValueError(f"the mask was made for the rules '{mask.rules.name}', but this kernel is for "
                         f"'{rules_name}' (or other rules of that name)")
    B, _, S, _ = q.shape
    if mask.seq_len != S:
        raise ValueError(f"layout has {mask.seq_len} tokens but q/k/v have sequence length {S}")
    if mask.batch_size != B:
        raise ValueError(f"the mask has {mask.batch_size} batch elements but q has batch {B}"
                         + (" (make it with omnigen.mask(..., batch=B) to repeat one layout)" if mask.batch_size == 1 else ""))
    if mask.device != q.device:
        raise ValueError(f"the mask is on {mask.device} but q is on {q.device}; make it with device={q.device}")


def check_layout_against(layout: Any, rules: Any, B: int, S: int) -> None:
    """A plain layout against the rules and the call (the layout is planned afterwards)."""
    if layout.batch_size not in (1, B):
        raise ValueError(f"layout has {layout.batch_size} batch elements but q has batch {B}")
    if layout.seq_len != S:
        raise ValueError(f"layout has {layout.seq_len} tokens but q/k/v have sequence length {S}")
    missing = layout.modalities - set(rules.modality_names) - {"pad"}
    if missing:
        raise ValueError(
            f"layout uses modalities {sorted(missing)} that the rules '{rules.name}' do not declare "
            f"(declared: {', '.join(rules.modality_names)})"
        )
