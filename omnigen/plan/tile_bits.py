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

from .bits import thread_columns, mask_words

# Tile elements packed at a time, about (bounded temporaries: an int16 copy of the values, int64 words of 8): on a CPU
# few enough to stay in cache; on a GPU, where each of the ~9 operations a batch takes is a launch that costs the host
# the same whatever its size, 8x more (random eviction's 8K partial tiles at 8K x 4 took ~1,150 packing launches at
# the CPU's size).
PACK_ELEMENTS = 1 << 22
GPU_PACK_ELEMENTS = 1 << 25


def pack_elements(device: torch.device) -> int:
    return PACK_ELEMENTS if device.type == "cpu" else GPU_PACK_ELEMENTS


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
    out = torch.empty(n, words, rows, 4, dtype=torch.int32, device=tiles.device)
    step = max(1, pack_elements(tiles.device) // max(1, rows * words * 128))
    for first in range(0, n, step):
        out[first : first + step] = _pack_bytes(tiles[first : first + step], words)
    return out


def _pack_bytes(tiles: torch.Tensor, words: int) -> torch.Tensor:
    """`pack` of bool [m, rows, columns] (columns a multiple of 16), eight values at a time: thread t's values in order
    are a reshape of the row (column c = 8 (v // 2) + 2 t + v % 2: groups of 8 columns, 4 threads, 2 values), and
    eight 0/1 bytes of an int64 word fold into one byte of bits by shifts (no multiply: nothing overflows)."""
    m, rows, columns = tiles.shape
    # Two adjacent columns are one int16, so thread t's values are every 4th int16 of the row: one copy of 2-byte
    # elements (not a gather of bytes), padded to whole int64 words of 8 values.
    groups = -(-columns // 32)  # int64 words of 8 values per thread and row
    pairs = tiles.contiguous().view(torch.int16).view(m, rows, columns // 8, 4).transpose(2, 3)
    if groups * 4 == columns // 8:
        values = pairs.contiguous()
    else:
        values = torch.zeros(m, rows, 4, groups * 4, dtype=torch.int16, device=tiles.device)
        values[..., : columns // 8] = pairs
    x = values.view(torch.int64)  # [m, rows, 4, groups]: byte k of word g is value 8 g + k
    x = (x | (x >> 7)) & 0x0003000300030003  # value pairs into the low 2 bits of each 16-bit lane
    x = (x | (x >> 14)) & 0x0000000F0000000F  # ... 4 bits of each 32-bit lane
    x = (x | (x >> 28)) & 0xFF  # the word's 8 values as bits 0-7
    if groups < words * 4:  # values past the tile's columns: 0
        x = torch.nn.functional.pad(x, (0, words * 4 - groups))
    shifts = torch.arange(0, 32, 8, device=tiles.device)
    packed = (x.view(m, rows, 4, words, 4) << shifts).sum(-1)  # [m, rows, 4, words], < 2^32 (bits distinct)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    return packed.permute(0, 3, 1, 2)


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
