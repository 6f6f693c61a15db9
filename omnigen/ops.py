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
from typing import Any, Mapping

import torch

from . import toolchain
from . import cache, codegen, tune_db, tune_space
from .layout import AnyLayout, Layout, LayoutBatch, as_layout
from .plan import Plan, plan
from .rules import Rules, TileConfig

DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
TORCH_DTYPES = {name: t for t, name in DTYPE_NAMES.items()}
_PLAN_CACHE_SIZE = 16


def _has_backward(module: Any) -> bool:
    return bool(getattr(module, "HAS_BACKWARD", hasattr(module, "backward")))


class Kernel:
    """The compiled variants of (rules x head dim x dtype x arch), callable like a function.

    `config`/`module` is the default variant. `tuned` maps sequence buckets to the tuner's choice of
    a forward and a backward config (tune_db.Choice); a call runs the choice of its sequence length's
    bucket (or the nearest tuned one) and the default where nothing was tuned. Modules of tuned
    configs are loaded from the cache on first use.
    """

    def __init__(self, rules: Rules, config: codegen.KernelConfig, module: Any,
                 tuned: Mapping[int, tune_db.Choice] | None = None) -> None:
        self.rules = rules
        self.config = config
        self.module = module
        self.tuned: dict[int, tune_db.Choice] = dict(tuned or {})
        self.dtype = TORCH_DTYPES[config.dtype]
        self._untuned = tune_db.Choice(config, config)  # what choice() returns where nothing was tuned
        self._modules: dict[codegen.KernelConfig, Any] = {config: module}
        self._plans: OrderedDict[tuple, Plan] = OrderedDict()
        self._lock = threading.Lock()
        self._module_lock = threading.Lock()

    @property
    def has_backward(self) -> bool:
        return _has_backward(self.module)

    def __repr__(self) -> str:
        tuned = f", tuned for S buckets {sorted(self.tuned)}" if self.tuned else ""
        return f"omnigen.Kernel({self.module.MODULE_NAME}{tuned})"

    def choice(self, seq_len: int) -> tune_db.Choice:
        """The (forward, backward) configs a call with this sequence length runs."""
        found = tune_db.nearest(self.tuned, seq_len)
        return found if found is not None else self._untuned

    def module_for(self, config: codegen.KernelConfig) -> Any:
        """The module of one of this kernel's configs (loaded, or built, on first use)."""
        module = self._modules.get(config)
        if module is None:
            with self._module_lock:
                module = self._modules.get(config)
                if module is None:
                    module = cache.get_module(self.rules, config)
                    self._modules[config] = module
        return module

    def plan(self, layout: AnyLayout, batch: int, device: torch.device, tile: TileConfig | None = None) -> Plan:
        """The plan for `layout` with a tile shape (default: this kernel's), reused while the same layout returns.

        A plan depends only on block_m x block_n, so configs that differ in warps or stages share one."""
        tile = tile or self.config.tile
        if isinstance(layout, Layout) and batch > 1:
            layout = LayoutBatch([layout] * batch)
        key = (layout, batch, device, tile.block_m, tile.block_n)
        with self._lock:
            found = self._plans.get(key)
            if found is not None:
                self._plans.move_to_end(key)
                return found
        made = plan(self.rules, layout, tile.block_m, tile.block_n, device=device)
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
        choice = self.choice(q.shape[2])
        p = self.plan(layout, q.shape[0], q.device, choice.forward.tile)
        out, lse = _Attention.apply(q, k, v, self, layout, choice, p, scale, deterministic)
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


