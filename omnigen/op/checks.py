"""The op's argument checks. Every mistake of a call is found, then all of them are reported at once,
each naming the argument, what was expected and the fix (`InputError`: a ValueError and a TypeError).

They read only shapes, dtypes, devices and plain attributes, so `torch.compile` traces the tensor checks
without a graph break (alignment, which needs data pointers, is checked inside the op).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..errors import InputError, tensor_problem
from ..kernels import DTYPE_NAMES
from ..layout import as_layout
from ..targets import HEAD_DIMS
from . import cpu

# Device types the kernels run on. Tests that stand a CPU emulator in for the kernels add "cpu".
DEVICE_TYPES: tuple[str, ...] = ("cuda",)
# The device type served by the PyTorch path (op/cpu.py) where no kernel runs, and the dtypes it takes.
HOST_DEVICE = "cpu"
HOST_DTYPES = cpu.DTYPES
WHERE_IT_RUNS = ("omnigen runs CUDA tensors on its kernels and CPU tensors on a PyTorch path for tests and debugging "
                 "(move them with .cuda() or .cpu())")


def _served(device: torch.device) -> bool:
    return device.type in DEVICE_TYPES or device.type == HOST_DEVICE


def _dtype_names(dtypes) -> str:
    names = [str(d) for d in dtypes]
    return ", ".join(names[:-1]) + " or " + names[-1]


def tensor_problems(q, k, v, scale: Any = None, dtype: torch.dtype | None = None,
                    head_dim: int | None = None, known_head_dims: bool = True) -> list[str]:
    """Every problem of q, k, v (SDPA layout) and scale. `dtype` / `head_dim`: what a built kernel takes
    (None: any dtype, and with `known_head_dims` any head dim omnigen builds; without it the head dim is
    left to the kernel's build, inside the op)."""
    problems: list[str] = []
    tensors = {}
    for name, t in (("q", q), ("k", k), ("v", v)):
        problem = tensor_problem(name, t)
        if problem:
            problems.append(problem)
        else:
            tensors[name] = t
    elsewhere = [name for name, t in tensors.items() if not _served(t.device)]
    if elsewhere:
        where = sorted({str(tensors[name].device) for name in elsewhere})
        problems.append(f"{', '.join(elsewhere)} {'is' if len(elsewhere) == 1 else 'are'} on {', '.join(where)}; "
                        f"{WHERE_IT_RUNS}")
    if len({t.device for t in tensors.values()}) > 1 and not elsewhere:
        problems.append(f"q, k and v must be on one device, got {', '.join(str(tensors[n].device) for n in tensors)}")
    for name, t in tensors.items():
        on_host = t.device.type == HOST_DEVICE and HOST_DEVICE not in DEVICE_TYPES
        if dtype is not None and t.dtype != dtype:
            problems.append(f"{name} is {t.dtype}, but this kernel was built for {dtype} "
                            f"(build another with omnigen.build(..., dtype={t.dtype}), or convert with .to({dtype}))")
        elif dtype is None and on_host and t.dtype == torch.float8_e4m3fn:
            problems.append(f"{name} is torch.float8_e4m3fn: the FP8 forward runs on Hopper GPUs (sm_90a); on the CPU "
                            f"dequantise first ({name}.float() * its descale)")
        elif dtype is None and on_host and t.dtype not in HOST_DTYPES:
            problems.append(f"{name} is {t.dtype}; omnigen on the CPU takes {_dtype_names(HOST_DTYPES)} "
                            f"(convert with .to(torch.float32))")
        elif dtype is None and not on_host and t.dtype not in DTYPE_NAMES:
            problems.append(f"{name} is {t.dtype}; omnigen kernels take torch.bfloat16 or torch.float16 (and, "
                            f"forward-only, torch.float8_e4m3fn) (convert with .to(torch.bfloat16))")
    if len(tensors) == 3 and dtype is None and len({t.dtype for t in tensors.values()}) > 1:
        problems.append(f"q, k and v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
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
        elif head_dim is None and known_head_dims and D not in HEAD_DIMS:
            problems.append(f"head dim {D} is not one omnigen builds (head dims: {', '.join(map(str, HEAD_DIMS))}); "
                            f"pad q, k and v to the next one")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not math.isfinite(scale) or scale <= 0):
        problems.append(f"scale must be a positive finite number (default 1/sqrt(head dim)), got {scale!r}")
    return problems


def layout_problems(layout: Any, rules: Any, batch: int | None, seq_len: int | None) -> tuple[list[str], Any]:
    """(every problem of a plain layout against the rules and the call, the layout as an omnigen layout or None)."""
    problems: list[str] = []
    try:
        layout = as_layout(layout)
    except (TypeError, ValueError) as exc:
        return [str(exc)], None
    if batch is not None and layout.batch_size not in (1, batch):
        problems.append(f"layout has {layout.batch_size} batch elements but q has batch {batch}")
    if seq_len is not None and layout.seq_len != seq_len:
        problems.append(f"layout has {layout.seq_len} tokens but q/k/v have sequence length {seq_len}")
    missing = layout.modalities - set(rules.modality_names) - {"pad"}
    if missing:
        problems.append(f"layout uses modalities {sorted(missing)} that the rules '{rules.name}' do not declare "
                        f"(declared: {', '.join(rules.modality_names)})")
    return problems, layout


def input_problems(q, k, v, layout, rules, *, dtype: torch.dtype | None = None, head_dim: int | None = None,
                   scale: Any = None) -> tuple[list[str], Any]:
    """(every problem of a call with a plain layout, the layout as an omnigen layout or None)."""
    problems = tensor_problems(q, k, v, scale, dtype, head_dim)
    shaped = isinstance(q, torch.Tensor) and q.dim() == 4
    found, layout = layout_problems(layout, rules, q.shape[0] if shaped else None, q.shape[2] if shaped else None)
    return problems + found, layout


def _scale(q: torch.Tensor, scale: Any) -> float:
    """The softmax scale a checked call runs with: 1/sqrt(head dim) unless given."""
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def _plainly_valid(q: Any, k: Any, v: Any, dtype: torch.dtype | None, head_dim: int | None) -> bool:
    """The common call, checked in one pass of attribute reads (a training step checks once per layer and pass):
    True means tensor_problems would find nothing; False means run it, to name every problem."""
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
        return False
    qs, ks = q.shape, k.shape
    return (len(qs) == 4 and len(ks) == 4 and ks == v.shape and ks[0] == qs[0] and ks[2] == qs[2] and ks[3] == qs[3]
            and ks[1] >= 1 and qs[1] % ks[1] == 0 and q.dtype == k.dtype == v.dtype
            and (q.dtype == dtype if dtype is not None else q.dtype in DTYPE_NAMES)
            and (head_dim is None or qs[3] == head_dim)
            and q.device == k.device == v.device and q.device.type in DEVICE_TYPES)


def check_tensors(q, k, v, scale: Any = None, dtype: torch.dtype | None = None, head_dim: int | None = None) -> float:
    """q, k, v as SDPA takes them (InputError naming every problem); returns the scale (default 1/sqrt(D))."""
    if scale is None and _plainly_valid(q, k, v, dtype, head_dim):
        return 1.0 / math.sqrt(q.shape[-1])
    problems = tensor_problems(q, k, v, scale, dtype, head_dim, known_head_dims=False)
    if problems:
        raise InputError(problems)
    return _scale(q, scale)


def check_call(q, k, v, layout, rules, scale: Any = None, dtype: torch.dtype | None = None,
               head_dim: int | None = None) -> float:
    """A call with a plain layout: every problem of the tensors and the layout at once; returns the scale."""
    problems, _ = input_problems(q, k, v, layout, rules, dtype=dtype, head_dim=head_dim, scale=scale)
    if problems:
        raise InputError(problems)
    return _scale(q, scale)


def check_layout_against(layout: Any, rules: Any, batch: int, seq_len: int) -> None:
    """A plain layout against the rules and the call (the layout is planned afterwards)."""
    problems, _ = layout_problems(layout, rules, batch, seq_len)
    if problems:
        raise InputError(problems)


def check_mask(mask: Any, q: torch.Tensor, rules_key: str, rules_name: str) -> None:
    """A mask (plan/masks.py) against the call: its rules, batch, length and device."""
    if mask.rules_key != rules_key:
        raise ValueError(f"the mask was made for the rules '{mask.rules.name}', but this kernel is for "
                         f"'{rules_name}' (or other rules of that name)")
    B, _, S, _ = q.shape
    if getattr(mask, "ruleless", False) and (mask.seq_len, mask.batch_size) != (S, B):
        raise ValueError(_remade_from_data(mask, B, S))
    if mask.seq_len != S:
        raise ValueError(f"layout has {mask.seq_len} tokens but q/k/v have sequence length {S}")
    if mask.batch_size != B:
        raise ValueError(f"the mask has {mask.batch_size} batch elements but q has batch {B}"
                         + (" (make it with omnigen.mask(..., batch=B) to repeat one layout)" if mask.batch_size == 1 else ""))
    if mask.device != q.device:
        raise ValueError(f"the mask is on {mask.device} but q is on {q.device}; make it with device={q.device}")


# How each maker of masks from data is called again for B sequences of S tokens: a mask from data has no layout to
# repeat over a batch (omnigen.mask(..., batch=B)), so the fix is to make it again from its input, of the right size.
_REMAKE = {
    "mask_from_mod": "omnigen.mask_from_mod(mask_mod, {B}, {S})",
    "mask_from_dense": ("omnigen.mask_from_dense(mask) with a bool mask of shape [{B}, {S}, {S}] "
                        "(or [{S}, {S}] with batch={B})"),
    "mask_from_intervals": "omnigen.mask_from_intervals(lts, lte[, uts, ute]) with vectors of shape [{B}, {S}]",
}


def _remade_from_data(mask: Any, B: int, S: int) -> str:
    """The message for a mask made from data whose batch or length differs from q/k/v's: what it was made for, what
    the call has, and how to make it again (the maker that made it where known, else the three)."""
    made = f"B={mask.batch_size}, S={mask.seq_len}"
    by = mask.made_by if mask.made_by in _REMAKE else None
    fixes = [_REMAKE[by]] if by else list(_REMAKE.values())
    fix = " or ".join(f.format(B=B, S=S) for f in fixes)
    again = "; then omnigen.reorder it again" if getattr(mask, "permutation", None) is not None else ""
    return (f"the mask was made {'by omnigen.' + by if by else 'from data'} for {made} (batch, sequence length), "
            f"but q/k/v have B={B}, S={S}: make it again for this call with {fix}{again}")

