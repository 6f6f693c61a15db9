"""Partial tiles' masks as bits, made once per layout: what the Hopper kernels read instead of evaluating the rules.

A partial tile's mask does not depend on the head, yet a kernel that evaluates the rules on it does that work once
per query head and call (16 times over at H = 16), and on the sm90 forward that work cost a partial tile ~1.6x a
full one. Here each partial tile, up to a capacity, gets its mask as bits once, when the mask is made; the kernel
loads two words per thread and step instead. Twice: for the forward schedule (a slot is a q-tile's block_m rows of
block_n keys) and, `transposed`, for the backward's (a kv-tile's block_n keys as rows, block_m queries as
columns: the layout of S^T in the backward's accumulators).

Slots. Slot s holds the s-th partial entry of the schedule in schedule order (the forward's q-tile rows in order,
each row's partial kv-tiles in order; the backward's kv-tile columns and their q-tiles). `slot_starts[r]` is the
slot of row r's first partial entry (an exclusive prefix sum of the rows' partial counts; the last entry,
`slot_starts[R]`, is the total). Entries whose slot is
`capacity` or more have no bits: the kernel evaluates the rules for them as before. The capacity is fixed by
(B, S, tile shape) and the caller's choice (`capacity_for`), never by the layout, so a mask's tensors keep
their shapes from layout to layout (CUDA graphs, torch.compile) and making one needs no host sync.

Bit layout of a slot (the wgmma accumulator's): thread quad lane t (= lane % 4) of the warp holding tile row m
keeps, in row m, the columns c(t, v) = 8 (v // 2) + 2 t + v % 2 for v = 0 .. columns / 4 - 1; bit v % 32 of word
v // 32 is that column's. Words are stored as [slot][word][row m][t] (int32), so the 32 lanes of a warp read 128
contiguous bytes per row half and word. Columns at or past the sequence's end are 0.

`partial_bits` makes them on the device of the schedules: on CUDA two Triton launches (the slot starts, by one
program; then one program per slot, which finds its row by bisection and writes zeros past the plan's partial
entries), else `partial_bits_reference`, the same in torch (the CPU path and the tests' oracle).
"""

from __future__ import annotations

import torch

from ..semantics import pair_predicate, rule_tensors
from .launch import DIRECT_LAUNCH, Launcher, launch_hooks_idle, tl, triton, unspecialised_jit

# What `omnigen.mask` reserves by default: bits for this many partial tiles per q-tile row of the batch, in each
# of the two schedules (O(S) memory: 2 KB a slot at 128 x 128 tiles, so 16 KB per 128 query rows). A Transfusion
# layout has 1.3-1.5 partial tiles per q-tile row at 8K-32K; layouts of many short segments have more, and their
# tiles past the capacity evaluate the rules in the kernel. `partial_bits="all"` reserves one slot per tile.
DEFAULT_SLOTS_PER_ROW = 4


