"""The op's argument checks: every mistake of a call is found, then all of them are reported at once,
each naming the argument, what was expected and the fix (`InputError`, a ValueError and a TypeError)."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..errors import InputError, tensor_problem
from ..kernels import DTYPE_NAMES, kernel_ready
from ..layout import as_layout
from ..targets import HEAD_DIMS

CPU_PATH = ("for a float64 result on the CPU use omnigen.reference.attention_reference(q, k, v, layout, rules)")


def input_problems(q, k, v, layout, rules, *, dtype: torch.dtype | None = None, head_dim: int | None = None,
                   scale: Any = None) -> tuple[list[str], Any]:
    """(every problem found in the arguments, the layout as an omnigen layout or None).

    `dtype` / `head_dim`: what a built kernel takes (None: any dtype and head dim omnigen builds)."""
    problems: list[str] = []
    tensors = {}
    for name, t in (("q", q), ("k", k), ("v", v)):
        problem = tensor_problem(name, t)
        if problem:
            problems.append(problem)
        else:
            tensors[name] = t
    off_gpu = [name for name, t in tensors.items() if t.device.type != "cuda"]
    if off_gpu:
        where = sorted({str(tensors[name].device) for name in off_gpu})
        problems.append(f"{', '.join(off_gpu)} {'is' if len(off_gpu) == 1 else 'are'} on {', '.join(where)}; omnigen "
                        f"kernels run on CUDA tensors (move them with .cuda()); {CPU_PATH}")
    on_gpu = {t.device for t in tensors.values() if t.device.type == "cuda"}
    if len(on_gpu) > 1:
        problems.append(f"q, k and v must be on one device, got {', '.join(str(tensors[n].device) for n in tensors)}")
    for name, t in tensors.items():
        if dtype is not None and t.dtype != dtype:
            problems.append(f"{name} is {t.dtype}, but this kernel was built for {dtype} "
                            f"(build another with omnigen.build(..., dtype={t.dtype}), or convert with .to({dtype}))")
        elif dtype is None and t.dtype not in DTYPE_NAMES:
            problems.append(f"{name} is {t.dtype}; omnigen kernels take torch.bfloat16 or torch.float16 "
                            f"(convert with .to(torch.bfloat16))")
    S = B = None
    if len(tensors) == 3:
        B, Hq, S, D = q.shape
        if k.shape != v.shape:
            problems.append(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
        if k.shape[0] != B or k.shape[2] != S or k.shape[3] != D:
            problems.append(f"k/v shape {tuple(k.shape)} does not match q shape {tuple(q.shape)} in B, S or D")
        Hkv = k.shape[1]
        if Hkv < 1 or Hq % Hkv:
            problems.append(f"q heads ({Hq}) must be a multiple of k/v heads ({Hkv})")
        if head_dim is not None and D != head_dim:
            problems.append(f"head dim {D} was not built: this kernel has head_dim {head_dim} "
                            f"(build one with omnigen.build(rules, head_dim={D}, ...))")
        elif head_dim is None and D not in HEAD_DIMS:
            problems.append(f"head dim {D} is not one omnigen builds (head dims: {', '.join(map(str, HEAD_DIMS))}); "
                            f"pad q, k and v to the next one")
    elif "q" in tensors:
        B, S = q.shape[0], q.shape[2]
    try:
        layout = as_layout(layout)
    except (TypeError, ValueError) as exc:
        problems.append(str(exc))
        layout = None
    if layout is not None:
        if B is not None and layout.batch_size not in (1, B):
            problems.append(f"layout has {layout.batch_size} batch elements but q has batch {B}")
        if S is not None and layout.seq_len != S:
            problems.append(f"layout has {layout.seq_len} tokens but q/k/v have sequence length {S}")
        missing = layout.modalities - set(rules.modality_names) - {"pad"}
        if missing:
            problems.append(
                f"layout uses modalities {sorted(missing)} that the rules '{rules.name}' do not declare "
                f"(declared: {', '.join(rules.modality_names)})"
            )
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not math.isfinite(scale) or scale <= 0):
        problems.append(f"scale must be a positive finite number (default 1/sqrt(head dim)), got {scale!r}")
    return problems, layout


def check_inputs(kernel: Any, q, k, v, layout, scale) -> tuple:
    problems, layout = input_problems(q, k, v, layout, kernel.rules, dtype=kernel.dtype,
                                      head_dim=kernel.config.head_dim, scale=scale)
    if problems:
        raise InputError(problems)
    q, k, v = (kernel_ready(t) for t in (q, k, v))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return q, k, v, layout, float(scale)
