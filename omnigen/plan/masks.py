"""`Mask`: one layout (or batch) planned once for every tile shape a kernel may run, ready to call.

What `omnigen.mask(rules, layouts, device="cuda")` returns (the op layer picks the tile shapes;
`make_mask` here plans them). A call with a mask reads only tensors the mask already holds: the
per-token tables and, per tile shape, the forward and backward schedules. Their sizes depend only
on (B, S, tile shape) -- the schedules are kept in buffers of B * nq * nk entries, of which the
plan's `num_tiles` are used -- so

- a call does no host synchronisation and allocates nothing whose size depends on the layout
  (a training step with a mask can be captured in a CUDA graph);
- masks of different layouts with the same B, S and tiles have tensors of the same shapes:
  `torch.compile` does not recompile for a new mask, and `mask.copy_(other)` refreshes a mask that
  a CUDA graph captured, in place.

On a CUDA device with Triton and at most `CAPACITY_LIMIT` tiles per schedule, making the mask does
not synchronise either (the planner's totals stay on the GPU until `mask.plan(...)` asks for them).
Above that limit the schedules are exact (their sizes then depend on the layout).

Per tile shape a mask also holds partial tiles' masks as bits (`plan.bits`: slot starts per schedule row and the
bits of up to a capacity of partial tiles, for the forward schedule and the backward's), which the sm90 kernels
read instead of evaluating the rules. Their capacity is `partial_bits` ("auto": a few tiles per q-tile row, O(S);
"all"; a number; "none"), fixed by B, S and the tile shape; a mask made from exact plans (a call with a plain
layout) holds every partial tile's.
"""

from __future__ import annotations

from typing import Iterable

import torch

from ..layout import AnyLayout, Layout, LayoutBatch, LayoutTables, as_layout
from ..rules import Rules
from . import bits, host
from .planners import _check_block, _gpu_planner
from .schedule import Plan

# Schedules of at most this many tiles are kept at full capacity (16 MiB per int32 buffer), as the
# GPU planner's inline buffers are (plan.gpu.INLINE_TILE_LIMIT).
CAPACITY_LIMIT = 1 << 22
# The tensors a mask holds per tile shape, in this order (the op's `schedules` list: eight per shape): the plan's
# schedules, then the partial tiles' bits (plan.bits) for the forward schedule and for the backward's.
SCHEDULE_TENSORS = ("fwd_ptr", "fwd_kv", "bwd_ptr", "bwd_q", "partial_slot", "partial_bits", "partial_slot_bwd",
                    "partial_bits_bwd")
PER_SHAPE = len(SCHEDULE_TENSORS)
# A mask made from exact plans holds bits for every partial tile up to this many bytes per tile shape (1 bit per
# pair: 256 MiB is a 46K-token layout whose every tile is partial); the tiles past it are evaluated by the kernel.
EXACT_BITS_LIMIT = 1 << 28


