"""The torch.library ops behind `omnigen.attention` and `Kernel.__call__`: `omnigen::attention` and
`omnigen::attention_backward`.

Only tensors and primitive values cross the op boundary, so `torch.compile` puts each call in its graph
as one node (it never traces the launch code, which reads raw pointers and the CUDA stream):

    omnigen::attention(q, k, v, schedules, tiles, token_segment, token_modality, token_doc,
                       kernel, scale, deterministic) -> (out, lse)
    omnigen::attention_backward(d_out, q, k, v, out, lse, schedules, tiles, token_segment,
                                token_modality, token_doc, kernel, scale, deterministic) -> (dq, dk, dv)

- `schedules`: a mask's schedules, eight int32 tensors per tile shape (fwd_ptr, fwd_kv, bwd_ptr, bwd_q, and the
  partial tiles' slot starts and bits for both schedules, `omnigen.plan.bits`);
  `tiles`: their (block_m, block_n), flattened. The op runs the tile shapes its kernel picks for the
  sequence length (the tuned choice, or the default) and finds their schedules in the list.
- `kernel`: which kernel, as a string: "kernel/v2:<Kernel.key>" (a `Kernel` object of this process) or
  "rules/v2:<Rules.key>" (what `omnigen.attention` builds on first use for the rules, head dim, dtype and
  device of q).
- token tables: int32 [B, S], the layout's segment, modality and document of every token.

On CPU tensors both ops run the PyTorch path of `op/cpu.py` (for tests and debugging) with the rules the key
names, on whichever of the mask's tile shapes is largest; no kernel is built. `register_fake` gives the output
shapes (for FakeTensor tracing), `op/autograd.py` registers the backward. The kernels behind the string keys
live in in-process registries (`register_kernel`, and the resolver `op/kernel.py` installs for "rules/v2:" keys);
nothing here imports the layer that makes them.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, Callable, NamedTuple

import torch

from ..kernels import as_heads_inner, capabilities, family_of, heads_inner, kernel_ready
from ..plan.masks import PER_SHAPE, SCHEDULE_TENSORS
from ..plan.ruleless import is_ruleless
from ..plan.schedule import dq_ranks
from ..rules import rules_for_key
from . import checks, cpu

# The kernel strings carry the version of the ops' output layout (heads_inner since v2). torch.compile's caches
# key a compiled graph by the graph, these strings included, but not by a custom op's fake: a graph cached by an
# omnigen whose outputs had other strides would be reused and stop at Inductor's stride assertion. Bump the
# version with any change to what the fakes return.
OUTPUT_LAYOUT_VERSION = 2
KERNEL_PREFIX = f"kernel/v{OUTPUT_LAYOUT_VERSION}:"
RULES_PREFIX = f"rules/v{OUTPUT_LAYOUT_VERSION}:"

_KERNELS: dict[str, Any] = {}
_COUNTER = itertools.count()
_LOCK = threading.Lock()
# (rules key, head_dim, dtype, device) -> Kernel: installed by op/kernel.py (it builds on first use).
_rules_resolver: Callable[[str, int, torch.dtype, torch.device], Any] | None = None


def register_kernel(kernel: Any, name: str) -> str:
    """Give a kernel its op key ("kernel/v2:<name>#<n>"), unique in the process."""
    with _LOCK:
        key = f"{KERNEL_PREFIX}{name}#{next(_COUNTER)}"
        _KERNELS[key] = kernel
    return key


def set_rules_resolver(resolver: Callable[[str, int, torch.dtype, torch.device], Any]) -> None:
    global _rules_resolver
    _rules_resolver = resolver


def registered(kernel: str) -> Any:
    """The Kernel object of a "kernel/v2:" key (register_kernel)."""
    found = _KERNELS.get(kernel)
    if found is None:
        raise ValueError(f"omnigen::attention: no kernel {kernel!r} in this process")
    return found


def resolve(kernel: str, q: torch.Tensor) -> Any:
    """The Kernel object a key names (for a "rules/v2:" key: the one for q's head dim, dtype and device)."""
    if kernel.startswith(KERNEL_PREFIX):
        return registered(kernel)
    if kernel.startswith(RULES_PREFIX) and _rules_resolver is not None:
        return _rules_resolver(kernel[len(RULES_PREFIX):], q.shape[-1], q.dtype, q.device)
    raise ValueError(f"omnigen::attention: kernel must be '{KERNEL_PREFIX}<key>' or '{RULES_PREFIX}<key>', not {kernel!r}")


def rules_of(kernel: str) -> Any:
    """The Rules a kernel key stands for, without building anything (what the CPU path needs of a key)."""
    if kernel.startswith(KERNEL_PREFIX):
        return registered(kernel).rules
    if kernel.startswith(RULES_PREFIX):
        try:
            return rules_for_key(kernel[len(RULES_PREFIX):])
        except KeyError:
            raise ValueError(f"omnigen::attention: the rules {kernel[len(RULES_PREFIX):]!r} are not alive in this "
                             "process") from None
    raise ValueError(f"omnigen::attention: kernel must be '{KERNEL_PREFIX}<key>' or '{RULES_PREFIX}<key>', not {kernel!r}")


def on_host_path(q: torch.Tensor) -> bool:
    """Whether a call runs the CPU path (op/cpu.py): CPU tensors, unless tests stand an emulator of the kernels
    in on the CPU (they add "cpu" to checks.DEVICE_TYPES, the device types the kernels run on)."""
    return on_host_device(q.device)


def on_host_device(device: torch.device) -> bool:
    """on_host_path for tensors on `device`."""
    return device.type == "cpu" and "cpu" not in checks.DEVICE_TYPES


def host_schedules(schedules: list[torch.Tensor], tiles: list[int], tables: TokenTables) -> Schedules:
    """The CPU path's pick of a mask's tile shapes: the largest (fewest trips through its Python loop)."""
    shapes = [(tiles[i], tiles[i + 1]) for i in range(0, len(tiles), 2)]
    block_m, block_n = max(shapes, key=lambda shape: (shape[0] * shape[1], shape[0]))
    return schedules_for(schedules, tiles, tables, block_m, block_n)


def has_backward(module: Any) -> bool:
    """Whether a built module carries backward kernels (older modules without the flag: a `backward`)."""
    return capabilities(module).has_backward


class TokenTables(NamedTuple):
    """The per-token tables a launch reads (the attributes of LayoutTables that kernels use)."""

    token_segment: torch.Tensor
    token_modality: torch.Tensor
    token_doc: torch.Tensor

    @property
    def batch_size(self) -> int:
        return self.token_segment.shape[0]

    @property
    def seq_len(self) -> int:
        return self.token_segment.shape[1]


class Schedules(NamedTuple):
    """What a kernel family's launch reads of a plan: the attributes of `Plan` that kernels use."""

    block_m: int
    block_n: int
    fwd_ptr: torch.Tensor
    fwd_kv: torch.Tensor
    bwd_ptr: torch.Tensor
    bwd_q: torch.Tensor
    partial_slot: torch.Tensor  # plan.bits: slot of each q-tile row's first partial entry
    partial_bits: torch.Tensor  # plan.bits: the partial tiles' masks, as many slots as it holds
    partial_slot_bwd: torch.Tensor  # the same for the backward schedule (transposed tiles)
    partial_bits_bwd: torch.Tensor
    tables: TokenTables

    @property
    def batch_size(self) -> int:
        return self.tables.batch_size

    @property
    def seq_len(self) -> int:
        return self.tables.seq_len

    @property
    def num_q_tiles(self) -> int:
        return -(-self.seq_len // self.block_m)

    @property
    def num_kv_tiles(self) -> int:
        return -(-self.seq_len // self.block_n)

    def dq_ranks(self) -> torch.Tensor:
        """The order of deterministic mode's dQ additions on Hopper (omnigen.plan.schedule.dq_ranks)."""
        return dq_ranks(self.fwd_ptr, self.fwd_kv, self.bwd_ptr, self.bwd_q, self.batch_size, self.num_q_tiles,
                        self.num_kv_tiles)

    @property
    def device(self) -> torch.device:
        return self.fwd_ptr.device


def schedules_for(schedules: list[torch.Tensor], tiles: list[int], tables: TokenTables, block_m: int,
                  block_n: int) -> Schedules:
    """The schedules of one tile shape out of the op's flat lists; ValueError when the mask lacks it."""
    for index in range(len(tiles) // 2):
        if tiles[2 * index] == block_m and tiles[2 * index + 1] == block_n:
            return Schedules(block_m, block_n, *schedules[PER_SHAPE * index : PER_SHAPE * (index + 1)], tables)
    have = ", ".join(f"{tiles[i]}x{tiles[i + 1]}" for i in range(0, len(tiles), 2)) or "none"
    raise ValueError(
        f"the mask has no plan for {block_m}x{block_n} tiles, which this kernel runs at this sequence length "
        f"(it has {have}); make it with omnigen.mask(rules, layout, device, head_dim=..., dtype=...) for this "
        "head dim and dtype, or with kernel.mask(layout) (masks from mask_from_mod, mask_from_dense and "
        "mask_from_intervals take the same head_dim= and dtype=)"
    )


def _check_lists(schedules: list[torch.Tensor], tiles: list[int]) -> None:
    if len(schedules) != PER_SHAPE * (len(tiles) // 2) or len(tiles) % 2 or not tiles:
        raise ValueError(f"omnigen::attention: {len(schedules)} schedule tensors for {len(tiles) // 2} tile shapes "
                         f"({PER_SHAPE} per shape: {', '.join(SCHEDULE_TENSORS)})")


def pass_module(kernel: str, q: torch.Tensor, backward: bool) -> tuple[Any, Any]:
    """(config, module) of the pass a call of q's sequence length runs for a kernel key; RuntimeError when the
    backward is asked of a module that has none. The Python kernels below and the op shim (op/native/) both use it."""
    found = resolve(kernel, q)
    choice = found.choice(q.shape[2])
    config = choice.backward if backward else choice.forward
    module = found.module_for(config)
    if backward and not has_backward(module):
        raise RuntimeError(f"{module.MODULE_NAME} has no backward kernel: "
                           f"{capabilities(module).backward_problem or 'rebuild with a newer omnigen'}")
    if kernel.startswith(RULES_PREFIX) and is_ruleless(kernel[len(RULES_PREFIX):]) and not capabilities(module).partial_bits:
        raise ValueError(_ruleless_refusal(f"{module.MODULE_NAME} ({'backward' if backward else 'forward'}) does not "
                                           "read partial tiles' bits"))
    return config, module


def pass_plan(kernel: str, q: torch.Tensor, backward: bool, schedules: list[torch.Tensor], tiles: list[int],
              tables: TokenTables) -> tuple[Any, Any, Schedules]:
    """`pass_module`'s (config, module), and the schedules of the tile shape that config runs, out of the op's lists."""
    config, module = pass_module(kernel, q, backward)
    return config, module, schedules_for(schedules, tiles, tables, config.tile.block_m, config.tile.block_n)


def _ruleless_refusal(why: str) -> str:
    return (f"omnigen::attention: this mask was made from data (mask_from_dense / mask_from_mod / "
            f"mask_from_intervals), so its partial tiles exist only as bits, and {why}. Such masks run on the sm80 "
            "family's kernels, the sm90 family's built with partial_bits on (the default), and on CPU tensors")


# Inductor may hand the ops q, k, v, out and dO in whatever layout their producers find cheapest
# (flexible_layout): the kernels take any row strides (kernel_ready copies only a tensor they cannot read), and
# the outputs' layout is fixed (heads_inner), never derived from the inputs', so the fakes stay right whatever
# Inductor picks. The default would pin every input to the layout eager mode gave it at trace time. With both, a
# training step of benchmarks/train_step.py's config (a) took 1 GiB less memory (RESULTS.md, eleventh session).
LAYOUT_TAGS = (torch._C.Tag.flexible_layout,)


@torch.library.custom_op("omnigen::attention", mutates_args=(), tags=LAYOUT_TAGS)
def attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, schedules: list[torch.Tensor], tiles: list[int],
    token_segment: torch.Tensor, token_modality: torch.Tensor, token_doc: torch.Tensor,
    kernel: str, scale: float, deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_lists(schedules, tiles)
    if on_host_path(q):
        rules = rules_of(kernel)
        plan = host_schedules(schedules, tiles, TokenTables(token_segment, token_modality, token_doc))
        out, lse = cpu.forward(rules, plan, q, k, v, scale)
        return as_heads_inner(out), lse
    config, module, plan = pass_plan(kernel, q, False, schedules, tiles,
                                     TokenTables(token_segment, token_modality, token_doc))
    q, k, v = (kernel_ready(t) for t in (q, k, v))
    out, lse = family_of(config).forward(module, plan, q, k, v, scale)
    return as_heads_inner(out), lse


@attention_op.register_fake
def _attention_fake(q, k, v, schedules, tiles, token_segment, token_modality, token_doc, kernel, scale, deterministic):
    B, Hq, S, D = q.shape
    return heads_inner(B, Hq, S, D, dtype=q.dtype, device=q.device), q.new_empty(B, Hq, S, dtype=torch.float32)


@torch.library.custom_op("omnigen::attention_backward", mutates_args=(), tags=LAYOUT_TAGS)
def attention_backward_op(
    d_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    schedules: list[torch.Tensor], tiles: list[int],
    token_segment: torch.Tensor, token_modality: torch.Tensor, token_doc: torch.Tensor,
    kernel: str, scale: float, deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_lists(schedules, tiles)
    if on_host_path(q):
        plan = host_schedules(schedules, tiles, TokenTables(token_segment, token_modality, token_doc))
        return tuple(as_heads_inner(g) for g in cpu.backward(rules_of(kernel), plan, q, k, v, out, lse, d_out, scale))
    config, module, plan = pass_plan(kernel, q, True, schedules, tiles,
                                     TokenTables(token_segment, token_modality, token_doc))
    q, k, v, out, d_out = (kernel_ready(t) for t in (q, k, v, out, d_out))
    dq, dk, dv = family_of(config).backward(module, plan, q, k, v, out, lse, d_out, scale, deterministic)
    # Own tensors in the layout the fake says (a family may hand back views or k-shaped strides).
    return tuple(as_heads_inner(g) for g in (dq, dk, dv))


@attention_backward_op.register_fake
def _attention_backward_fake(d_out, q, k, v, out, lse, schedules, tiles, token_segment, token_modality, token_doc,
                             kernel, scale, deterministic):
    return tuple(heads_inner(*t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
