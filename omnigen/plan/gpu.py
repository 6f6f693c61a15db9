"""The planner on a CUDA GPU: three fused Triton launches and one host sync.

`classify_and_schedule(rules, tables, block_m, block_n)` returns exactly what `host._classify` +
`ruleless.schedules_from_kinds` return (same tiles, same kinds, same schedule order, same allowed-pair count),
computed from the O(S) layout tables, never from per-token prefix arrays:

1. `_prep_kernel`: one program computes segment-level prefix sums of every column weight row
   (E_m = columns modality m sees when earlier, L_m = columns m sees when later); the other
   programs zero the counters. A weight is constant inside a segment, so for a position x in
   segment g that starts at x0, with d = x - x0 and the segment's weight w,

       P(x)  = SegP[g] + d * w                            (weighted columns before x)
       PP(x) = SegPP[g] + d * SegP[g] + w * d (d - 1) / 2  (sum of P over the positions before x)

   looked up through the layout's `token_segment` table; a sentinel segment at n = B * S with
   w = 0 gives P(n) and PP(n + 1). The all-ones weight row needs no table: P(x) = x,
   PP(x) = x (x - 1) / 2.
2. `_classify_kernel`, one program per (q-tile row, block of BLOCK_J kv-tiles): walks the row's
   pieces (its rows inside one segment), counts each piece's allowed pairs over its whole visible
   range and the kv-tiles it may reach; if its block meets that reach, sums over the pieces the
   allowed pairs N and above-diagonal pairs U of each tile with the closed forms of
   `host._Prefix.count_rows`, and classifies exactly as `host._classify` does. It writes the int8
   kind grid and adds (atomically) to the counts per row and kind, per column and kind, and per
   group of GROUP rows or columns.
3. `_schedule_kernel`, one program per q-tile row and one per kv-tile column: finds its offsets
   from the group totals before it plus the counts inside its group (and writes them to
   `fwd_ptr` / `bwd_ptr`; the last row writes the tile total, row 0 the allowed-pair total), then
   places its kv-tiles (q-tiles for a column, reading the grid transposed) at offset + rank.

The schedules are written into buffers sized for every tile (B * nq * nk), so the one host sync
(reading the two totals) comes after the last launch; `fwd_kv` and `bwd_q` are views of their
first `num_tiles` entries. Where that bound exceeds `INLINE_TILE_LIMIT`, `_scan_kernel` makes the
pointers and totals in one program, the sync comes before the scheduling launch, and the
schedules are allocated exactly. Positions and pair counts are int64 (PP reaches ~n^2 / 2).

What a call costs is mostly the host's, not the GPU's (~15-20 us of kernels at 8K), so the host
side is kept small: every kernel takes the same nine arguments (the layout's one packed table
buffer, the rule table, one scratch buffer for everything, and six sizes) and finds its places in
the scratch buffer itself (`_scratch`, mirrored on the host by `_scratch_layout`); after the first
launch of each configuration, `launch.Launcher` starts the compiled kernel directly, without Triton's
per-call argument binding.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from ..layout import LayoutTables
from ..semantics import SEE_ALL, SEE_EARLIER, rule_tensors
from ..rules import Rules
from .launch import DIRECT_LAUNCH, Launcher, launch_hooks_idle, tl, triton, unspecialised_jit

# Schedules are written into buffers of B * nq * nk entries when that is at most this many tiles
# (16 MiB per int32 buffer); above it, one sync before the scheduling launch sizes them exactly.
INLINE_TILE_LIMIT = 1 << 22

# Rows (and columns) are also counted in groups of GROUP (columns: of one batch element), so each
# scheduling program finds its offset from at most (R / GROUP + 3 GROUP) counts.
GROUP = 64

_ZBLOCK = 1024  # counters zeroed per _prep_kernel program
_INT32_MAX = 2**31 - 1
_RULE_CACHE: dict = {}


def available() -> bool:
    """True where Triton imports and a CUDA device is present."""
    if triton is None:
        return False
    try:
        return torch.cuda.is_available()
    except Exception:  # pragma: no cover - broken driver installs
        return False


def _next_pow2(value: int) -> int:
    return 1 << max(0, int(value) - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _rule_table(rules: Rules, device: torch.device) -> tuple[torch.Tensor, bool]:
    """The rules as one int64 tensor on `device`, cached per (rules, device), as `semantics.rule_tensors`.

    Layout (M user modalities, pad id = M): weight rows [2M, M+1] (row m = E_m: see(m -> k) is
    earlier or all; row M + m = L_m: see(m -> k) is all; pad columns weigh 0), then causal [M+1]
    (0/1), then window [M+1] (0 = none).
    """
    # Keyed by the frozen Rules itself (hashing it is well under a us; the same object compares by
    # identity), not by mask hash + modality names + device name, which took a few us a plan to build.
    key = (rules, device.index)
    cached = _RULE_CACHE.get(key)
    if cached is None:
        rt = rule_tensors(rules, torch.device("cpu"))
        n_mod = len(rules.modalities)
        see = rt["see"][:n_mod]  # [M, M+1]
        weights = torch.cat([(see >= SEE_EARLIER).long(), (see == SEE_ALL).long()])  # [2M, M+1]
        packed = torch.cat([weights.reshape(-1), rt["causal"].long(), rt["window"].long()]).to(device)
        cached = (packed, bool(rules.has_windows))
        _RULE_CACHE[key] = cached
    return cached


class _Scratch(NamedTuple):
    """The parts of one call's int64 scratch buffer the host needs (the kernels' `_scratch` finds
    the same places from the same sizes).

    int64 words: [tile total, allowed-pair total | allowed pairs per row (R) | segment first
    positions (nseg + 1) | SegP, SegPP, w (2M rows of nseg + 1 each)]; then int32 entries:
    [fwd_ptr 3R+1 | bwd_ptr 3C+1 | counts: per row 3R, per column 3C, per group of GROUP rows, per
    group of GROUP columns of one element (`n_zero` in all, zeroed by _prep_kernel)]; then the int8
    kind grid (R * nk, padded to whole int32 entries); then, when `inline`, fwd_kv and bwd_q of
    `cap` int32 entries each. One allocation instead of three, and no offsets to pass.
    """

    rows: int  # R = B * nq
    cols: int  # C = B * nk
    nq: int
    nk: int
    n_zero: int
    inline: bool
    words: int  # int64 words to allocate
    # sizes for splitting the int32 view: inline [head, fwd_ptr, bwd_ptr, counts + grid, fwd_kv, bwd_q, tail],
    # else [head, fwd_ptr, bwd_ptr, rest]
    pieces: tuple[int, ...]


@functools.lru_cache(maxsize=256)
def _scratch_layout(B: int, S: int, nseg: int, n_mod: int, block_m: int, block_n: int, inline_limit: int) -> _Scratch:
    """The scratch buffer's sizes for one problem (cached: a training run repeats its shapes)."""
    nq, nk = _cdiv(S, block_m), _cdiv(S, block_n)
    R, C = B * nq, B * nk
    words64 = 2 + R + (nseg + 1) * (1 + 3 * 2 * n_mod)
    fwd_ptr = 2 * words64
    n_zero = 3 * R + 3 * C + _cdiv(R, GROUP) + B * _cdiv(nk, GROUP)
    grid = fwd_ptr + (3 * R + 1) + (3 * C + 1) + n_zero
    cap = R * nk
    fwd_kv = grid + _cdiv(cap, 4)
    inline = cap <= inline_limit
    words = _cdiv(fwd_kv + 2 * cap if inline else fwd_kv, 2)
    pointers = [fwd_ptr, 3 * R + 1, 3 * C + 1]
    if inline:
        pieces = pointers + [fwd_kv - fwd_ptr - 3 * (R + C) - 2, cap, cap, 2 * words - fwd_kv - 2 * cap]
    else:
        pieces = pointers + [2 * words - fwd_ptr - 3 * (R + C) - 2]
    return _Scratch(R, C, nq, nk, n_zero, inline, words, tuple(pieces))