class Mask:
    """A layout (or batch) planned for a set of tile shapes, in fixed-size tensors. Accepted wherever a
    layout is (`kernel(q, k, v, mask)`, `omnigen.attention(q, k, v, mask)`, `omnigen.plan(rules, mask)`).

    Attributes a call reads (plain attributes, so `torch.compile` traces them as graph inputs):
    `token_segment`, `token_modality`, `token_doc` (int32 [B, S]); `schedules`, eight tensors per tile
    shape (SCHEDULE_TENSORS: fwd_ptr, fwd_kv, bwd_ptr, bwd_q, then the partial tiles' slot starts and bits for
    the forward and the backward);
    `tile_shapes`, (block_m, block_n) per tile shape flattened; `rules_key`, the rules' identity (`Rules.key`).
    """

    # True for a mask made from data (omnigen.plan.ruleless): its partial tiles exist only as bits, every one of them.
    ruleless = False
    # Which maker made a mask from data ("mask_from_mod", "mask_from_dense", "mask_from_intervals"; None otherwise or
    # when unknown): the op's checks name it in the fix when the mask meets q/k/v of another batch or length.
    made_by: str | None = None
    # A reordered mask (omnigen.reorder) holds the plan of the permuted sequence and the permutation (int64 [S] or
    # [B, S]: reordered position i is original token permutation[..., i]) with its inverse; a call gathers q, k, v
    # into its order and scatters the output back (op/permute.py), so callers always see the original order.
    permutation: torch.Tensor | None = None
    inverse_permutation: torch.Tensor | None = None

    def __init__(self, rules: Rules, layout: AnyLayout, tables: LayoutTables,
                 entries: dict[tuple[int, int], tuple], device: torch.device, fixed: bool) -> None:
        self.rules = rules
        self.rules_key = rules.key
        self.layout = layout
        self.device = device
        self.batch_size = tables.batch_size
        self.seq_len = tables.seq_len
        self.batched = isinstance(layout, LayoutBatch)
        self.fixed = fixed  # schedules at full capacity (sizes depend on B, S and the tiles only)
        self.tables = tables
        # Own copies of the per-token tables (not views into `tables.packed`): fixed shapes and offsets.
        self.token_segment = tables.token_segment.clone()
        self.token_modality = tables.token_modality.contiguous()
        self.token_doc = tables.token_doc.contiguous()
        self._entries = entries  # (block_m, block_n) -> (the SCHEDULE_TENSORS..., totals or Plan)
        self.schedules: list[torch.Tensor] = [t for entry in entries.values() for t in entry[:PER_SHAPE]]
        self.tile_shapes: tuple[int, ...] = tuple(x for shape in entries for x in shape)

    # -- what it holds ---------------------------------------------------------------------------

    @property
    def tiles(self) -> tuple[tuple[int, int], ...]:
        """The (block_m, block_n) shapes this mask was planned for."""
        return tuple(self._entries)

    def has_tile(self, block_m: int, block_n: int) -> bool:
        return (block_m, block_n) in self._entries

    def plan(self, block_m: int, block_n: int) -> Plan:
        """The exact `Plan` of one tile shape (reads the planner's totals: a host sync the first time)."""
        entry = self._entries.get((block_m, block_n))
        if entry is None:
            raise ValueError(f"this mask has no plan for {block_m}x{block_n} tiles (it has {self._tile_text()})")
        last = entry[PER_SHAPE]
        if isinstance(last, Plan):
            return last
        fwd_ptr, fwd_kv, bwd_ptr, bwd_q = entry[:4]
        totals = last
        total, pairs = (int(x) for x in totals.tolist())
        made = Plan(block_m=block_m, block_n=block_n, batch_size=self.batch_size, seq_len=self.seq_len,
                    batched=self.batched, fwd_ptr=fwd_ptr, fwd_kv=fwd_kv[:total], bwd_ptr=bwd_ptr,
                    bwd_q=bwd_q[:total], pair_count=pairs, tables=self.tables, rules_hash=self.rules.mask_hash())
        self._entries[(block_m, block_n)] = entry[:PER_SHAPE] + (made,)
        return made

    @property
    def allowed_pairs(self) -> int:
        return self.plan(*self.tiles[0]).allowed_pairs

    @property
    def modalities(self) -> frozenset[str]:
        return frozenset(self.layout.modalities)

    def nbytes(self) -> int:
        tensors = [self.token_segment, self.token_modality, self.token_doc, *self.schedules]
        return sum(t.numel() * t.element_size() for t in tensors)

    # -- refreshing in place ---------------------------------------------------------------------

    def copy_(self, other: "Mask") -> "Mask":
        """Copy another mask's tables and schedules into this one's tensors (same rules, B, S and tiles):
        how a CUDA graph captured with this mask runs a new layout. Asynchronous; returns self."""
        if not isinstance(other, Mask):
            raise TypeError(f"copy_ takes an omnigen mask, not {type(other).__name__}")
        problems = []
        if other.rules_key != self.rules_key:
            problems.append("other rules")
        if (other.batch_size, other.seq_len) != (self.batch_size, self.seq_len):
            problems.append(f"B x S {other.batch_size} x {other.seq_len} instead of {self.batch_size} x {self.seq_len}")
        if other.tiles != self.tiles:
            problems.append(f"tiles {other._tile_text()} instead of {self._tile_text()}")
        mine = [self.token_segment, self.token_modality, self.token_doc, *self.schedules]
        theirs = [other.token_segment, other.token_modality, other.token_doc, *other.schedules]
        if not problems and any(a.shape != b.shape for a, b in zip(mine, theirs)):
            problems.append("schedules or partial-tile bits of another size (masks above CAPACITY_LIMIT tiles, and "
                            "masks from plain layouts, are exact-sized; omnigen.mask's partial_bits must match)")
        mine_order, theirs_order = self.permutation, other.permutation
        if (mine_order is None) != (theirs_order is None) or (mine_order is not None and mine_order.shape != theirs_order.shape):
            problems.append("one is reordered (omnigen.reorder) and the other not, or their permutations differ in shape")
        if problems:
            raise ValueError("mask.copy_: the masks differ: " + "; ".join(problems))
        if mine_order is not None:
            self.permutation.copy_(theirs_order, non_blocking=True)
            self.inverse_permutation.copy_(other.inverse_permutation, non_blocking=True)
        for a, b in zip(mine, theirs):
            a.copy_(b, non_blocking=True)
        self.layout, self.tables = other.layout, other.tables
        self._entries = {shape: self._entries[shape][:PER_SHAPE] + (_copied_totals(other._entries[shape][PER_SHAPE]),)
                         for shape in self._entries}
        return self

    def _tile_text(self) -> str:
        return ", ".join(f"{m}x{n}" for m, n in self.tiles) or "none"

    def __repr__(self) -> str:
        return (f"omnigen.Mask(rules={self.rules.name!r}, B={self.batch_size}, S={self.seq_len}, "
                f"tiles=[{self._tile_text()}], device={self.device})")


