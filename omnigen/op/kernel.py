"""`Kernel`, `build`, `attention` and `mask`: the user-facing op around the built variant modules.

    kernel = omnigen.build(rules, head_dim=128, dtype=torch.bfloat16)
    out = kernel(q, k, v, layout)                        # q [B, Hq, S, D], k/v [B, Hkv, S, D]
    out = omnigen.attention(q, k, v, layout, rules)      # builds on first use, cached in-process
    mask = omnigen.mask(rules, layout, device="cuda")    # plan once per batch, for every tile it may run
    out = omnigen.attention(q, k, v, mask)               # no host sync; torch.compile / CUDA-graph ready

Every call ends in the custom op `omnigen::attention` (op/library.py) with the mask's tensors. A plain
layout is first planned (on the GPU, one host sync; the result is kept in a small cache while the same
layout comes back) into a mask of exactly the tile shapes the kernel runs; under `torch.compile` that
step is a graph break, and under `fullgraph=True` it is planned while Dynamo traces (op/traced_layouts.py).
"""

from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from dataclasses import replace
from typing import Any, Mapping

import torch

from ..errors import InputError
from ..jit import cache, toolchain
from ..kernels import DTYPE_NAMES, FAMILIES, TORCH_DTYPES, check, default_backward
from ..layout import AnyLayout, Layout, LayoutBatch, as_layout
from ..plan import Mask, Plan, make_mask, mask_from_plans, plan
from ..plan import ruleless
from ..plan.planners import _check_device
from ..rules import Rules, rules_for_key
from ..targets import FP8_DTYPES, KernelConfig, TileConfig
from ..tune import db as tune_db
from ..tune import space as tune_space
from . import autograd  # registers the op's backward; EagerAttention
from . import cpu, fp8, library, native, permute, traced_layouts
from .library import has_backward, on_host_device
from .checks import check_call, check_layout_against, check_mask, check_tensors

_PLAN_CACHE_SIZE = 16


