"""The op's argument checks: every mistake a caller can make gets a sentence naming the argument."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..kernels import kernel_ready
from ..layout import as_layout


def check_inputs(kernel: Any, q, k, v, layout, scale) -> tuple:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, not {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dimensions [B, H, S, D] (SDPA layout), got shape {tuple(t.shape)}")
        if t.device.type != "cuda":
            raise ValueError(f"{name} is on {t.device}; omnigen kernels run on CUDA tensors")
        if t.dtype != kernel.dtype:
            raise TypeError(
                f"{name} is {t.dtype}, but this kernel was built for {kernel.dtype} "
                f"(build another with omnigen.build(..., dtype={t.dtype}))"
            )
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    B, Hq, S, D = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[0] != B or k.shape[2] != S or k.shape[3] != D:
        raise ValueError(f"k/v shape {tuple(k.shape)} does not match q shape {tuple(q.shape)} in B, S or D")
    Hkv = k.shape[1]
    if Hkv < 1 or Hq % Hkv:
        raise ValueError(f"q heads ({Hq}) must be a multiple of k/v heads ({Hkv})")
    if D != kernel.config.head_dim:
        raise ValueError(
            f"head dim {D} was not built: this kernel has head_dim {kernel.config.head_dim} "
            f"(build one with omnigen.build(rules, head_dim={D}, ...))"
        )
    q, k, v = (kernel_ready(t) for t in (q, k, v))
    layout = as_layout(layout)
    if layout.batch_size not in (1, B):
        raise ValueError(f"layout has {layout.batch_size} batch elements but q has batch {B}")
    if layout.seq_len != S:
        raise ValueError(f"layout has {layout.seq_len} tokens but q/k/v have sequence length {S}")
    missing = layout.modalities - set(kernel.rules.modality_names) - {"pad"}
    if missing:
        raise ValueError(
            f"layout uses modalities {sorted(missing)} that the rules '{kernel.rules.name}' do not declare "
            f"(declared: {', '.join(kernel.rules.modality_names)})"
        )
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    elif not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    return q, k, v, layout, float(scale)
