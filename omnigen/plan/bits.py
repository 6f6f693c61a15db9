"""Partial tiles' masks as bits, made once per layout: what the Hopper forward reads instead of evaluating the rules.

A partial tile's mask does not depend on the head, yet a kernel that evaluates the rules on it does that work once
per query head and call (16 times over at H = 16), and on the sm90 forward that work cost a partial tile ~1.6x a
full one. Here each partial tile of the forward schedule, up to a capacity, gets its block_m x block_n mask as
bits once, when the mask is made; the kernel loads two words per thread and step instead.

Slots. Slot s holds the s-th partial entry of the forward schedule in schedule order (q-tile rows in order, each
row's partial kv-tiles in order). `slot_starts[r]` is the slot of row r's first partial entry (an exclusive
prefix sum of the rows' partial counts; the last entry, `slot_starts[R]`, is the total). Entries whose slot is
`capacity` or more have no bits: the kernel evaluates the rules for them as before. The capacity is fixed by
(B, S, tile shape) and the caller's choice (`capacity_for`), never by the layout, so a mask's tensors keep
their shapes from layout to layout (CUDA graphs, torch.compile) and making one needs no host sync.

Bit layout of a slot (the wgmma accumulator's): thread quad lane t (= lane % 4) of the warp holding tile row m
keeps, in row m, the columns c(t, v) = 8 (v // 2) + 2 t + v % 2 for v = 0 .. block_n / 4 - 1; bit v % 32 of word
v // 32 is that column's. Words are stored as [slot][word][row m][t] (int32), so the 32 lanes of a warp read 128
contiguous bytes per row half and word. Columns at or past the sequence's end are 0.

`partial_bits` makes them on the device of the schedules: a Triton kernel on CUDA (one program per slot; slots
past the plan's partial total return at once), else `partial_bits_reference`, the same in torch (the CPU path and
the tests' oracle).
"""

from __future__ import annotations

import torch

from ..semantics import pair_predicate, rule_tensors
from .launch import tl, triton

# What `omnigen.mask` reserves by default: bits for this many partial tiles per q-tile row of the batch (O(S)
# memory: 2 KB a slot at 128 x 128 tiles, so 8 KB per 128 query rows). A Transfusion layout has 1.3-1.5 partial
# tiles per q-tile row at 8K-32K; layouts of many short segments have more, and their tiles past the capacity
# evaluate the rules in the kernel. `partial_bits="all"` reserves one slot per tile.
DEFAULT_SLOTS_PER_ROW = 4


