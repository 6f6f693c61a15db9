"""`Kernel`, `build` and `attention`: the user-facing op around the built variant modules.

    kernel = omnigen.build(rules, head_dim=128, dtype=torch.bfloat16)
    out = kernel(q, k, v, layout)                        # q [B, Hq, S, D], k/v [B, Hkv, S, D]
    out = omnigen.attention(q, k, v, layout, rules)      # builds on first use, cached in-process

The layout is planned on the GPU once per call (or taken from a small cache when the same layout
comes back) and the same plan serves the forward and the backward pass.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Mapping

import torch

from ..jit import cache, toolchain
from ..kernels import DTYPE_NAMES, TORCH_DTYPES, check
from ..layout import AnyLayout, Layout, LayoutBatch
from ..plan import Plan, plan
from ..rules import Rules
from ..targets import KernelConfig, TileConfig
from ..tune import db as tune_db
from ..tune import space as tune_space
from .autograd import Attention, has_backward
from .checks import InputError, check_inputs, input_problems

_PLAN_CACHE_SIZE = 16


class Kernel:
    """The compiled variants of (rules x head dim x dtype x arch), callable like a function.

    `config`/`module` is the default variant. `tuned` maps sequence buckets to the tuner's choice of
    a forward and a backward config (tune_db.Choice); a call runs the choice of its sequence length's
    bucket (or the nearest tuned one) and the default where nothing was tuned. Modules of tuned
    configs are loaded from the cache on first use.
    """

    def __init__(self, rules: Rules, config: KernelConfig, module: Any,
                 tuned: Mapping[int, tune_db.Choice] | None = None) -> None:
        self.rules = rules
        self.config = config
        self.module = module
        self.tuned: dict[int, tune_db.Choice] = dict(tuned or {})
        self.dtype = TORCH_DTYPES[config.dtype]
        self._untuned = tune_db.Choice(config, config)  # what choice() returns where nothing was tuned
        self._modules: dict[KernelConfig, Any] = {config: module}
        self._plans: OrderedDict[tuple, Plan] = OrderedDict()
        self._lock = threading.Lock()
        self._module_lock = threading.Lock()
        self.tuning_generation = tune_db.generation()  # the database as this kernel read it

    @property
    def has_backward(self) -> bool:
        return has_backward(self.module)

    def __repr__(self) -> str:
        tuned = f", tuned for S buckets {sorted(self.tuned)}" if self.tuned else ""
        return f"omnigen.Kernel({self.module.MODULE_NAME}{tuned})"

    def choice(self, seq_len: int) -> tune_db.Choice:
        """The (forward, backward) configs a call with this sequence length runs."""
        found = tune_db.nearest(self.tuned, seq_len)
        return found if found is not None else self._untuned

    def module_for(self, config: KernelConfig) -> Any:
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
        q, k, v, layout, scale = check_inputs(self, q, k, v, layout, scale)
        choice = self.choice(q.shape[2])
        p = self.plan(layout, q.shape[0], q.device, choice.forward.tile)
        out, lse = Attention.apply(q, k, v, self, layout, choice, p, scale, deterministic)
        return (out, lse) if return_lse else out


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
    config = KernelConfig(head_dim=head_dim, dtype=DTYPE_NAMES[dtype], arch=arch, tile=tile)
    check(config)
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
    process tuned with the same candidate space (omnigen/tune/).
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
        from .. import tune as tuner

        tuned = tuner.tune_kernel(rules, head_dim, config.dtype)
    else:
        tuned = _tuned_choices(rules, config) if tile is None else {}
    return Kernel(rules, config, cache.get_module(rules, config), tuned=tuned)


def _tuned_choices(rules: Rules, config: KernelConfig) -> dict[int, tune_db.Choice]:
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


def _cached_kernel(key: tuple) -> Kernel | None:
    """attention()'s kernel for `key`, unless the tuning database was written since it was made."""
    kernel = _KERNELS.get(key)
    return kernel if kernel is not None and kernel.tuning_generation == tune_db.generation() else None


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
    # Every mistake of the call at once, before anything is built.
    problems, _ = input_problems(q, k, v, layout, rules, scale=scale)
    if problems:
        raise InputError(problems)
    key = (rules.without_kernel(), q.shape[-1], q.dtype, q.device.index)
    kernel = _cached_kernel(key)
    if kernel is None:
        with _KERNELS_LOCK:
            kernel = _cached_kernel(key)
            if kernel is None:
                with torch.cuda.device(q.device):
                    kernel = build(rules, head_dim=q.shape[-1], dtype=q.dtype)
                _KERNELS[key] = kernel
    return kernel(q, k, v, layout, scale=scale, return_lse=return_lse, deterministic=deterministic)
