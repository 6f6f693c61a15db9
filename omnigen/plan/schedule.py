"""`Plan`: which tiles a kernel visits and how, as compressed schedules (CSR per tile row and column)."""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from ..layout import LayoutTables
from ..semantics import KIND_NAMES, SCHEDULE_KINDS
from .host import schedule_kind_cells, schedule_rows
from .summary import PlanStatistics


@dataclass
class Plan(PlanStatistics):
    """Which tiles a kernel visits and how, for one layout (or a batch) and one tile shape.

    Forward schedule (per q-tile row r = b * num_q_tiles + i): kv-tile indices
    `fwd_kv[fwd_ptr[3r] : fwd_ptr[3r+3]]`, grouped by kind: full tiles in
    `[fwd_ptr[3r], fwd_ptr[3r+1])`, causal in `[fwd_ptr[3r+1], fwd_ptr[3r+2])`, partial in
    `[fwd_ptr[3r+2], fwd_ptr[3r+3])`. The backward schedule is the same per kv-tile column
    c = b * num_kv_tiles + j, listing q-tile indices in `bwd_q`.
    """

    block_m: int
    block_n: int
    batch_size: int
    seq_len: int
    batched: bool
    fwd_ptr: torch.Tensor  # int32 [B * num_q_tiles * 3 + 1]
    fwd_kv: torch.Tensor  # int32 [num_tiles]
    bwd_ptr: torch.Tensor  # int32 [B * num_kv_tiles * 3 + 1]
    bwd_q: torch.Tensor  # int32 [num_tiles]
    # The allowed-pair count, or (host planner) a function that counts it: the kernels never need it, so
    # a plan made for a training step does not pay for it.
    pair_count: int | Callable[[], int] = field(repr=False)
    tables: LayoutTables = field(repr=False)
    rules_hash: str = ""

    @property
    def allowed_pairs(self) -> int:
        """Allowed (query, key) pairs over the whole layout (or batch)."""
        if not isinstance(self.pair_count, int):
            self.pair_count = int(self.pair_count())
        return self.pair_count

    @property
    def num_tiles(self) -> int:
        """Tiles a kernel visits (every non-empty tile)."""
        return int(self.fwd_kv.shape[0])

    @property
    def device(self) -> torch.device:
        return self.fwd_kv.device

    @property
    def kinds(self) -> torch.Tensor:
        """Dense tile kinds, int8 [nq, nk] (or [B, nq, nk] for a batch): 0 empty 1 full 2 causal 3 partial.

        Made on demand on the host from the forward schedule (`host.schedule_rows`), a band of q-tile rows at
        a time (so its temporaries stay small next to the int8 result, even for a million-token plan), then
        placed on the plan's device."""
        nq, nk = self.num_q_tiles, self.num_kv_tiles
        rows = self.batch_size * nq
        fwd_ptr, fwd_kv = self._host_forward()
        dense = np.empty((rows, nk), dtype=np.int8)
        band = max(1, (1 << 22) // max(nk, 1))
        for ra in range(0, rows, band):
            rb = min(rows, ra + band)
            dense[ra:rb] = schedule_rows(fwd_ptr, fwd_kv, ra, rb, nk)
        kinds = torch.from_numpy(dense).view(self.batch_size, nq, nk).to(self.device)
        return kinds if self.batched else kinds[0]

    def kind_cells(self, elements: int, row_factor: int, col_factor: int) -> np.ndarray:
        fwd_ptr, fwd_kv = self._host_forward()
        return schedule_kind_cells(fwd_ptr, fwd_kv, self.num_q_tiles, self.num_kv_tiles, elements, row_factor,
                                   col_factor)

    def _host_forward(self) -> tuple[np.ndarray, np.ndarray]:
        """fwd_ptr and fwd_kv as numpy arrays (views of CPU tensors, copies of others)."""
        return self.fwd_ptr.cpu().numpy(), self.fwd_kv.cpu().numpy()

    def counts(self) -> dict[str, int]:
        total = self.batch_size * self.num_q_tiles * self.num_kv_tiles
        sizes = (self.fwd_ptr[1:] - self.fwd_ptr[:-1]).view(-1, 3).sum(0).tolist()
        out = {KIND_NAMES[k]: int(n) for k, n in zip(SCHEDULE_KINDS, sizes)}
        out["empty"] = total - sum(sizes)
        return {name: out[name] for name in ("empty", "full", "causal", "partial")}

    def nbytes(self) -> int:
        """Bytes of schedule metadata a kernel reads (the O(S) layout tables not included)."""
        return sum(t.numel() * t.element_size() for t in (self.fwd_ptr, self.fwd_kv, self.bwd_ptr, self.bwd_q))

    def dq_ranks(self) -> torch.Tensor:
        """The order of deterministic mode's dQ additions on Hopper: see `dq_ranks` (the function)."""
        return dq_ranks(self.fwd_ptr, self.fwd_kv, self.bwd_ptr, self.bwd_q, self.batch_size, self.num_q_tiles,
                        self.num_kv_tiles)

    def forward_tiles(self, q_tile: int, batch: int = 0) -> dict[str, list[int]]:
        """kv-tiles of one q-tile, by kind (for inspection and tests). `q_tile` in [0, num_q_tiles),
        `batch` in [0, batch_size); anything else is an IndexError that says the range."""
        _check_tile_index("q_tile", q_tile, self.num_q_tiles, self.seq_len, self.block_m, "block_m")
        _check_tile_index("batch", batch, self.batch_size)
        return _schedule_row(self.fwd_ptr, self.fwd_kv, batch * self.num_q_tiles + q_tile)

    def backward_tiles(self, kv_tile: int, batch: int = 0) -> dict[str, list[int]]:
        """q-tiles of one kv-tile, by kind. `kv_tile` in [0, num_kv_tiles), `batch` in [0, batch_size)."""
        _check_tile_index("kv_tile", kv_tile, self.num_kv_tiles, self.seq_len, self.block_n, "block_n")
        _check_tile_index("batch", batch, self.batch_size)
        return _schedule_row(self.bwd_ptr, self.bwd_q, batch * self.num_kv_tiles + kv_tile)

    def to(self, device: torch.device | str) -> "Plan":
        moved = {name: getattr(self, name).to(device) for name in ("fwd_ptr", "fwd_kv", "bwd_ptr", "bwd_q")}
        return Plan(
            block_m=self.block_m, block_n=self.block_n, batch_size=self.batch_size, seq_len=self.seq_len,
            batched=self.batched, pair_count=self.pair_count, rules_hash=self.rules_hash,
            tables=self.tables if self.tables.device == torch.device(device) else self.tables.to(device),
            **moved,
        )


def _check_tile_index(name: str, value: Any, count: int, seq_len: int = 0, block: int = 0, block_name: str = "") -> None:
    """An index into a plan's tiles (or batch): an int in [0, count), else an error that says the range."""
    try:
        if isinstance(value, bool):
            raise TypeError
        value = operator.index(value)  # ints, numpy and 0-d torch integers
    except TypeError:
        raise TypeError(f"{name} must be an integer in [0, {count - 1}], not {type(value).__name__} {value!r}") from None
    if not 0 <= value < count:
        plural = "s" if count != 1 else ""
        if block:  # a tile index
            has = f"{count} {name.split('_')[0]}-tile{plural} ({seq_len} tokens in tiles of {block_name}={block})"
        else:
            has = f"a batch of {count} element{plural}"
        raise IndexError(f"{name}={value} is out of range: this plan has {has}, so {name} must be in [0, {count - 1}]")


def _schedule_row(ptr: torch.Tensor, index: torch.Tensor, row: int) -> dict[str, list[int]]:
    bounds = ptr[3 * row : 3 * row + 4].tolist()
    return {KIND_NAMES[k]: index[bounds[g] : bounds[g + 1]].tolist() for g, k in enumerate(SCHEDULE_KINDS)}


def dq_ranks(fwd_ptr: torch.Tensor, fwd_kv: torch.Tensor, bwd_ptr: torch.Tensor, bwd_q: torch.Tensor, batch_size: int,
             num_q_tiles: int, num_kv_tiles: int) -> torch.Tensor:
    """int32 [len(bwd_q)], parallel to `bwd_q`: for each backward-schedule entry (kv-tile j, q-tile i), how many
    kv-tiles before j (in index order) the q-tile's row visits; 0 past the plan's last entry.

    Deterministic mode on Hopper adds a q-tile's dQ contributions in this order: the kv-tile of rank r waits
    until the q-tile's counter reaches r, so every dQ element gets the same sums in the same order on every
    run, and a kv-tile only ever waits for lower-indexed ones (earlier CTAs of the grid: no deadlock). Memory:
    a few int64 copies of the tile count, like the plan itself.

    No host sync and shapes fixed by the buffers' lengths (a precomputed mask's schedule buffers may be longer
    than its plan): it runs inside CUDA-graph capture, and a captured graph recomputes the ranks when the mask
    is overwritten with another layout's."""
    nq, nk = num_q_tiles, num_kv_tiles
    rows, columns = batch_size * nq, batch_size * nk
    device = fwd_kv.device
    fwd, bwd = fwd_ptr.long(), bwd_ptr.long()
    total = fwd[3 * rows]  # a 0-d tensor: read on the device, never by the host

    def owners(ptr: torch.Tensor, groups: int, entries: torch.Tensor) -> torch.Tensor:
        """The schedule row (q-tile, or kv-tile for the backward) of each entry, from the rows' starts."""
        return (torch.searchsorted(ptr[0 : 3 * groups + 1 : 3].contiguous(), entries, right=True) - 1).clamp(0, groups - 1)

    forward_entries = torch.arange(fwd_kv.numel(), device=device)
    unused = rows * nk  # past every real key: entries beyond the plan sort last
    visited = torch.where(forward_entries < total, owners(fwd, rows, forward_entries) * nk + fwd_kv.long(), unused)
    visited = visited.sort().values
    backward_entries = torch.arange(bwd_q.numel(), device=device)
    inside = backward_entries < total
    column_of = owners(bwd, columns, backward_entries)
    row = torch.where(inside, (column_of // nk) * nq + bwd_q.long(), 0).clamp(0, rows - 1)
    position = torch.searchsorted(visited, row * nk + column_of % nk)
    return torch.where(inside, position - fwd[3 * row], 0).to(torch.int32)