def classify_and_schedule(
    rules: Rules, tables: LayoutTables, block_m: int, block_n: int, exact: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int | torch.Tensor]:
    """(fwd_ptr, fwd_kv, bwd_ptr, bwd_q, allowed_pairs), equal to the CPU path's, on the tables' device.

    `exact=False` (what `omnigen.mask` asks for): where the schedules fit the inline buffers, return
    them uncut -- fwd_kv and bwd_q of B * nq * nk entries, of which the first `total` are the
    schedule -- and, instead of the pair count, the int64 tensor [total, allowed pairs] on the
    device: no host sync at all. Elsewhere the result is the exact one (and the call syncs)."""
    if triton is None:
        raise RuntimeError("the GPU planner needs Triton")
    device = tables.device
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        with torch.cuda.device(device):  # Triton launches on the current device
            return classify_and_schedule(rules, tables, block_m, block_n, exact)
    rule_table, has_window = _rule_table(rules, device)
    B, S = tables.batch_size, tables.seq_len
    nseg = tables.num_segments
    n_mod = len(rules.modalities)
    lay = _scratch_layout(B, S, nseg, n_mod, block_m, block_n, INLINE_TILE_LIMIT)
    R, C = lay.rows, lay.cols
    work = torch.empty(lay.words, dtype=torch.int64, device=device)
    args = (tables.packed, rule_table, work, B, S, nseg, n_mod, block_m, block_n)
    # Direct launches need every integer argument to keep its int32 type (all are <= B * S or a tile size).
    direct = DIRECT_LAUNCH and max(B * S, block_m, block_n) <= _INT32_MAX and launch_hooks_idle()

    large = nseg >= 256
    _PREP((max(1, _cdiv(lay.n_zero, _ZBLOCK)), 1, 1), args,
          (max(2, _next_pow2(2 * n_mod)), 2048 if large else 256, _ZBLOCK, GROUP), 8 if large else 4, direct)
    block_j = min(128, max(16, _next_pow2(lay.nk)))  # >= GROUP unless a row is one chunk
    _CLASSIFY((R, _cdiv(lay.nk, block_j), 1), args, (block_j, GROUP, has_window), 4, direct)
    block = min(1024, max(16, _next_pow2(max(lay.nq, lay.nk))))
    out32 = work.view(torch.int32)
    if lay.inline:
        # each scheduling program finds its own offsets from the group and per-row counts
        _SCHEDULE((R + C, 1, 1), args + (work,), (block, GROUP, True), 4, direct)
        # views made while the GPU works; only the cut to the tile count waits for the sync
        _, fwd_ptr, bwd_ptr, _, fwd_kv, bwd_q, _ = out32.split_with_sizes(lay.pieces)
        if not exact:
            return fwd_ptr, fwd_kv, bwd_ptr, bwd_q, work[:2]
        total, allowed = work[:2].tolist()  # the one host sync
        return fwd_ptr, fwd_kv[:total], bwd_ptr, bwd_q[:total], allowed
    _SCAN((1, 1, 1), args, (1024, GROUP), 4, direct)
    _, fwd_ptr, bwd_ptr, _ = out32.split_with_sizes(lay.pieces)
    total, allowed = work[:2].tolist()  # the one host sync
    size = max(total, 1)
    schedules = torch.empty(2 * size, dtype=torch.int32, device=device)  # fwd_kv, then bwd_q from `size`
    _SCHEDULE((R + C, 1, 1), args + (schedules,), (block, GROUP, False), 4, direct)
    return fwd_ptr, schedules[:total], bwd_ptr, schedules[size : size + total], allowed




