"""The planner on a CUDA GPU: three fused Triton launches and one host sync.

`classify_and_schedule(rules, tables, block_m, block_n)` returns exactly what `plan._classify` +
`plan._schedules` return (same tiles, same kinds, same schedule order, same allowed-pair count),
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
   `plan._Prefix.count_rows`, and classifies exactly as `plan._classify` does. It writes the int8
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
"""

from __future__ import annotations

import torch

from .layout import LayoutTables
from .rules import Rules

try:  # Triton is optional: without it plan() runs its tensor-op path
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None

# Schedules are written into buffers of B * nq * nk entries when that is at most this many tiles
# (16 MiB per int32 buffer); above it, one sync before the scheduling launch sizes them exactly.
INLINE_TILE_LIMIT = 1 << 22

# Rows (and columns) are also counted in groups of GROUP (columns: of one batch element), so each
# scheduling program finds its offset from at most (R / GROUP + 3 GROUP) counts.
GROUP = 64

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


def _rule_table(rules: Rules, device: torch.device) -> tuple[torch.Tensor, bool]:
    """The rules as one int64 tensor on `device`, cached per (rules, device).

    Layout (M user modalities, pad id = M): weight rows [2M, M+1] (row m = E_m: see(m -> k) is
    earlier or all; row M + m = L_m: see(m -> k) is all; pad columns weigh 0), then causal [M+1]
    (0/1), then window [M+1] (0 = none).
    """
    key = (rules.mask_hash(), rules.modality_names, str(device))
    cached = _RULE_CACHE.get(key)
    if cached is None:
        from .plan import SEE_ALL, SEE_EARLIER, rule_tensors

        rt = rule_tensors(rules, torch.device("cpu"))
        n_mod = len(rules.modalities)
        see = rt["see"][:n_mod]  # [M, M+1]
        weights = torch.cat([(see >= SEE_EARLIER).long(), (see == SEE_ALL).long()])  # [2M, M+1]
        packed = torch.cat([weights.reshape(-1), rt["causal"].long(), rt["window"].long()])
        cached = (packed.to(device), bool(rules.has_windows))
        _RULE_CACHE[key] = cached
    return cached


