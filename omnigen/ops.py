"""The differentiable attention op around a built variant module.

    kernel = omnigen.build(rules, head_dim=128, dtype=torch.bfloat16)
    out = kernel(q, k, v, layout)                        # q [B, Hq, S, D], k/v [B, Hkv, S, D]
    out = omnigen.attention(q, k, v, layout, rules)      # builds on first use, cached in-process

The layout is planned on the GPU once per call (or taken from a small cache when the same layout
comes back) and the same plan serves the forward and the backward pass.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from typing import Any

import torch

from . import toolchain
from . import cache, codegen
from .layout import AnyLayout, Layout, LayoutBatch, as_layout
from .plan import Plan, plan
from .rules import Rules, TileConfig

DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
_PLAN_CACHE_SIZE = 16


class Kernel:
    """One compiled variant (rules x head dim x dtype x arch x tile), callable like a function."""

    def __init__(self, rules: Rules, config: codegen.KernelConfig, module: Any) -> None:
        self.rules = rules
        self.config = config
        self.module = module
        self.dtype = next(t for t, name in DTYPE_NAMES.items() if name == config.dtype)
        self._plans: OrderedDict[tuple, Plan] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def has_backward(self) -> bool:
        return hasattr(self.module, "backward")

    def __repr__(self) -> str:
        return f"omnigen.Kernel({self.module.MODULE_NAME})"

    def plan(self, layout: AnyLayout, batch: int, device: torch.device) -> Plan:
        """The plan for `layout` with this variant's tile shape, reused while the same layout returns."""
        if isinstance(layout, Layout) and batch > 1:
            layout = LayoutBatch([layout] * batch)
        key = (layout, batch, device)
        with self._lock:
            found = self._plans.get(key)
            if found is not None:
                self._plans.move_to_end(key)
                return found
        made = plan(self.rules, layout, self.config.tile.block_m, self.config.tile.block_n, device=device)
        with self._lock:
            self._plans[key] = made
            while len(self._plans) > _PLAN_CACHE_SIZE:
                self._plans.popitem(last=False)
        return made

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layout: AnyLayout | str,
        *,
        scale: float | None = None,
        return_lse: bool = False,
        deterministic: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        q, k, v, layout, scale = _check_inputs(self, q, k, v, layout, scale)
        p = self.plan(layout, q.shape[0], q.device)
        out, lse = _Attention.apply(q, k, v, self, p, scale, deterministic)
        return (out, lse) if return_lse else out


def _check_inputs(kernel: Kernel, q, k, v, layout, scale) -> tuple:
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
    q, k, v = (_kernel_ready(t) for t in (q, k, v))
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


def _kernel_ready(t: torch.Tensor) -> torch.Tensor:
    """The kernels need a contiguous last dim, 16-byte aligned rows: copy only when that fails."""
    aligned = t.stride(-1) == 1 and all(s % 8 == 0 for s in t.stride()[:-1]) and t.data_ptr() % 16 == 0
    return t if aligned else t.contiguous()


