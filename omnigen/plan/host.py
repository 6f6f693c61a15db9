"""Exact tile classification and the schedules kernels walk, without ever building the S x S mask.

How it stays exact and O(output): the mask is a union of segment-shaped pieces. A query row
q in segment [s0, s1) of modality m, whose document (or batch element) spans [v0, v1), sees

    E-part   keys in [v0, s0) whose modality m may see earlier    (see(m -> mk) in {earlier, all})
    own      keys in [s0, q+1) if m is causal, else [s0, s1)
    L-part   keys in [s1, v1) whose modality m may see later      (see(m -> mk) == all)

all intersected with the sliding window [q - W + 1, inf) when m has a window W. Each part is a
fixed column interval [x, y) weighted by a per-column 0/1 indicator, cut by a sliding interval
[q + a, q + b). Its allowed-pair count over a run of rows is a difference of sums of a prefix
count P evaluated at clamp(q + d, x, y); those sums are O(1) with a second prefix sum PP. A
weight is constant inside a segment, so P and PP are closed forms of per-segment sums (`_Prefix`):
no per-token prefix array is ever made.

Rows are cut into *pieces*: maximal runs inside one q-tile and one segment. For every piece and
every kv-tile its columns may reach, we count allowed pairs N and allowed pairs above the
diagonal U (k > q). Summed per tile, those decide the kind exactly:

    empty   N == 0          full    N == tile area
    causal  U == 0 and N == number of (q, k) in the tile with k <= q          partial  otherwise

Most visited tiles are *far* tiles: wholly before every piece of their q-tile row and inside
every window. There each row sees a column iff its modality sees that column's modality, so the
kind follows from per-kv-tile bit sets ("modalities that see every column", "... some column")
and the row's set of modalities: a few operations per tile, no counting. Only the *near* tiles
(touching a piece's own segment, a document edge or a window's edge) are counted as above, which
keeps the work proportional to the tiles a kernel visits with a small constant.

Memory: every intermediate is O(segments + B * (nq + nk)) or, per *band* of q-tile rows, bounded by
CHUNK_COST cells of that band's [rows, kv-tiles] grid; a problem larger than one band is classified
band by band and its schedules assembled from the bands' runs (`_schedules_banded`), so the peak is
~16 bytes per visited tile plus one band (a 1M-token causal plan: ~0.6 GB, 3 s on 2 cores). When
even that would not fit, `PlanMemoryError` (a MemoryError) says so before anything large is made.
Rows that are one piece also get an *own* interval: tiles inside their segment and window, whose
kind is the segment's own policy (full, or causal across the diagonal), so a long segment costs an
elementwise write per tile instead of an exact count.

The host path is numpy: a few hundred operations on arrays of O(segments + visited tiles)
elements, where per-call overhead is what costs (numpy's is about a third of torch's, and it never
spreads a small array over threads). On a CUDA device with Triton, `plan()` hands the same
computation to `plan.gpu`: one Triton program per (q-tile row, block of kv-tiles) counts N and U
with the same closed forms and classifies, and one program per row and per column writes the
schedules: three launches and one host sync, results identical to `_classify` + `ruleless.schedules_from_kinds`
(tests/test_plan_gpu.py compares them array for array).

Everything here is numpy; torch is met only at the edge (`classify_and_schedule` returns tensors, and
imports torch to make them), so the command line plans without importing torch: `host_schedules` gives
the same schedules as numpy arrays, `tile_counts` the tiles per kind without making the schedules, and
`problem_kind_cells` a downsampled picture of the kinds (`KindCells`), one band of q-tile rows at a time.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np

from ..rules import Rules
from ..semantics import CAUSAL, EMPTY, FULL, PARTIAL, SCHEDULE_KINDS, SEE_ALL, SEE_EARLIER, rule_arrays

if TYPE_CHECKING:
    import torch

    from ..layout import HostTables, LayoutTables


def classify_and_schedule(
    rules: Rules, tables: LayoutTables | HostTables, block_m: int, block_n: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Callable[[], int]]:
    """(fwd_ptr, fwd_kv, bwd_ptr, bwd_q) on `device` from host tables, and a function counting allowed pairs:
    `host_schedules` as tensors.

    Raises PlanMemoryError (a MemoryError) before allocating when the schedules would not fit."""
    import torch

    host_tables = _CpuTables.of(tables)
    schedules = host_schedules(rules, host_tables, block_m, block_n)
    fwd_ptr, fwd_kv, bwd_ptr, bwd_q = (torch.from_numpy(a).to(device) for a in schedules)
    return fwd_ptr, fwd_kv, bwd_ptr, bwd_q, lambda: _allowed_pairs_host(rules, host_tables)


def host_schedules(rules: Rules, tables: "_CpuTables", block_m: int, block_n: int) -> tuple[np.ndarray, ...]:
    """(fwd_ptr, fwd_kv, bwd_ptr, bwd_q), int32 numpy arrays: the plan's schedules (see `Plan`).

    Raises PlanMemoryError (a MemoryError) before allocating when they would not fit."""
    problem = _Problem(rules, tables, block_m, block_n)
    bands = problem.bands()
    _check_memory(problem, banded=len(bands) > 1)
    if len(bands) == 1:
        grid, _ = problem.classify(0, problem.n_rows, narrow=False)
        return _schedules_host(grid.reshape(problem.B, problem.nq, problem.nk))
    return _schedules_banded(problem, bands)


class _Prefix:
    """Prefix counts of 0/1 column weights, P(x) = sum of w over [0, x) and PP(i) = sum of P over [0, i).

    A weight is constant inside a segment (it depends on the column's modality), so both are
    closed forms of per-segment sums: set-up is O(segments) plus one copy of the token->segment
    table, and each lookup reads that table once. Weight rows: 0 = every column; 1 + m = E_m
    (columns modality m sees when earlier); 1 + M + m = L_m (columns m sees when later).
    """

    def __init__(self, n_mod: int, t: "_CpuTables", see: np.ndarray) -> None:
        self.n = t.n_tokens
        n_segments = t.seg_start.shape[0]
        # A sentinel segment [n, n + 2) of weight 0 answers P(n) and PP(n + 1).
        self.starts = np.append(t.seg_start, self.n)
        self.segment_of = np.append(t.token_segment, np.array([n_segments, n_segments], dtype=t.token_segment.dtype))
        length = np.append(t.seg_end - t.seg_start, 2)
        see_of_segment = see[:n_mod][:, t.seg_modality]  # [M, G]
        weight = np.zeros((1 + 2 * n_mod, n_segments + 1), dtype=np.int64)
        weight[0, :-1] = 1
        weight[1 : 1 + n_mod, :-1] = see_of_segment >= SEE_EARLIER
        weight[1 + n_mod :, :-1] = see_of_segment == SEE_ALL
        self.width = n_segments + 1
        counted = weight * length
        p_start = np.cumsum(counted, 1) - counted  # P at each segment's start
        pp_step = length * p_start + weight * (length * (length - 1) // 2)
        pp_start = np.cumsum(pp_step, 1) - pp_step  # PP at each segment's start
        self.weight, self.p_start, self.pp_start = weight.reshape(-1), p_start.reshape(-1), pp_start.reshape(-1)

    def _locate(self, row: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(flat index of (row, segment holding x), offset of x in that segment)."""
        segment = self.segment_of[x]
        return row * self.width + segment, x - self.starts[segment]

    def p(self, row: np.ndarray, x: np.ndarray) -> np.ndarray:
        """P_row(x) for 0 <= x <= n."""
        at, offset = self._locate(row, x)
        return self.p_start[at] + self.weight[at] * offset

    def pp(self, row: np.ndarray, i: np.ndarray) -> np.ndarray:
        """PP_row(i) = sum of P_row(t) for t in [0, i), for 0 <= i <= n + 1."""
        at, offset = self._locate(row, i)
        return self.pp_start[at] + offset * self.p_start[at] + self.weight[at] * (offset * (offset - 1) // 2)

    def count(self, row: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """Weighted count of columns [lo, hi) (needs lo <= hi)."""
        return self.p(row, hi) - self.p(row, lo)

    def window_sum(self, row, x, y, r0, r1, delta) -> np.ndarray:
        """sum over q in [r0, r1) of P_row[clamp(q + delta, x, y)], elementwise; needs x <= y."""
        t0, t1 = r0 + delta, r1 + delta
        mid_lo = np.minimum(np.maximum(x + 1, t0), t1)
        mid_hi = np.maximum(np.minimum(np.maximum(y, t0), t1), mid_lo)
        limit = self.n + 1
        mid = self.pp(row, np.clip(mid_hi, 0, limit)) - self.pp(row, np.clip(mid_lo, 0, limit))
        return (mid_lo - t0) * self.p(row, x) + mid + (t1 - mid_hi) * self.p(row, y)

    def count_rows(self, c0, c1, r0, r1, s0, s1, v0, v1, window, causal, e_row, l_row, big):
        """(allowed, above-diagonal) pair counts of rows [r0, r1) x columns [c0, c1), exactly.

        The rows lie in one segment [s0, s1) whose queries see [v0, v1); `window` is W or `big`.
        Each part is a column interval [x, y) cut by a sliding interval [q + bottom, q + top).
        """
        low_edge = 1 - window  # sliding lower bound q - W + 1
        infinity = np.full_like(low_edge, big)
        own_top = np.where(causal, 1, infinity)
        zeros, ones = np.zeros_like(low_edge), np.ones_like(low_edge)
        e_x = np.maximum(v0, c0)
        o_x = np.maximum(s0, c0)
        l_x = np.maximum(s1, c0)
        e_y = np.maximum(np.minimum(s0, c1), e_x)
        o_y = np.maximum(np.minimum(s1, c1), o_x)
        l_y = np.maximum(np.minimum(v1, c1), l_x)
        parts = [  # (weight row, x, y, top, bottom)
            (e_row, e_x, e_y, infinity, low_edge),  # allowed: earlier segments
            (zeros, o_x, o_y, own_top, low_edge),  # allowed: own segment
            (l_row, l_x, l_y, infinity, low_edge),  # allowed: later segments
            (zeros, o_x, o_y, own_top, ones),  # above the diagonal: own segment
            (l_row, l_x, l_y, infinity, ones),  # above the diagonal: later segments
        ]
        row_t, x_t, y_t, top_t, bottom_t = (np.stack([p[k] for p in parts]) for k in range(5))  # all [k] already
        counted = self.window_sum(row_t, x_t, y_t, r0, r1, top_t) - self.window_sum(row_t, x_t, y_t, r0, r1, bottom_t)
        return counted[:3].sum(0), counted[3:].sum(0)


@dataclass
class _CpuTables:
    """The layout tables the CPU planner reads, as flat int64 numpy arrays (token_segment int32)."""

    batch_size: int
    seq_len: int
    seg_start: np.ndarray
    seg_end: np.ndarray
    seg_modality: np.ndarray
    seg_visible_start: np.ndarray
    seg_visible_end: np.ndarray
    token_segment: np.ndarray

    @property
    def n_tokens(self) -> int:
        return self.batch_size * self.seq_len

    @classmethod
    def of(cls, tables: LayoutTables | HostTables) -> "_CpuTables":
        rows, token_segment = tables.host_arrays()
        start, end, modality, _, _, visible_start, visible_end = rows
        return cls(tables.batch_size, tables.seq_len, start, end, modality, visible_start, visible_end, token_segment)


def _unique(values: np.ndarray) -> np.ndarray:
    """np.unique of a 1-d array, without np.unique: that imports numpy.ma on first use (~30 ms of a
    command line's 0.5 s on a busy 2-core machine), for a check that never applies here."""
    values = np.sort(values)
    return values[np.r_[True, values[1:] != values[:-1]]] if values.shape[0] else values


def _unique_inverse(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """np.unique(values, return_inverse=True) of a 1-d array (see `_unique`)."""
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    opens = np.r_[True, ordered[1:] != ordered[:-1]] if values.shape[0] else np.zeros(0, dtype=bool)
    inverse = np.empty(values.shape[0], dtype=np.int64)
    inverse[order] = np.cumsum(opens) - 1
    return ordered[opens], inverse


def _ragged(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """All (owner, value) with lo[owner] <= value < hi[owner]."""
    sizes = np.maximum(hi - lo, 0)
    owner = np.repeat(np.arange(sizes.shape[0]), sizes)
    first = np.cumsum(sizes) - sizes
    return owner, lo[owner] + np.arange(owner.shape[0]) - first[owner]


def _classify(rules: Rules, tables: LayoutTables, block_m: int, block_n: int) -> tuple[torch.Tensor, int]:
    """Tile kinds as a flat int8 CPU grid [B * nq * nk] and the number of allowed pairs."""
    import torch

    host_tables = _CpuTables.of(tables)
    grid = _classify_host(rules, host_tables, block_m, block_n)
    return torch.from_numpy(grid), _allowed_pairs_host(rules, host_tables)


def _host_rules(rules: Rules) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(see, causal, window) of `rule_arrays`."""
    arrays = rule_arrays(rules)
    return arrays["see"], arrays["causal"], arrays["window"]


def _allowed_pairs_host(rules: Rules, t: _CpuTables) -> int:
    """Allowed pairs of the whole layout: each non-pad segment's rows counted over its visible range."""
    see, causal_of, window_of = _host_rules(rules)
    n_mod = len(rules.modalities)
    big = 4 * t.n_tokens + 4
    keep = t.seg_modality != rules.pad_id
    s0, s1, modality = t.seg_start[keep], t.seg_end[keep], t.seg_modality[keep]
    v0, v1 = t.seg_visible_start[keep], t.seg_visible_end[keep]
    window = window_of[modality]
    window = np.where(window > 0, window, big)
    allowed, _ = _Prefix(n_mod, t, see).count_rows(
        v0, v1, s0, s1, s0, s1, v0, v1, window, causal_of[modality], 1 + modality, 1 + n_mod + modality, big
    )
    return int(allowed.sum())


# ---- chunking: a large plan is classified and scheduled a band of q-tile rows at a time --------
# One band's temporaries are bounded by CHUNK_COST "cells": a dense [rows, kv-tiles] cell of the band's
# grid costs 1 (a few bytes of int8/bool/uint8 temporaries), a near tile that is counted exactly
# NEAR_COST (~1 KB of int64 temporaries in `count_rows`). A problem under one CHUNK_COST is one band
# over the whole [B * nq, nk] grid (the training sizes, 4K-32K: the same work as before bands existed).
CHUNK_COST = 1 << 21
NEAR_COST = 32
# Grids of more tiles than this also write *own* tiles (inside a whole-row piece's segment) in closed form.
OWN_FROM = 1 << 16
# Exactly counted tiles are processed in slices of this many (bounds `count_rows`' temporaries).
COUNT_SLICE = 1 << 15
# Bytes a visited tile costs at the peak of a banded plan: fwd_kv and bwd_q (int32 each), the bands'
# backward entries kept until the backward pointers are known (int32), and fwd_kv's pieces (int32).
BYTES_PER_TILE = 16
# Bytes of one band's temporaries (CHUNK_COST cells), with margin.
CHUNK_BYTES = 256 << 20
# Plans that need less than this are made without looking at the available memory.
CHECK_FROM = 256 << 20


class PlanMemoryError(MemoryError):
    """A plan would need more memory than this machine has available (raised before allocating)."""


def _bit_dtype(n_bits: int) -> type:
    """The narrowest unsigned dtype holding n_bits bits (the modality sets of rows and columns)."""
    return np.uint8 if n_bits <= 8 else np.uint16 if n_bits <= 16 else np.uint32 if n_bits <= 32 else np.uint64


class _Problem:
    """What every band needs: the rules as arrays, the prefix sums, the row pieces, and per q-tile row
    its far interval, own interval, modality set and reach; per kv-tile its modality bit sets.
    Everything here is O(segments + B * (nq + nk)).

    Rows are cut into *pieces*: maximal runs inside one q-tile and one segment. Per q-tile row:

    far tiles  [jf0, jf1): wholly before every piece of the row and inside every window; a tile's
               allowed pairs are sum(rows x E_m(tile)) over the row's pieces, so it is full when every
               modality of the row sees all its columns, empty when none sees any, else partial.
    own tiles  of a piece that is its whole row (one non-pad segment): tiles wholly
               inside that segment and wholly inside its window, where the mask is the segment's own
               policy: full, or for a causal segment full below the diagonal and causal across it.
    near tiles the rest of each piece's reach, counted exactly (`count_rows`).
    """

    def __init__(self, rules: Rules, t: _CpuTables, block_m: int, block_n: int) -> None:
        see, causal_of, window_of = _host_rules(rules)
        B, S = t.batch_size, t.seq_len
        n_tokens = B * S
        nq, nk = -(-S // block_m), -(-S // block_n)
        n_mod = len(rules.modalities)
        big = 4 * n_tokens + 4 * max(block_m, block_n)
        self.B, self.S, self.nq, self.nk, self.block_m, self.block_n, self.big = B, S, nq, nk, block_m, block_n, big
        self.prefix = prefix = _Prefix(n_mod, t, see)

        # ---- row pieces: runs of rows inside one q-tile and one segment (sorted by row) -----------
        tile_starts = (np.arange(B)[:, None] * S + np.arange(nq)[None, :] * block_m).reshape(-1)
        starts = _unique(np.concatenate([tile_starts, t.seg_start]))  # sorted
        ends = np.append(starts[1:], n_tokens)
        segment = t.token_segment[starts].astype(np.int64)
        modality = t.seg_modality[segment]
        keep = modality != rules.pad_id
        r0, r1, segment, modality = starts[keep], ends[keep], segment[keep], modality[keep]
        base = (r0 // S) * S
        row_tile = (r0 // S) * nq + (r0 - base) // block_m
        s0, s1 = t.seg_start[segment], t.seg_end[segment]
        v0, v1 = t.seg_visible_start[segment], t.seg_visible_end[segment]
        causal = causal_of[modality]
        window = window_of[modality]
        window = np.where(window > 0, window, big)
        e_row, l_row = 1 + modality, 1 + n_mod + modality

        # Columns a piece can reach: skip kv-tiles that certainly hold nothing it may see.
        sees_earlier = prefix.count(e_row, v0, s0) > 0
        sees_later = prefix.count(l_row, s1, v1) > 0
        lo = np.maximum(np.where(sees_earlier, v0, s0), r0 - window + 1)
        hi = np.where(sees_later, v1, np.where(causal, r1, s1))
        j_lo = (lo - base) // block_n
        j_hi = (hi - base + block_n - 1) // block_n
        self.pieces = (r0, r1, base, row_tile, s0, s1, v0, v1, causal, window, e_row, l_row, j_lo, j_hi)

        # ---- per q-tile row: far interval, modality set, own interval -----------------------------
        n_row_tiles = B * nq
        far_lo = np.zeros(n_row_tiles, dtype=np.int64)
        np.maximum.at(far_lo, row_tile, np.maximum(v0, r1 - window))
        far_hi = np.full(n_row_tiles, n_tokens, dtype=np.int64)
        np.minimum.at(far_hi, row_tile, s0)
        row_base = (np.arange(n_row_tiles) // nq) * S
        jf0 = (far_lo - row_base + block_n - 1) // block_n
        jf1 = np.maximum((far_hi - row_base) // block_n, jf0)
        n_pieces = np.bincount(row_tile, minlength=n_row_tiles)
        no_far = ~((n_pieces > 0) & (jf1 > jf0))
        jf0[no_far] = big
        jf1[no_far] = big

        row_first = np.arange(n_row_tiles) % nq * block_m + row_base
        real_rows = np.minimum(row_first + block_m, row_base + S) - row_first
        rows_of = np.bincount(row_tile, weights=r1 - r0, minlength=n_row_tiles).astype(np.int64)
        present = np.bincount(row_tile * (n_mod + 1) + modality, minlength=n_row_tiles * (n_mod + 1))
        self.bit_dtype = dtype = _bit_dtype(n_mod + 1)
        bits = (1 << np.arange(n_mod + 1, dtype=np.int64))
        row_set = ((present.reshape(n_row_tiles, n_mod + 1) > 0) * bits).sum(1) | np.where(
            rows_of < real_rows, bits[n_mod], 0
        )  # pad rows: a pad bit that no column satisfies
        col_first = np.arange(B * nk)
        col_first = (col_first // nk) * S + (col_first % nk) * block_n
        col_last = np.minimum(col_first + block_n, (col_first // S) * S + S)
        e_counts = prefix.count(np.arange(1, 1 + n_mod)[:, None], col_first[None, :], col_last[None, :])  # [M, B*nk]
        self.full_bits = ((e_counts == (col_last - col_first)) * bits[:n_mod, None]).sum(0).astype(dtype).reshape(B, nk)
        self.seen_bits = ((e_counts > 0) * bits[:n_mod, None]).sum(0).astype(dtype).reshape(B, nk)
        self.row_set = row_set.astype(dtype)

        # Own interval of a piece that is its whole q-tile row (the row is one non-pad segment): tiles
        # inside the segment and inside the window for every pair (c0 >= r1 - W), within the reach;
        # for a causal segment only tiles starting at or before the last row (later ones are empty).
        # Only for grids over OWN_FROM tiles: below, counting them is cheaper than the ~40 operations.
        self.rows = (jf0, jf1, row_first, real_rows, row_base)
        piece_jf0, piece_jf1 = jf0[row_tile], jf1[row_tile]
        self.use_own = B * nq * nk > OWN_FROM
        if not self.use_own:
            # near intervals: the reach minus the far interval
            self.near_lo = np.concatenate([j_lo, np.maximum(j_lo, piece_jf1)])  # [2 * pieces]
            self.near_hi = np.concatenate([np.minimum(j_hi, piece_jf0), j_hi])
            self.row_tile, self.n_parts = row_tile, 2
            return
        row_start = base + (r0 - base) // block_m * block_m
        whole = (r0 == row_start) & (r1 == np.minimum(row_start + block_m, base + S))
        own0 = np.maximum((np.maximum(s0, r1 - window) - base + block_n - 1) // block_n, j_lo)
        own1 = np.minimum(np.where(s1 - base == S, nk, (s1 - base) // block_n), j_hi)
        own1 = np.where(causal, np.minimum(own1, (r1 - base + block_n - 1) // block_n), own1)
        has_own = whole & (own1 > own0)
        self.own_lo = np.where(has_own, own0, 0)
        self.own_hi = np.where(has_own, own1, 0)
        # Its causal tiles: c1 = base + min((j + 1) * block_n, S) > r0 + 1, i.e. j >= x // block_n and
        # x < S, with x = r0 + 1 - base (x == S: a one-row last q-tile, whose own tiles are all full).
        x = r0 + 1 - base
        self.own_causal_from = np.where(causal.astype(bool) & (x < S), x // block_n, big)

        # Near intervals of a piece are its reach minus [A0, A1) (far) minus [B0, B1) (own), A before B;
        # an empty interval collapses to a point that keeps that order.
        a_empty = piece_jf0 == big
        B0 = np.where(has_own, own0, np.where(a_empty, big, piece_jf1))
        B1 = np.where(has_own, own1, B0)
        A0 = np.where(a_empty, B0, piece_jf0)
        A1 = np.where(a_empty, B0, piece_jf1)
        self.near_lo = np.concatenate([j_lo, np.maximum(j_lo, A1), np.maximum(j_lo, B1)])  # [3 * pieces]
        self.near_hi = np.concatenate([np.minimum(j_hi, A0), np.minimum(j_hi, B0), j_hi])
        self.row_tile, self.n_parts = row_tile, 3

    @functools.cached_property
    def reach(self) -> tuple[np.ndarray, np.ndarray]:
        """Per q-tile row: the first and one past the last kv-tile a piece of it reaches."""
        n_row_tiles, nk = self.n_rows, self.nk
        (_, _, _, row_tile, _, _, _, _, _, _, _, _, j_lo, j_hi) = self.pieces
        reach_lo = np.full(n_row_tiles, nk, dtype=np.int64)
        np.minimum.at(reach_lo, row_tile, j_lo)
        reach_hi = np.zeros(n_row_tiles, dtype=np.int64)
        np.maximum.at(reach_hi, row_tile, j_hi)
        reach_lo = np.minimum(np.maximum(reach_lo, 0), nk)
        return reach_lo, np.maximum(np.minimum(reach_hi, nk), reach_lo)

    @property
    def n_rows(self) -> int:
        return self.B * self.nq

    def visited_bound(self) -> int:
        """An upper bound of the visited tiles: every q-tile row's reach (the whole grid when small)."""
        if self.n_rows * self.nk <= CHUNK_COST:
            return self.n_rows * self.nk
        lo, hi = self.reach
        return int((hi - lo).sum())

    def bands(self) -> list[tuple[int, int]]:
        """[ra, rb) ranges of q-tile rows, each within about CHUNK_COST (one row at least). Grids of at
        most OWN_FROM tiles are one band (their near tiles, at most pieces x nk, are counted in slices)."""
        if self.n_rows * self.nk <= OWN_FROM:
            return [(0, self.n_rows)]
        near = np.maximum(self.near_hi - self.near_lo, 0).reshape(self.n_parts, -1).sum(0)  # per piece
        if self.n_rows * self.nk + NEAR_COST * int(near.sum()) <= CHUNK_COST:
            return [(0, self.n_rows)]
        lo, hi = self.reach
        cost = (hi - lo) + NEAR_COST * np.bincount(self.row_tile, weights=near, minlength=self.n_rows)
        total = np.cumsum(cost)
        n_bands = int(total[-1] // CHUNK_COST) + 1
        if n_bands == 1:
            return [(0, self.n_rows)]
        cuts = np.searchsorted(total, np.arange(1, n_bands) * CHUNK_COST, side="right")
        edges = _unique(np.concatenate([[0], np.minimum(np.maximum(cuts, 1), self.n_rows), [self.n_rows]]))
        return list(zip(edges[:-1].tolist(), edges[1:].tolist()))

    def classify(self, ra: int, rb: int, narrow: bool) -> tuple[np.ndarray, int]:
        """Kinds of q-tile rows [ra, rb) as an int8 grid [rb - ra, width] of kv-tiles [j0, j0 + width),
        and j0: all kv-tiles (j0 = 0) unless `narrow`, then the band's reach."""
        nk = self.nk
        jf0, jf1 = self.rows[0][ra:rb], self.rows[1][ra:rb]
        row_tile = self.pieces[3]
        pa, pb = self.piece_range(ra, rb)
        if narrow:
            lo, hi = self.reach
            j0 = int(lo[ra:rb].min())
            width = max(int(hi[ra:rb].max()) - j0, 0)
        else:
            j0, width = 0, nk
        n_rows = rb - ra

        # ---- far tiles: elementwise over the band's [rows, kv-tiles] grid ---------------------------
        j_all = np.arange(j0, j0 + width)
        b_first, b_last = ra // self.nq, (rb - 1) // self.nq
        if b_first == b_last:
            full_bits = self.full_bits[b_first, j0 : j0 + width][None, :]
            seen_bits = self.seen_bits[b_first, j0 : j0 + width][None, :]
        else:
            element = np.arange(ra, rb) // self.nq
            full_bits = self.full_bits[element, j0 : j0 + width]
            seen_bits = self.seen_bits[element, j0 : j0 + width]
        in_far = (j_all >= jf0[:, None]) & (j_all < jf1[:, None])
        far_kind = _far_kind(self.row_set[ra:rb, None], full_bits, seen_bits)
        grid = np.where(in_far, far_kind, np.int8(EMPTY)).astype(np.int8, copy=False).reshape(-1)
        del in_far, far_kind

        # ---- own tiles of whole-row pieces: full, or causal from the diagonal on ---------------------
        if self.use_own:
            owner, j = _ragged(self.own_lo[pa:pb], self.own_hi[pa:pb])
            if owner.shape[0]:
                owner += pa
                grid[(row_tile[owner] - ra) * width + (j - j0)] = np.where(
                    j >= self.own_causal_from[owner], np.int8(CAUSAL), np.int8(FULL))
            del owner, j

        # ---- near tiles: the rest of each piece's reach, counted exactly ---------------------------
        t_row, t_col, kind = self.near_kinds(ra, pa, pb)
        grid[t_row * width + (t_col - j0)] = kind
        return grid.reshape(n_rows, width), j0

    def piece_range(self, ra: int, rb: int) -> tuple[int, int]:
        """[pa, pb): the pieces of q-tile rows [ra, rb) (pieces are sorted by row)."""
        if ra == 0 and rb == self.n_rows:
            return 0, self.pieces[3].shape[0]
        pa, pb = np.searchsorted(self.pieces[3], [ra, rb])
        return int(pa), int(pb)

    def near_kinds(self, ra: int, pa: int, pb: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(row - ra, kv-tile, kind) of every near tile of pieces [pa, pb), each tile once, counted exactly.

        Pieces [pa, pb) must be every piece of their q-tile rows (a tile's kind sums all of its row's pieces);
        near tiles are disjoint from the rows' far and own tiles, so they are simply written over those."""
        (r0, r1, base, row_tile, s0, s1, v0, v1, causal, window, e_row, l_row, j_lo, j_hi) = self.pieces
        nk, block_n, S, big = self.nk, self.block_n, self.S, self.big
        _, _, row_first, real_rows, row_base = self.rows
        n_pieces = row_tile.shape[0]
        if pa == 0 and pb == n_pieces:
            owner, j = _ragged(self.near_lo, self.near_hi)
        else:
            owner, j = _ragged(self.near_lo.reshape(self.n_parts, -1)[:, pa:pb].reshape(-1),
                               self.near_hi.reshape(self.n_parts, -1)[:, pa:pb].reshape(-1))
        piece = owner % max(pb - pa, 1) + pa
        del owner
        c0 = base[piece] + j * block_n
        c1 = np.minimum(c0 + block_n, base[piece] + S)
        n_piece_rows = (r1 - r0)[piece]
        # Simple pairs: the tile lies wholly before the piece's segment and inside its window for
        # every row (rows x E-columns), or wholly after it (rows x L-columns, all above the diagonal).
        ps0, ps1 = s0[piece], s1[piece]
        after = c0 >= ps1
        before = (c1 <= ps0) & (c0 >= (r1 - window)[piece])
        weight_row = np.where(after, l_row[piece], e_row[piece])
        lo_col = np.where(after, c0, np.maximum(v0[piece], c0))
        hi_col = np.maximum(np.where(after, np.minimum(c1, v1[piece]), c1), lo_col)
        near_allowed = n_piece_rows * self.prefix.count(weight_row, lo_col, hi_col)
        near_above = np.where(after, near_allowed, 0)
        hard = np.flatnonzero(~(after | before))
        for start in range(0, hard.shape[0], COUNT_SLICE):
            h = hard[start : start + COUNT_SLICE]
            hp = piece[h]
            near_allowed[h], near_above[h] = self.prefix.count_rows(
                c0[h], c1[h], r0[hp], r1[hp], s0[hp], s1[hp], v0[hp], v1[hp],
                window[hp], causal[hp], e_row[hp], l_row[hp], big,
            )

        local = (row_tile[piece] - ra) * nk + j  # row-major over [rows, nk]
        tile, inverse = _unique_inverse(local)
        n_allowed = np.zeros(tile.shape[0], dtype=np.int64)
        np.add.at(n_allowed, inverse, near_allowed)
        n_above = np.zeros(tile.shape[0], dtype=np.int64)
        np.add.at(n_above, inverse, near_above)
        t_row, t_col = tile // nk, tile % nk
        R0 = row_first[t_row + ra]
        R1 = R0 + real_rows[t_row + ra]
        C0 = row_base[t_row + ra] + t_col * block_n
        C1 = np.minimum(C0 + block_n, row_base[t_row + ra] + S)
        area = (R1 - R0) * (C1 - C0)
        zeros = np.zeros_like(R0)
        below_or_on = self.prefix.window_sum(zeros, C0, C1, R0, R1, 1) - (R1 - R0) * C0
        kind = np.where(n_allowed == 0, EMPTY, PARTIAL)
        kind = np.where((n_above == 0) & (n_allowed == below_or_on) & (n_allowed > 0), CAUSAL, kind)
        kind = np.where(n_allowed == area, FULL, kind)
        return t_row, t_col, kind


def _classify_host(rules: Rules, t: _CpuTables, block_m: int, block_n: int) -> np.ndarray:
    """Tile kinds as a flat int8 grid [B * nq * nk] (one band over the whole grid)."""
    problem = _Problem(rules, t, block_m, block_n)
    grid, _ = problem.classify(0, problem.n_rows, narrow=False)
    return grid.reshape(-1)


def _far_kind(row_set: np.ndarray, full_bits: np.ndarray, seen_bits: np.ndarray) -> np.ndarray:
    """Kinds of far tiles (broadcast): full when every modality of the row sees all the tile's columns, empty
    when none sees any, else partial."""
    return np.where(
        (row_set & ~full_bits) == 0,
        np.int8(FULL),
        np.where((row_set & seen_bits) == 0, np.int8(EMPTY), np.int8(PARTIAL)),
    )


# ---- statistics and pictures without the schedules (the command line's `plan` and `show`) ------------
# Near tiles are counted a chunk of q-tile rows at a time, about this many near entries per chunk.
NEAR_ENTRIES = 1 << 18


def tile_counts(problem: _Problem) -> dict[str, int]:
    """Tiles per kind, exactly what the schedules of `host_schedules` hold, without making them or any
    [rows, kv-tiles] grid: O(segments + B * (nq + nk)) memory and time, plus the near tiles.

    Far tiles are counted per (batch element, row modality set) from prefix sums of their kinds along the
    kv-tiles; own tiles from their intervals (full, then causal from the diagonal); near tiles as `classify`
    counts them. The three are disjoint per q-tile row, so their sums are the kinds' totals."""
    nq, nk, n_rows = problem.nq, problem.nk, problem.n_rows
    jf0, jf1 = problem.rows[0], problem.rows[1]
    counts = np.zeros(4, dtype=np.int64)

    # ---- far: rows grouped by (element, modality set); per group, prefix sums over its kv-tiles ----------
    rows = np.flatnonzero(jf1 > jf0)
    if rows.shape[0]:
        element_of, set_of = rows // nq, problem.row_set[rows]
        order = np.lexsort((set_of, element_of))  # rows by group; groups by (element, set)
        by_element, by_set = element_of[order], set_of[order]
        opens = np.r_[True, (by_element[1:] != by_element[:-1]) | (by_set[1:] != by_set[:-1])]
        first = order[opens]  # each group's first row (an index into `rows`)
        group_of = np.empty(rows.shape[0], dtype=np.int64)
        group_of[order] = np.cumsum(opens) - 1
        n_groups = first.shape[0]
        bounds = np.append(np.flatnonzero(opens), rows.shape[0])
        step = max(1, CHUNK_COST // max(nk, 1))
        for g0 in range(0, n_groups, step):
            g1 = min(n_groups, g0 + step)
            element, sets = element_of[first[g0:g1]], set_of[first[g0:g1]]
            kind = _far_kind(sets[:, None], problem.full_bits[element], problem.seen_bits[element])
            members = order[bounds[g0] : bounds[g1]]
            g, r = group_of[members] - g0, rows[members]
            for code in (FULL, PARTIAL):
                prefix = np.zeros((g1 - g0, nk + 1), dtype=np.int64)
                np.cumsum(kind == code, axis=1, out=prefix[:, 1:])
                counts[code] += int((prefix[g, jf1[r]] - prefix[g, jf0[r]]).sum())
            del kind

    # ---- own: intervals of whole-row pieces, causal from `own_causal_from` on ------------------------------
    if problem.use_own:
        size = problem.own_hi - problem.own_lo
        causal = np.clip(problem.own_hi - np.maximum(problem.own_lo, problem.own_causal_from), 0, size)
        counts[CAUSAL] += int(causal.sum())
        counts[FULL] += int((size - causal).sum())

    # ---- near: counted exactly, in chunks of whole q-tile rows ---------------------------------------------
    for ra, rb in _near_chunks(problem):
        _, _, kind = problem.near_kinds(ra, *problem.piece_range(ra, rb))
        counts += np.bincount(kind, minlength=4)[:4]

    visited = int(counts[FULL] + counts[CAUSAL] + counts[PARTIAL])
    return {"empty": n_rows * nk - visited, "full": int(counts[FULL]), "causal": int(counts[CAUSAL]),
            "partial": int(counts[PARTIAL])}


def _near_chunks(problem: _Problem) -> list[tuple[int, int]]:
    """[ra, rb) ranges of q-tile rows holding about NEAR_ENTRIES near entries each (one row at least)."""
    near = np.maximum(problem.near_hi - problem.near_lo, 0).reshape(problem.n_parts, -1).sum(0)
    per_row = np.bincount(problem.pieces[3], weights=near, minlength=problem.n_rows)
    total = np.cumsum(per_row)
    if not total.shape[0] or total[-1] <= NEAR_ENTRIES:
        return [(0, problem.n_rows)]
    cuts = np.searchsorted(total, np.arange(1, int(total[-1] // NEAR_ENTRIES) + 1) * NEAR_ENTRIES, side="right")
    edges = _unique(np.concatenate([[0], np.clip(cuts, 1, problem.n_rows), [problem.n_rows]]))
    return list(zip(edges[:-1].tolist(), edges[1:].tolist()))


_KIND_BIT = np.array([1 << EMPTY, 1 << FULL, 1 << CAUSAL, 1 << PARTIAL], dtype=np.uint8)
# A cell's bits -> its kind where exactly one kind is present, else -1 ("several kinds").
_BITS_KIND = np.full(16, -1, dtype=np.int8)
_BITS_KIND[_KIND_BIT] = [EMPTY, FULL, CAUSAL, PARTIAL]


class KindCells:
    """Tile kinds downsampled to cells of row_factor x col_factor tiles, per batch element: a cell is the kind
    its tiles share, or -1 where they are of several kinds. Filled from grids of q-tile rows (`add`), so the
    full [nq, nk] grid never has to exist: memory is one byte per cell plus the caller's band."""

    def __init__(self, elements: int, nq: int, nk: int, row_factor: int, col_factor: int) -> None:
        self.nq, self.nk, self.row_factor, self.col_factor = nq, nk, row_factor, col_factor
        self.bits = np.zeros((elements, -(-nq // row_factor), -(-nk // col_factor)), dtype=np.uint8)

    def add(self, element: int, q0: int, grid: np.ndarray, j0: int) -> None:
        """Kinds of q-tiles [q0, q0 + len(grid)) of one element at kv-tiles [j0, j0 + width); the rest of
        those rows' kv-tiles are empty."""
        n, width = grid.shape
        rf, cf = self.row_factor, self.col_factor
        c_row0, c_row1 = q0 // rf, (q0 + n - 1) // rf + 1
        cells = self.bits[element, c_row0:c_row1]
        if width:
            row_starts = _unique(np.concatenate([[0], np.arange(-q0 % rf, n, rf)]))
            col_starts = _unique(np.concatenate([[0], np.arange(-j0 % cf, width, cf)]))
            reduced = np.bitwise_or.reduceat(np.bitwise_or.reduceat(_KIND_BIT[grid], row_starts, axis=0),
                                             col_starts, axis=1)
            c_col0 = j0 // cf
            cells[:, c_col0 : c_col0 + reduced.shape[1]] |= reduced
        # Cells with kv-tiles outside [j0, j0 + width): those tiles are empty.
        cells[:, : -(-j0 // cf) if width else cells.shape[1]] |= _KIND_BIT[EMPTY]
        if j0 + width < self.nk:
            cells[:, (j0 + width) // cf :] |= _KIND_BIT[EMPTY]

    def kinds(self) -> np.ndarray:
        """int8 [elements, cell rows, cell columns]: the kind of each cell, -1 for several."""
        return _BITS_KIND[self.bits]


def problem_kind_cells(problem: _Problem, elements: int, row_factor: int, col_factor: int) -> np.ndarray:
    """`KindCells.kinds()` of the first `elements` batch elements, classified a band of q-tile rows at a time
    (the schedules' memory bound without the schedules)."""
    cells = KindCells(elements, problem.nq, problem.nk, row_factor, col_factor)
    limit = elements * problem.nq
    for ra, rb in problem.bands():
        if ra >= limit:
            break
        rb = min(rb, limit)
        grid, j0 = problem.classify(ra, rb, narrow=True)
        _add_rows(cells, grid, ra, j0, problem.nq)
        del grid
    return cells.kinds()


def problem_cell_sums(problem: _Problem, row_factor: int, col_factor: int, cost: np.ndarray
                      ) -> tuple[np.ndarray, np.ndarray]:
    """Per cell of row_factor x col_factor tiles, summed over the batch: (float64 [nq', nk'] the sum of
    cost[kind] over its tiles, bool [nq', nk'] whether any of its tiles is not empty). Classified a band of q-tile
    rows at a time like `problem_kind_cells`, without schedules, and summed in slices of at most 2^23 tiles (what
    balancing context-parallel chunks reads)."""
    nq, nk = problem.nq, problem.nk
    sums = np.zeros((-(-nq // row_factor), -(-nk // col_factor)), dtype=np.float64)
    touched = np.zeros(sums.shape, dtype=bool)
    weight = np.asarray(cost, dtype=np.float64)
    for ra, rb in problem.bands():
        grid, j0 = problem.classify(ra, rb, narrow=True)
        width = grid.shape[1]
        if width == 0:
            continue
        lead, first = j0 % col_factor, j0 // col_factor  # the band's columns widened to whole cells
        cells = -(-(lead + width) // col_factor)
        span = slice(first, first + cells)
        cell_row = (np.arange(ra, rb) % nq) // row_factor
        step = max(1, (1 << 23) // width)
        for r0 in range(0, grid.shape[0], step):
            part = grid[r0:r0 + step]
            if lead or width != cells * col_factor:
                widened = np.zeros((part.shape[0], cells * col_factor), dtype=np.int8)  # EMPTY outside the band
                widened[:, lead:lead + width] = part
                part = widened
            blocks = part.reshape(part.shape[0], cells, col_factor)
            rows = cell_row[r0:r0 + step]
            starts = np.flatnonzero(np.r_[True, rows[1:] != rows[:-1]])  # runs of rows in one cell row
            values = weight[blocks].sum(2)
            np.add.at(sums[:, span], rows[starts], np.add.reduceat(values, starts, axis=0))
            visited = (blocks != EMPTY).any(2)
            np.logical_or.at(touched[:, span], rows[starts], np.logical_or.reduceat(visited, starts, axis=0))
    return sums, touched


def schedule_kind_cells(fwd_ptr: np.ndarray, fwd_kv: np.ndarray, nq: int, nk: int, elements: int,
                        row_factor: int, col_factor: int) -> np.ndarray:
    """`KindCells.kinds()` of the first `elements` batch elements of a forward schedule."""
    cells = KindCells(elements, nq, nk, row_factor, col_factor)
    band = max(1, (1 << 22) // max(nk, 1))
    for ra in range(0, elements * nq, band):
        rb = min(elements * nq, ra + band)
        _add_rows(cells, schedule_rows(fwd_ptr, fwd_kv, ra, rb, nk), ra, 0, nq)
    return cells.kinds()


def _add_rows(cells: KindCells, grid: np.ndarray, ra: int, j0: int, nq: int) -> None:
    """A grid of global q-tile rows [ra, ra + len(grid)) into `cells`, split at batch elements."""
    rb = ra + grid.shape[0]
    edges = sorted({ra, rb, *range((ra // nq + 1) * nq, rb, nq)})
    for lo, hi in zip(edges[:-1], edges[1:]):
        cells.add(lo // nq, lo % nq, grid[lo - ra : hi - ra], j0)


def schedule_rows(fwd_ptr: np.ndarray, fwd_kv: np.ndarray, ra: int, rb: int, nk: int) -> np.ndarray:
    """Dense kinds int8 [rb - ra, nk] of q-tile rows [ra, rb), from the forward schedule."""
    ptr = fwd_ptr.astype(np.int64)
    dense = np.zeros((rb - ra) * nk, dtype=np.int8)
    per_group = ptr[3 * ra + 1 : 3 * rb + 1] - ptr[3 * ra : 3 * rb]
    group = np.repeat(np.arange(3 * (rb - ra)), per_group)
    cols = fwd_kv[int(ptr[3 * ra]) : int(ptr[3 * rb])].astype(np.int64)
    dense[(group // 3) * nk + cols] = np.array(SCHEDULE_KINDS, dtype=np.int8)[group % 3]
    return dense.reshape(rb - ra, nk)


def _available_bytes() -> int | None:
    """Memory this process may still take: MemAvailable, capped by a cgroup (v2 or v1) limit and
    RLIMIT_AS / RLIMIT_DATA. None where none of them can be read."""
    import resource

    limits = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    limits.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    for limit_path, usage_path in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit_path) as f:
                text = f.read().strip()
            if text != "max" and int(text) < 1 << 60:
                with open(usage_path) as f:
                    limits.append(int(text) - int(f.read().strip()))
                break
        except (OSError, ValueError):
            continue
    for which in (resource.RLIMIT_AS, resource.RLIMIT_DATA):
        soft, _ = resource.getrlimit(which)
        if soft != resource.RLIM_INFINITY:
            try:
                with open("/proc/self/statm") as f:
                    used = int(f.read().split()[0]) * resource.getpagesize()
            except (OSError, ValueError):
                used = 0
            limits.append(soft - used)
    return max(min(limits), 0) if limits else None


def _check_memory(problem: _Problem, banded: bool, available: int | None = None) -> None:
    """Raise PlanMemoryError, before the big allocations, when the plan would not fit in memory."""
    visited = problem.visited_bound()
    need = visited * BYTES_PER_TILE + (CHUNK_BYTES if banded else 64 * problem.n_rows * problem.nk)
    if available is None and need < CHECK_FROM:
        return  # (reading the limits costs more than a small plan)
    available = _available_bytes() if available is None else available
    if available is None or need <= available:
        return
    B, S = problem.B, problem.S
    element = f"{S:,} tokens" + (f" x {B}" if B > 1 else "")
    raise PlanMemoryError(
        f"planning {element} with {problem.block_m}x{problem.block_n} tiles needs about {need / 2**30:.1f} GiB "
        f"(up to {visited:,} visited tiles) but {available / 2**30:.1f} GiB is available; use larger tiles "
        f"(block_m/block_n 256), a shorter layout, or plan on a GPU (omnigen.plan(..., device='cuda'))"
    )


def check_summary_memory(batch_size: int, seq_len: int, n_segments: int, n_modalities: int, block_m: int,
                         block_n: int, available: int | None = None) -> None:
    """Raise PlanMemoryError, before the tables are made, when a summary (statistics without schedules) would
    not fit: its memory is O(tokens + segments + tile rows) plus one band's temporaries, never the plan's."""
    n_tokens = batch_size * seq_len
    tile_rows = batch_size * (-(-seq_len // block_m) + -(-seq_len // block_n))
    # Bytes: the packed tables and the prefix sums' copy of the token table (8 per token), the prefix sums'
    # per-segment rows, ~40 int64 arrays per piece and per tile row (pieces <= segments + tile rows), a band.
    need = 8 * n_tokens + 24 * (1 + 2 * n_modalities) * n_segments + 320 * (n_segments + tile_rows) + CHUNK_BYTES
    if available is None and need < CHECK_FROM:
        return
    available = _available_bytes() if available is None else available
    if available is None or need <= available:
        return
    element = f"{seq_len:,} tokens" + (f" x {batch_size}" if batch_size > 1 else "")
    raise PlanMemoryError(
        f"summarizing the plan of {element} with {block_m}x{block_n} tiles needs about {need / 2**30:.1f} GiB "
        f"but {available / 2**30:.1f} GiB is available; use a shorter layout (the memory grows with the tokens)"
    )


def _schedules_banded(problem: _Problem, bands: list[tuple[int, int]]) -> tuple[np.ndarray, ...]:
    """The four schedules, classifying one band of q-tile rows at a time: peak memory ~16 bytes per
    visited tile plus one band's temporaries.

    Forward: each band's rows are grouped as in `_grouped` and their kv-tiles appended. Backward: a
    kv-tile column lists its q-tiles in ascending order, and bands come in ascending row order, so
    each band's entries per (column, kind) are a run that follows the previous bands' runs; they are
    kept per band (with their run sizes) until the column totals fix the pointers, then placed."""
    B, nq, nk = problem.B, problem.nq, problem.nk
    R, C = B * nq, B * nk
    fwd_counts = np.zeros(3 * R, dtype=np.int64)
    col_counts = np.zeros(3 * C, dtype=np.int64)
    fwd_parts: list[np.ndarray] = []
    bwd_parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    for ra, rb in bands:
        grid, j0 = problem.classify(ra, rb, narrow=True)
        width = grid.shape[1]
        ptr, kv = _grouped(grid)
        fwd_parts.append(kv + np.int32(j0))
        fwd_counts[3 * ra : 3 * rb] = np.diff(ptr)
        # Backward runs, per batch element the band touches: [rows of that element, width] transposed.
        edges = sorted({ra, rb, *range((ra // nq + 1) * nq, rb, nq)})
        for lo, hi in zip(edges[:-1], edges[1:]):
            b = lo // nq
            tptr, q = _grouped(np.ascontiguousarray(grid[lo - ra : hi - ra].T))
            q += np.int32(lo - b * nq)
            sizes = np.diff(tptr)
            keys = 3 * (b * nk + j0) + np.arange(3 * width)
            col_counts[keys] += sizes
            bwd_parts.append((keys, sizes, q))
        del grid
    fwd_ptr = np.zeros(3 * R + 1, dtype=np.int32)
    np.cumsum(fwd_counts, out=fwd_ptr[1:])
    fwd_kv = np.concatenate(fwd_parts) if fwd_parts else np.zeros(0, dtype=np.int32)
    del fwd_parts
    bwd_ptr = np.zeros(3 * C + 1, dtype=np.int32)
    np.cumsum(col_counts, out=bwd_ptr[1:])
    bwd_q = np.empty(int(bwd_ptr[-1]), dtype=np.int32)
    cursor = bwd_ptr[:-1].astype(np.int64)
    bwd_parts.reverse()
    while bwd_parts:
        keys, sizes, q = bwd_parts.pop()
        source = np.cumsum(sizes) - sizes
        shift = cursor[keys] - source
        cursor[keys] += sizes
        bwd_q[np.arange(q.shape[0]) + np.repeat(shift, sizes)] = q
    return fwd_ptr, fwd_kv, bwd_ptr, bwd_q


def _schedules_host(grid: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    B, nq, nk = grid.shape
    fwd_ptr, fwd_kv = _grouped(grid.reshape(B * nq, nk))
    bwd_ptr, bwd_q = _grouped(np.ascontiguousarray(grid.transpose(0, 2, 1)).reshape(B * nk, nq))
    return fwd_ptr, fwd_kv, bwd_ptr, bwd_q


_SCHEDULE_ORDER = np.array(SCHEDULE_KINDS, dtype=np.int8)[None, :, None]


def _grouped(kinds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """CSR of a [rows, cols] kind grid with three groups per row (SCHEDULE_KINDS order), columns ascending."""
    n_rows, n_cols = kinds.shape
    # [rows, group, cols]: its non-zeros in memory order are the CSR entries in schedule order.
    member = kinds[:, None, :] == _SCHEDULE_ORDER
    ptr = np.zeros(3 * n_rows + 1, dtype=np.int32)
    np.cumsum(member.sum(2, dtype=np.int32).reshape(-1), out=ptr[1:])
    entries = np.flatnonzero(member)
    if member.size < 2**31:  # int32 arithmetic is the faster modulo
        return ptr, entries.astype(np.int32) % np.int32(n_cols)
    return ptr, (entries % n_cols).astype(np.int32)
