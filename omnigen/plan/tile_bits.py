"""Boolean tiles to and from the kernels' bit layout of a partial tile (`omnigen.plan.bits`), for masks given as data.

`bits.partial_bits` makes a slot's words by evaluating the rules; a mask without rules (a dense mask, a `mask_mod`,
FlashMask intervals: `omnigen.plan.ruleless`) already has each partial tile as a boolean [block_m, block_n] block, and
`pack` turns a batch of such blocks into the same words -- the forward's slot (a q-tile's rows of keys) or, with
`transposed`, the backward's (the kv-tile's keys as rows, its queries as columns). `unpack` is the inverse: what a
path that does not read bits the kernels' way (the CPU path, tests) uses to get a slot's tile back.

The layout (bits.py's docstring): thread quad lane t of a row keeps the columns c(t, v) = 8 (v // 2) + 2 t + v % 2,
v = 0 .. columns / 4 - 1; bit v % 32 of word v // 32 is that column's; words stored [slot][word][row][t].
"""

from __future__ import annotations

import torch

from .bits import thread_columns, mask_words, pack_thread_values

# Scores of this many tile elements are packed at a time (bounded temporaries: int64 weights per element).
PACK_ELEMENTS = 1 << 22


def _columns(columns: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(tile column of thread t's value v as int64 [4, words * 32], clamped into the tile; whether it exists)."""
    column = thread_columns(columns, device)  # `columns` where a thread has no such value
    return column.clamp(max=columns - 1), column < columns


def pack(tiles: torch.Tensor, transposed: bool = False) -> torch.Tensor:
    """int32 [n, words, rows, 4]: the slots of `tiles` (bool [n, block_m, block_n], queries x keys). Forward: rows are
    the tile's queries; `transposed`: rows are its keys and columns its queries (the backward's slot)."""
    if transposed:
        tiles = tiles.transpose(1, 2)
    n, rows, columns = tiles.shape
    words = mask_words(columns)
    column, exists = _columns(columns, tiles.device)
    out = torch.empty(n, words, rows, 4, dtype=torch.int32, device=tiles.device)
    step = max(1, PACK_ELEMENTS // max(1, rows * words * 128))
    for first in range(0, n, step):
        # [m, rows, 4, words * 32]: each thread's values in order, absent columns False.
        out[first : first + step] = pack_thread_values(tiles[first : first + step][:, :, column] & exists)
    return out


def unpack(words: torch.Tensor, block_m: int, block_n: int, transposed: bool = False) -> torch.Tensor:
    """bool [n, block_m, block_n] (queries x keys) from slots' words (int32, any shape of n whole slots): `pack`'s
    inverse; the backward's slots (`transposed`) come back in the same query x key orientation."""
    rows, columns = (block_n, block_m) if transposed else (block_m, block_n)
    n_words = mask_words(columns)
    view = words.reshape(-1, n_words, rows, 4).long() & 0xFFFFFFFF
    column, exists = _columns(columns, words.device)  # [4, V]
    v = torch.arange(n_words * 32, device=words.device)
    # [n, rows, 4, V]: bit v % 32 of word v // 32 of thread t.
    bit = (view[:, v // 32].permute(0, 2, 3, 1) >> (v % 32)) & 1
    tiles = torch.zeros(view.shape[0], rows, columns, dtype=torch.bool, device=words.device)
    t_index, v_index = exists.nonzero(as_tuple=True)
    tiles[:, :, column[t_index, v_index]] = bit[:, :, t_index, v_index].bool()
    return tiles.transpose(1, 2) if transposed else tiles
