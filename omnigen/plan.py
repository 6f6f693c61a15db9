"""Exact tile classification and the schedules kernels walk, without ever building the S x S mask.

How it stays exact and O(output): the mask is a union of segment-shaped pieces. A query row
q in segment [s0, s1) of modality m, whose document (or batch element) spans [v0, v1), sees

    E-part   keys in [v0, s0) whose modality m may see earlier    (see(m -> mk) in {earlier, all})
    own      keys in [s0, q+1) if m is causal, else [s0, s1)
    L-part   keys in [s1, v1) whose modality m may see later      (see(m -> mk) == all)

all intersected with the sliding window [q - W + 1, inf) when m has a window W. Each part is a
fixed column interval [x, y) weighted by a per-column 0/1 indicator, cut by a sliding interval
[q + a, q + b). Its allowed-pair count over a run of rows is a difference of sums of a prefix
count P evaluated at clamp(q + d, x, y); those sums are O(1) with a second prefix sum PP.

Rows are cut into *pieces*: maximal runs inside one q-tile and one segment. For every piece and
every kv-tile its columns may reach, we count allowed pairs N and allowed pairs above the
diagonal U (k > q). Summed per tile, those decide the kind exactly:

    empty   N == 0          full    N == tile area
    causal  U == 0 and N == number of (q, k) in the tile with k <= q          partial  otherwise
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .layout import AnyLayout, LayoutBatch, LayoutTables, as_layout
from .rules import Rules

EMPTY, FULL, CAUSAL, PARTIAL = 0, 1, 2, 3
KIND_NAMES = {EMPTY: "empty", FULL: "full", CAUSAL: "causal", PARTIAL: "partial"}
# The schedules list each tile row's kv-tiles in this order of kinds (and by index inside a kind).
SCHEDULE_KINDS = (FULL, CAUSAL, PARTIAL)

# see policies as codes, for tensors
SEE_NONE, SEE_EARLIER, SEE_ALL = 0, 1, 2
SEE_CODES = {"none": SEE_NONE, "earlier": SEE_EARLIER, "all": SEE_ALL}


def rule_tensors(rules: Rules, device: torch.device) -> dict[str, torch.Tensor]:
    """The rules as small tensors indexed by modality id (pad = the last id)."""
    count = len(rules.modalities) + 1
    see = torch.zeros(count, count, dtype=torch.int64)
    for q, row in enumerate(rules.see_matrix()):
        for k, policy in enumerate(row):
            see[q, k] = SEE_CODES[policy]
    causal = torch.tensor([m.causal for m in rules.modalities] + [False], dtype=torch.bool)
    window = torch.tensor([m.window for m in rules.modalities] + [0], dtype=torch.int64)
    return {"see": see.to(device), "causal": causal.to(device), "window": window.to(device)}


@dataclass
class Plan:
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
    allowed_pairs: int
    tables: LayoutTables = field(repr=False)
    rules_hash: str = ""

    @property
    def num_q_tiles(self) -> int:
        return -(-self.seq_len // self.block_m)

    @property
    def num_kv_tiles(self) -> int:
        return -(-self.seq_len // self.block_n)

    @property
    def num_tiles(self) -> int:
        """Tiles a kernel visits (every non-empty tile)."""
        return int(self.fwd_kv.shape[0])

    @property
    def device(self) -> torch.device:
        return self.fwd_kv.device

    def _tile_list(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q-tile row r, kv-tile j, kind) for every visited tile, in forward-schedule order."""
        per_group = (self.fwd_ptr[1:] - self.fwd_ptr[:-1]).long()
        group = torch.repeat_interleave(torch.arange(per_group.numel(), device=self.device), per_group)
        kinds = torch.tensor(SCHEDULE_KINDS, dtype=torch.int8, device=self.device)
        return group // 3, self.fwd_kv.long(), kinds[group % 3]

    @property
    def kinds(self) -> torch.Tensor:
        """Dense tile kinds, int8 [nq, nk] (or [B, nq, nk] for a batch): 0 empty 1 full 2 causal 3 partial."""
        rows, cols, kinds = self._tile_list()
        nq, nk = self.num_q_tiles, self.num_kv_tiles
        dense = torch.zeros(self.batch_size * nq * nk, dtype=torch.int8, device=self.device)
        dense[rows * nk + cols] = kinds
        dense = dense.view(self.batch_size, nq, nk)
        return dense if self.batched else dense[0]

    def counts(self) -> dict[str, int]:
        total = self.batch_size * self.num_q_tiles * self.num_kv_tiles
        sizes = (self.fwd_ptr[1:] - self.fwd_ptr[:-1]).view(-1, 3).sum(0).tolist()
        out = {KIND_NAMES[k]: int(n) for k, n in zip(SCHEDULE_KINDS, sizes)}
        out["empty"] = total - sum(sizes)
        return {name: out[name] for name in ("empty", "full", "causal", "partial")}

    @property
    def density(self) -> float:
        return self.allowed_pairs / float(self.batch_size * self.seq_len * self.seq_len)

    @property
    def partial_fraction(self) -> float:
        """Share of visited tiles that need the rules' predicate."""
        counts = self.counts()
        visited = counts["full"] + counts["causal"] + counts["partial"]
        return counts["partial"] / visited if visited else 0.0

    def nbytes(self) -> int:
        """Bytes of schedule metadata a kernel reads (the O(S) layout tables not included)."""
        return sum(t.numel() * t.element_size() for t in (self.fwd_ptr, self.fwd_kv, self.bwd_ptr, self.bwd_q))

    def forward_tiles(self, q_tile: int, batch: int = 0) -> dict[str, list[int]]:
        """kv-tiles of one q-tile, by kind (for inspection and tests)."""
        return _schedule_row(self.fwd_ptr, self.fwd_kv, batch * self.num_q_tiles + q_tile)

    def backward_tiles(self, kv_tile: int, batch: int = 0) -> dict[str, list[int]]:
        """q-tiles of one kv-tile, by kind."""
        return _schedule_row(self.bwd_ptr, self.bwd_q, batch * self.num_kv_tiles + kv_tile)

    def stats(self) -> dict[str, Any]:
        counts = self.counts()
        return {
            "seq_len": self.seq_len,
            "batch": self.batch_size,
            "block_m": self.block_m,
            "block_n": self.block_n,
            "tiles": counts,
            "allowed_pairs": self.allowed_pairs,
            "density": self.density,
            "partial_fraction": self.partial_fraction,
            "metadata_bytes": self.nbytes(),
        }

    def to(self, device: torch.device | str) -> "Plan":
        moved = {name: getattr(self, name).to(device) for name in ("fwd_ptr", "fwd_kv", "bwd_ptr", "bwd_q")}
        return Plan(
            block_m=self.block_m, block_n=self.block_n, batch_size=self.batch_size, seq_len=self.seq_len,
            batched=self.batched, allowed_pairs=self.allowed_pairs, rules_hash=self.rules_hash,
            tables=self.tables if self.tables.seg_start.device == torch.device(device) else _move_tables(self.tables, device),
            **moved,
        )