if triton is not None:
    # The arguments every kernel takes (the scheduling kernel one more pointer, `sched`).
    _SIZES = ("B", "S", "nseg", "n_mod", "block_m", "block_n")
    _POINTERS = ("tables", "rule_tab", "work", "sched")

    def _jit(fn):
        """triton.jit without specialisation of the sizes or the pointers' alignment (launch.unspecialised_jit)."""
        return unspecialised_jit(fn, _SIZES, _POINTERS)

    @triton.jit
    def _scratch(work, B, S, nseg, n_mod, block_m, block_n, GROUP: tl.constexpr):
        """Sizes and the places in the scratch buffer (the host's `_scratch_layout` mirrors them):
        (nq, nk, R, C, row_allowed, seg_first, seg_p, seg_pp, seg_w, fwd_ptr, bwd_ptr, row_counts,
        col_counts, row_groups, col_groups, n_zero, grid, fwd_kv, bwd_q). All sizes int64."""
        B = B.to(tl.int64)
        S = S.to(tl.int64)
        nseg = nseg.to(tl.int64)
        n_mod = n_mod.to(tl.int64)
        block_m = block_m.to(tl.int64)
        block_n = block_n.to(tl.int64)
        nq = (S + block_m - 1) // block_m
        nk = (S + block_n - 1) // block_n
        R = B * nq
        C = B * nk
        stride = nseg + 1
        n_weights = 2 * n_mod
        # int64 words
        row_allowed = work + 2  # work[0], work[1]: tile and allowed-pair totals
        seg_first = row_allowed + R
        seg_p = seg_first + stride
        seg_pp = seg_p + n_weights * stride
        seg_w = seg_pp + n_weights * stride
        # int32 entries
        fwd_ptr = (seg_w + n_weights * stride).to(tl.pointer_type(tl.int32))
        bwd_ptr = fwd_ptr + 3 * R + 1
        row_counts = bwd_ptr + 3 * C + 1
        col_counts = row_counts + 3 * R
        row_groups = col_counts + 3 * C
        col_groups = row_groups + (R + GROUP - 1) // GROUP
        n_zero = 3 * R + 3 * C + (R + GROUP - 1) // GROUP + B * ((nk + GROUP - 1) // GROUP)
        grid32 = row_counts + n_zero
        fwd_kv = grid32 + (R * nk + 3) // 4  # (inline schedules only)
        bwd_q = fwd_kv + R * nk
        return (nq, nk, R, C, row_allowed, seg_first, seg_p, seg_pp, seg_w, fwd_ptr, bwd_ptr, row_counts,
                col_counts, row_groups, col_groups, n_zero, grid32.to(tl.pointer_type(tl.int8)), fwd_kv, bwd_q)

    @triton.jit
    def _clamp(v, lo, hi):
        return tl.minimum(tl.maximum(v, lo), hi)

    @triton.jit
    def _segment_of(x, n, nseg, tok_seg):
        """Global segment of position x in [0, n + 1]; the sentinel nseg for x >= n."""
        inside = x < n
        seg = tl.load(tok_seg + tl.where(inside, x, 0), mask=inside, other=0).to(tl.int64)
        return tl.where(inside, seg, nseg)

    @triton.jit
    def _prefix_at(x, row, n, nseg, tok_seg, seg_first, seg_p, seg_w):
        """P_row(x): weighted columns in [0, x), for x in [0, n]."""
        seg = _segment_of(x, n, nseg, tok_seg)
        at = row + seg
        return tl.load(seg_p + at) + (x - tl.load(seg_first + seg)) * tl.load(seg_w + at)

    @triton.jit
    def _prefix2_at(x, row, n, nseg, tok_seg, seg_first, seg_p, seg_pp, seg_w):
        """PP_row(x) = sum of P_row over [0, x), for x in [0, n + 1]."""
        seg = _segment_of(x, n, nseg, tok_seg)
        at = row + seg
        d = x - tl.load(seg_first + seg)
        w = tl.load(seg_w + at)
        return tl.load(seg_pp + at) + d * tl.load(seg_p + at) + w * (d * (d - 1) // 2)

    @triton.jit
    def _window_sum(x, y, px, py, r0, r1, delta, row, n, nseg, tok_seg, seg_first, seg_p, seg_pp, seg_w):
        """sum over q in [r0, r1) of P_row[clamp(q + delta, x, y)] (px = P(x), py = P(y)); plan._Prefix.window_sum."""
        t0 = r0 + delta
        t1 = r1 + delta
        mid_lo = _clamp(x + 1, t0, t1)
        mid_hi = tl.maximum(_clamp(y, t0, t1), mid_lo)
        hi = _prefix2_at(_clamp(mid_hi, 0, n + 1), row, n, nseg, tok_seg, seg_first, seg_p, seg_pp, seg_w)
        lo = _prefix2_at(_clamp(mid_lo, 0, n + 1), row, n, nseg, tok_seg, seg_first, seg_p, seg_pp, seg_w)
        return (mid_lo - t0) * px + (hi - lo) + (t1 - mid_hi) * py

    @triton.jit
    def _window_sum_ones(x, y, r0, r1, delta, n):
        """_window_sum for the all-ones weight row: P(x) = x, PP(x) = x (x - 1) / 2."""
        t0 = r0 + delta
        t1 = r1 + delta
        mid_lo = _clamp(x + 1, t0, t1)
        mid_hi = tl.maximum(_clamp(y, t0, t1), mid_lo)
        a = _clamp(mid_hi, 0, n + 1)
        b = _clamp(mid_lo, 0, n + 1)
        return (mid_lo - t0) * x + (a * (a - 1) // 2 - b * (b - 1) // 2) + (t1 - mid_hi) * y

    @triton.jit
    def _piece(s, row_first, row_end, seg_start, seg_end, seg_mod, seg_vs, seg_ve, causal_tab, window_tab,
               n_mod, stride, big):
        """Rows [r0, r1) of q-tile rows [row_first, row_end) inside segment s, and that segment's rules."""
        m = tl.load(seg_mod + s)
        real = m != n_mod  # pad rows see nothing
        mm = tl.minimum(m, n_mod - 1)
        s0 = tl.load(seg_start + s)
        s1 = tl.load(seg_end + s)
        v0 = tl.load(seg_vs + s)
        v1 = tl.load(seg_ve + s)
        r0 = tl.maximum(s0, row_first)
        r1 = tl.minimum(s1, row_end)
        window = tl.load(window_tab + mm)
        window = tl.where(window > 0, window, big)
        causal = tl.load(causal_tab + mm) != 0
        own_top = tl.where(causal, 1, big)
        return real, r0, r1, s0, s1, v0, v1, window, causal, own_top, mm * stride, (n_mod + mm) * stride

    @triton.jit
    def _piece_counts(c0, c1, r0, r1, s0, s1, v0, v1, window, own_top, e_row, l_row,
                      n, nseg, tok_seg, seg_first, seg_p, seg_pp, seg_w, HAS_WINDOW: tl.constexpr):
        """(allowed, above-diagonal) pairs of rows [r0, r1) x columns [c0, c1); plan._Prefix.count_rows.

        Earlier columns lie below the diagonal, later ones above it and never outside the window:
        those parts of count_rows reduce to the forms below (same values).
        """
        rows = r1 - r0
        low_edge = 1 - window
        # earlier segments: [max(v0, c0), min(s0, c1)) weighted by E_m, cut by the window
        e_x = tl.maximum(v0, c0)
        e_y = tl.maximum(tl.minimum(s0, c1), e_x)
        pe_x = _prefix_at(e_x, e_row, n, nseg, tok_seg, seg_first, seg_p, seg_w)
        pe_y = _prefix_at(e_y, e_row, n, nseg, tok_seg, seg_first, seg_p, seg_w)
        if HAS_WINDOW:
            earlier = rows * pe_y - _window_sum(
                e_x, e_y, pe_x, pe_y, r0, r1, low_edge, e_row, n, nseg, tok_seg, seg_first, seg_p, seg_pp, seg_w
            )
        else:
            earlier = rows * (pe_y - pe_x)
        # own segment: [max(s0, c0), min(s1, c1)) cut by [q - W + 1, q + 1) (causal) or [q - W + 1, inf)
        o_x = tl.maximum(s0, c0)
        o_y = tl.maximum(tl.minimum(s1, c1), o_x)
        top = _window_sum_ones(o_x, o_y, r0, r1, own_top, n)
        own = top - _window_sum_ones(o_x, o_y, r0, r1, low_edge, n)
        own_above = top - _window_sum_ones(o_x, o_y, r0, r1, 1, n)
        # later segments: [max(s1, c0), min(v1, c1)) weighted by L_m, every pair above the diagonal
        l_x = tl.maximum(s1, c0)
        l_y = tl.maximum(tl.minimum(v1, c1), l_x)
        later = rows * (
            _prefix_at(l_y, l_row, n, nseg, tok_seg, seg_first, seg_p, seg_w)
            - _prefix_at(l_x, l_row, n, nseg, tok_seg, seg_first, seg_p, seg_w)
        )
        return earlier + own + later, own_above + later

    @_jit
    def _prep_kernel(tables, rule_tab, work, B, S, nseg, n_mod, block_m, block_n,
                     NWP: tl.constexpr, BLOCK_S: tl.constexpr, ZBLOCK: tl.constexpr, GROUP: tl.constexpr):
        (nq, nk, R, C, row_allowed, seg_first, seg_p, seg_pp, seg_w, fwd_ptr, bwd_ptr, row_counts,
         col_counts, row_groups, col_groups, n_zero, grid, fwd_kv, bwd_q) = _scratch(
            work, B, S, nseg, n_mod, block_m, block_n, GROUP)
        pid = tl.program_id(0)
        z = pid * ZBLOCK + tl.arange(0, ZBLOCK)
        tl.store(row_counts + z, tl.zeros([ZBLOCK], tl.int32), mask=z < n_zero)
        if pid == 0:
            n64 = B.to(tl.int64) * S
            nseg64 = nseg.to(tl.int64)
            stride = nseg64 + 1
            n_weights = 2 * n_mod
            seg_end = tables + nseg64
            seg_mod = tables + 2 * nseg64
            rows = tl.arange(0, NWP)[:, None].to(tl.int64)
            row_ok = rows < n_weights
            carry_p = tl.zeros([NWP], tl.int64)
            carry_pp = tl.zeros([NWP], tl.int64)
            for start in range(0, nseg64 + 1, BLOCK_S):
                s = start + tl.arange(0, BLOCK_S)[None, :].to(tl.int64)
                valid = s < nseg64
                listed = s <= nseg64  # nseg itself is the sentinel: first = n, length 0, weight 0
                first = tl.load(tables + s, mask=valid, other=0)
                length = tl.load(seg_end + s, mask=valid, other=0) - first
                first = tl.where(valid, first, n64)
                m = tl.load(seg_mod + s, mask=valid, other=0)
                w = tl.load(rule_tab + rows * (n_mod + 1) + m, mask=row_ok & valid, other=0)
                cp = w * length
                p = carry_p[:, None] + tl.cumsum(cp, 1) - cp
                cpp = length * p + w * (length * (length - 1) // 2)
                pp = carry_pp[:, None] + tl.cumsum(cpp, 1) - cpp
                keep = row_ok & listed
                tl.store(seg_p + rows * stride + s, p, mask=keep)
                tl.store(seg_pp + rows * stride + s, pp, mask=keep)
                tl.store(seg_w + rows * stride + s, w, mask=keep)
                tl.store(seg_first + s, first, mask=listed)
                carry_p += tl.sum(cp, 1)
                carry_pp += tl.sum(cpp, 1)

    @_jit
    def _classify_kernel(tables, rule_tab, work, B, S, nseg, n_mod, block_m, block_n,
                         BLOCK_J: tl.constexpr, GROUP: tl.constexpr, HAS_WINDOW: tl.constexpr):
        """Program (r, c): kv-tiles [c * BLOCK_J, (c + 1) * BLOCK_J) of q-tile row r (BLOCK_J >= GROUP,
        or the row has a single chunk)."""
        (nq, nk, R, C, row_allowed, seg_first, seg_p, seg_pp, seg_w, fwd_ptr, bwd_ptr, row_counts,
         col_counts, row_groups, col_groups, n_zero, grid, fwd_kv, bwd_q) = _scratch(
            work, B, S, nseg, n_mod, block_m, block_n, GROUP)
        r = tl.program_id(0).to(tl.int64)
        chunk = tl.program_id(1).to(tl.int64)
        S = S.to(tl.int64)
        nseg = nseg.to(tl.int64)
        block_m = block_m.to(tl.int64)
        block_n = block_n.to(tl.int64)
        n_mod = n_mod.to(tl.int64)
        n = B.to(tl.int64) * S
        big = 4 * n + 4 * tl.maximum(block_m, block_n)  # "no window" / "no causal edge", as host._classify
        stride = nseg + 1
        # LayoutTables.packed: 7 int64 rows of nseg, then the int32 token table from word
        # layout.token_offset(nseg) (the 7 rows rounded up to 32 words)
        seg_start = tables
        seg_end = tables + nseg
        seg_mod = tables + 2 * nseg
        seg_vs = tables + 5 * nseg
        seg_ve = tables + 6 * nseg
        tok_seg = (tables + (7 * nseg + 31) // 32 * 32).to(tl.pointer_type(tl.int32))
        causal_tab = rule_tab + 2 * n_mod * (n_mod + 1)
        window_tab = causal_tab + n_mod + 1

        b = r // nq
        base = b * S
        row_first = base + (r - b * nq) * block_m
        row_end = tl.minimum(row_first + block_m, base + S)
        seg_lo = tl.load(tok_seg + row_first).to(tl.int64)
        seg_hi = tl.load(tok_seg + row_end - 1).to(tl.int64)

        # pass 1: each piece's allowed pairs over its whole visible range, and the kv-tiles it reaches
        allowed = tl.zeros([], tl.int64)
        j_lo = nk
        j_hi = tl.zeros([], tl.int64)
        for s in range(seg_lo, seg_hi + 1):
            real, r0, r1, s0, s1, v0, v1, window, causal, own_top, e_row, l_row = _piece(
                s, row_first, row_end, seg_start, seg_end, seg_mod, seg_vs, seg_ve, causal_tab, window_tab,
                n_mod, stride, big)
            if chunk == 0:
                count, _ = _piece_counts(v0, v1, r0, r1, s0, s1, v0, v1, window, own_top, e_row, l_row,
                                         n, nseg, tok_seg, seg_first, seg_p, seg_pp, seg_w, HAS_WINDOW)
                allowed += tl.where(real, count, 0)
            sees_earlier = (_prefix_at(s0, e_row, n, nseg, tok_seg, seg_first, seg_p, seg_w)
                            - _prefix_at(v0, e_row, n, nseg, tok_seg, seg_first, seg_p, seg_w)) > 0
            sees_later = (_prefix_at(v1, l_row, n, nseg, tok_seg, seg_first, seg_p, seg_w)
                          - _prefix_at(s1, l_row, n, nseg, tok_seg, seg_first, seg_p, seg_w)) > 0
            lo = tl.maximum(tl.where(sees_earlier, v0, s0), r0 - window + 1)
            hi = tl.where(sees_later, v1, tl.where(causal, r1, s1))
            j_lo = tl.where(real, tl.minimum(j_lo, (lo - base) // block_n), j_lo)
            j_hi = tl.where(real, tl.maximum(j_hi, (hi - base + block_n - 1) // block_n), j_hi)
        tl.store(row_allowed + r, allowed, mask=chunk == 0)

        # pass 2: count and classify this program's kv-tiles; tiles outside the reach are empty
        jc = chunk * BLOCK_J
        j = jc + tl.arange(0, BLOCK_J).to(tl.int64)
        in_row = j < nk
        c0 = tl.minimum(base + j * block_n, base + S)
        c1 = tl.minimum(c0 + block_n, base + S)
        active = (jc < j_hi) & (jc + BLOCK_J > j_lo)
        stop = tl.where(active, seg_hi + 1, seg_lo)
        n_allowed = tl.zeros([BLOCK_J], tl.int64)
        n_above = tl.zeros([BLOCK_J], tl.int64)
        for s in range(seg_lo, stop):
            real, r0, r1, s0, s1, v0, v1, window, causal, own_top, e_row, l_row = _piece(
                s, row_first, row_end, seg_start, seg_end, seg_mod, seg_vs, seg_ve, causal_tab, window_tab,
                n_mod, stride, big)
            count, above = _piece_counts(c0, c1, r0, r1, s0, s1, v0, v1, window, own_top, e_row, l_row,
                                         n, nseg, tok_seg, seg_first, seg_p, seg_pp, seg_w, HAS_WINDOW)
            n_allowed += tl.where(real, count, 0)
            n_above += tl.where(real, above, 0)
        tile_rows = row_end - row_first
        area = tile_rows * (c1 - c0)
        below_or_on = _window_sum_ones(c0, c1, row_first, row_end, 1, n) - tile_rows * c0
        kind = tl.where(n_allowed == 0, 0, 3)
        kind = tl.where((n_above == 0) & (n_allowed == below_or_on) & (n_allowed > 0), 2, kind)
        kind = tl.where(n_allowed == area, 1, kind)
        kind = tl.where(in_row, kind, 0)
        tl.store(grid + r * nk + j, kind.to(tl.int8), mask=in_row)

        # counts per row, per column, per group of rows and per group of columns (zeroed by _prep_kernel)
        if active:  # (an inactive chunk is all empty)
            visited = kind > 0
            n_full = tl.sum((kind == 1).to(tl.int32), 0)
            n_causal = tl.sum((kind == 2).to(tl.int32), 0)
            n_partial = tl.sum((kind == 3).to(tl.int32), 0)
            tl.atomic_add(row_counts + 3 * r, n_full, sem="relaxed")
            tl.atomic_add(row_counts + 3 * r + 1, n_causal, sem="relaxed")
            tl.atomic_add(row_counts + 3 * r + 2, n_partial, sem="relaxed")
            tl.atomic_add(row_groups + r // GROUP, n_full + n_causal + n_partial, sem="relaxed")
            column = b * nk + j
            ones = tl.full([BLOCK_J], 1, tl.int32)
            tl.atomic_add(col_counts + column * 3 + tl.where(visited, kind - 1, 0), ones,
                          mask=visited, sem="relaxed")
            # column groups: GROUP consecutive kv-tiles of one batch element (a chunk holds whole groups)
            col_group = b * ((nk + GROUP - 1) // GROUP) + chunk * (BLOCK_J // GROUP)
            if BLOCK_J >= GROUP:
                per_group = tl.sum(tl.reshape(visited.to(tl.int32), (BLOCK_J // GROUP, GROUP)), 1)
                tl.atomic_add(col_groups + col_group + tl.arange(0, BLOCK_J // GROUP), per_group,
                              mask=per_group > 0, sem="relaxed")
            else:  # the row's only chunk: one group
                tl.atomic_add(col_groups + col_group, tl.sum(visited.to(tl.int32), 0), sem="relaxed")

    @_jit
    def _scan_kernel(tables, rule_tab, work, B, S, nseg, n_mod, block_m, block_n,
                     BLOCK: tl.constexpr, GROUP: tl.constexpr):
        """fwd_ptr, bwd_ptr, tile and allowed-pair totals in one program (when the schedules are sized exactly)."""
        (nq, nk, R, C, row_allowed, seg_first, seg_p, seg_pp, seg_w, fwd_ptr, bwd_ptr, row_counts,
         col_counts, row_groups, col_groups, n_zero, grid, fwd_kv, bwd_q) = _scratch(
            work, B, S, nseg, n_mod, block_m, block_n, GROUP)
        lanes = tl.arange(0, BLOCK)
        carry = tl.zeros([], tl.int32)
        for start in range(0, 3 * R, BLOCK):
            at = start + lanes
            v = tl.load(row_counts + at, mask=at < 3 * R, other=0)
            tl.store(fwd_ptr + 1 + at, carry + tl.cumsum(v, 0), mask=at < 3 * R)
            carry += tl.sum(v, 0)
        tl.store(fwd_ptr, 0)
        total = carry
        carry = tl.zeros([], tl.int32)
        for start in range(0, 3 * C, BLOCK):
            at = start + lanes
            v = tl.load(col_counts + at, mask=at < 3 * C, other=0)
            tl.store(bwd_ptr + 1 + at, carry + tl.cumsum(v, 0), mask=at < 3 * C)
            carry += tl.sum(v, 0)
        tl.store(bwd_ptr, 0)
        allowed = tl.zeros([], tl.int64)
        for start in range(0, R, BLOCK):
            at = start + lanes
            allowed += tl.sum(tl.load(row_allowed + at, mask=at < R, other=0), 0)
        tl.store(work, total.to(tl.int64))
        tl.store(work + 1, allowed)

    @triton.jit
    def _offsets(counts, groups, group, first, item, n_items, ptr, BLOCK: tl.constexpr, GROUP: tl.constexpr):
        """Schedule offsets of `item` (its full, causal, partial starts) from the totals of the groups
        before its group and the per-item counts (3 per item) from its group's first item `first`;
        writes them to ptr[3 item ...], and the total to ptr[3 n_items] from the last item.
        Returns (full, causal, partial, end)."""
        lanes = tl.arange(0, BLOCK)
        before = tl.zeros([], tl.int32)
        for start in range(0, group, BLOCK):
            at = start + lanes
            before += tl.sum(tl.load(groups + at, mask=at < group, other=0), 0)
        at = 3 * first + tl.arange(0, 4 * GROUP)
        before += tl.sum(tl.load(counts + at, mask=at < 3 * item, other=0), 0)
        f = before
        c = f + tl.load(counts + 3 * item)
        p = c + tl.load(counts + 3 * item + 1)
        end = p + tl.load(counts + 3 * item + 2)
        tl.store(ptr + 3 * item, f)
        tl.store(ptr + 3 * item + 1, c)
        tl.store(ptr + 3 * item + 2, p)
        tl.store(ptr + 3 * n_items, end, mask=item == n_items - 1)
        return f, c, p, end

    @triton.jit
    def _emit(kind, index, f, c, p, out):
        """Write `index` of the full / causal / partial entries at f / c / p + rank; the advanced offsets."""
        full = (kind == 1).to(tl.int32)
        tl.store(out + f + tl.cumsum(full, 0) - 1, index, mask=full != 0)
        causal = (kind == 2).to(tl.int32)
        tl.store(out + c + tl.cumsum(causal, 0) - 1, index, mask=causal != 0)
        partial = (kind == 3).to(tl.int32)
        tl.store(out + p + tl.cumsum(partial, 0) - 1, index, mask=partial != 0)
        return f + tl.sum(full, 0), c + tl.sum(causal, 0), p + tl.sum(partial, 0)

    @_jit
    def _schedule_kernel(tables, rule_tab, work, B, S, nseg, n_mod, block_m, block_n, sched,
                         BLOCK: tl.constexpr, GROUP: tl.constexpr, FUSED_SCAN: tl.constexpr):
        """Program r < R: the forward schedule of q-tile row r; program R + c: the backward one of kv-tile column c.

        FUSED_SCAN: find the offsets (and write fwd_ptr / bwd_ptr and the totals) here and write the
        schedules into the scratch buffer; else read the offsets _scan_kernel wrote and write the
        schedules to `sched` (int32: fwd_kv, then bwd_q from max(total, 1))."""
        (nq, nk, R, C, row_allowed, seg_first, seg_p, seg_pp, seg_w, fwd_ptr, bwd_ptr, row_counts,
         col_counts, row_groups, col_groups, n_zero, grid, fwd_kv, bwd_q) = _scratch(
            work, B, S, nseg, n_mod, block_m, block_n, GROUP)
        if not FUSED_SCAN:
            fwd_kv = sched
            bwd_q = sched + tl.maximum(tl.load(work), 1)
        pid = tl.program_id(0).to(tl.int64)
        lanes = tl.arange(0, BLOCK).to(tl.int64)
        if pid < R:  # forward: q-tile row r lists its kv-tiles
            r = pid
            if FUSED_SCAN:
                f, c, p, end = _offsets(row_counts, row_groups, r // GROUP, r // GROUP * GROUP, r, R, fwd_ptr,
                                        BLOCK, GROUP)
                tl.store(work, end.to(tl.int64), mask=r == R - 1)
                allowed = tl.zeros([], tl.int64)
                for start in range(0, tl.where(r == 0, R, 0), BLOCK):
                    at = start + lanes
                    allowed += tl.sum(tl.load(row_allowed + at, mask=at < R, other=0), 0)
                tl.store(work + 1, allowed, mask=r == 0)
            else:
                f = tl.load(fwd_ptr + 3 * r)
                c = tl.load(fwd_ptr + 3 * r + 1)
                p = tl.load(fwd_ptr + 3 * r + 2)
            for start in range(0, nk, BLOCK):
                j = start + lanes
                kind = tl.load(grid + r * nk + j, mask=j < nk, other=0)
                f, c, p = _emit(kind, j.to(tl.int32), f, c, p, fwd_kv)
        else:  # backward: kv-tile column (b, j) lists its q-tiles, reading the grid transposed
            col = pid - R
            b = col // nk
            j = col - b * nk
            if FUSED_SCAN:  # column groups: GROUP consecutive kv-tiles of one batch element
                group = b * ((nk + GROUP - 1) // GROUP) + j // GROUP
                f, c, p, end = _offsets(col_counts, col_groups, group, col - j % GROUP, col, C, bwd_ptr,
                                        BLOCK, GROUP)
            else:
                f = tl.load(bwd_ptr + 3 * col)
                c = tl.load(bwd_ptr + 3 * col + 1)
                p = tl.load(bwd_ptr + 3 * col + 2)
            for start in range(0, nq, BLOCK):
                i = start + lanes
                kind = tl.load(grid + (b * nq + i) * nk + j, mask=i < nq, other=0)
                f, c, p = _emit(kind, i.to(tl.int32), f, c, p, bwd_q)

    _PREP = Launcher(_prep_kernel, ("NWP", "BLOCK_S", "ZBLOCK", "GROUP"))
    _CLASSIFY = Launcher(_classify_kernel, ("BLOCK_J", "GROUP", "HAS_WINDOW"))
    _SCAN = Launcher(_scan_kernel, ("BLOCK", "GROUP"))
    _SCHEDULE = Launcher(_schedule_kernel, ("BLOCK", "GROUP", "FUSED_SCAN"))
