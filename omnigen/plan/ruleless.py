"""Masks no rule says -- a dense boolean mask, a FlexAttention `mask_mod`, FlashMask's column intervals -- as a `Mask`.

The makers (`from_dense`, `from_mod`, `from_intervals`) classify every tile exactly (empty / full / causal /
partial, the definition of docs/semantics.md section 5) and hand this module, per tile shape, the kind grid, the
allowed-pair count and the partial tiles' boolean blocks; `ruleless_mask` turns them into the same `Mask` that
`omnigen.mask` returns (schedules, partial tiles' bits for both schedules, per-token tables), accepted by
`omnigen.attention`, the custom op, `torch.compile` and CUDA graphs like any other.

Partial tiles without rules (the design)
----------------------------------------
A layout's mask has rules: a kernel can always evaluate a partial tile's predicate from the token tables, and the
bits (`plan.bits`) are a cache in front of that evaluation -- slots past the capacity fall back to the rules. A
mask made from data has no predicate the kernels could evaluate, so for it:

1. **Every partial tile has bits, in both schedules.** The capacity is never "auto" or "none": by default it is
   exactly the number of partial tiles (`partial_bits="exact"`; the mask's tensors then have sizes that depend on the
   mask, as a mask made from exact plans does); `partial_bits=N` reserves N slots (fixed shapes for CUDA graphs and
   `torch.compile`: N >= the partial tiles, else a ValueError naming the count), `"all"` one per tile. So a kernel that
   reads bits (`PARTIAL_BITS`: the sm90 forward and the Hopper backward; the sm80 family's forward, dK/dV and dQ
   kernels in the module of these rules) finds every partial entry's slot below the
   capacity (`slot < partial_slots`) and never takes its evaluating branch. The bits are made on every device (the
   rules-based `make_mask` makes them only where a Hopper kernel reads them): the CPU path and the sm80 family have
   no other way to know a partial tile.
2. **The mask says it has no rules, through the op boundary.** It carries `RULELESS_RULES` (a fixed rule set, name
   `bits_only`), so the op's kernel string is `rules/v2:<RULELESS_RULES.key>` and `is_ruleless(rules)` is what a
   kernel family, the CPU path or the op's checks ask to know that partial tiles must come from the bits
   (`mask.ruleless` on the Python side). One kernel module per (head dim, dtype, arch) serves every such mask.
3. **If something evaluates the rules anyway, it drops keys, it never adds them.** The per-token tables are those of
   an all-`pad` layout (one pad segment of S tokens per batch element): the rules' predicate is False for every
   pair, so a path that ignored the bits would give rows of zeros on partial tiles (loud in any test against a
   reference), never attention to a key the mask hides. Full and causal tiles do not read the tables.

What the op layer needs to add (omnigen/op, not edited here): refuse a ruleless mask on a module whose
`capabilities(module).partial_bits` is False (sm90 built with `HopperOptions(partial_bits=False)`), with
a message saying so; the CPU path's masker must read a partial span's tiles from the bits (`tile_bits.unpack` of the
span's slots, `bits.slot_starts` finds them) when `is_ruleless(rules)`; `omnigen.plan(rules, mask)` should refuse a
ruleless mask (its layout is the all-pad stand-in) and point at `mask.plan(block_m, block_n)`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch

from ..layout import Layout, LayoutBatch, LayoutTables
from ..rules import Rules
from ..semantics import CAUSAL, EMPTY, FULL, PARTIAL, SCHEDULE_KINDS
from . import bits, classify_gpu
from .masks import CAPACITY_LIMIT, PER_SHAPE, SCHEDULE_TENSORS, Mask, _capacity
from .planners import _check_block
from .schedule import Plan
from .tile_bits import pack, pack_elements, unpack

# The rule set every mask without rules carries: its key tells the op and the kernels "partial tiles from bits
# only". One modality that sees all of its own segment and nothing else; the masks' tables are all pad (see above).
RULELESS_RULES = Rules(name="bits_only", modalities={"token": "full"}, see={"default": "none"})
RULELESS_KEY = RULELESS_RULES.key  # also keeps the rules registered (rules_for_key) for the process's lifetime

# The choices of `partial_bits` a mask without rules takes (besides a number of slots).
CAPACITY_CHOICES = ("exact", "all")


def is_ruleless(rules: Rules | str) -> bool:
    """Whether `rules` (or a rules key, as the op receives it) is the stand-in of a mask without rules: partial
    tiles must come from the mask's bits, never from evaluating the rules."""
    return (rules if isinstance(rules, str) else rules.key) == RULELESS_KEY