def mask_words(columns: int) -> int:
    """32-bit words per thread and row of a tile `columns` wide (a thread holds columns / 4 of a row)."""
    return -(-columns // 128)


def slot_words(block_m: int, block_n: int, transposed: bool = False) -> int:
    """int32 words of one slot (one partial tile): block_m rows of block_n columns, or the transpose (backward)."""
    rows, columns = (block_n, block_m) if transposed else (block_m, block_n)
    return mask_words(columns) * rows * 4


def capacity_for(choice: int | str, batch: int, seq_len: int, block_m: int, block_n: int) -> int:
    """Slots to reserve for `choice`: "auto" (DEFAULT_SLOTS_PER_ROW per q-tile row), "all" (every tile), an int
    (that many, at most every tile), or 0 / "none" (no bits: the kernel evaluates every partial tile)."""
    nq, nk = -(-seq_len // block_m), -(-seq_len // block_n)
    tiles = batch * nq * nk
    if choice == "auto":
        return min(tiles, DEFAULT_SLOTS_PER_ROW * batch * nq)
    if choice == "all":
        return tiles
    if choice == "none":
        return 0
    if isinstance(choice, bool) or not isinstance(choice, int) or choice < 0:
        raise ValueError(f"partial_bits must be 'auto', 'all', 'none' or a number of tiles >= 0, not {choice!r}")
    return min(tiles, choice)


def slot_starts(ptr: torch.Tensor, rows: int) -> torch.Tensor:
    """int32 [rows + 1]: the slot of each schedule row's first partial entry; the last entry is the total."""
    ptr = ptr.long()
    counts = ptr[3 : 3 * rows + 1 : 3] - ptr[2 : 3 * rows : 3]
    starts = torch.zeros(rows + 1, dtype=torch.int64, device=ptr.device)
    starts[1:] = torch.cumsum(counts, 0)
    return starts.to(torch.int32)


def slot_tiles(ptr: torch.Tensor, index: torch.Tensor, starts: torch.Tensor, rows: int, row_tiles: int,
               capacity: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per slot: (batch element, the schedule row's tile, the entry's tile) as int64 [capacity] -- (b, q-tile, kv-tile)
    for the forward schedule, (b, kv-tile, q-tile) for the backward's; batch element -1 for an unused slot."""
    device = ptr.device
    slots = torch.arange(capacity, device=device)
    ends = starts[1:].long()
    row = torch.searchsorted(ends, slots, right=True).clamp(max=max(rows - 1, 0))
    used = slots < starts[rows].long()
    entry = ptr.long()[3 * row + 2] + slots - starts.long()[row]
    other = index.long()[entry.clamp(0, max(index.numel() - 1, 0))] if index.numel() else torch.zeros_like(slots)
    batch = torch.where(used, row // row_tiles, -1)
    return batch, row % row_tiles, torch.where(used, other, 0)


def pack_thread_values(allowed: torch.Tensor) -> torch.Tensor:
    """int32 [n, words, rows, 4], the slots' layout, from bool [n, rows, 4, words * 32]: each row's thread t's values
    v in order (`thread_columns`), bit v % 32 of word v // 32."""
    n, rows, threads, values = allowed.shape
    weights = torch.bitwise_left_shift(torch.ones(32, dtype=torch.int64, device=allowed.device),
                                       torch.arange(32, device=allowed.device))
    packed = (allowed.view(n, rows, threads, values // 32, 32).long() * weights).sum(-1)  # distinct bits: sum = or
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    return packed.permute(0, 3, 1, 2)


def thread_columns(columns: int, device: torch.device) -> torch.Tensor:
    """int64 [4, words * 32]: tile column of thread t's value v (`columns` or more: no such column)."""
    v = torch.arange(mask_words(columns) * 32, device=device)
    t = torch.arange(4, device=device)[:, None]
    column = 8 * (v // 2) + 2 * t + v % 2
    return torch.where(v < columns // 4, column, columns)


def _shape(tables, block_m: int, block_n: int, transposed: bool) -> tuple[int, int, int]:
    """(tile rows, tile columns, row tiles per batch element) of the forward's tiles or the backward's transposed."""
    S = tables.seq_len
    return (block_n, block_m, -(-S // block_n)) if transposed else (block_m, block_n, -(-S // block_m))


def partial_bits_reference(rules, tables, ptr: torch.Tensor, index: torch.Tensor, block_m: int, block_n: int,
                           capacity: int, transposed: bool = False,
                           chunk: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """(slot_starts, bits) in torch on the schedules' device: bits int32 [capacity * slot_words]. Forward: `ptr`,
    `index` are fwd_ptr, fwd_kv and a slot holds a q-tile's rows of keys; `transposed` (backward): bwd_ptr, bwd_q,
    and a slot holds a kv-tile's keys (rows) of queries (columns)."""
    B, S = tables.batch_size, tables.seq_len
    tile_rows, tile_columns, row_tiles = _shape(tables, block_m, block_n, transposed)
    rows = B * row_tiles
    starts = slot_starts(ptr, rows)
    words = mask_words(tile_columns)
    device = ptr.device
    bits = torch.zeros(capacity, words, tile_rows, 4, dtype=torch.int32, device=device)
    if capacity == 0:
        return starts, bits.view(-1)
    batch, row_tile, column_tile = slot_tiles(ptr, index, starts, rows, row_tiles, capacity)
    rule_t = rule_tensors(rules, device)
    columns = thread_columns(tile_columns, device)[None, None]  # [1, 1, 4, V]
    for first in range(0, capacity, chunk):
        b, i, j = (x[first : first + chunk] for x in (batch, row_tile, column_tile))
        row_pos = (i * tile_rows)[:, None, None, None] + torch.arange(tile_rows, device=device)[None, :, None, None]
        column_pos = torch.where(columns < tile_columns, (j * tile_columns)[:, None, None, None] + columns, S)
        q_pos, k_pos = (column_pos, row_pos) if transposed else (row_pos, column_pos)
        allowed = pair_predicate(rules, tables, b.clamp(min=0)[:, None, None, None], q_pos, k_pos, rule_t)
        allowed &= (b >= 0)[:, None, None, None]
        bits[first : first + chunk] = pack_thread_values(allowed)
    return starts, bits.view(-1)


def partial_bits(rules, tables, ptr: torch.Tensor, index: torch.Tensor, block_m: int, block_n: int,
                 capacity: int, transposed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(slot_starts int32 [schedule rows + 1], bits int32 [capacity * slot_words]) on the schedules' device, for the
    forward schedule or (`transposed`) the backward's; no host sync."""
    if ptr.device.type != "cuda" or triton is None or capacity == 0:
        return partial_bits_reference(rules, tables, ptr, index, block_m, block_n, capacity, transposed)
    with torch.cuda.device(ptr.device):  # Triton launches on the current device
        return _partial_bits_triton(rules, tables, ptr, index, block_m, block_n, capacity, transposed)


# ---- the Triton kernels -------------------------------------------------------------------------------------
# Two launches per schedule, both straight through the compiled kernel after the first (launch.Launcher): making
# a mask is on a training step's path, and a dozen small torch operations per schedule had doubled its host time.

if triton is not None:

    # The kernels' integer and pointer arguments (launch.unspecialised_jit: one compiled kernel per constexpr set).
    _INTS = ("rows", "row_tiles", "S", "n_mod", "pad")
    _POINTERS = ("ptr", "index", "starts", "segment", "modality", "document", "see", "causal", "window", "bits")

    def _starts_kernel(ptr, starts, rows, BLOCK: tl.constexpr):
        """One program: starts[0] = 0, starts[r + 1] = the partial entries of rows 0..r (slot_starts)."""
        tl.store(starts, 0)
        carry = tl.full((), 0, tl.int32)
        for first in range(0, rows, BLOCK):
            r = first + tl.arange(0, BLOCK)
            inside = r < rows
            counts = tl.load(ptr + 3 * r + 3, mask=inside, other=0) - tl.load(ptr + 3 * r + 2, mask=inside, other=0)
            tl.store(starts + 1 + r, tl.cumsum(counts, 0) + carry, mask=inside)
            carry += tl.sum(counts, 0)

    def _bits_kernel(ptr, index, starts, segment, modality, document, see, causal, window, bits,
                     rows, row_tiles, S, n_mod, pad,
                     ROWS: tl.constexpr, ROWS_P2: tl.constexpr, COLUMNS: tl.constexpr, WORDS: tl.constexpr,
                     TRANSPOSED: tl.constexpr, ISOLATED: tl.constexpr, WINDOWS: tl.constexpr):
        """One program per slot: a slot past the plan's partial entries writes zeros; the others find their schedule
        row r (starts[r] <= slot < starts[r + 1]) by bisection, their entry and tiles, and write the tile's words."""
        slot = tl.program_id(0)
        rows_here = tl.arange(0, ROWS_P2)  # a power of two: rows past ROWS are neither evaluated nor stored
        t = tl.arange(0, 4)
        stored = (rows_here < ROWS)[:, None]
        if slot >= tl.load(starts + rows):  # past the plan's partial entries: zeros, and no predicate to evaluate
            for w in tl.static_range(WORDS):
                out = bits + (slot.to(tl.int64) * WORDS + w) * (ROWS * 4) + rows_here[:, None] * 4 + t[None, :]
                tl.store(out, tl.zeros((ROWS_P2, 4), tl.int32), mask=stored)
            return
        lo = tl.full((), 0, tl.int32)
        hi = tl.full((), 0, tl.int32) + rows
        while hi - lo > 1:
            mid = (lo + hi) // 2
            below = tl.load(starts + mid) <= slot
            lo = tl.where(below, mid, lo)
            hi = tl.where(below, hi, mid)
        column_tile = tl.load(index + tl.load(ptr + 3 * lo + 2) + slot - tl.load(starts + lo))
        base = (lo // row_tiles).to(tl.int64) * S
        row_pos = ((lo % row_tiles) * ROWS + rows_here)[:, None, None]  # [R, 1, 1]
        row_ok = (rows_here < ROWS)[:, None, None]
        bit = tl.arange(0, 32)
        for w in tl.static_range(WORDS):
            v = 32 * w + bit
            column = 8 * (v // 2)[None, :] + 2 * t[:, None] + (v % 2)[None, :]  # [4, 32]
            column_pos = (column_tile * COLUMNS + column)[None, :, :]  # [1, 4, 32]
            column_ok = (v < COLUMNS // 4)[None, None, :]
            if TRANSPOSED:
                q = column_pos
                k = row_pos
            else:
                q = row_pos
                k = column_pos
            inside = (q < S) & (k < S) & column_ok & row_ok
            qc = tl.minimum(q, S - 1)
            kc = tl.minimum(k, S - 1)
            seg_q = tl.load(segment + base + qc)
            seg_k = tl.load(segment + base + kc)
            mod_q = tl.load(modality + base + qc)
            mod_k = tl.load(modality + base + kc)
            policy = tl.load(see + mod_q * (n_mod + 1) + mod_k)
            own = (tl.load(causal + mod_q) == 0) | (k <= q)
            other = tl.where(seg_k < seg_q, policy >= 1, policy == 2)
            ok = tl.where(seg_q == seg_k, own, other) & inside & (mod_q != pad) & (mod_k != pad)
            if ISOLATED:
                ok = ok & (tl.load(document + base + qc) == tl.load(document + base + kc))
            if WINDOWS:
                wq = tl.load(window + mod_q)
                ok = ok & ((wq == 0) | (q - k < wq))
            word = tl.sum(ok.to(tl.int32) << bit[None, None, :], axis=2)  # [R, 4]: distinct bits, so sum = or
            out = bits + (slot.to(tl.int64) * WORDS + w) * (ROWS * 4) + rows_here[:, None] * 4 + t[None, :]
            tl.store(out, word, mask=stored)

    _STARTS = Launcher(unspecialised_jit(_starts_kernel, _INTS, _POINTERS), ("BLOCK",))
    _BITS = Launcher(unspecialised_jit(_bits_kernel, _INTS, _POINTERS),
                     ("ROWS", "ROWS_P2", "COLUMNS", "WORDS", "TRANSPOSED", "ISOLATED", "WINDOWS"))

_RULES_INT32: dict = {}


def _rules_int32(rules, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rules' see / causal / window tables as int32 on `device` (cached: a mask is made per batch)."""
    key = (rules, str(device))
    cached = _RULES_INT32.get(key)
    if cached is None:
        rule_t = rule_tensors(rules, device)
        cached = tuple(rule_t[name].to(torch.int32).contiguous() for name in ("see", "causal", "window"))
        _RULES_INT32[key] = cached
    return cached


def _partial_bits_triton(rules, tables, ptr, index, block_m, block_n, capacity, transposed):
    B, S = tables.batch_size, tables.seq_len
    tile_rows, tile_columns, row_tiles = _shape(tables, block_m, block_n, transposed)
    rows = B * row_tiles
    device = ptr.device
    starts = torch.empty(rows + 1, dtype=torch.int32, device=device)
    bits = torch.empty(capacity * slot_words(block_m, block_n, transposed), dtype=torch.int32, device=device)
    see, causal, window = _rules_int32(rules, device)
    direct = DIRECT_LAUNCH and B * S <= 2**31 - 1 and launch_hooks_idle()
    _STARTS((1, 1, 1), (ptr, starts, rows), (1024,), 4, direct)
    if index.numel() == 0:  # nothing visited: a live address in its place (every slot is unused, nothing reads it)
        index = starts
    args = (ptr, index, starts, tables.token_segment.contiguous(), tables.token_modality.contiguous(),
            tables.token_doc.contiguous(), see, causal, window, bits, rows, row_tiles, S, len(rules.modalities),
            rules.pad_id)
    constants = (tile_rows, 1 << (tile_rows - 1).bit_length(), tile_columns, mask_words(tile_columns),
                 bool(transposed), bool(rules.isolated_documents), bool(rules.has_windows))
    _BITS((capacity, 1, 1), args, constants, 4, direct)
    return starts, bits
