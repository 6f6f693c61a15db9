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

The host path is numpy: a few hundred operations on arrays of O(segments + visited tiles)
elements, where per-call overhead is what costs (numpy's is about a third of torch's, and it never
spreads a small array over threads). On a CUDA device with Triton, `plan()` hands the same
computation to `plan.gpu`: one Triton program per (q-tile row, block of kv-tiles) counts N and U
with the same closed forms and classifies, and one program per row and per column writes the
schedules: three launches and one host sync, results identical to `_classify` + `_schedules`
(tests/test_plan_gpu.py compares them array for array).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ..layout import LayoutTables
from ..mask import CAUSAL, EMPTY, FULL, PARTIAL, SCHEDULE_KINDS, SEE_ALL, SEE_EARLIER, rule_tensors
from ..rules import Rules


def classify_and_schedule(
    rules: Rules, tables: LayoutTables, block_m: int, block_n: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Callable[[], int]]:
    """(fwd_ptr, fwd_kv, bwd_ptr, bwd_q) on `device` from CPU tables, and a function counting allowed pairs."""
    host_tables = _CpuTables.of(tables)
    B, S = tables.batch_size, tables.seq_len
    grid = _classify_host(rules, host_tables, block_m, block_n)
    schedules = _schedules_host(grid.reshape(B, -(-S // block_m), -(-S // block_n)))
    fwd_ptr, fwd_kv, bwd_ptr, bwd_q = (torch.from_numpy(a).to(device) for a in schedules)
    return fwd_ptr, fwd_kv, bwd_ptr, bwd_q, lambda: _allowed_pairs_host(rules, host_tables)


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
    def of(cls, tables: LayoutTables) -> "_CpuTables":
        rows, token_segment = tables.host_arrays()
        start, end, modality, _, _, visible_start, visible_end = rows
        return cls(tables.batch_size, tables.seq_len, start, end, modality, visible_start, visible_end, token_segment)


def _ragged(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """All (owner, value) with lo[owner] <= value < hi[owner]."""
    sizes = np.maximum(hi - lo, 0)
    owner = np.repeat(np.arange(sizes.shape[0]), sizes)
    first = np.cumsum(sizes) - sizes
    return owner, lo[owner] + np.arange(owner.shape[0]) - first[owner]


def _classify(rules: Rules, tables: LayoutTables, block_m: int, block_n: int) -> tuple[torch.Tensor, int]:
    """Tile kinds as a flat int8 CPU grid [B * nq * nk] and the number of allowed pairs."""
    host_tables = _CpuTables.of(tables)
    grid = _classify_host(rules, host_tables, block_m, block_n)
    return torch.from_numpy(grid), _allowed_pairs_host(rules, host_tables)


@functools.lru_cache(maxsize=64)
def _host_rules(rules: Rules) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(see, causal, window) of `rule_tensors` as numpy arrays (cached: a few us a plan otherwise)."""
    rt = rule_tensors(rules, "cpu")
    return rt["see"].numpy(), rt["causal"].numpy(), rt["window"].numpy()


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


def _classify_host(rules: Rules, t: _CpuTables, block_m: int, block_n: int) -> np.ndarray:
    """`_classify` on numpy arrays: the CPU planner is a few hundred small array operations, so
    per-operation overhead decides its speed (numpy's is a third of torch's and never threads)."""
    see, causal_of, window_of = _host_rules(rules)
    B, S = t.batch_size, t.seq_len
    n_tokens = B * S
    nq, nk = -(-S // block_m), -(-S // block_n)
    n_mod = len(rules.modalities)
    big = 4 * n_tokens + 4 * max(block_m, block_n)
    prefix = _Prefix(n_mod, t, see)

    # ---- row pieces: runs of rows inside one q-tile and one segment ------------------------
    tile_starts = (np.arange(B)[:, None] * S + np.arange(nq)[None, :] * block_m).reshape(-1)
    starts = np.unique(np.concatenate([tile_starts, t.seg_start]))  # sorted
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

    # ---- far tiles: wholly before every piece of their row, inside every window --------------
    # There a tile's allowed pairs are sum(rows x E_m(tile)) over the row's pieces, so it is full
    # when every modality of the row sees all its columns, empty when none sees any, else partial.
    n_row_tiles = B * nq
    far_lo = np.zeros(n_row_tiles, dtype=np.int64)
    np.maximum.at(far_lo, row_tile, np.maximum(v0, r1 - window))
    far_hi = np.full(n_row_tiles, n_tokens, dtype=np.int64)
    np.minimum.at(far_hi, row_tile, s0)
    row_base = (np.arange(n_row_tiles) // nq) * S
    jf0 = (far_lo - row_base + block_n - 1) // block_n
    jf1 = np.maximum((far_hi - row_base) // block_n, jf0)
    has_piece = np.zeros(n_row_tiles, dtype=bool)
    has_piece[row_tile] = True
    no_far = ~(has_piece & (jf1 > jf0))
    jf0[no_far] = big
    jf1[no_far] = big

    row_first = np.arange(n_row_tiles) % nq * block_m + row_base
    real_rows = np.minimum(row_first + block_m, row_base + S) - row_first
    rows_of = np.bincount(row_tile, weights=r1 - r0, minlength=n_row_tiles).astype(np.int64)
    present = np.bincount(row_tile * (n_mod + 1) + modality, minlength=n_row_tiles * (n_mod + 1))
    bits = 1 << np.arange(n_mod + 1, dtype=np.int64)
    row_set = ((present.reshape(n_row_tiles, n_mod + 1) > 0) * bits).sum(1) | np.where(
        rows_of < real_rows, bits[n_mod], 0
    )  # pad rows: a pad bit that no column satisfies
    col_first = np.arange(B * nk)
    col_first = (col_first // nk) * S + (col_first % nk) * block_n
    col_last = np.minimum(col_first + block_n, (col_first // S) * S + S)
    e_counts = prefix.count(np.arange(1, 1 + n_mod)[:, None], col_first[None, :], col_last[None, :])  # [M, B*nk]
    full_bits = ((e_counts == (col_last - col_first)) * bits[:n_mod, None]).sum(0).reshape(B, 1, nk)
    seen_bits = ((e_counts > 0) * bits[:n_mod, None]).sum(0).reshape(B, 1, nk)
    # Dense over the [rows, kv-tiles] grid: plain elementwise work, no gathers per visited tile.
    j_all = np.arange(nk)
    in_far = ((j_all >= jf0[:, None]) & (j_all < jf1[:, None])).reshape(B, nq, nk)
    row_set3 = row_set.reshape(B, nq, 1)
    far_kind = np.where(
        (row_set3 & ~full_bits) == 0,
        np.int8(FULL),
        np.where((row_set3 & seen_bits) == 0, np.int8(EMPTY), np.int8(PARTIAL)),
    )
    grid = np.where(in_far, far_kind, np.int8(EMPTY)).astype(np.int8).reshape(-1)

    # ---- near tiles: the rest of each piece's reach, counted exactly ---------------------------
    piece_jf0, piece_jf1 = jf0[row_tile], jf1[row_tile]
    left_piece, left_j = _ragged(j_lo, np.minimum(j_hi, piece_jf0))
    right_piece, right_j = _ragged(np.maximum(j_lo, piece_jf1), j_hi)
    piece = np.concatenate([left_piece, right_piece])
    j = np.concatenate([left_j, right_j])
    c0 = base[piece] + j * block_n
    c1 = np.minimum(c0 + block_n, base[piece] + S)
    n_rows = (r1 - r0)[piece]
    # Simple pairs: the tile lies wholly before the piece's segment and inside its window for
    # every row (rows x E-columns), or wholly after it (rows x L-columns, all above the diagonal).
    ps0, ps1 = s0[piece], s1[piece]
    after = c0 >= ps1
    before = (c1 <= ps0) & (c0 >= (r1 - window)[piece])
    weight_row = np.where(after, l_row[piece], e_row[piece])
    lo_col = np.where(after, c0, np.maximum(v0[piece], c0))
    hi_col = np.maximum(np.where(after, np.minimum(c1, v1[piece]), c1), lo_col)
    near_allowed = n_rows * prefix.count(weight_row, lo_col, hi_col)
    near_above = np.where(after, near_allowed, 0)
    hard = np.flatnonzero(~(after | before))
    if hard.shape[0]:
        hp = piece[hard]
        near_allowed[hard], near_above[hard] = prefix.count_rows(
            c0[hard], c1[hard], r0[hp], r1[hp], s0[hp], s1[hp], v0[hp], v1[hp],
            window[hp], causal[hp], e_row[hp], l_row[hp], big,
        )

    tile, inverse = np.unique(row_tile[piece] * nk + j, return_inverse=True)
    n_allowed = np.zeros(tile.shape[0], dtype=np.int64)
    np.add.at(n_allowed, inverse, near_allowed)
    n_above = np.zeros(tile.shape[0], dtype=np.int64)
    np.add.at(n_above, inverse, near_above)
    t_row, t_col = tile // nk, tile % nk
    R0 = row_first[t_row]
    R1 = R0 + real_rows[t_row]
    C0 = row_base[t_row] + t_col * block_n
    C1 = np.minimum(C0 + block_n, row_base[t_row] + S)
    area = (R1 - R0) * (C1 - C0)
    zeros = np.zeros_like(R0)
    below_or_on = prefix.window_sum(zeros, C0, C1, R0, R1, 1) - (R1 - R0) * C0
    kind = np.where(n_allowed == 0, EMPTY, PARTIAL)
    kind = np.where((n_above == 0) & (n_allowed == below_or_on) & (n_allowed > 0), CAUSAL, kind)
    kind = np.where(n_allowed == area, FULL, kind)

    grid[tile] = kind
    return grid


def _schedules(grid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward (per q-tile row) and backward (per kv-tile column) schedules from a [B, nq, nk] CPU kind grid."""
    return tuple(torch.from_numpy(a) for a in _schedules_host(grid.numpy()))


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