@dataclass
class ShapePlan:
    """One tile shape of a mask made from data: what a maker found.

    `kinds`: int8 [B, nq, nk] on the planning device; `pairs`: allowed pairs; `partials`: chunks of partial tiles
    as (batch, q-tile, kv-tile) int64 [n] each and their blocks bool [n, block_m, block_n] (queries x keys; positions
    past the sequence False), in any order, every partial tile of `kinds` exactly once -- a list, or a function
    that makes them again on each call (they are walked twice, so a maker that can evaluate them cheaply does not
    hold every partial tile's block at once). A maker that packed the blocks already gives `packed` instead: chunks
    of (batch, q-tile, kv-tile, forward slot words [n, ...], backward slot words [n, ...]) (`tile_bits.pack`), so
    only bits are held. `partial_count`: the partial tiles of `kinds`, where the maker knows it without a host wait.
    `fused`: what `classify_gpu` left instead of `packed` (buffers of words and row counts its schedules read)."""

    block_m: int
    block_n: int
    kinds: torch.Tensor
    pairs: int
    partials: Iterable[tuple[torch.Tensor, ...]] | Callable[[], Iterable[tuple[torch.Tensor, ...]]]
    packed: list[tuple[torch.Tensor, ...]] | None = None
    partial_count: int | None = None
    fused: classify_gpu.FusedTiles | None = None

    def partial_chunks(self) -> Iterable[tuple[torch.Tensor, ...]]:
        return self.partials() if callable(self.partials) else self.partials


# ---- classification -------------------------------------------------------------------------------------------


def kinds_from_counts(allowed: torch.Tensor, above: torch.Tensor, below_missing: torch.Tensor,
                      area: torch.Tensor) -> torch.Tensor:
    """int8 kinds from exact per-tile counts (any shape): allowed pairs, allowed pairs above the diagonal (k > q),
    pairs on or below it that are not allowed, and the tile's pairs inside the sequence. Causal: the tile's mask is
    exactly k <= q -- nothing above, nothing missing below -- and it is neither empty nor full."""
    # Python scalars in torch.where keep int8 and make no device tensor (on a GPU each would be a copy from the host).
    kinds = torch.full(allowed.shape, PARTIAL, dtype=torch.int8, device=allowed.device)
    kinds = torch.where((above == 0) & (below_missing == 0), CAUSAL, kinds)
    kinds = torch.where(allowed == area, FULL, kinds)
    return torch.where(allowed == 0, EMPTY, kinds)


def tile_area(S: int, block_m: int, block_n: int, device: torch.device) -> torch.Tensor:
    """int64 [nq, nk]: pairs of each tile inside the sequence (tail tiles are smaller)."""
    rows = (S - torch.arange(0, S, block_m, device=device)).clamp(max=block_m)
    cols = (S - torch.arange(0, S, block_n, device=device)).clamp(max=block_n)
    return rows[:, None] * cols[None, :]