def mask_words(block_n: int) -> int:
    """32-bit words per thread and row: block_n / 4 columns a thread holds in a row."""
    return -(-block_n // 128)


def slot_words(block_m: int, block_n: int) -> int:
    """int32 words of one slot (one partial tile)."""
    return mask_words(block_n) * block_m * 4


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


def slot_starts(fwd_ptr: torch.Tensor, rows: int) -> torch.Tensor:
    """int32 [rows + 1]: the slot of each q-tile row's first partial entry; the last entry is the total."""
    ptr = fwd_ptr.long()
    counts = ptr[3 : 3 * rows + 1 : 3] - ptr[2 : 3 * rows : 3]
    starts = torch.zeros(rows + 1, dtype=torch.int64, device=fwd_ptr.device)
    starts[1:] = torch.cumsum(counts, 0)
    return starts.to(torch.int32)


def slot_tiles(fwd_ptr: torch.Tensor, fwd_kv: torch.Tensor, starts: torch.Tensor, rows: int, num_q_tiles: int,
               capacity: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per slot: (batch element, q-tile, kv-tile) as int64 [capacity]; batch element -1 for an unused slot."""
    device = fwd_ptr.device
    slots = torch.arange(capacity, device=device)
    ends = starts[1:].long()
    row = torch.searchsorted(ends, slots, right=True).clamp(max=max(rows - 1, 0))
    used = slots < starts[rows].long()
    entry = fwd_ptr.long()[3 * row + 2] + slots - starts.long()[row]
    kv_tile = fwd_kv.long()[entry.clamp(0, max(fwd_kv.numel() - 1, 0))] if fwd_kv.numel() else torch.zeros_like(slots)
    batch = torch.where(used, row // num_q_tiles, -1)
    return batch, row % num_q_tiles, torch.where(used, kv_tile, 0)


def _thread_columns(block_n: int, device: torch.device) -> torch.Tensor:
    """int64 [4, words * 32]: tile column of thread t's value v (block_n or more: no such column)."""
    v = torch.arange(mask_words(block_n) * 32, device=device)
    t = torch.arange(4, device=device)[:, None]
    column = 8 * (v // 2) + 2 * t + v % 2
    return torch.where(v < block_n // 4, column, block_n)


def partial_bits_reference(rules, tables, fwd_ptr: torch.Tensor, fwd_kv: torch.Tensor, block_m: int, block_n: int,
                           capacity: int, chunk: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """(slot_starts, bits) in torch on the schedules' device: bits int32 [capacity * slot_words]."""
    B, S = tables.batch_size, tables.seq_len
    nq = -(-S // block_m)
    rows = B * nq
    starts = slot_starts(fwd_ptr, rows)
    words = mask_words(block_n)
    device = fwd_ptr.device
    bits = torch.zeros(capacity, words, block_m, 4, dtype=torch.int32, device=device)
    if capacity == 0:
        return starts, bits.view(-1)
    batch, q_tile, kv_tile = slot_tiles(fwd_ptr, fwd_kv, starts, rows, nq, capacity)
    rule_t = rule_tensors(rules, device)
    columns = _thread_columns(block_n, device)  # [4, V]
    weights = torch.bitwise_left_shift(torch.ones(32, dtype=torch.int64, device=device),
                                       torch.arange(32, device=device))
    for first in range(0, capacity, chunk):
        b, i, j = (x[first : first + chunk] for x in (batch, q_tile, kv_tile))
        q_pos = (i * block_m)[:, None, None, None] + torch.arange(block_m, device=device)[None, :, None, None]
        column = columns[None, None]  # [1, 1, 4, V]
        k_pos = torch.where(column < block_n, (j * block_n)[:, None, None, None] + column, S)
        allowed = pair_predicate(rules, tables, b.clamp(min=0)[:, None, None, None], q_pos, k_pos, rule_t)
        allowed &= (b >= 0)[:, None, None, None]
        packed = (allowed.view(*allowed.shape[:3], words, 32).long() * weights).sum(-1)  # [n, BM, 4, W]
        packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
        bits[first : first + chunk] = packed.permute(0, 3, 1, 2)
    return starts, bits.view(-1)


def partial_bits(rules, tables, fwd_ptr: torch.Tensor, fwd_kv: torch.Tensor, block_m: int, block_n: int,
                 capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(slot_starts int32 [B * nq + 1], bits int32 [capacity * slot_words]) on the schedules' device; no host sync."""
    if fwd_ptr.device.type != "cuda" or triton is None or capacity == 0:
        return partial_bits_reference(rules, tables, fwd_ptr, fwd_kv, block_m, block_n, capacity)
    return _partial_bits_triton(rules, tables, fwd_ptr, fwd_kv, block_m, block_n, capacity)


# ---- the Triton kernel --------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _bits_kernel(slot_batch, slot_q, slot_k, segment, modality, document, see, causal, window, bits,
                     S, n_mod, pad,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WORDS: tl.constexpr,
                     ISOLATED: tl.constexpr, WINDOWS: tl.constexpr):
        slot = tl.program_id(0)
        b = tl.load(slot_batch + slot)
        if b < 0:  # past the plan's partial tiles (the buffer was zeroed)
            return
        q0 = tl.load(slot_q + slot) * BLOCK_M
        k0 = tl.load(slot_k + slot) * BLOCK_N
        rows = tl.arange(0, BLOCK_M)
        q = q0 + rows
        q_in = q < S
        qc = tl.minimum(q, S - 1)
        base = b.to(tl.int64) * S
        seg_q = tl.load(segment + base + qc)
        mod_q = tl.load(modality + base + qc)
        causal_q = tl.load(causal + mod_q)
        window_q = tl.load(window + mod_q)
        if ISOLATED:
            doc_q = tl.load(document + base + qc)
        t = tl.arange(0, 4)
        bit = tl.arange(0, 32)
        for w in tl.static_range(WORDS):
            v = 32 * w + bit  # [32]
            column = 8 * (v // 2)[None, :] + 2 * t[:, None] + (v % 2)[None, :]  # [4, 32]
            k = k0 + column
            k_in = (v < BLOCK_N // 4)[None, :] & (k < S)
            kc = tl.minimum(k, S - 1)
            seg_k = tl.load(segment + base + kc)
            mod_k = tl.load(modality + base + kc)
            policy = tl.load(see + mod_q[:, None, None] * (n_mod + 1) + mod_k[None, :, :])  # [BM, 4, 32]
            sq = seg_q[:, None, None]
            sk = seg_k[None, :, :]
            qq = q[:, None, None]
            kk = k[None, :, :]
            own = (causal_q[:, None, None] == 0) | (kk <= qq)
            other = tl.where(sk < sq, policy >= 1, policy == 2)
            ok = tl.where(sq == sk, own, other)
            ok = ok & q_in[:, None, None] & k_in[None, :, :]
            ok = ok & (mod_q[:, None, None] != pad) & (mod_k[None, :, :] != pad)
            if ISOLATED:
                doc_k = tl.load(document + base + kc)
                ok = ok & (doc_q[:, None, None] == doc_k[None, :, :])
            if WINDOWS:
                wq = window_q[:, None, None]
                ok = ok & ((wq == 0) | (qq - kk < wq))
            word = tl.sum(ok.to(tl.int32) << bit[None, None, :], axis=2)  # [BM, 4]: distinct bits, so sum = or
            out = bits + (slot.to(tl.int64) * WORDS + w) * (BLOCK_M * 4) + rows[:, None] * 4 + t[None, :]
            tl.store(out, word)


def _partial_bits_triton(rules, tables, fwd_ptr, fwd_kv, block_m, block_n, capacity):
    B, S = tables.batch_size, tables.seq_len
    nq = -(-S // block_m)
    rows = B * nq
    device = fwd_ptr.device
    starts = slot_starts(fwd_ptr, rows)
    batch, q_tile, kv_tile = slot_tiles(fwd_ptr, fwd_kv, starts, rows, nq, capacity)
    words = mask_words(block_n)
    bits = torch.zeros(capacity * slot_words(block_m, block_n), dtype=torch.int32, device=device)
    rule_t = rule_tensors(rules, device)
    see = rule_t["see"].to(torch.int32).contiguous()
    causal = rule_t["causal"].to(torch.int32).contiguous()
    window = rule_t["window"].to(torch.int32).contiguous()
    _bits_kernel[(capacity,)](
        batch.to(torch.int32), q_tile.to(torch.int32), kv_tile.to(torch.int32),
        tables.token_segment, tables.token_modality, tables.token_doc, see, causal, window, bits,
        S, len(rules.modalities), rules.pad_id,
        BLOCK_M=block_m, BLOCK_N=block_n, WORDS=words,
        ISOLATED=bool(rules.isolated_documents), WINDOWS=bool(rules.has_windows), num_warps=4,
    )
    return starts, bits