def _stream() -> int:
    return torch.cuda.current_stream().cuda_stream


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, kernel: Kernel, p: Plan, scale: float, deterministic: bool):
        B, Hq, S, D = q.shape
        out = torch.empty(B, Hq, S, D, dtype=q.dtype, device=q.device)
        lse = torch.empty(B, Hq, S, dtype=torch.float32, device=q.device)
        t = p.tables
        kernel.module.forward(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(),
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
            B, Hq, k.shape[1], S, scale,
            p.fwd_ptr.data_ptr(), p.fwd_kv.data_ptr(),
            t.token_segment.data_ptr(), t.token_modality.data_ptr(), t.token_doc.data_ptr(),
            _stream(),
        )
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kernel, ctx.plan, ctx.scale, ctx.deterministic = kernel, p, scale, deterministic
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, d_out, _d_lse):
        kernel: Kernel = ctx.kernel
        if not kernel.has_backward:
            raise RuntimeError(f"{kernel.module.MODULE_NAME} has no backward kernel; rebuild with a newer omnigen")
        q, k, v, out, lse = ctx.saved_tensors
        p: Plan = ctx.plan
        B, Hq, S, D = q.shape
        Hkv = k.shape[1]
        d_out = _kernel_ready(d_out)
        delta = torch.empty(B, Hq, S, dtype=torch.float32, device=q.device)  # dO . O per row
        kernel.module.backward_delta(
            out.data_ptr(), d_out.data_ptr(), delta.data_ptr(), *out.stride()[:3], *d_out.stride()[:3], B, Hq, S, _stream()
        )
        dq_accum = torch.zeros(B, Hq, S, D, dtype=torch.float32, device=q.device)
        if Hq == Hkv:
            dk, dv = torch.empty_like(k), torch.empty_like(v)
        else:  # per q-head partial dK/dV, summed over each group of q heads below
            dk = torch.empty(B, Hq, S, D, dtype=torch.float32, device=q.device)
            dv = torch.empty_like(dk)
        t = p.tables
        kernel.module.backward(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(), d_out.data_ptr(),
            delta.data_ptr(), dq_accum.data_ptr(), dk.data_ptr(), dv.data_ptr(),
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3], *d_out.stride()[:3],
            *dk.stride()[:3], *dv.stride()[:3],
            B, Hq, Hkv, S, ctx.scale,
            p.fwd_ptr.data_ptr(), p.fwd_kv.data_ptr(), p.bwd_ptr.data_ptr(), p.bwd_q.data_ptr(),
            t.token_segment.data_ptr(), t.token_modality.data_ptr(), t.token_doc.data_ptr(),
            ctx.deterministic, _stream(),
        )
        if Hq != Hkv:
            dk = dk.view(B, Hkv, Hq // Hkv, S, D).sum(2).to(k.dtype)
            dv = dv.view(B, Hkv, Hq // Hkv, S, D).sum(2).to(v.dtype)
        return dq_accum.to(q.dtype), dk, dv, None, None, None, None


# ------------------------------------------------------------------------------------------------


def _variant_config(rules: Rules, head_dim: int, dtype: torch.dtype, arch: str | None, tile: TileConfig | None):
    if dtype not in DTYPE_NAMES:
        raise TypeError(f"dtype must be torch.bfloat16 or torch.float16, not {dtype}")
    if arch is None:
        arch = toolchain.visible_gpu_arch()
        if arch is None:
            raise RuntimeError("no CUDA GPU is visible: pass arch='sm_80' or 'sm_90a' to build for one anyway")
    arch = toolchain.check_arch(arch)
    if tile is None:
        fitting = [
            t for t in (rules.kernel.tiles if rules.kernel else ())
            if not codegen.KernelConfig(head_dim, DTYPE_NAMES[dtype], arch, t).problems()
        ]
        tile = fitting[0] if fitting else codegen.default_tile(head_dim)
    config = codegen.KernelConfig(head_dim=head_dim, dtype=DTYPE_NAMES[dtype], arch=arch, tile=tile)
    config.check()
    return config


def build(
    rules: Rules,
    head_dim: int = 128,
    dtype: torch.dtype = torch.bfloat16,
    tune: bool = False,
    *,
    arch: str | None = None,
    tile: TileConfig | None = None,
) -> Kernel:
    """Build (or load from the cache) the variant for these rules and return it as a callable kernel.

    `arch` defaults to the visible GPU's; `tile` to the first of the rules' `kernel.tiles` that fits,
    else the default tile for the head dim.
    """
    if not isinstance(rules, Rules):
        raise TypeError(f"rules must be omnigen.Rules, not {type(rules).__name__}")
    if tune:
        raise NotImplementedError("tuning is not implemented yet: call omnigen.build(..., tune=False)")
    config = _variant_config(rules, head_dim, dtype, arch, tile)
    return Kernel(rules, config, cache.get_module(rules, config))


_KERNELS: dict[tuple, Kernel] = {}
_KERNELS_LOCK = threading.Lock()


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: AnyLayout | str,
    rules: Rules,
    *,
    scale: float | None = None,
    return_lse: bool = False,
    deterministic: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Masked attention for `rules` over `layout`; builds the variant on first use (cached in-process)."""
    if not isinstance(rules, Rules):
        raise TypeError(f"rules must be omnigen.Rules, not {type(rules).__name__}")
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError("q must be a 4-dimensional tensor [B, H, S, D]")
    if q.device.type != "cuda":
        raise ValueError(f"q is on {q.device}; omnigen kernels run on CUDA tensors")
    key = (rules.without_kernel(), q.shape[-1], q.dtype, q.device.index)
    kernel = _KERNELS.get(key)
    if kernel is None:
        with _KERNELS_LOCK:
            kernel = _KERNELS.get(key)
            if kernel is None:
                with torch.cuda.device(q.device):
                    kernel = build(rules, head_dim=q.shape[-1], dtype=q.dtype)
                _KERNELS[key] = kernel
    return kernel(q, k, v, layout, scale=scale, return_lse=return_lse, deterministic=deterministic)