def lower_counts(S: int, r0: int, r1: int, block_n: int, device: torch.device) -> torch.Tensor:
    """int64 [nk]: pairs with k <= q of the tiles of rows [r0, r1) (inside the sequence), per kv-tile."""
    nk = -(-S // block_n)
    c0 = torch.arange(nk, device=device) * block_n
    c1 = (c0 + block_n).clamp(max=S)
    q = torch.arange(r0, r1, device=device)[:, None]
    # keys of [c0, c1) with k <= q: clamp(q + 1 - c0, 0, c1 - c0), summed over the rows
    return (q + 1 - c0[None, :]).clamp(min=0).minimum((c1 - c0)[None, :]).sum(0)


# Elements of one slab (block-rows of tiles over some batch elements, every key) the classifier holds at once. A slab
# spans as many block-rows as fit, so the host waits once per slab, not per row. On a GPU a slab is larger: each of its
# ~100 small launches costs the host a few microseconds whatever the slab's size, so fewer, larger slabs keep the GPU
# (not the launches) the limit; the mod's temporaries stay bounded by from_mod.EVAL_ELEMENTS.
SLAB_ELEMENTS = 1 << 24
GPU_SLAB_ELEMENTS = 1 << 26


def slab_elements(device: torch.device) -> int:
    """The slab budget on `device` (SLAB_ELEMENTS on a CPU, GPU_SLAB_ELEMENTS elsewhere)."""
    return SLAB_ELEMENTS if device.type == "cpu" else max(SLAB_ELEMENTS, GPU_SLAB_ELEMENTS)


# Count cells are at most this many rows: `_cell_counts` adds 0/1 bytes of int64 words row by row, so a byte of the
# sum holds at most this many (< 128: no carry into the next byte, no signed overflow of the top one).
CELL_ROWS = 64


def _cell_counts(data: torch.Tensor, gm: int, gn: int) -> torch.Tensor:
    """int64 [b, rows / gm, cols / gn]: the True entries of every gm x gn cell of `data`, bool [b, rows, cols] whose
    int64 view exists (`_as_words`); gm <= CELL_ROWS, gn a multiple of 8.

    A bool is a 0/1 byte, so an int64 word adds eight of them at once (SWAR): the cell's rows summed word by word
    leave in each byte the count of one column (<= gm), and those bytes, read back as uint8, are summed per cell --
    a reduction over 1/gm of the slab. Exact, and on a CPU ~10x faster than a reduction over the bools."""
    b, rows, cols = data.shape
    words = data.view(torch.int64).view(b, rows // gm, gm, cols // 8)
    columns = words.sum(2).view(torch.uint8)  # [b, rows / gm, cols]: per column, its count in the cell's rows
    return columns.view(b, rows // gm, cols // gn, gn).sum(-1)


def _as_words(block: torch.Tensor, b: int, rows: int, width: int) -> torch.Tensor:
    """`block` (bool [b, r, S], r <= rows, S <= width) as bool [b, rows, width] with an int64 view: itself where its
    shape and strides allow (no copy), else a zero-padded copy (positions past the sequence False)."""
    if (tuple(block.shape) == (b, rows, width) and block.stride(-1) == 1 and block.storage_offset() % 8 == 0
            and all(st % 8 == 0 for st in block.stride()[:-1])):
        return block
    out = torch.zeros(b, rows, width, dtype=torch.bool, device=block.device)
    out[:, : block.shape[1], : block.shape[2]] = block
    return out


def lower_grid(S: int, block_m: int, block_n: int, device: torch.device) -> torch.Tensor:
    """int64 [nq, nk]: pairs with k <= q of each tile inside the sequence (closed form: `lower_counts` of every
    block-row at once). With g(x) = the pairs k <= q of rows [0, x) in the tile's columns [c0, c0 + w): rows below c0
    have none, row q < c0 + w has q + 1 - c0, later rows all w; the tile's count is g(r1) - g(r0)."""
    rows = torch.arange(0, S, block_m, device=device)[:, None]
    c0 = torch.arange(0, S, block_n, device=device)[None, :]
    w = (S - c0).clamp(max=block_n)

    def g(x: torch.Tensor) -> torch.Tensor:
        t = (torch.minimum(x, c0 + w) - c0).clamp(min=0)
        return t * (t + 1) // 2 + w * (x - c0 - w).clamp(min=0)

    return g((rows + block_m).clamp(max=S)) - g(rows)


def _lcm(values: Iterable[int]) -> int:
    out = 1
    for v in values:
        out = out * v // math.gcd(out, v)
    return out


def _shape_groups(S: int, shapes: list[tuple[int, int]], budget: int) -> list[list[tuple[int, int]]]:
    """Tile shapes read from one slab: all of them, unless the block-rows they share (the lcm of their block_m) would
    not fit a slab; then one group per block_m."""
    width = _lcm(n for _, n in shapes) * -(-S // _lcm(n for _, n in shapes))
    if _lcm(m for m, _ in shapes) * width <= budget:
        return [shapes]
    by_m: dict[int, list[tuple[int, int]]] = {}
    for m, n in shapes:
        by_m.setdefault(m, []).append((m, n))
    return list(by_m.values())


def positions_of(flags: torch.Tensor, count: int) -> torch.Tensor:
    """int64 [count]: the True positions of a flat bool tensor holding `count` of them, without the host wait of
    nonzero (the count is known), where this torch has nonzero_static for the device."""
    try:
        return torch.nonzero_static(flags, size=count).squeeze(1)
    except (AttributeError, NotImplementedError, RuntimeError):  # older torch, or no kernel for this device
        return flags.nonzero().squeeze(1)


def classify_shapes(slab, B: int, S: int, shapes: list[tuple[int, int]], device: torch.device,
                    while_waiting: Callable[[], None] | None = None, budget: int | None = None) -> list[ShapePlan]:
    """ShapePlans (in `shapes` order) from `slab(b0, b1, r0, r1)` -> bool [b1 - b0, r1 - r0, S], the mask's rows
    [r0, r1) of batch elements b0..b1 (every column), each part of the mask read once for every tile shape.

    A slab spans many block-rows (up to `budget` pairs, by default `slab_elements(device)`). Its pairs are counted
    once, in cells that every shape's tiles are unions of (gcd of the block sides), by the SWAR count of
    `_cell_counts`; pairs above the diagonal only in the band of columns the diagonal crosses (left of it none,
    right of it all); each shape's tile counts are sums of cells, its kinds `kinds_from_counts` of them (lower
    counts in closed form: `lower_grid`). The host waits once per slab, for the number of partial tiles of each
    shape and the slab's pairs; the partial tiles' blocks are gathered and packed to bits in batches (`_Packer`):
    memory O(slab + pack_elements + partial tiles' bits).
    Work O(B S^2), launches O(slabs x shapes + partial tiles / pack_elements).

    On CUDA (`classify_gpu.supported`) the same slabs are classified and their partial tiles packed by a Triton
    launch per slab and shape, with no host wait per slab (classify_gpu's docstring); the masks are bit-identical.

    `while_waiting`, if given, is called once: on the Triton path after the first group's slabs are launched and before
    the host waits for them (so host work and launches that do not depend on the classification overlap it), on the
    torch path before the first slab."""
    budget = budget or slab_elements(device)
    plans = {}
    for group in _shape_groups(S, shapes, budget):
        for plan in _classify_group(slab, B, S, group, device, budget, while_waiting):
            plans[(plan.block_m, plan.block_n)] = plan
        while_waiting = None
    return [plans[shape] for shape in shapes]


def _slab_geometry(B: int, S: int, shapes: list[tuple[int, int]], budget: int) -> tuple[int, int, int, int]:
    """(columns padded to whole tiles of every shape, rows padded likewise, rows per slab, batch elements per slab):
    slabs of whole block-rows of every shape, as many as `budget` pairs hold."""
    unit_m, unit_n = _lcm(m for m, _ in shapes), _lcm(n for _, n in shapes)
    width = unit_n * -(-S // unit_n)
    all_rows = unit_m * -(-S // unit_m)
    rows = min(all_rows, max(unit_m, budget // width // unit_m * unit_m))
    return width, all_rows, rows, max(1, budget // (rows * width))


def _classify_group(slab, B: int, S: int, shapes: list[tuple[int, int]], device: torch.device, budget: int,
                    while_waiting: Callable[[], None] | None = None) -> list[ShapePlan]:
    if classify_gpu.supported(device):  # a few Triton launches per slab instead of ~50 operations per shape
        width, all_rows, rows, per_batch = _slab_geometry(B, S, shapes, budget)
        slabs = [(b0, min(B, b0 + per_batch), r0, min(S, r0 + rows))
                 for r0 in range(0, S, rows) for b0 in range(0, B, per_batch)]
        made = classify_gpu.classify(slab, B, S, shapes, slabs, device, while_waiting)
        return [ShapePlan(m, n, shape.kinds, shape.pairs, [], partial_count=shape.partial_count, fused=shape.fused)
                for (m, n), shape in zip(shapes, made)]
    if while_waiting is not None:
        while_waiting()
    gm = math.gcd(CELL_ROWS, *(m for m, _ in shapes))
    gn = math.gcd(*(n for _, n in shapes))
    width, all_rows, rows, per_batch = _slab_geometry(B, S, shapes, budget)  # width: columns padded to whole tiles
    grids = [(-(-S // m), -(-S // n)) for m, n in shapes]
    kinds = [torch.empty(B, nq, nk, dtype=torch.int8, device=device) for nq, nk in grids]
    areas = [tile_area(S, m, n, device) for m, n in shapes]
    lowers = [lower_grid(S, m, n, device) for m, n in shapes]
    packers = [_Packer() for _ in shapes]
    partial_counts = [0] * len(shapes)
    pairs = 0
    positions = torch.arange(width, device=device)
    for r0 in range(0, S, rows):
        held = min(rows, all_rows - r0)  # the last slab: only the block-rows left
        r1 = min(S, r0 + held)
        slab_rows = torch.arange(r0, r0 + held, device=device)[:, None]
        # The band of columns whose cells the diagonal of rows [r0, r0 + held) crosses: cells left of it lie below
        # the diagonal (no pair above), cells right of it above (every pair).
        c_s, c_e = r0 // gn * gn, min(width, -(-(r0 + held) // gn) * gn)
        upper = positions[None, c_s:c_e] > slab_rows  # [held, c_e - c_s]: k > q
        for b0 in range(0, B, per_batch):
            b1 = min(B, b0 + per_batch)
            n_b = b1 - b0
            data = _as_words(slab(b0, b1, r0, r1), n_b, held, width)
            cells = _cell_counts(data, gm, gn)  # [n_b, held / gm, width / gn]
            band = (data[:, :, c_s:c_e] & upper).contiguous()
            above = torch.where(torch.arange(width // gn, device=device) >= c_e // gn, cells, 0)
            above[:, :, c_s // gn : c_e // gn] = _cell_counts(band, gm, gn)
            flags, sizes, lo = [], [], []
            for s, (m, n) in enumerate(shapes):
                nq, nk = grids[s]
                i0, i1 = r0 // m, min(nq, (r0 + held) // m)
                lo.append(i0)

                def tiles(c: torch.Tensor) -> torch.Tensor:
                    return c.view(n_b, held // m, m // gm, width // n, n // gn).sum((2, 4))[:, : i1 - i0, :nk]

                allowed, above_t = tiles(cells), tiles(above)
                below_missing = lowers[s][None, i0:i1] - (allowed - above_t)
                grid = kinds_from_counts(allowed, above_t, below_missing, areas[s][None, i0:i1])
                kinds[s][b0:b1, i0:i1] = grid
                flags.append((grid == PARTIAL).reshape(-1))
                sizes.append(grid.shape)
            # The host's one wait of the slab: each shape's partial tiles (to size their blocks) and the slab's pairs.
            counts = torch.stack([f.sum() for f in flags] + [cells.sum()]).tolist()
            pairs += counts[-1]
            for s, (m, n) in enumerate(shapes):
                if not counts[s]:
                    continue
                partial_counts[s] += counts[s]
                _, rows_s, nk = sizes[s]
                flat = positions_of(flags[s], counts[s])
                b, i, j = flat // (rows_s * nk), flat // nk % rows_s, flat % nk
                blocks = data.view(n_b, held // m, m, width // n, n)[b, i, :, j]  # [count, m, n]
                packers[s].add(b + b0, i + lo[s], j, blocks)
    return [ShapePlan(m, n, kinds[s], pairs, [], packed=packers[s].done(), partial_count=partial_counts[s])
            for s, (m, n) in enumerate(shapes)]


class _Packer:
    """Partial tiles' blocks gathered from slabs, packed to both schedules' bits as many elements at a time as
    `tile_bits.pack` packs in one go on their device (a few launches per batch, not per slab): memory
    O(pack_elements + partial tiles' bits), and the packing's launches scale with the partial tiles, not the slabs."""

    def __init__(self) -> None:
        self.pending: list[tuple[torch.Tensor, ...]] = []
        self.elements = 0
        self.packed: list[tuple[torch.Tensor, ...]] = []

    def add(self, b: torch.Tensor, i: torch.Tensor, j: torch.Tensor, blocks: torch.Tensor) -> None:
        self.pending.append((b, i, j, blocks))
        self.elements += blocks.numel()
        if self.elements >= pack_elements(blocks.device):
            self._flush()

    def _flush(self) -> None:
        if not self.pending:
            return
        b, i, j, blocks = (torch.cat(parts) if len(self.pending) > 1 else parts[0] for parts in zip(*self.pending))
        self.packed.append((b, i, j, pack(blocks), pack(blocks, transposed=True)))
        self.pending, self.elements = [], 0

    def done(self) -> list[tuple[torch.Tensor, ...]]:
        self._flush()
        return self.packed


# ---- schedules and the Mask -----------------------------------------------------------------------------------


def grouped(kinds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(ptr int32 [3 rows + 1], index int32) of a [rows, cols] kind grid in torch on its device: three groups per row
    (SCHEDULE_KINDS order), columns ascending -- the plan's CSR (host._grouped, in torch so CUDA grids stay there)."""
    rows, cols = kinds.shape
    order = torch.tensor(SCHEDULE_KINDS, dtype=torch.int8, device=kinds.device)
    member = kinds[:, None, :] == order[None, :, None]  # [rows, group, cols]: entries in memory order
    ptr = torch.zeros(3 * rows + 1, dtype=torch.int32, device=kinds.device)
    ptr[1:] = member.sum(2).reshape(-1).cumsum(0)
    index = (member.reshape(-1).nonzero().squeeze(1) % cols).to(torch.int32)
    return ptr, index


def schedules_from_kinds(kinds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fwd_ptr, fwd_kv, bwd_ptr, bwd_q) of a [B, nq, nk] kind grid (see `Plan`)."""
    B, nq, nk = kinds.shape
    fwd_ptr, fwd_kv = grouped(kinds.reshape(B * nq, nk))
    bwd_ptr, bwd_q = grouped(kinds.transpose(1, 2).reshape(B * nk, nq))
    return fwd_ptr, fwd_kv, bwd_ptr, bwd_q


def capacity_of(choice: int | str, partial: int, B: int, S: int, block_m: int, block_n: int) -> int:
    """Slots for a mask without rules: every partial tile's, at least (see the module docstring)."""
    tiles = B * -(-S // block_m) * -(-S // block_n)
    if choice == "exact":
        return partial
    if choice == "all":
        return tiles
    if isinstance(choice, bool) or not isinstance(choice, int) or choice < 0:
        raise ValueError(f"partial_bits must be 'exact' (the default), 'all' or a number of slots, not {choice!r}: a "
                         "mask without rules needs the bits of every partial tile ('auto' and 'none' leave some to "
                         "the rules, which it does not have)")
    if choice < partial:
        raise ValueError(f"partial_bits={choice}, but this mask has {partial} partial {block_m}x{block_n} tiles, each "
                         f"of which needs its bits: pass partial_bits >= {partial} (or 'exact')")
    return min(choice, tiles)


def check_capacity_choice(choice: int | str) -> None:
    """A bad `partial_bits` raises before any planning."""
    if choice not in CAPACITY_CHOICES:
        capacity_of(choice, 0, 1, 16, 16, 16)


def _slots(shape: ShapePlan, ptr: torch.Tensor, capacity: int, transposed: bool,
           device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(slot starts, bits) of one schedule (`ptr`: its CSR starts): every partial tile's words in the schedule's
    order -- rows in order, each row's partial tiles by column -- and zeros after."""
    grid = shape.kinds.transpose(1, 2) if transposed else shape.kinds  # [B, schedule rows, entries per row]
    B, rows, cols = grid.shape
    starts = bits.slot_starts(ptr, B * rows)
    # The slot of every partial tile of the grid: the partial tiles before it in row-major order.
    rank = (grid == PARTIAL).reshape(-1).long().cumsum(0) - 1
    words = bits.slot_words(shape.block_m, shape.block_n, transposed)
    out = torch.zeros(capacity * words, dtype=torch.int32, device=device)
    if shape.packed is not None:
        # Packed as classified: one scatter of every chunk's words (the chunks together are O(partial tiles' bits)).
        if shape.packed:
            b, i, j, fwd, bwd = (torch.cat([chunk[k].to(device) for chunk in shape.packed]) for k in range(5))
            flat = (b * rows + j) * cols + i if transposed else (b * rows + i) * cols + j
            out.view(-1, words)[rank[flat]] = (bwd if transposed else fwd).view(len(flat), words)
        return starts, out
    for b, i, j, blocks in shape.partial_chunks():
        b, i, j = (x.to(device) for x in (b, i, j))
        flat = (b * rows + j) * cols + i if transposed else (b * rows + i) * cols + j
        out.view(-1, words)[rank[flat]] = pack(blocks.to(device), transposed).view(len(flat), words)
    return starts, out


def ruleless_tables(B: int, S: int, batched: bool, device: torch.device) -> tuple[Layout | LayoutBatch, LayoutTables]:
    """The stand-in layout of a mask without rules -- all pad: its rules' predicate allows nothing -- and its
    per-token tables on `device` (what `ruleless_mask` makes when not handed them)."""
    single = Layout.from_segments([("pad", S)])
    layout = LayoutBatch([single] * B) if batched else single
    return layout, layout.tables(RULELESS_RULES, device)


def ruleless_mask(shapes: list[ShapePlan], B: int, S: int, batched: bool, device: torch.device,
                  partial_bits: int | str = "exact", made_by: str | None = None,
                  stand_in: tuple[Layout | LayoutBatch, LayoutTables] | None = None) -> Mask:
    """The Mask of a mask without rules from its tile shapes' ShapePlans (see the module docstring); `made_by`
    names the public maker (`Mask.made_by`), so an error about the mask can say how to make it again. `stand_in`:
    `ruleless_tables(B, S, batched, device)`, where the maker made them already (while the GPU classified)."""
    layout, tables = stand_in if stand_in is not None else ruleless_tables(B, S, batched, device)
    entries: dict[tuple[int, int], tuple] = {}
    fixed = partial_bits != "exact"
    for shape in shapes:
        block_m, block_n = shape.block_m, shape.block_n
        kinds = shape.kinds.to(device)
        shape.kinds = kinds
        tiles = B * -(-S // block_m) * -(-S // block_n)
        partial = shape.partial_count if shape.partial_count is not None else int((kinds == PARTIAL).sum())
        capacity = capacity_of(partial_bits, partial, B, S, block_m, block_n)
        if shape.fused is not None:  # classify_gpu's schedules: a few launches each, no host wait
            index_size = tiles if tiles <= CAPACITY_LIMIT else shape.fused.visited
            fwd_ptr, fwd_kv, *forward = classify_gpu.schedule(kinds, shape.fused, block_m, block_n, False, partial,
                                                              capacity, index_size)
            bwd_ptr, bwd_q, *backward = classify_gpu.schedule(kinds, shape.fused, block_m, block_n, True, partial,
                                                              capacity, index_size)
        else:
            fwd_ptr, fwd_kv, bwd_ptr, bwd_q = schedules_from_kinds(kinds)
            if shape.packed is None and not callable(shape.partials):
                shape.partials = list(shape.partials)  # walked twice: forward and backward slots
            forward = _slots(shape, fwd_ptr, capacity, False, device)
            backward = _slots(shape, bwd_ptr, capacity, True, device)
        plan = Plan(block_m, block_n, B, S, batched, fwd_ptr, fwd_kv, bwd_ptr, bwd_q, shape.pairs, tables,
                    RULELESS_RULES.mask_hash())
        if tiles <= CAPACITY_LIMIT:  # schedule buffers of fixed size, as make_mask keeps them
            fwd_kv, bwd_q = _capacity(fwd_kv, tiles), _capacity(bwd_q, tiles)
        else:
            fixed = False
        entries[(block_m, block_n)] = (fwd_ptr, fwd_kv, bwd_ptr, bwd_q, *forward, *backward, plan)
    mask = Mask(RULELESS_RULES, layout, tables, entries, device, fixed)
    mask.ruleless = True  # (Mask.ruleless is False for masks of a layout)
    mask.made_by = made_by
    return mask


# ---- arguments shared by the makers ---------------------------------------------------------------------------

# The tile shapes kernels may run, (rules, S, device, head_dim, dtype) -> [(block_m, block_n)]: the op layer knows
# them (the families' defaults and the tuning database) and installs this when it is imported, as it installs the
# op's rules resolver; the public names omnigen.mask_from_* import it first.
_default_tiles: Callable[..., list[tuple[int, int]]] | None = None


def set_default_tiles(finder: Callable[..., list[tuple[int, int]]]) -> None:
    global _default_tiles
    _default_tiles = finder



def tile_shapes(S: int, device: torch.device, tiles: Iterable[tuple[int, int]] | None, head_dim: int | None,
                dtype: torch.dtype | None) -> list[tuple[int, int]]:
    """The tile shapes to plan: `tiles`, else those kernels may run at this length (as `omnigen.mask` picks them)."""
    if tiles is None:
        if _default_tiles is None:
            raise ValueError("tiles=None: the kernels' tile shapes are known once omnigen's ops are loaded; call "
                             "omnigen.mask_from_dense / mask_from_mod / mask_from_intervals (they load them), or pass "
                             "tiles=[(block_m, block_n), ...]")
        tiles = _default_tiles(RULELESS_RULES, S, device, head_dim, dtype)
    try:
        shapes = list(dict.fromkeys((_check_block(m, "block_m"), _check_block(n, "block_n")) for m, n in tiles))
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ValueError) and "multiple of 16" in str(exc):
            raise
        raise ValueError(f"tiles must be (block_m, block_n) pairs, not {tiles!r}") from None
    if not shapes:
        raise ValueError("a mask needs at least one tile shape: tiles=[(128, 128)], or leave tiles out")
    return shapes


def dense_from_bits(mask: Mask, block_m: int, block_n: int, element: int = 0) -> torch.Tensor:
    """bool [S, S] on the mask's device: batch element `element` of a mask made from data, rebuilt from what the
    kernels read -- its forward schedule's kinds (full: all, causal: k <= q, empty: none) and the partial tiles'
    bits -- so a picture shows the mask the kernels run, whichever input it was made from. O(S^2): for pictures
    and tests of small masks."""
    if not mask.ruleless:
        raise ValueError("dense_from_bits reads a mask made from data; for a mask of rules use rules.dense_mask(layout)")
    if not 0 <= element < mask.batch_size:
        raise ValueError(f"element must be in [0, {mask.batch_size}), not {element!r}")
    plan = mask.plan(block_m, block_n)
    kinds = plan.kinds if plan.kinds.dim() == 3 else plan.kinds[None]
    S, device = mask.seq_len, kinds.device
    nq, nk = kinds.shape[1:]
    grid = kinds[element]
    tiles = torch.zeros(nq, nk, block_m, block_n, dtype=torch.bool, device=device)
    tiles[grid == FULL] = True
    rows = torch.arange(block_m, device=device)[:, None]
    cols = torch.arange(block_n, device=device)[None, :]
    i, j = (grid == CAUSAL).nonzero(as_tuple=True)
    tiles[i, j] = (j[:, None, None] * block_n + cols) <= (i[:, None, None] * block_m + rows)
    partial = grid == PARTIAL
    if partial.any():
        # Slots hold the forward schedule's partial entries in row-major order over (element, q-tile, kv-tile).
        first = int((kinds[:element] == PARTIAL).sum())
        words = bits.slot_words(block_m, block_n)
        shape = mask.tiles.index((block_m, block_n))
        slots = mask.schedules[PER_SHAPE * shape + SCHEDULE_TENSORS.index("partial_bits")]  # the forward's
        count = int(partial.sum())
        tiles[partial] = unpack(slots[first * words : (first + count) * words], block_m, block_n)
    return tiles.permute(0, 2, 1, 3).reshape(nq * block_m, nk * block_n)[:S, :S]


# Tiles whose blocks `every_tile_as` makes at once (bool block_m x block_n each: 64 MiB of 128 x 128 tiles).
RETILE_CHUNK = 4096


def every_tile_as(mask: Mask, kind: int) -> Mask:
    """A timing counterpart of a mask made from data: the same visited tiles, in the same schedules' order, every one
    taken as `kind` -- what "a partial tile costs <= 1.2x a full one" (issue 29) compares on a real mask's grid, its
    tail tiles, its load balance and its number of tiles held fixed.

    PARTIAL: every visited tile is read from bits (full tiles' bits all set, causal tiles' k <= q, partial tiles their
    own), so the mask says the same pairs as `mask` and a call gives the same output, all of it through the partial
    path. FULL: every visited tile unmasked -- no mask work at all, but attention to pairs `mask` hides (for timing
    only). Empty tiles stay empty. Not exact in the sense of the plans' contract (a partial tile here may be full):
    never hand it to anything but a timer or a test."""
    if not mask.ruleless:
        raise ValueError("every_tile_as takes a mask made from data (mask_from_dense / mask_from_mod / "
                         "mask_from_intervals)")
    if kind not in (FULL, PARTIAL):
        raise ValueError(f"kind must be FULL ({FULL}) or PARTIAL ({PARTIAL}), not {kind!r}")
    B, S, device = mask.batch_size, mask.seq_len, mask.device
    shapes = []
    for index, (block_m, block_n) in enumerate(mask.tiles):
        plan = mask.plan(block_m, block_n)
        kinds = plan.kinds.to(device)
        kinds = kinds if kinds.dim() == 3 else kinds[None].expand(B, -1, -1)
        visited = kinds != EMPTY
        new = torch.where(visited, torch.tensor(kind, dtype=torch.int8, device=device),
                          torch.tensor(EMPTY, dtype=torch.int8, device=device))
        if kind == FULL:
            area = tile_area(S, block_m, block_n, device)
            shapes.append(ShapePlan(block_m, block_n, new, int((area * visited).sum()), []))
        else:
            words = mask.schedules[PER_SHAPE * index + SCHEDULE_TENSORS.index("partial_bits")]
            shapes.append(ShapePlan(block_m, block_n, new, plan.allowed_pairs,
                                    _blocks_of_every_tile(kinds, words, S, block_m, block_n)))
    made = ruleless_mask(shapes, B, S, mask.batched, device)
    made.made_by = mask.made_by
    return made


def _blocks_of_every_tile(kinds: torch.Tensor, words: torch.Tensor, S: int, block_m: int,
                          block_n: int) -> Callable[[], Iterator[tuple[torch.Tensor, ...]]]:
    """ShapePlan.partials for `every_tile_as(..., PARTIAL)`: chunks of (b, i, j, blocks) of every visited tile of
    `kinds` [B, nq, nk], a partial tile's block unpacked from its forward slot (slots hold the partial tiles in
    row-major order of (b, i, j): `_slots`), a full or causal tile's made from its kind; past S, False."""
    device = kinds.device
    per_slot = bits.slot_words(block_m, block_n)
    rows = torch.arange(block_m, device=device)[:, None]
    cols = torch.arange(block_n, device=device)[None, :]

    def chunks() -> Iterator[tuple[torch.Tensor, ...]]:
        where = (kinds != EMPTY).nonzero()
        slot = (kinds == PARTIAL).reshape(-1).long().cumsum(0) - 1  # a partial tile's slot, by row-major rank
        for first in range(0, where.shape[0], RETILE_CHUNK):
            b, i, j = where[first : first + RETILE_CHUNK].unbind(1)
            k = kinds[b, i, j]
            q_pos = i[:, None, None] * block_m + rows
            k_pos = j[:, None, None] * block_n + cols
            blocks = (k == FULL)[:, None, None] | ((k == CAUSAL)[:, None, None] & (k_pos <= q_pos))
            partial = (k == PARTIAL).nonzero().squeeze(1)
            if partial.numel():
                slots = slot[((b * kinds.shape[1] + i) * kinds.shape[2] + j)[partial]]
                picked = words.view(-1, per_slot)[slots]
                blocks[partial] = unpack(picked, block_m, block_n)
            yield b, i, j, blocks & (q_pos < S) & (k_pos < S)

    return chunks