def classify_and_schedule(
    rules: Rules, tables: LayoutTables, block_m: int, block_n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(fwd_ptr, fwd_kv, bwd_ptr, bwd_q, allowed_pairs), equal to the CPU path's, on the tables' device."""
    if triton is None:
        raise RuntimeError("the GPU planner needs Triton")
    device = tables.seg_start.device
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        with torch.cuda.device(device):  # Triton launches on the current device
            return classify_and_schedule(rules, tables, block_m, block_n)
    rule_table, has_window = _rule_table(rules, device)
    B, S = tables.batch_size, tables.seq_len
    n = B * S
    nq, nk = -(-S // block_m), -(-S // block_n)
    R, C = B * nq, B * nk
    nseg = int(tables.seg_start.shape[0])
    n_mod = len(rules.modalities)
    n_weights = 2 * n_mod
    stride = nseg + 1
    big = 4 * n + 4 * max(block_m, block_n)  # "no window" / "no causal edge", as plan._classify

    # int64 scratch: [totals 2 | allowed per row R | segment first (nseg+1) | SegP | SegPP | w]
    off_first = 2 + R
    off_p = off_first + stride
    off_pp = off_p + n_weights * stride
    off_w = off_pp + n_weights * stride
    ws64 = torch.empty(off_w + n_weights * stride, dtype=torch.int64, device=device)
    # int32: [fwd_ptr 3R+1 | bwd_ptr 3C+1 | counts: per row 3R, per column 3C, per group of GROUP rows,
    #         per group of GROUP columns of one element | fwd_kv cap | bwd_q cap]; the counts start at zero
    cap = R * nk
    inline = cap <= INLINE_TILE_LIMIT
    off_bptr = 3 * R + 1
    off_rowc = off_bptr + 3 * C + 1
    off_colc = off_rowc + 3 * R
    off_rowg = off_colc + 3 * C
    off_colg = off_rowg + -(-R // GROUP)
    off_kv = off_colg + B * -(-nk // GROUP)
    off_q = off_kv + cap
    out32 = torch.empty(off_q + cap if inline else off_kv, dtype=torch.int32, device=device)
    grid = torch.empty(R * nk, dtype=torch.int8, device=device)

    zblock = 1024
    large = nseg >= 256
    _prep_kernel[(max(1, -(-(off_kv - off_rowc) // zblock)),)](
        tables.seg_start, tables.seg_end, tables.seg_modality, rule_table, ws64, out32,
        n, nseg, n_mod, n_weights, off_first, off_p, off_pp, off_w, off_rowc, off_kv - off_rowc,
        NWP=max(2, _next_pow2(n_weights)), BLOCK_S=2048 if large else 256, ZBLOCK=zblock,
        num_warps=8 if large else 4,
    )
    block_j = min(128, max(16, _next_pow2(nk)))  # >= GROUP unless a row is one chunk
    _classify_kernel[(R, -(-nk // block_j))](
        tables.token_segment, tables.seg_start, tables.seg_end, tables.seg_modality,
        tables.seg_visible_start, tables.seg_visible_end, rule_table, ws64, out32, grid,
        S, n, nseg, nq, nk, block_m, block_n, n_mod, big,
        off_first, off_p, off_pp, off_w, off_rowc, off_colc, off_rowg, off_colg,
        BLOCK_J=block_j, GROUP=GROUP, HAS_WINDOW=has_window, num_warps=4,
    )
    fwd_ptr = out32[:off_bptr]
    bwd_ptr = out32[off_bptr:off_rowc]
    block = min(1024, max(16, _next_pow2(max(nq, nk))))
    if inline:
        # each scheduling program finds its own offsets from the group and per-row counts
        fwd_kv, bwd_q = out32[off_kv:off_q], out32[off_q:]
        _schedule_kernel[(R + C,)](
            grid, out32, ws64, fwd_kv, bwd_q, R, C, nq, nk, off_bptr, off_rowc, off_colc, off_rowg, off_colg,
            BLOCK=block, GROUP=GROUP, FUSED_SCAN=True, num_warps=4,
        )
        total, allowed = ws64[:2].tolist()  # the one host sync
        return fwd_ptr, fwd_kv[:total], bwd_ptr, bwd_q[:total], int(allowed)
    _scan_kernel[(1,)](out32, ws64, 3 * R, 3 * C, R, off_rowc, off_colc, off_bptr, BLOCK=1024, num_warps=4)
    total, allowed = ws64[:2].tolist()  # the one host sync
    size = max(total, 1)
    schedules = torch.empty(2 * size, dtype=torch.int32, device=device)
    fwd_kv, bwd_q = schedules[:total], schedules[size : size + total]
    _schedule_kernel[(R + C,)](
        grid, out32, ws64, fwd_kv, schedules[size:], R, C, nq, nk, off_bptr, off_rowc, off_colc, off_rowg, off_colg,
        BLOCK=block, GROUP=GROUP, FUSED_SCAN=False, num_warps=4,
    )
    return fwd_ptr, fwd_kv, bwd_ptr, bwd_q, int(allowed)


if triton is not None:

    def _jit(ints=(), pointers=()):
        """triton.jit without value specialisation of the varying integers and pointer alignments
        (each new combination would otherwise compile a new kernel)."""

        def wrap(fn):
            try:
                return triton.jit(fn, do_not_specialize=list(ints), do_not_specialize_on_alignment=list(pointers))
            except TypeError:  # pragma: no cover - older Triton
                return triton.jit(fn, do_not_specialize=list(ints))

        return wrap

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

    @_jit(ints=("n", "nseg", "n_mod", "n_weights", "off_first", "off_p", "off_pp", "off_w", "off_zero", "n_zero"),
          pointers=("seg_start", "seg_end", "seg_mod", "rule_tab", "ws64", "out32"))
    def _prep_kernel(seg_start, seg_end, seg_mod, rule_tab, ws64, out32,
                     n, nseg, n_mod, n_weights, off_first, off_p, off_pp, off_w, off_zero, n_zero,
                     NWP: tl.constexpr, BLOCK_S: tl.constexpr, ZBLOCK: tl.constexpr):
        pid = tl.program_id(0)
        z = pid * ZBLOCK + tl.arange(0, ZBLOCK)
        tl.store(out32 + off_zero + z, tl.zeros([ZBLOCK], tl.int32), mask=z < n_zero)
        if pid == 0:
            n64 = n.to(tl.int64)
            nseg64 = nseg.to(tl.int64)
            stride = nseg64 + 1
            rows = tl.arange(0, NWP)[:, None].to(tl.int64)
            row_ok = rows < n_weights
            carry_p = tl.zeros([NWP], tl.int64)
            carry_pp = tl.zeros([NWP], tl.int64)
            for start in range(0, nseg64 + 1, BLOCK_S):
                s = start + tl.arange(0, BLOCK_S)[None, :].to(tl.int64)
                valid = s < nseg64
                listed = s <= nseg64  # nseg itself is the sentinel: first = n, length 0, weight 0
                first = tl.load(seg_start + s, mask=valid, other=0)
                first = tl.where(valid, first, n64)
                length = tl.load(seg_end + s, mask=valid, other=0) - tl.load(seg_start + s, mask=valid, other=0)
                m = tl.load(seg_mod + s, mask=valid, other=0)
                w = tl.load(rule_tab + rows * (n_mod + 1) + m, mask=row_ok & valid, other=0)
                cp = w * length
                p = carry_p[:, None] + tl.cumsum(cp, 1) - cp
                cpp = length * p + w * (length * (length - 1) // 2)
                pp = carry_pp[:, None] + tl.cumsum(cpp, 1) - cpp
                keep = row_ok & listed
                tl.store(ws64 + off_p + rows * stride + s, p, mask=keep)
                tl.store(ws64 + off_pp + rows * stride + s, pp, mask=keep)
                tl.store(ws64 + off_w + rows * stride + s, w, mask=keep)
                tl.store(ws64 + off_first + s, first, mask=listed)
                carry_p += tl.sum(cp, 1)
                carry_pp += tl.sum(cpp, 1)

    @_jit(ints=("S", "n", "nseg", "nq", "nk", "block_m", "block_n", "n_mod", "big",
                "off_first", "off_p", "off_pp", "off_w", "off_rowc", "off_colc", "off_rowg", "off_colg"),
          pointers=("tok_seg", "seg_start", "seg_end", "seg_mod", "seg_vs", "seg_ve", "rule_tab", "ws64", "out32",
                    "grid"))
    def _classify_kernel(tok_seg, seg_start, seg_end, seg_mod, seg_vs, seg_ve, rule_tab, ws64, out32, grid,
                         S, n, nseg, nq, nk, block_m, block_n, n_mod, big,
                         off_first, off_p, off_pp, off_w, off_rowc, off_colc, off_rowg, off_colg,
                         BLOCK_J: tl.constexpr, GROUP: tl.constexpr, HAS_WINDOW: tl.constexpr):
        """Program (r, c): kv-tiles [c * BLOCK_J, (c + 1) * BLOCK_J) of q-tile row r (BLOCK_J >= GROUP,
        or the row has a single chunk)."""
        r = tl.program_id(0).to(tl.int64)
        chunk = tl.program_id(1).to(tl.int64)
        S = S.to(tl.int64)
        n = n.to(tl.int64)
        nseg = nseg.to(tl.int64)
        nq = nq.to(tl.int64)
        nk = nk.to(tl.int64)
        block_m = block_m.to(tl.int64)
        block_n = block_n.to(tl.int64)
        n_mod = n_mod.to(tl.int64)
        big = big.to(tl.int64)
        stride = nseg + 1
        seg_first = ws64 + off_first
        seg_p = ws64 + off_p
        seg_pp = ws64 + off_pp
        seg_w = ws64 + off_w
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
        tl.store(ws64 + 2 + r, allowed, mask=chunk == 0)

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
            tl.atomic_add(out32 + off_rowc + 3 * r, n_full, sem="relaxed")
            tl.atomic_add(out32 + off_rowc + 3 * r + 1, n_causal, sem="relaxed")
            tl.atomic_add(out32 + off_rowc + 3 * r + 2, n_partial, sem="relaxed")
            tl.atomic_add(out32 + off_rowg + r // GROUP, n_full + n_causal + n_partial, sem="relaxed")
            column = b * nk + j
            ones = tl.full([BLOCK_J], 1, tl.int32)
            tl.atomic_add(out32 + off_colc + column * 3 + tl.where(visited, kind - 1, 0), ones,
                          mask=visited, sem="relaxed")
            # column groups: GROUP consecutive kv-tiles of one batch element (a chunk holds whole groups)
            col_group = b * ((nk + GROUP - 1) // GROUP) + chunk * (BLOCK_J // GROUP)
            if BLOCK_J >= GROUP:
                per_group = tl.sum(tl.reshape(visited.to(tl.int32), (BLOCK_J // GROUP, GROUP)), 1)
                tl.atomic_add(out32 + off_colg + col_group + tl.arange(0, BLOCK_J // GROUP), per_group,
                              mask=per_group > 0, sem="relaxed")
            else:  # the row's only chunk: one group
                tl.atomic_add(out32 + off_colg + col_group, tl.sum(visited.to(tl.int32), 0), sem="relaxed")

    @_jit(ints=("R3", "C3", "R", "off_rowc", "off_colc", "off_bptr"), pointers=("out32", "ws64"))
    def _scan_kernel(out32, ws64, R3, C3, R, off_rowc, off_colc, off_bptr, BLOCK: tl.constexpr):
        """fwd_ptr, bwd_ptr, tile and allowed-pair totals in one program (when the schedules are sized exactly)."""
        lanes = tl.arange(0, BLOCK)
        carry = tl.zeros([], tl.int32)
        for start in range(0, R3, BLOCK):
            at = start + lanes
            v = tl.load(out32 + off_rowc + at, mask=at < R3, other=0)
            tl.store(out32 + 1 + at, carry + tl.cumsum(v, 0), mask=at < R3)
            carry += tl.sum(v, 0)
        tl.store(out32, 0)
        total = carry
        carry = tl.zeros([], tl.int32)
        for start in range(0, C3, BLOCK):
            at = start + lanes
            v = tl.load(out32 + off_colc + at, mask=at < C3, other=0)
            tl.store(out32 + off_bptr + 1 + at, carry + tl.cumsum(v, 0), mask=at < C3)
            carry += tl.sum(v, 0)
        tl.store(out32 + off_bptr, 0)
        allowed = tl.zeros([], tl.int64)
        for start in range(0, R, BLOCK):
            at = start + lanes
            allowed += tl.sum(tl.load(ws64 + 2 + at, mask=at < R, other=0), 0)
        tl.store(ws64, total.to(tl.int64))
        tl.store(ws64 + 1, allowed)

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

    @_jit(ints=("R", "C", "nq", "nk", "off_bptr", "off_rowc", "off_colc", "off_rowg", "off_colg"),
          pointers=("grid", "ptrs", "ws64", "fwd_kv", "bwd_q"))
    def _schedule_kernel(grid, ptrs, ws64, fwd_kv, bwd_q, R, C, nq, nk, off_bptr, off_rowc, off_colc, off_rowg, off_colg,
                         BLOCK: tl.constexpr, GROUP: tl.constexpr, FUSED_SCAN: tl.constexpr):
        """Program r < R: the forward schedule of q-tile row r; program R + c: the backward one of kv-tile column c.

        FUSED_SCAN: find the offsets (and write fwd_ptr / bwd_ptr and the totals) here; else read
        them from the pointers _scan_kernel wrote."""
        pid = tl.program_id(0).to(tl.int64)
        nq = nq.to(tl.int64)
        nk = nk.to(tl.int64)
        lanes = tl.arange(0, BLOCK).to(tl.int64)
        if pid < R:  # forward: q-tile row r lists its kv-tiles
            r = pid
            if FUSED_SCAN:
                f, c, p, end = _offsets(ptrs + off_rowc, ptrs + off_rowg, r // GROUP, r // GROUP * GROUP, r, R, ptrs,
                                        BLOCK, GROUP)
                tl.store(ws64, end.to(tl.int64), mask=r == R - 1)
                allowed = tl.zeros([], tl.int64)
                for start in range(0, tl.where(r == 0, R, 0), BLOCK):
                    at = start + lanes
                    allowed += tl.sum(tl.load(ws64 + 2 + at, mask=at < R, other=0), 0)
                tl.store(ws64 + 1, allowed, mask=r == 0)
            else:
                f = tl.load(ptrs + 3 * r)
                c = tl.load(ptrs + 3 * r + 1)
                p = tl.load(ptrs + 3 * r + 2)
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
                f, c, p, end = _offsets(ptrs + off_colc, ptrs + off_colg, group, col - j % GROUP, col, C,
                                        ptrs + off_bptr, BLOCK, GROUP)
            else:
                f = tl.load(ptrs + off_bptr + 3 * col)
                c = tl.load(ptrs + off_bptr + 3 * col + 1)
                p = tl.load(ptrs + off_bptr + 3 * col + 2)
            for start in range(0, nq, BLOCK):
                i = start + lanes
                kind = tl.load(grid + (b * nq + i) * nk + j, mask=i < nq, other=0)
                f, c, p = _emit(kind, i.to(tl.int32), f, c, p, bwd_q)
