"""Tiles of a mask made from data classified, packed and scheduled on a GPU in a few Triton launches.

`ruleless.classify_shapes` in torch costs ~50 small operations per slab and tile shape, a host wait per slab, and
`ruleless_mask`'s schedules and slots a dozen more per shape with two more waits: on an H100, making a mask from a
mod at 8K x 4 took 383-707 launches and ~16 host syncs, and the host, not the GPU, set its time (issue 29's "making a
mask <= create_block_mask"). Here the same results come from:

* per slab and tile shape, one launch of `_classify_kernel`: a program per tile reads the tile's block of the slab,
  counts its allowed pairs, those above the diagonal and the missing ones on or below it, writes its kind (the
  definition of `ruleless.kinds_from_counts`), adds its pairs and its kind to per-row counts of both schedules, and,
  for a partial tile, takes the next slot of a per-shape buffer (an atomic counter) and packs the tile's forward and
  backward words there (the layout of `tile_bits.pack`), recording which slot it took;
* per shape and schedule, `_scan_kernel` (the CSR starts and the slot starts from the row counts, one program) and
  `_schedule_kernel` (a program per schedule row writes its entries, columns ascending, and the buffer slot of each of
  its partial entries in schedule order), then one `index_select` of the words into the schedule's slot order.

Atomic slots make the buffers' order arbitrary, but the schedules' slots are ordered by the kinds alone, so the mask is
bit-identical to the torch path's (tests/test_classify_gpu.py compares them, on CUDA and in Triton's interpreter).

The host waits only when the slot buffers could overflow (their capacity is checked against an upper bound: every
tile launched since the last wait partial) and once at the end for the counts (pairs, partial and visited tiles).
`ENABLED` switches the path off (the torch path runs everywhere) so a benchmark can compare both in one process.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch

from ..semantics import CAUSAL, EMPTY, FULL, PARTIAL, SCHEDULE_KINDS
from .bits import mask_words, slot_words
from .launch import DIRECT_LAUNCH, Launcher, launch_hooks_idle, tl, triton, unspecialised_jit

# On: timed on an H100 (RESULTS.md, sixteenth session), 8K x 4, torch path -> this one against create_block_mask:
# a sliding window 8.13 -> 5.63 ms (flex 3.55), random eviction 11.96 -> 5.09 (6.35), a MEDUSA tree 19.67 -> 14.60
# (5.32, its mod's own evaluation 11 ms of GPU time); bit-identical masks. (With the aligned rows' loads and the head
# check under the slabs: 4.80, 3.87 and 12.58 ms.) tests/test_classify_gpu.py's GPU tests compare both paths whatever
# this says; scripts/profile_mask_making.py --compare-fused times both.
ENABLED = True

# Bytes of slot buffers (both schedules' words) a shape starts with, at most (never more than every tile's): at 8K x 4
# room for every tile of 128 x 64 (96 MiB) and 128 x 128 tiles (64 MiB), so the host never waits to grow them there;
# longer masks wait about once per buffer's worth of slabs (the tiles launched since the last wait, each counted as
# partial). Allocations only: nothing but partial tiles' words is written.
SLOT_BUFFER_BYTES = 1 << 27

# Entries a schedule program (and the scan) handles per step of its loop.
ROW_BLOCK = 1024
# Tile rows a classifying program reads (and packs) at a time, in a loop: registers a thread at 128 x 128 tiles and 4
# warps (cuobjdump of the sm_90 cubin): a whole tile at once 203 (8 warps), 32 rows 205, 16 rows 128, 8 rows 72 -- a
# byte loaded (rows that are not 16-byte aligned, and packing) costs a 64-bit address, so a chunk, not the tile, sets
# how many blocks share an SM.
ROW_CHUNK = 16

# The kernels write a non-empty tile's schedule group as kind - 1.
assert SCHEDULE_KINDS == (FULL, CAUSAL, PARTIAL) == (1, 2, 3) and EMPTY == 0

Slab = Callable[[int, int, int, int], torch.Tensor]


def supported(device: torch.device) -> bool:
    """Whether masks on `device` are classified here: CUDA with Triton, while ENABLED (tests replace this function to
    run the path regardless, on CUDA or on a CPU under Triton's interpreter)."""
    return ENABLED and triton is not None and device.type == "cuda"


@dataclass
class FusedTiles:
    """What `_classify_kernel` left for one tile shape: `slot_of` int32 [B * nq * nk] (the buffer slot of each partial
    tile, row-major; other entries unset), the buffers' forward and backward words (a slot's words each), and each
    schedule row's tiles per group (int32 [rows * 3], forward rows (b, q-tile), backward rows (b, kv-tile)); `visited`:
    the non-empty tiles."""

    slot_of: torch.Tensor
    forward_words: torch.Tensor
    backward_words: torch.Tensor
    forward_counts: torch.Tensor
    backward_counts: torch.Tensor
    visited: int = 0


@dataclass
class Classified:
    """One tile shape's kinds [B, nq, nk] (int8), allowed pairs, partial tiles and `FusedTiles`."""

    kinds: torch.Tensor
    pairs: int
    partial_count: int
    fused: FusedTiles


class _SlotBuffers:
    """One shape's partial tiles' words, grown when the tiles launched since the host last read the slot counter
    could overflow them (the counter itself stays on the device)."""

    def __init__(self, block_m: int, block_n: int, total_tiles: int, device: torch.device) -> None:
        self.forward_size, self.backward_size = slot_words(block_m, block_n), slot_words(block_m, block_n, True)
        self.total_tiles, self.device = total_tiles, device
        self.capacity = min(total_tiles, max(1, SLOT_BUFFER_BYTES // (4 * (self.forward_size + self.backward_size))))
        self.forward = torch.empty(self.capacity * self.forward_size, dtype=torch.int32, device=device)
        self.backward = torch.empty(self.capacity * self.backward_size, dtype=torch.int32, device=device)
        self.known = 0  # partial tiles counted when the host last waited
        self.launched = 0  # tiles launched since then, each possibly partial

    def fits(self, tiles: int) -> bool:
        return self.known + self.launched + tiles <= self.capacity

    def grow_for(self, tiles: int) -> None:
        """After the host read `known`: room for `tiles` more (the filled slots copied into larger buffers)."""
        self.launched = 0
        if self.known + tiles <= self.capacity:
            return
        self.capacity = min(self.total_tiles, max(2 * self.capacity, self.known + tiles))
        forward = torch.empty(self.capacity * self.forward_size, dtype=torch.int32, device=self.device)
        backward = torch.empty(self.capacity * self.backward_size, dtype=torch.int32, device=self.device)
        forward[: self.known * self.forward_size] = self.forward[: self.known * self.forward_size]
        backward[: self.known * self.backward_size] = self.backward[: self.known * self.backward_size]
        self.forward, self.backward = forward, backward


def classify(slab: Slab, B: int, S: int, shapes: list[tuple[int, int]], slabs: list[tuple[int, int, int, int]],
             device: torch.device, while_waiting: Callable[[], None] | None = None) -> list[Classified]:
    """Every shape's `Classified` (in `shapes` order) from `slab(b0, b1, r0, r1)` -> bool [b1 - b0, r1 - r0, S]
    (any strides), read once per entry of `slabs` for every shape; `slabs` cover every (batch element, row) once, each
    in whole tile rows of every shape (its r0 a multiple of every block_m, its r1 one as well, or S). `while_waiting`:
    called once every slab is launched, before the host waits for the counts."""
    grids = [(-(-S // m), -(-S // n)) for m, n in shapes]
    # One zero fill for every counter: int64 [pairs, partial tiles per shape, visited tiles per shape], then each
    # shape's int32 row counts of both schedules (the kernels' atomics add to them; the scan reads them).
    n_counters = 1 + 2 * len(shapes)
    sizes = [n for nq, nk in grids for n in (3 * B * nq, 3 * B * nk)]
    zeros = torch.zeros(n_counters + -(-sum(sizes) // 2), dtype=torch.int64, device=device)
    counters = zeros[:n_counters]
    row_counts = zeros[n_counters:].view(torch.int32)[: sum(sizes)].split(sizes)
    kinds = [torch.empty(B, nq, nk, dtype=torch.int8, device=device) for nq, nk in grids]
    slot_of = [torch.empty(B * nq * nk, dtype=torch.int32, device=device) for nq, nk in grids]
    buffers = [_SlotBuffers(m, n, B * nq * nk, device) for (m, n), (nq, nk) in zip(shapes, grids)]
    with _on(device):  # (Triton launches on the current device)
        for b0, b1, r0, r1 in slabs:
            _classify_slab(slab(b0, b1, r0, r1), b0, b1, r0, r1, S, shapes, grids, kinds, slot_of, buffers, counters,
                           row_counts)
    if while_waiting is not None:
        while_waiting()
    counts = counters.tolist()  # the one wait every mask takes: pairs, partial and visited tiles
    out = []
    for s in range(len(shapes)):
        fused = FusedTiles(slot_of[s], buffers[s].forward, buffers[s].backward, row_counts[2 * s],
                           row_counts[2 * s + 1], counts[1 + len(shapes) + s])
        out.append(Classified(kinds[s], counts[0], counts[1 + s], fused))
    return out


def _classify_slab(data: torch.Tensor, b0: int, b1: int, r0: int, r1: int, S: int, shapes: list[tuple[int, int]],
                   grids: list[tuple[int, int]], kinds: list[torch.Tensor], slot_of: list[torch.Tensor],
                   buffers: list[_SlotBuffers], counters: torch.Tensor, row_counts: list[torch.Tensor]) -> None:
    """One launch per shape over the slab's tiles, after growing a shape's slot buffers where they could overflow."""
    data = (data if data.dtype == torch.bool else data != 0).view(torch.uint8)  # the kernel reads bytes
    for s, ((m, n), (nq, nk)) in enumerate(zip(shapes, grids)):
        i0, i1 = r0 // m, -(-r1 // m)
        tiles = (b1 - b0) * (i1 - i0) * nk
        if not buffers[s].fits(tiles):
            _read_counts(counters, buffers)  # the host's wait: only when the buffers could overflow
            buffers[s].grow_for(tiles)
        buffers[s].launched += tiles
        _launch_classify(data, kinds[s], slot_of[s], buffers[s], counters, row_counts[2 * s], row_counts[2 * s + 1],
                         b0, r0, i0, i1 - i0, S, nq, nk, s, len(shapes), m, n, tiles)


def _read_counts(counters: torch.Tensor, buffers: list[_SlotBuffers]) -> None:
    known = counters.tolist()
    for s, buffer in enumerate(buffers):
        buffer.known, buffer.launched = known[1 + s], 0


def _fits_int32(*values: int) -> bool:
    return all(-(2**31) <= v < 2**31 for v in values)


def _block(n: int) -> int:
    """Entries per loop step of a program walking `n`: ROW_BLOCK, or fewer for short rows (a few compiled sizes)."""
    return max(16, min(ROW_BLOCK, triton.next_power_of_2(max(1, n))))


def _launch_classify(data: torch.Tensor, kinds: torch.Tensor, slot_of: torch.Tensor, buffers: _SlotBuffers,
                     counters: torch.Tensor, forward_counts: torch.Tensor, backward_counts: torch.Tensor, b0: int,
                     r0: int, i0: int, tile_rows: int, S: int, nq: int, nk: int, shape: int, n_shapes: int,
                     block_m: int, block_n: int, tiles: int) -> None:
    if tiles == 0:
        return
    ints = (*data.stride(), b0, r0, i0, tile_rows, S, nq, nk, 1 + shape, 1 + n_shapes + shape)
    args = (data, kinds, slot_of, buffers.forward, buffers.backward, counters, forward_counts, backward_counts, *ints)
    m_p2, n_p2 = triton.next_power_of_2(block_m), triton.next_power_of_2(block_n)
    # Rows of 16-byte-aligned contiguous bytes (a mod's fresh result at S % 16 == 0): 16-byte loads (H100, 8K x 4:
    # 238 us a slab with byte loads).
    rows_aligned = (data.stride(2) == 1 and data.stride(1) % 16 == 0 and data.stride(0) % 16 == 0
                    and data.data_ptr() % 16 == 0 and S % 16 == 0 and block_n % 16 == 0)
    constants = (block_m, block_n, m_p2, n_p2, mask_words(block_n), mask_words(block_m), shape == 0,
                 min(ROW_CHUNK, m_p2, n_p2), rows_aligned)
    direct = DIRECT_LAUNCH and _fits_int32(*ints) and launch_hooks_idle()
    _CLASSIFY((tiles, 1, 1), args, constants, 4, direct)


def _on(device: torch.device) -> contextlib.AbstractContextManager:
    """Triton launches on the current CUDA device: `device` made current (nothing to do for Triton's interpreter,
    which runs on CPU tensors)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def schedule(kinds: torch.Tensor, fused: FusedTiles, block_m: int, block_n: int, transposed: bool, partial: int,
             capacity: int, index_size: int) -> tuple[torch.Tensor, ...]:
    """(ptr, index, slot starts, slot words) of the forward schedule of `kinds` [B, nq, nk] or, `transposed`, the
    backward's -- what `ruleless.grouped` and `ruleless._slots` make: `index` has `index_size` entries (>= the
    visited tiles; zeros past them), the words `capacity` slots (zeros past the `partial` tiles)."""
    B, nq, nk = kinds.shape
    device = kinds.device
    row_tiles, entries = (nk, nq) if transposed else (nq, nk)
    rows = B * row_tiles
    counts = fused.backward_counts if transposed else fused.forward_counts
    ptr = torch.empty(3 * rows + 1, dtype=torch.int32, device=device)
    starts = torch.empty(rows + 1, dtype=torch.int32, device=device)
    # (at least one entry allocated: a kernel's pointer must be a live address even where nothing is written)
    index = (torch.zeros if index_size > fused.visited else torch.empty)(max(1, index_size), dtype=torch.int32,
                                                                          device=device)[:index_size]
    sources = torch.empty(max(1, partial), dtype=torch.int32, device=device)
    ints = (rows, row_tiles, entries, nq, nk)
    direct = DIRECT_LAUNCH and _fits_int32(B * nq * nk) and launch_hooks_idle()
    with _on(device):
        _SCAN((1, 1, 1), (counts, ptr, starts, rows), (_block(rows),), 4, direct)
        if rows:
            _SCHEDULE((rows, 1, 1), (kinds, fused.slot_of, ptr, starts, index, sources,
                                     *ints), (_block(entries), bool(transposed)), 4, direct)
    size = slot_words(block_m, block_n, transposed)
    words = (torch.zeros if capacity > partial else torch.empty)(capacity * size, dtype=torch.int32, device=device)
    if partial:
        buffer = (fused.backward_words if transposed else fused.forward_words).view(-1, size)
        torch.index_select(buffer, 0, sources, out=words.view(-1, size)[:partial])
    return ptr, index, starts, words


# ---- the Triton kernels -------------------------------------------------------------------------------------

if triton is not None:
    _EMPTY, _FULL, _CAUSAL, _PARTIAL = (tl.constexpr(k) for k in (EMPTY, FULL, CAUSAL, PARTIAL))

    @triton.jit
    def _pack_words(base, row_tile, column_tile, r0, S, stride_r, stride_c, words, ROWS: tl.constexpr,
                    ROWS_P2: tl.constexpr, COLUMNS: tl.constexpr, WORDS: tl.constexpr, TRANSPOSED: tl.constexpr,
                    CHUNK: tl.constexpr):
        """The slot words of one tile at `words`: its rows (queries, or keys `TRANSPOSED`) in chunks of CHUNK, and
        the columns thread t keeps as value v (bits.py's layout: c = 8 (v // 2) + 2 t + v % 2), read from the slab."""
        t = tl.arange(0, 4)
        bit = tl.arange(0, 32)
        for w in tl.static_range(WORDS):
            v = 32 * w + bit
            column = column_tile * COLUMNS + 8 * (v // 2)[None, :] + 2 * t[:, None] + (v % 2)[None, :]  # [4, 32]
            column_ok = (v < COLUMNS // 4)[None, :] & (column < S)
            for chunk in range(ROWS_P2 // CHUNK):  # (a loop, not unrolled: one chunk live at a time)
                rows_here = chunk * CHUNK + tl.arange(0, CHUNK)
                row_pos = row_tile * ROWS + rows_here
                ok = ((rows_here < ROWS) & (row_pos < S))[:, None, None] & column_ok[None, :, :]
                if TRANSPOSED:  # rows are keys, columns queries
                    offset = ((column - r0).to(tl.int64)[None, :, :] * stride_r
                              + row_pos.to(tl.int64)[:, None, None] * stride_c)
                else:
                    offset = ((row_pos - r0).to(tl.int64)[:, None, None] * stride_r
                              + column.to(tl.int64)[None, :, :] * stride_c)
                values = tl.load(base + offset, mask=ok, other=0) != 0
                word = tl.sum(values.to(tl.int32) << bit[None, None, :], axis=2)  # [CHUNK, 4]: distinct bits: or
                out = words + w * (ROWS * 4) + rows_here[:, None] * 4 + t[None, :]
                tl.store(out, word, mask=(rows_here < ROWS)[:, None])

    def _classify_kernel(data, kinds, slot_of, forward_words, backward_words, counters, forward_counts,
                         backward_counts, stride_b, stride_r, stride_c, b0, r0, i0, tile_rows, S, nq, nk,
                         partial_counter, visited_counter,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, M_P2: tl.constexpr, N_P2: tl.constexpr,
                         FORWARD_WORDS: tl.constexpr, BACKWARD_WORDS: tl.constexpr, COUNT_PAIRS: tl.constexpr,
                         CHUNK: tl.constexpr, ROWS_ALIGNED: tl.constexpr):
        """One program per tile (b, i, j) of the slab's tile rows: its kind, counts and, if partial, its words; rows
        CHUNK at a time (ROW_CHUNK)."""
        pid = tl.program_id(0)
        j = pid % nk
        i = i0 + (pid // nk) % tile_rows
        b_local = pid // (nk * tile_rows)
        b = b0 + b_local
        columns_here = tl.arange(0, N_P2)
        k = j * BLOCK_N + columns_here
        if ROWS_ALIGNED:  # the same test by groups of 16 columns (S and BLOCK_N multiples of 16), so that a load's
            # mask is constant over each 16 bytes and the loads can be vectors
            k_ok = ((columns_here // 16) < (BLOCK_N // 16)) & ((k // 16) < (S // 16))
        else:
            k_ok = (columns_here < BLOCK_N) & (k < S)
        base = data + b_local.to(tl.int64) * stride_b
        allowed = 0
        above = 0
        lower = 0
        area = 0
        for chunk in range(M_P2 // CHUNK):  # (a loop, not unrolled: one chunk live at a time)
            rows_here = chunk * CHUNK + tl.arange(0, CHUNK)
            q = i * BLOCK_M + rows_here
            inside = ((rows_here < BLOCK_M) & (q < S))[:, None] & k_ok[None, :]
            if ROWS_ALIGNED:  # 16-byte rows of contiguous bytes: vector loads
                row_offset = tl.multiple_of((q - r0).to(tl.int64) * stride_r, 16)
                pointers = tl.multiple_of(base, 16) + row_offset[:, None] + k[None, :]
            else:
                pointers = base + (q - r0).to(tl.int64)[:, None] * stride_r + k.to(tl.int64)[None, :] * stride_c
            allowed_here = (tl.load(pointers, mask=inside, other=0) != 0) & inside
            upper = k[None, :] > q[:, None]
            allowed += tl.sum(allowed_here.to(tl.int32))
            above += tl.sum((allowed_here & upper).to(tl.int32))
            lower += tl.sum((inside & ~upper).to(tl.int32))
            area += tl.sum(inside.to(tl.int32))
        below_missing = lower - (allowed - above)
        kind = tl.where((above == 0) & (below_missing == 0), _CAUSAL, _PARTIAL)
        kind = tl.where(allowed == area, _FULL, kind)
        kind = tl.where(allowed == 0, _EMPTY, kind)
        flat = (b.to(tl.int64) * nq + i) * nk + j
        tl.store(kinds + flat, kind.to(tl.int8))
        if COUNT_PAIRS:  # the first shape's tiles add up every allowed pair once
            tl.atomic_add(counters, allowed.to(tl.int64), mask=allowed > 0)
        if kind != _EMPTY:
            tl.atomic_add(counters + visited_counter, tl.full((), 1, tl.int64))
            tl.atomic_add(forward_counts + (b * nq + i) * 3 + kind - 1, 1)
            tl.atomic_add(backward_counts + (b * nk + j) * 3 + kind - 1, 1)
        if kind == _PARTIAL:
            slot = tl.atomic_add(counters + partial_counter, tl.full((), 1, tl.int64))
            tl.store(slot_of + flat, slot.to(tl.int32))
            _pack_words(base, i, j, r0, S, stride_r, stride_c, forward_words + slot * (FORWARD_WORDS * BLOCK_M * 4),
                        BLOCK_M, M_P2, BLOCK_N, FORWARD_WORDS, False, CHUNK)
            _pack_words(base, j, i, r0, S, stride_r, stride_c, backward_words + slot * (BACKWARD_WORDS * BLOCK_N * 4),
                        BLOCK_N, N_P2, BLOCK_M, BACKWARD_WORDS, True, CHUNK)

    def _scan_kernel(counts, ptr, starts, rows, BLOCK: tl.constexpr):
        """One program: ptr (the CSR starts of rows x 3 groups, from each row's group counts) and the slot starts
        (each row's first partial entry: `bits.slot_starts`)."""
        tl.store(ptr, 0)
        tl.store(starts, 0)
        carry = tl.full((), 0, tl.int32)
        partial_carry = tl.full((), 0, tl.int32)
        first = 0
        while first < rows:
            r = first + tl.arange(0, BLOCK)
            inside = r < rows
            full = tl.load(counts + 3 * r, mask=inside, other=0)
            causal = tl.load(counts + 3 * r + 1, mask=inside, other=0)
            partial = tl.load(counts + 3 * r + 2, mask=inside, other=0)
            total = full + causal + partial
            before = tl.cumsum(total, 0) - total + carry
            tl.store(ptr + 3 * r + 1, before + full, mask=inside)
            tl.store(ptr + 3 * r + 2, before + full + causal, mask=inside)
            tl.store(ptr + 3 * r + 3, before + total, mask=inside)
            tl.store(starts + 1 + r, tl.cumsum(partial, 0) + partial_carry, mask=inside)
            carry += tl.sum(total, 0)
            partial_carry += tl.sum(partial, 0)
            first += BLOCK

    def _schedule_kernel(kinds, slot_of, ptr, starts, index, sources, rows, row_tiles, entries, nq, nk,
                         BLOCK: tl.constexpr, TRANSPOSED: tl.constexpr):
        """One program per schedule row: its entries by group (SCHEDULE_KINDS order), ascending, at ptr's offsets,
        and the buffer slot of each partial entry at its schedule slot (starts[row] onwards)."""
        row = tl.program_id(0)
        b = row // row_tiles
        tile = row % row_tiles
        full_at = tl.load(ptr + 3 * row)
        causal_at = tl.load(ptr + 3 * row + 1)
        partial_at = tl.load(ptr + 3 * row + 2)
        slot_at = tl.load(starts + row)
        first = 0
        while first < entries:
            e = first + tl.arange(0, BLOCK)
            inside = e < entries
            if TRANSPOSED:  # the kv-tile's q-tiles
                flat = (b.to(tl.int64) * nq + e) * nk + tile
            else:  # the q-tile's kv-tiles
                flat = (b.to(tl.int64) * nq + tile) * nk + e
            kind = tl.load(kinds + flat, mask=inside, other=0)
            is_full = (kind == _FULL).to(tl.int32)
            is_causal = (kind == _CAUSAL).to(tl.int32)
            is_partial = (kind == _PARTIAL).to(tl.int32)
            tl.store(index + full_at + tl.cumsum(is_full, 0) - 1, e, mask=is_full != 0)
            tl.store(index + causal_at + tl.cumsum(is_causal, 0) - 1, e, mask=is_causal != 0)
            rank = tl.cumsum(is_partial, 0) - 1
            tl.store(index + partial_at + rank, e, mask=is_partial != 0)
            source = tl.load(slot_of + flat, mask=is_partial != 0, other=0)
            tl.store(sources + slot_at + rank, source, mask=is_partial != 0)
            full_at += tl.sum(is_full, 0)
            causal_at += tl.sum(is_causal, 0)
            partial_at += tl.sum(is_partial, 0)
            slot_at += tl.sum(is_partial, 0)
            first += BLOCK

    _INTS = ("stride_b", "stride_r", "stride_c", "b0", "r0", "i0", "tile_rows", "S", "nq", "nk", "partial_counter",
             "visited_counter", "rows", "row_tiles", "entries")
    _POINTERS = ("data", "kinds", "slot_of", "forward_words", "backward_words", "counters", "forward_counts",
                 "backward_counts", "counts", "ptr", "starts", "index", "sources")
    _CLASSIFY = Launcher(unspecialised_jit(_classify_kernel, _INTS, _POINTERS),
                         ("BLOCK_M", "BLOCK_N", "M_P2", "N_P2", "FORWARD_WORDS", "BACKWARD_WORDS", "COUNT_PAIRS",
                          "CHUNK", "ROWS_ALIGNED"))
    _SCAN = Launcher(unspecialised_jit(_scan_kernel, _INTS, _POINTERS), ("BLOCK",))
    _SCHEDULE = Launcher(unspecialised_jit(_schedule_kernel, _INTS, _POINTERS), ("BLOCK", "TRANSPOSED"))