def _copied_totals(last):
    """After copy_: the other mask's totals (a Plan is rebuilt from them when asked)."""
    if isinstance(last, Plan):
        return torch.tensor([last.num_tiles, last.allowed_pairs], dtype=torch.int64)
    return last.clone()


def _capacity(tensor: torch.Tensor, size: int) -> torch.Tensor:
    """`tensor` in a zero-filled buffer of `size` entries (a device-side copy, no sync)."""
    if tensor.numel() == size:
        return tensor
    out = torch.zeros(size, dtype=tensor.dtype, device=tensor.device)
    out[: tensor.numel()].copy_(tensor)
    return out


def make_mask(rules: Rules, layout: AnyLayout | str, tiles: Iterable[tuple[int, int]],
              device: torch.device | str | None = None, batch: int | None = None,
              partial_bits: int | str = "auto") -> Mask:
    """Plan `layout` for every (block_m, block_n) in `tiles` on `device` and return the `Mask`.

    A single Layout with `batch` > 1 is repeated over the batch (a kernel call indexes the tables by
    batch element). `partial_bits`: how many partial tiles per shape get their mask as bits (`bits.capacity_for`:
    "auto", "all", "none" or a number); the rest are evaluated by the kernel."""
    if not isinstance(rules, Rules):
        raise TypeError(f"rules must be omnigen.Rules, not {type(rules).__name__}")
    layout = as_layout(layout)
    if isinstance(layout, Mask):  # pragma: no cover - as_layout returns the mask's layout
        layout = layout.layout
    if batch is not None:
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch must be a positive integer, not {batch!r}")
        if isinstance(layout, Layout) and batch > 1:
            layout = LayoutBatch([layout] * batch)
        elif layout.batch_size != batch:
            raise ValueError(f"batch={batch}, but the layouts hold {layout.batch_size} batch elements")
    shapes = list(dict.fromkeys((_check_block(m, "block_m"), _check_block(n, "block_n")) for m, n in tiles))
    if not shapes:
        raise ValueError("a mask needs at least one tile shape")
    bits.capacity_for(partial_bits, 1, 1, 1, 1)  # a bad choice raises before any planning
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    tables = layout.tables(rules, device)  # unknown modalities raise here, naming the rules
    B, S = tables.batch_size, tables.seq_len
    gpu = _gpu_planner() if device.type == "cuda" else None
    entries: dict[tuple[int, int], tuple] = {}
    fixed = True
    for block_m, block_n in shapes:
        capacity = B * (-(-S // block_m)) * (-(-S // block_n))
        if gpu is not None:
            fwd_ptr, fwd_kv, bwd_ptr, bwd_q, last = gpu.classify_and_schedule(rules, tables, block_m, block_n, exact=False)
            if not isinstance(last, torch.Tensor):  # above the inline limit: exact schedules
                last = Plan(block_m, block_n, B, S, isinstance(layout, LayoutBatch), fwd_ptr, fwd_kv, bwd_ptr, bwd_q,
                            last, tables, rules.mask_hash())
        else:
            host_tables = tables if device.type == "cpu" else layout.tables(rules, "cpu")
            fwd_ptr, fwd_kv, bwd_ptr, bwd_q, count = host.classify_and_schedule(rules, host_tables, block_m, block_n, device)
            last = Plan(block_m, block_n, B, S, isinstance(layout, LayoutBatch), fwd_ptr, fwd_kv, bwd_ptr, bwd_q,
                        count, tables, rules.mask_hash())
        if capacity <= CAPACITY_LIMIT:
            fwd_kv, bwd_q = _capacity(fwd_kv, capacity), _capacity(bwd_q, capacity)
        else:
            fixed = False
        slots = bits.capacity_for(partial_bits, B, S, block_m, block_n) if _reads_bits(device) else 0
        made = _bits_both_ways(rules, tables, fwd_ptr, fwd_kv, bwd_ptr, bwd_q, block_m, block_n, slots)
        entries[(block_m, block_n)] = (fwd_ptr, fwd_kv, bwd_ptr, bwd_q, *made, last)
    return Mask(rules, layout, tables, entries, device, fixed)


def mask_from_plans(rules: Rules, layout: AnyLayout, plans: Iterable[Plan]) -> Mask:
    """A Mask around plans already made (the eager path of a call with a plain layout): exact schedules."""
    plans = list(plans)
    entries = {(p.block_m, p.block_n): (p.fwd_ptr, p.fwd_kv, p.bwd_ptr, p.bwd_q, *_exact_bits(rules, p), p)
               for p in plans}
    return Mask(rules, layout, plans[0].tables, entries, plans[0].device, fixed=False)


def _reads_bits(device: torch.device) -> bool:
    """Whether a kernel on `device` reads partial tiles' bits: the sm90 family's forward and Hopper backward
    (compute capability 9.x). Elsewhere a mask holds none (capacity 0), which costs nothing."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def _bits_both_ways(rules: Rules, tables: LayoutTables, fwd_ptr, fwd_kv, bwd_ptr, bwd_q, block_m: int, block_n: int,
                    slots: int) -> tuple[torch.Tensor, ...]:
    """(partial_slot, partial_bits, partial_slot_bwd, partial_bits_bwd): `slots` partial tiles of each schedule."""
    forward = bits.partial_bits(rules, tables, fwd_ptr, fwd_kv, block_m, block_n, slots)
    backward = bits.partial_bits(rules, tables, bwd_ptr, bwd_q, block_m, block_n, slots, transposed=True)
    return (*forward, *backward)


def _exact_bits(rules: Rules, p: Plan) -> tuple[torch.Tensor, ...]:
    """Bits for every partial tile of an exact plan, up to EXACT_BITS_LIMIT bytes per schedule (the rest are
    evaluated)."""
    slots = 0
    if _reads_bits(p.device):
        most = EXACT_BITS_LIMIT // (4 * max(bits.slot_words(p.block_m, p.block_n, t) for t in (False, True)))
        slots = min(p.counts()["partial"], most)
    return _bits_both_ways(rules, p.tables, p.fwd_ptr, p.fwd_kv, p.bwd_ptr, p.bwd_q, p.block_m, p.block_n, slots)