def _move_tables(tables: LayoutTables, device: torch.device | str) -> LayoutTables:
    return LayoutTables(**{k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in tables.__dict__.items()})


def _schedule_row(ptr: torch.Tensor, index: torch.Tensor, row: int) -> dict[str, list[int]]:
    bounds = ptr[3 * row : 3 * row + 4].tolist()
    return {KIND_NAMES[k]: index[bounds[g] : bounds[g + 1]].tolist() for g, k in enumerate(SCHEDULE_KINDS)}


def _check_block(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 16 or value % 16:
        raise ValueError(f"{name} must be a positive multiple of 16, not {value!r}")
    return value


def plan(
    rules: Rules,
    layout: AnyLayout | str,
    block_m: int = 128,
    block_n: int = 128,
    device: torch.device | str | None = None,
) -> Plan:
    """Classify every (block_m x block_n) tile of the mask exactly and build forward/backward schedules.

    Runs on `device` (default CPU) with vectorised tensor code; memory is O(S + visited tiles).
    """
    if not isinstance(rules, Rules):
        raise TypeError(f"rules must be omnigen.Rules, not {type(rules).__name__}")
    layout = as_layout(layout)
    block_m = _check_block(block_m, "block_m")
    block_n = _check_block(block_n, "block_n")
    device = torch.device(device) if device is not None else torch.device("cpu")
    tables = layout.tables(rules, device)
    rt = rule_tensors(rules, device)
    B, S = tables.batch_size, tables.seq_len
    n_tokens = B * S
    nq, nk = -(-S // block_m), -(-S // block_n)
    n_mod = len(rules.modalities)
    big = 4 * n_tokens + 4 * max(block_m, block_n)
    i64 = dict(dtype=torch.int64, device=device)

    # ---- per-column indicators and their prefix sums --------------------------------------
    # weight rows: 0 = every column; 1 + m = E_m (m may see it when earlier); 1 + M + m = L_m (later)
    token_mod = tables.token_modality.reshape(-1).long()
    see_of_column = rt["see"][:n_mod][:, token_mod]  # [M, N]
    weights = torch.cat(
        [torch.ones(1, n_tokens, **i64), (see_of_column >= SEE_EARLIER).long(), (see_of_column == SEE_ALL).long()]
    )
    n_rows = weights.shape[0]
    prefix = torch.zeros(n_rows, n_tokens + 1, **i64)
    prefix[:, 1:] = torch.cumsum(weights, 1)
    prefix2 = torch.zeros(n_rows, n_tokens + 2, **i64)
    prefix2[:, 1:] = torch.cumsum(prefix, 1)
    prefix_flat, prefix2_flat = prefix.reshape(-1), prefix2.reshape(-1)
    p_stride, pp_stride = n_tokens + 1, n_tokens + 2

    def window_sum(row, x, y, r0, r1, delta):
        """sum over q in [r0, r1) of P_row[clamp(q + delta, x, y)], elementwise; needs x <= y."""
        t0, t1 = r0 + delta, r1 + delta
        mid_lo = torch.clamp(x + 1, t0, t1)
        mid_hi = torch.maximum(torch.clamp(y, t0, t1), mid_lo)
        base = row * p_stride
        base2 = row * pp_stride
        mid = prefix2_flat[base2 + mid_hi.clamp(0, n_tokens + 1)] - prefix2_flat[base2 + mid_lo.clamp(0, n_tokens + 1)]
        return (mid_lo - t0) * prefix_flat[base + x] + mid + (t1 - mid_hi) * prefix_flat[base + y]

    # ---- row pieces: runs of rows inside one q-tile and one segment ------------------------
    element = torch.arange(B, **i64)
    tile_starts = (element[:, None] * S + torch.arange(nq, **i64)[None, :] * block_m).reshape(-1)
    starts = torch.unique(torch.cat([tile_starts, tables.seg_start]))  # sorted
    ends = torch.cat([starts[1:], torch.tensor([n_tokens], **i64)])
    segment = tables.token_segment.reshape(-1).long()[starts]
    modality = tables.seg_modality[segment]
    keep = modality != rules.pad_id
    r0, r1, segment, modality = starts[keep], ends[keep], segment[keep], modality[keep]
    b = r0 // S
    row_tile = b * nq + (r0 - b * S) // block_m
    s0, s1 = tables.seg_start[segment], tables.seg_end[segment]
    v0, v1 = tables.seg_visible_start[segment], tables.seg_visible_end[segment]
    causal = rt["causal"][modality]
    window = rt["window"][modality]
    window = torch.where(window > 0, window, torch.full_like(window, big))
    e_row, l_row = 1 + modality, 1 + n_mod + modality

    # Columns a piece can reach: skip kv-tiles that certainly hold nothing it may see.
    sees_earlier = (prefix_flat[e_row * p_stride + s0] - prefix_flat[e_row * p_stride + v0]) > 0
    sees_later = (prefix_flat[l_row * p_stride + v1] - prefix_flat[l_row * p_stride + s1]) > 0
    lo = torch.maximum(torch.where(sees_earlier, v0, s0), r0 - window + 1)
    hi = torch.where(sees_later, v1, torch.where(causal, r1, s1))
    base = b * S
    j_lo = (lo - base) // block_n
    j_hi = (hi - base + block_n - 1) // block_n
    per_piece = (j_hi - j_lo).clamp(min=0)

    # ---- expand to (piece, kv-tile) pairs ----------------------------------------------------
    total = int(per_piece.sum())
    piece = torch.repeat_interleave(torch.arange(per_piece.numel(), device=device), per_piece, output_size=total)
    first = torch.cumsum(per_piece, 0) - per_piece
    j = j_lo[piece] + torch.arange(total, device=device) - first[piece]
    c0 = base[piece] + j * block_n
    c1 = torch.minimum(c0 + block_n, base[piece] + S)
    pr0, pr1 = r0[piece], r1[piece]
    ps0, ps1, pv0, pv1 = s0[piece], s1[piece], v0[piece], v1[piece]
    low_edge = 1 - window[piece]  # sliding lower bound q - W + 1
    own_top = torch.where(causal[piece], torch.ones_like(low_edge), torch.full_like(low_edge, big))
    zeros = torch.zeros_like(low_edge)
    e_rows, l_rows = e_row[piece], l_row[piece]

    def interval(x, y):
        return x, torch.maximum(y, x)

    e_x, e_y = interval(torch.maximum(pv0, c0), torch.minimum(ps0, c1))
    o_x, o_y = interval(torch.maximum(ps0, c0), torch.minimum(ps1, c1))
    l_x, l_y = interval(torch.maximum(ps1, c0), torch.minimum(pv1, c1))
    infinity = torch.full_like(low_edge, big)
    ones = torch.ones_like(low_edge)
    # (weight row, x, y, sliding top offset, sliding bottom offset) for each counted part
    parts_all = [
        (e_rows, e_x, e_y, infinity, low_edge),
        (zeros, o_x, o_y, own_top, low_edge),
        (l_rows, l_x, l_y, infinity, low_edge),
    ]
    parts_above = [
        (zeros, o_x, o_y, own_top, ones),
        (l_rows, l_x, l_y, infinity, ones),
    ]
    parts = parts_all + parts_above
    row_t, x_t, y_t, top_t, bottom_t = (torch.stack([p[k] for p in parts]) for k in range(5))
    rr0, rr1 = pr0.expand_as(x_t), pr1.expand_as(x_t)
    counted = window_sum(row_t, x_t, y_t, rr0, rr1, top_t) - window_sum(row_t, x_t, y_t, rr0, rr1, bottom_t)
    allowed = counted[: len(parts_all)].sum(0)
    above = counted[len(parts_all) :].sum(0)

    # ---- per tile: sum pieces, classify --------------------------------------------------
    key = row_tile[piece] * nk + j
    packed = torch.zeros(B * nq * nk, **i64)
    packed.index_add_(0, key, (allowed << 32) | above)
    tile = torch.nonzero(packed >> 32).squeeze(1)
    n_allowed, n_above = packed[tile] >> 32, packed[tile] & 0xFFFFFFFF
    t_row, t_col = tile // nk, tile % nk
    t_b = t_row // nq
    R0 = t_b * S + (t_row % nq) * block_m
    R1 = torch.minimum(R0 + block_m, t_b * S + S)
    C0 = t_b * S + t_col * block_n
    C1 = torch.minimum(C0 + block_n, t_b * S + S)
    area = (R1 - R0) * (C1 - C0)
    zero_row = torch.zeros_like(R0)
    below_or_on = window_sum(zero_row, C0, C1, R0, R1, torch.ones_like(R0)) - (R1 - R0) * C0
    kind = torch.full_like(tile, PARTIAL)
    kind = torch.where((n_above == 0) & (n_allowed == below_or_on), torch.full_like(kind, CAUSAL), kind)
    kind = torch.where(n_allowed == area, torch.full_like(kind, FULL), kind)
    allowed_pairs = int(n_allowed.sum())

    # ---- schedules ---------------------------------------------------------------------------
    rank = torch.empty(4, **i64)
    rank[torch.tensor(SCHEDULE_KINDS, device=device)] = torch.arange(3, **i64)
    group_rank = rank[kind]
    fwd_group = t_row * 3 + group_rank
    fwd_order = torch.argsort(fwd_group * nk + t_col)
    fwd_ptr = _offsets(fwd_group, B * nq * 3)
    t_kv_column = t_b * nk + t_col
    bwd_group = t_kv_column * 3 + group_rank
    bwd_order = torch.argsort(bwd_group * nq + t_row % nq)
    bwd_ptr = _offsets(bwd_group, B * nk * 3)
    return Plan(
        block_m=block_m,
        block_n=block_n,
        batch_size=B,
        seq_len=S,
        batched=isinstance(layout, LayoutBatch),
        fwd_ptr=fwd_ptr,
        fwd_kv=t_col[fwd_order].to(torch.int32),
        bwd_ptr=bwd_ptr,
        bwd_q=(t_row % nq)[bwd_order].to(torch.int32),
        allowed_pairs=allowed_pairs,
        tables=tables,
        rules_hash=rules.mask_hash(),
    )


def _offsets(group: torch.Tensor, n_groups: int) -> torch.Tensor:
    counts = torch.bincount(group, minlength=n_groups)
    out = torch.zeros(n_groups + 1, dtype=torch.int32, device=group.device)
    out[1:] = torch.cumsum(counts, 0)
    return out