def forward_pass(module: Any, p: Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward launch of a built module: (out, lse). Inputs already checked (see Kernel.__call__)."""
    B, Hq, S, D = q.shape
    out = torch.empty(B, Hq, S, D, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, Hq, S, dtype=torch.float32, device=q.device)
    t = p.tables
    module.forward(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(),
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
        B, Hq, k.shape[1], S, scale,
        p.fwd_ptr.data_ptr(), p.fwd_kv.data_ptr(),
        t.token_segment.data_ptr(), t.token_modality.data_ptr(), t.token_doc.data_ptr(),
        _stream(),
    )
    return out, lse


def backward_pass(module: Any, p: Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, d_out: torch.Tensor, scale: float,
                  deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward of a built module -- Delta, dQ/dK/dV kernels, the GQA sums: (dq, dk, dv).

    `p` must be planned with this module's block_m x block_n; out/lse may come from any forward
    (they do not depend on the tile), which is what lets the forward and backward tiles differ."""
    B, Hq, S, D = q.shape
    Hkv = k.shape[1]
    d_out = _kernel_ready(d_out)
    delta = torch.empty(B, Hq, S, dtype=torch.float32, device=q.device)  # dO . O per row
    module.backward_delta(
        out.data_ptr(), d_out.data_ptr(), delta.data_ptr(), *out.stride()[:3], *d_out.stride()[:3], B, Hq, S, _stream()
    )
    dq_accum = torch.zeros(B, Hq, S, D, dtype=torch.float32, device=q.device)
    if Hq == Hkv:
        dk, dv = torch.empty_like(k), torch.empty_like(v)
    else:  # per q-head partial dK/dV, summed over each group of q heads below
        dk = torch.empty(B, Hq, S, D, dtype=torch.float32, device=q.device)
        dv = torch.empty_like(dk)
    t = p.tables
    module.backward(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(), d_out.data_ptr(),
        delta.data_ptr(), dq_accum.data_ptr(), dk.data_ptr(), dv.data_ptr(),
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3], *d_out.stride()[:3],
        *dk.stride()[:3], *dv.stride()[:3],
        B, Hq, Hkv, S, scale,
        p.fwd_ptr.data_ptr(), p.fwd_kv.data_ptr(), p.bwd_ptr.data_ptr(), p.bwd_q.data_ptr(),
        t.token_segment.data_ptr(), t.token_modality.data_ptr(), t.token_doc.data_ptr(),
        deterministic, _stream(),
    )
    if Hq != Hkv:
        dk = dk.view(B, Hkv, Hq // Hkv, S, D).sum(2).to(k.dtype)
        dv = dv.view(B, Hkv, Hq // Hkv, S, D).sum(2).to(v.dtype)
    return dq_accum.to(q.dtype), dk, dv


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, kernel: Kernel, layout: AnyLayout, choice: tune_db.Choice, p: Plan, scale: float,
                deterministic: bool):
        out, lse = forward_pass(kernel.module_for(choice.forward), p, q, k, v, scale)
        # The backward needs only q, k, v, out and lse (not tile-specific), plus the layout to plan for
        # its own tile shape when the tuner gave it a different one.
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kernel, ctx.layout, ctx.choice, ctx.plan = kernel, layout, choice, p
        ctx.scale, ctx.deterministic = scale, deterministic
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, d_out, _d_lse):
        kernel: Kernel = ctx.kernel
        config: codegen.KernelConfig = ctx.choice.backward
        module = kernel.module_for(config)
        if not _has_backward(module):
            raise RuntimeError(f"{module.MODULE_NAME} has no backward kernel: "
                               f"{getattr(module, 'BACKWARD_PROBLEM', None) or 'rebuild with a newer omnigen'}")
        q, k, v, out, lse = ctx.saved_tensors
        p: Plan = ctx.plan
        if (p.block_m, p.block_n) != (config.tile.block_m, config.tile.block_n):
            p = kernel.plan(ctx.layout, q.shape[0], q.device, config.tile)
        dq, dk, dv = backward_pass(module, p, q, k, v, out, lse, d_out, ctx.scale, ctx.deterministic)
        return dq, dk, dv, None, None, None, None, None, None


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
        tile = tune_space.default_config(rules, head_dim, DTYPE_NAMES[dtype], arch).tile
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
    else the default tile for the head dim. Without a pinned `tile`, the kernel dispatches each
    sequence length to the configs the tuning database holds for this GPU (when it holds any);
    `tune=True` first tunes this head dim and dtype on the visible GPU -- or reuses what an earlier
    process tuned with the same candidate space (omnigen/tune.py).
    """
    if not isinstance(rules, Rules):
        raise TypeError(f"rules must be omnigen.Rules, not {type(rules).__name__}")
    if tune and tile is not None:
        raise ValueError("tune=True picks the tiles itself: pass tile=None, or tune=False to pin a tile")
    config = _variant_config(rules, head_dim, dtype, arch, tile)
    if tune:
        visible = toolchain.visible_gpu_arch()
        if visible is None:
            raise RuntimeError("tune=True needs a CUDA GPU to time the candidates on, and none is visible: "
                               "build with tune=False here, and tune on the GPU machine")
        if visible != config.arch:
            raise ValueError(f"tune=True times on the visible GPU ({visible}); arch={config.arch} cannot be tuned here")
        from . import tune as tuner

        tuned = tuner.tune_kernel(rules, head_dim, config.dtype)
    else:
        tuned = _tuned_choices(rules, config) if tile is None else {}
    return Kernel(rules, config, cache.get_module(rules, config), tuned=tuned)


def _tuned_choices(rules: Rules, config: codegen.KernelConfig) -> dict[int, tune_db.Choice]:
    """What the tuning database holds for this GPU; nothing when there is no GPU or no matching entry."""
    if toolchain.visible_gpu_arch() != config.arch:
        return {}
    return tune_db.lookup(tune_db.Device.current(), rules, config.dtype, config.head_dim, config.arch)


_KERNELS: dict[tuple, Kernel] = {}
_KERNELS_LOCK = threading.Lock()


def forget_kernels() -> None:
    """Drop attention()'s in-process kernels, so the next call re-reads the tuning database."""
    with _KERNELS_LOCK:
        _KERNELS.clear()


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