class _Recent:
    """The last few values made for keys (a layout coming back reuses its plan or mask), thread-safe."""

    def __init__(self, size: int = _PLAN_CACHE_SIZE) -> None:
        self._size = size
        self._items: OrderedDict[tuple, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get_or_make(self, key: tuple, make) -> Any:
        with self._lock:
            found = self._items.get(key)
            if found is not None:
                self._items.move_to_end(key)
                return found
        made = make()  # outside the lock: planning may take a while
        with self._lock:
            self._items[key] = made
            while len(self._items) > self._size:
                self._items.popitem(last=False)
        return made


def _disable(fn, reason: str):
    """torch.compiler.disable with a reason where this torch takes one (the message a fullgraph=True trace prints
    where it cannot plan while tracing: a torch whose Dynamo does not say whether the trace may break)."""
    try:
        return torch.compiler.disable(fn, reason=reason)
    except TypeError:  # pragma: no cover - torch without `reason`
        return torch.compiler.disable(fn)


_PLANNING_REASON = ("omnigen plans a plain layout on the host (a host sync), and this torch's Dynamo does not let "
                    "it plan while tracing: pass a mask made outside the compiled function, omnigen.mask(rules, "
                    "layout, device) or kernel.mask(layout), to compile with fullgraph=True")


def _call_op(q, k, v, mask: Mask, kernel_key: str, scale: float, deterministic: bool, return_lse: bool):
    reordered = mask.permutation is not None  # omnigen.reorder's mask: the kernels run in its token order
    if reordered:
        q, k, v = permute.into_mask_order(mask, q, k, v)
    inputs = (q, k, v, mask.schedules, list(mask.tile_shapes), mask.token_segment, mask.token_modality,
              mask.token_doc, kernel_key, scale, bool(deterministic))
    # The op itself when compiling (AOTAutograd traces its backward) and on CUDA tensors with the shim loaded (its
    # autograd is C++, op/native/); otherwise eagerly the same op under a plain Function's autograd, which costs the
    # host a quarter as much as torch.library's Python autograd layer (op/autograd.py).
    if torch.compiler.is_compiling() or (q.is_cuda and native.loaded()):
        out, lse = autograd.ATTENTION(*inputs)
    else:
        out, lse = autograd.EagerAttention.apply(*inputs)
    if reordered:
        out, lse = permute.back_to_original(mask, out, lse)
    return (out, lse) if return_lse else out


class Kernel:
    """The compiled variants of (rules x head dim x dtype x arch), callable like a function.

    `config`/`module` is the default variant. `tuned` maps sequence buckets to the tuner's choice of
    a forward and a backward config (tune_db.Choice); a call runs the choice of its sequence length's
    bucket (or the nearest tuned one) and the default where nothing was tuned. Modules of tuned
    configs are loaded from the cache on first use.
    """

    def __init__(self, rules: Rules, config: KernelConfig, module: Any,
                 tuned: Mapping[int, tune_db.Choice] | None = None, backward: KernelConfig | None = None) -> None:
        self.rules = rules
        self.config = config
        self.module = module
        self.tuned: dict[int, tune_db.Choice] = dict(tuned or {})
        self.dtype = TORCH_DTYPES[config.dtype]
        # What choice() returns where nothing was tuned: a pinned variant runs both passes itself; the default
        # one may run its backward elsewhere (kernels.default_backward: sm90 modules, sm80's backward).
        self._untuned = tune_db.Choice(config, backward or config)
        self._modules: dict[KernelConfig, Any] = {config: module}
        self._plans = _Recent()
        self._masks = _Recent()
        self._module_lock = threading.Lock()
        self.tuning_generation = tune_db.generation()  # the database as this kernel read it
        self.rules_key = rules.key
        self.key = library.register_kernel(self, getattr(module, "MODULE_NAME", "kernel"))  # the op's handle
        if torch.cuda.is_available():
            native.load()  # the C++ call path, built once per torch (op/native/)

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
        layout = _batched(layout, batch)
        return self._plans.get_or_make((layout, batch, device, tile.block_m, tile.block_n),
                                       lambda: plan(self.rules, layout, tile.block_m, tile.block_n, device=device))

    def tile_shapes(self, seq_len: int) -> list[tuple[int, int]]:
        """The (block_m, block_n) shapes a call of this sequence length runs: forward's, then backward's."""
        choice = self.choice(seq_len)
        shapes = [(c.tile.block_m, c.tile.block_n) for c in (choice.forward, choice.backward)]
        return list(dict.fromkeys(shapes))

    def mask(self, layout: AnyLayout | str, *, device: torch.device | str | None = None,
             batch: int | None = None, partial_bits: int | str = "auto") -> Mask:
        """A mask for exactly the tile shapes this kernel runs on `layout` (device: the current CUDA one);
        `partial_bits` as for `omnigen.mask`."""
        layout = as_layout(layout)
        check_layout_against(layout, self.rules, batch or layout.batch_size, layout.seq_len)
        device = _mask_device(device if device is not None else "cuda")
        return make_mask(self.rules, layout, self.tile_shapes(layout.seq_len), device, batch, partial_bits)

    def _mask_for_layout(self, layout: AnyLayout, batch: int, device: torch.device) -> Mask:
        """A plain layout planned for this call's tile shapes (eager; kept while the same layout returns)."""
        shapes = tuple(self.tile_shapes(layout.seq_len))
        return self._masks.get_or_make(
            (layout, batch, device, shapes),
            lambda: mask_from_plans(self.rules, _batched(layout, batch),
                                    [self.plan(layout, batch, device, TileConfig(m, n)) for m, n in shapes]))

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layout: AnyLayout | Mask | str,
        *,
        scale: float | None = None,
        return_lse: bool = False,
        deterministic: bool = False,
        descale: tuple[float | torch.Tensor, float | torch.Tensor, float | torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if isinstance(layout, Mask):
            scale = check_tensors(q, k, v, scale, self.dtype, self.config.head_dim)
            _check_descale(q, k, v, descale)
            mask = layout
        else:
            scale = check_call(q, k, v, layout, self.rules, scale, self.dtype, self.config.head_dim)
            _check_descale(q, k, v, descale)
            # under fullgraph=True: planned while Dynamo traces (op/traced_layouts.py)
            mask = (traced_layouts.traced_mask(("kernel", self.key), layout, q)
                    or _prepare_kernel_layout(self, layout, q))
        check_mask(mask, q, self.rules_key, self.rules.name)
        if fp8.is_fp8(q):
            return fp8.forward(q, k, v, mask, self.key, scale, descale, return_lse)
        return _call_op(q, k, v, mask, self.key, scale, deterministic, return_lse)


def _check_descale(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, descale: Any) -> None:
    """The FP8 call's own checks (after the common ones, before any planning or building), or that a 16-bit call
    has no descale."""
    if fp8.is_fp8(q):
        fp8.check_call(q, k, v, descale)
    elif descale is not None:
        raise InputError(f"descale is for FP8 inputs (torch.float8_e4m3fn); q is {q.dtype}")


def _batched(layout: AnyLayout, batch: int) -> AnyLayout:
    return LayoutBatch([layout] * batch) if isinstance(layout, Layout) and batch > 1 else layout


def _plan_layout(kernel: Kernel, layout: Any, batch: int, seq_len: int, device: torch.device) -> Mask:
    layout = as_layout(layout)
    check_layout_against(layout, kernel.rules, batch, seq_len)
    return kernel._mask_for_layout(layout, batch, device)


def _prepare_layout(kernel: Kernel, layout: Any, q: torch.Tensor) -> Mask:
    return _plan_layout(kernel, layout, q.shape[0], q.shape[2], q.device)


_prepare_kernel_layout = _disable(_prepare_layout, _PLANNING_REASON)


# ------------------------------------------------------------------------------------------------


_DTYPES_TAKEN = "dtype must be torch.bfloat16 or torch.float16 (or, forward-only, torch.float8_e4m3fn)"


def _variant_config(rules: Rules, head_dim: int, dtype: torch.dtype, arch: str | None, tile: TileConfig | None,
                    family: str | None = None):
    from ..targets import HEAD_DIMS

    # What is wrong whatever the machine comes first: a CPU-only machine reports the head dim, not only the GPU.
    if dtype not in DTYPE_NAMES:
        raise TypeError(f"{_DTYPES_TAKEN}, not {dtype}")
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {', '.join(map(str, HEAD_DIMS))} (the head dims omnigen builds "
                         f"kernels for), not {head_dim!r}")
    if arch is None:
        arch = toolchain.visible_gpu_arch()
        if arch is None:
            raise RuntimeError("no CUDA GPU is visible: pass arch='sm_80' or 'sm_90a' to build for one anyway")
    arch = toolchain.check_arch(arch)
    if family is not None and family not in FAMILIES:
        raise ValueError(f"family must be one of {', '.join(FAMILIES)}, not {family!r}")
    if tile is None:
        tile = (FAMILIES[family].default_tile(head_dim, DTYPE_NAMES[dtype]) if family else
                tune_space.default_config(rules, head_dim, DTYPE_NAMES[dtype], arch).tile)
    config = KernelConfig(head_dim=head_dim, dtype=DTYPE_NAMES[dtype], arch=arch, tile=tile,
                          kernel_family=family or "", forward_only=DTYPE_NAMES[dtype] in FP8_DTYPES)
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
    family: str | None = None,
    forward_only: bool = False,
) -> Kernel:
    """Build (or load from the cache) the variant for these rules and return it as a callable kernel.

    `arch` defaults to the visible GPU's; `tile` to the first of the rules' `kernel.tiles` that fits,
    else the default tile for the head dim. Without a pinned `tile`, the kernel dispatches each
    sequence length to the configs the tuning database holds for this GPU (when it holds any);
    `tune=True` first tunes this head dim and dtype on the visible GPU -- or reuses what an earlier
    process tuned with the same candidate space (omnigen/tune/). `family` pins a kernel family (e.g.
    "sm80" or "sm90" on an H100) instead of the arch's own (omnigen.kernels.FAMILIES); it implies a
    pinned variant (no tuning database). `forward_only=True` builds the forward kernels alone (inference: a smaller
    module, somewhat faster to compile); its calls run under torch.no_grad() or on tensors that need no gradient,
    and a backward raises saying so. `dtype=torch.float8_e4m3fn` builds the sm90 family's FP8 forward (head dim
    128, forward-only, untuned: its default tile); its calls take `descale=(dq, dk, dv)` (omnigen/op/fp8.py).
    """
    if not isinstance(rules, Rules):
        raise TypeError(f"rules must be omnigen.Rules, not {type(rules).__name__}")
    if tune and dtype == fp8.FP8_DTYPE:
        raise ValueError("tune=True does not tune FP8 variants yet: build them with tune=False (the default tile)")
    if tune and (tile is not None or family is not None):
        raise ValueError("tune=True picks the tiles itself: pass tile=None and family=None, or tune=False to pin them")
    config = _variant_config(rules, head_dim, dtype, arch, tile, family)
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
        tuned = _tuned_choices(rules, config) if tile is None and family is None and config.dtype not in FP8_DTYPES else {}
    pinned = tile is not None or family is not None
    # Every config it may run, the tuned ones too, is built without its backward (FP8 variants always are).
    if forward_only or config.forward_only:
        config = replace(config, forward_only=True)
        tuned = {bucket: tune_db.Choice(replace(c.forward, forward_only=True), replace(c.forward, forward_only=True))
                 for bucket, c in tuned.items()}
        return Kernel(rules, config, cache.get_module(rules, config), tuned=tuned, backward=config)
    return Kernel(rules, config, cache.get_module(rules, config), tuned=tuned,
                  backward=None if pinned else default_backward(config))


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
    native.forget()


def _cached_kernel(key: tuple) -> Kernel | None:
    """attention()'s kernel for `key`, unless the tuning database was written since it was made."""
    kernel = _KERNELS.get(key)
    return kernel if kernel is not None and kernel.tuning_generation == tune_db.generation() else None


def kernel_for(rules: Rules, head_dim: int, dtype: torch.dtype, device: torch.device) -> Kernel:
    """attention()'s kernel for (rules, head dim, dtype, device): built (or loaded) on first use, then kept."""
    key = (rules.key, head_dim, dtype, device.index)
    kernel = _cached_kernel(key)
    if kernel is None:
        with _KERNELS_LOCK:
            kernel = _cached_kernel(key)
            if kernel is None:
                if device.type == "cuda":
                    with torch.cuda.device(device):
                        kernel = build(rules, head_dim=head_dim, dtype=dtype)
                else:
                    kernel = build(rules, head_dim=head_dim, dtype=dtype)
                _KERNELS[key] = kernel
    return kernel


def _resolve_rules_key(rules_key: str, head_dim: int, dtype: torch.dtype, device: torch.device) -> Kernel:
    """The op's "rules:<key>" kernels (library.resolve): the Rules are found by their key."""
    try:
        rules = rules_for_key(rules_key)
    except KeyError:
        raise ValueError(f"omnigen::attention: the rules {rules_key!r} are not alive in this process") from None
    return kernel_for(rules, head_dim, dtype, device)


library.set_rules_resolver(_resolve_rules_key)
tune_db.on_record(native.forget)  # a "rules:" key may resolve to newly tuned configs


# Plain layouts planned for the CPU path (op/cpu.py), which needs no kernel: (rules, layout, batch) -> Mask.
_HOST_MASKS = _Recent()


def _plan_rules_layout(rules: Rules, layout: Any, batch: int, seq_len: int, head_dim: int, dtype: torch.dtype,
                       device: torch.device) -> Mask:
    """attention()'s mask for a plain layout and a call on q of [batch, heads, seq_len, head_dim] in dtype."""
    layout = as_layout(layout)
    check_layout_against(layout, rules, batch, seq_len)
    if on_host_device(device):
        return _HOST_MASKS.get_or_make((rules.key, layout, batch), lambda: mask_from_plans(
            rules, _batched(layout, batch), [plan(rules, _batched(layout, batch), *cpu.TILE, device="cpu")]))
    return kernel_for(rules, head_dim, dtype, device)._mask_for_layout(layout, batch, device)


def _prepare_rules_layout(rules: Rules, layout: Any, q: torch.Tensor) -> Mask:
    return _plan_rules_layout(rules, layout, q.shape[0], q.shape[2], q.shape[-1], q.dtype, q.device)


_prepare_attention_layout = _disable(_prepare_rules_layout, _PLANNING_REASON)


def _plan_traced_layout(owner: tuple[str, str], layout: Any, batch: int, seq_len: int, head_dim: int,
                        dtype: torch.dtype, device: torch.device) -> Mask:
    """traced_layouts' planner: the mask a call of `owner` would make of a plain layout, made at trace time. The
    owner is ("rules", Rules.canonical) for attention() or ("kernel", op key) for a Kernel: constants, which a trace
    can hand over where objects may not go."""
    kind, name = owner
    if kind == "rules":
        return _plan_rules_layout(_rules_from_canonical(name), layout, batch, seq_len, head_dim, dtype, device)
    return _plan_layout(library.registered(name), layout, batch, seq_len, device)


@functools.lru_cache(maxsize=64)
def _rules_from_canonical(canonical: str) -> Rules:
    """Rules rebuilt from their canonical form: equal to the caller's, so the same key and kernel (kept: a mask
    holds its rules, and a trace may plan several layouts for them)."""
    return Rules.from_dict(json.loads(canonical), source="rules traced by torch.compile")


traced_layouts.set_planner(_plan_traced_layout)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: AnyLayout | Mask | str,
    rules: Rules | None = None,
    *,
    scale: float | None = None,
    return_lse: bool = False,
    deterministic: bool = False,
    descale: tuple[float | torch.Tensor, float | torch.Tensor, float | torch.Tensor] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Masked attention for `rules` over `layout` (or over a mask, which carries its rules); builds the
    variant on first use (cached in-process).

    q, k, v in torch.float8_e4m3fn (CUDA, Hopper, head dim 128) run the FP8 forward: bf16 out, no autograd,
    `descale=(dq, dk, dv)` the per-tensor factors of the stored values (default 1): Python numbers, or one-element
    float32 tensors on q's device (read by the kernel: no recompilation under torch.compile when they change).

    CPU tensors (float32, float64, bfloat16 or float16) run a plan-driven PyTorch path instead of a kernel, for
    tests and debugging (op/cpu.py): the same arguments, checks, outputs and autograd, in O(S * D) memory, far
    slower than a GPU."""
    if isinstance(layout, Mask):
        if rules is not None and (not isinstance(rules, Rules) or rules.key != layout.rules_key):
            raise ValueError("the rules given differ from the mask's: pass the mask alone, "
                             "omnigen.attention(q, k, v, mask)")
        scale = check_tensors(q, k, v, scale)
        _check_descale(q, k, v, descale)
        mask = layout
        check_mask(mask, q, mask.rules_key, mask.rules.name)
    else:
        if not isinstance(rules, Rules):
            raise TypeError(f"rules must be omnigen.Rules, not {type(rules).__name__}"
                            if rules is not None else "omnigen.attention needs the rules with a plain layout: "
                            "attention(q, k, v, layout, rules), or a mask: attention(q, k, v, omnigen.mask(...))")
        scale = check_call(q, k, v, layout, rules, scale)  # every mistake of the call at once, before building
        _check_descale(q, k, v, descale)
        # under fullgraph=True: planned while Dynamo traces (op/traced_layouts.py)
        mask = (traced_layouts.traced_mask(("rules", rules.canonical), layout, q)
                or _prepare_attention_layout(rules, layout, q))
    if fp8.is_fp8(q):
        return fp8.forward(q, k, v, mask, library.RULES_PREFIX + mask.rules_key, scale, descale, return_lse)
    return _call_op(q, k, v, mask, library.RULES_PREFIX + mask.rules_key, scale, deterministic, return_lse)


def mask(
    rules: Rules,
    layout: AnyLayout | str,
    device: torch.device | str | None = "cuda",
    *,
    batch: int | None = None,
    head_dim: int | None = None,
    dtype: torch.dtype | None = None,
    tiles: list[tuple[int, int]] | None = None,
    partial_bits: int | str = "auto",
) -> Mask:
    """Plan `layout` once (per batch) for every tile shape a kernel for `rules` may run at its length.

    The shapes: `tiles` when given; else, for each head dim (`head_dim`, else the rules' kernel head
    dims) and dtype (`dtype`, else the rules' kernel dtypes), the default tile and the tuned forward and
    backward tiles of this GPU's tuning database for the layout's sequence length. With the mask, a call
    (`omnigen.attention(q, k, v, mask)`, `kernel(q, k, v, mask)`) does no host sync and allocates nothing
    that depends on the layout. `batch` repeats a single layout over a batch.

    `partial_bits`: how many partial tiles (per tile shape) get their mask precomputed as bits, which the Hopper
    kernels read instead of evaluating the rules (1 bit per pair, for the forward's schedule and again for the
    backward's: 2 x 2 KB a 128 x 128 tile). "auto" (default): 4 per q-tile row of the batch, O(S) memory, more
    than Transfusion-style layouts use; "all": every tile (B * S^2 / 4 bytes at most; for layouts of many short
    segments); a number; "none". Partial tiles past the capacity are evaluated in the kernel, as they always are
    on other GPUs.
    """
    if not isinstance(rules, Rules):
        raise TypeError(f"rules must be omnigen.Rules, not {type(rules).__name__}")
    layout = as_layout(layout)
    check_layout_against(layout, rules, batch or layout.batch_size, layout.seq_len)
    device = _mask_device(device if device is not None else "cpu")
    if tiles is None:
        tiles = candidate_tile_shapes(rules, layout.seq_len, device, head_dim, dtype)
    return make_mask(rules, layout, tiles, device, batch, partial_bits)


def _mask_device(device: torch.device | str) -> torch.device:
    """Where a mask is made (plan.planners._check_device), with the advice for a machine without CUDA."""
    return _check_device(device, "on this machine make the mask with device='cpu' and call omnigen.attention with "
                                 "CPU tensors (a PyTorch path, for tests and debugging)")


def candidate_tile_shapes(rules: Rules, seq_len: int, device: torch.device, head_dim: int | None = None,
                          dtype: torch.dtype | None = None) -> list[tuple[int, int]]:
    """The (block_m, block_n) shapes kernels for `rules` may run at `seq_len` on `device` (see `mask`)."""
    spec = rules.kernel
    head_dims = [head_dim] if head_dim is not None else list(spec.head_dims if spec else (64, 128))
    if dtype is not None and dtype not in DTYPE_NAMES:
        raise TypeError(f"{_DTYPES_TAKEN}, not {dtype}")
    dtypes = [DTYPE_NAMES[dtype]] if dtype is not None else list(spec.dtypes if spec else ("bf16", "fp16"))
    arch = toolchain.visible_gpu_arch() if device.type == "cuda" else None
    tuned_on = database = None
    if arch is not None:
        try:  # read once: a mask is made per batch
            tuned_on, database = tune_db.Device.current(device), cache.read_tuning_db()
        except Exception:  # no toolchain: the default tiles only
            arch = None
    shapes: list[tuple[int, int]] = []
    for d in head_dims:
        for name in dtypes:
            configs = []
            try:
                default = tune_space.default_config(rules, d, name, arch or "sm_80")
                configs += [default, default_backward(default)]
            except ValueError:
                pass
            if arch is not None:
                entries = tune_db.entries_for(tuned_on, rules, name, d, database)
                found = tune_db.nearest(tune_db.choices(entries, d, name, arch), seq_len)
                if found is not None:
                    configs += [found.forward, found.backward]
            shapes += [(c.tile.block_m, c.tile.block_n) for c in configs]
    return list(dict.fromkeys(shapes)) or [(128, 64)]


ruleless.set_default_tiles(candidate_tile_shapes)  # masks made from data plan the kernels' tiles
