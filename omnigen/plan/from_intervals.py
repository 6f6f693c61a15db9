"""`mask_from_intervals`: FlashMask's column-wise masked intervals as a `Mask`, in O(S) memory.

Key column j is hidden from the query rows in [lts[j], lte[j]) and in [uts[j], ute[j]); with uts / ute left out the
mask is also causal (FlashMask's causal mode: rows q < j hidden too). So each column's hidden rows are a union of at
most three intervals, and the number of visible rows of any row range is closed-form (inclusion-exclusion over
interval overlaps).

Classification. Per kv-tile, the min and max of each vector over its columns (O(S)) decide most tiles outright: a
tile is sure full when no column's interval can reach its rows (every start >= its last row + 1, or every end <= its
first row) and, causal, it lies on or below the diagonal; sure empty when one interval covers its rows in every
column, or, causal, it lies above the diagonal. The tiles these bounds leave open (the ones the mask's edges cross)
are counted exactly column by column (O(block_n) each): allowed pairs, those above the diagonal, those missing
below it -- so a full tile is never called partial. Partial tiles' blocks are evaluated from the vectors, a chunk
at a time, once, and packed to both schedules' bits right away (`omnigen.plan.ruleless`: ShapePlan.packed). Counts
stay on the device: the host waits for the open tiles and once more per tile shape.
"""

from __future__ import annotations

from typing import Iterable

import torch

from ..errors import InputError, type_name
from ..semantics import EMPTY, FULL, PARTIAL
from .masks import Mask
from .planners import _check_device
from .ruleless import (ShapePlan, check_capacity_choice, kinds_from_counts, positions_of, ruleless_mask, tile_area,
                       tile_shapes)
from .tile_bits import pack

# Column evaluations (undecided tiles x block_n) and pairs (partial tiles x block_m x block_n) per chunk.
CHUNK_ELEMENTS = 1 << 22

NAMES = ("lts", "lte", "uts", "ute")


def interval_problems(vectors: dict[str, object]) -> list[str]:
    """Every problem of FlashMask's vectors (the given ones: lts, lte and optionally uts, ute)."""
    problems = []
    given = {name: v for name, v in vectors.items() if v is not None}
    if ("uts" in given) != ("ute" in given):
        have, missing = ("uts", "ute") if "uts" in given else ("ute", "uts")
        problems.append(f"{have} is given without {missing}: pass both (the upper masked interval [uts, ute), "
                        "bidirectional) or neither (causal mode)")
    tensors = {}
    for name, v in given.items():
        if not isinstance(v, torch.Tensor):
            problems.append(f"{name} must be an integer torch.Tensor [B, S], not {type_name(v)} (convert it with "
                            f"torch.as_tensor({name}))")
        elif v.dtype == torch.bool or v.is_floating_point() or v.is_complex():
            problems.append(f"{name} must hold integer row indices, not {v.dtype} (convert with {name}.long())")
        elif v.dim() not in (1, 2):
            problems.append(f"{name} must be [B, S] (or [S]), got shape {tuple(v.shape)}; FlashMask's "
                            f"startend_row_indices [B, 1, S, k] holds the vectors as [:, 0, :, i]")
        elif v.shape[-1] == 0:
            problems.append(f"{name} is empty (shape {tuple(v.shape)}): it needs at least one token")
        else:
            tensors[name] = v
    if len(tensors) < len(given):
        return problems
    shapes = {tuple(v.shape) for v in tensors.values()}
    if len(shapes) > 1:
        problems.append("lts, lte, uts and ute must have one shape, got " +
                        ", ".join(f"{n} {tuple(v.shape)}" for n, v in tensors.items()))
        return problems
    devices = {v.device for v in tensors.values()}
    if len(devices) > 1:
        problems.append("lts, lte, uts and ute must be on one device, got " +
                        ", ".join(f"{n} on {v.device}" for n, v in tensors.items()))
        return problems
    S = next(iter(shapes))[-1]
    # Every check counted on the device and read at once (one host wait); the first bad entry is looked up only for a
    # check that failed.
    out_of_range = {name: (v < 0) | (v > S) for name, v in tensors.items()}
    order = {(start, end): tensors[start] > tensors[end] for start, end in (("lts", "lte"), ("uts", "ute"))
             if start in tensors and end in tensors}
    checks = [bad.sum() for bad in [*out_of_range.values(), *order.values()]]
    counts = torch.stack(checks).tolist() if checks else []
    for (name, bad), count in zip(out_of_range.items(), counts):
        if count:
            where = tuple(bad.nonzero()[0].tolist())
            problems.append(f"{name} must hold row indices in [0, S] = [0, {S}]: {name}{list(where)} = "
                            f"{int(tensors[name][where])} ({count} entries out of range)")
    for ((start, end), bad), count in zip(order.items(), counts[len(out_of_range):]):
        if count and not any(n in p for p in problems for n in (start, end)):
            where = tuple(bad.nonzero()[0].tolist())
            problems.append(f"{start} must be <= {end} (the masked rows of a column are [{start}, {end}); equal "
                            f"means none): at {list(where)} {start} = {int(tensors[start][where])} > {end} = "
                            f"{int(tensors[end][where])} ({count} columns)")
    return problems


class _Intervals:
    """The vectors as int64 [B, S] on the planning device, empty intervals moved to [S, S) (so bounds ignore them);
    an absent upper interval is empty everywhere; `causal`: rows above the diagonal hidden too."""

    def __init__(self, lts: torch.Tensor, lte: torch.Tensor, uts: torch.Tensor | None, ute: torch.Tensor | None,
                 device: torch.device) -> None:
        def prepared(v: torch.Tensor) -> torch.Tensor:
            v = v.to(device=device, dtype=torch.int64)
            return v[None] if v.dim() == 1 else v

        self.batched = lts.dim() == 2
        self.causal = uts is None
        lo, hi = prepared(lts), prepared(lte)
        self.B, self.S = lo.shape
        full = torch.full_like(lo, self.S)
        if uts is None:
            up_lo, up_hi = full, full
        else:
            up_lo, up_hi = prepared(uts), prepared(ute)
        none, none_up = lo >= hi, up_lo >= up_hi
        self.lo, self.hi = torch.where(none, full, lo), torch.where(none, full, hi)
        self.up_lo, self.up_hi = torch.where(none_up, full, up_lo), torch.where(none_up, full, up_hi)
        self.device = device

    # -- exact evaluation ------------------------------------------------------------------------------------

    def columns(self, b: torch.Tensor, j: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The intervals of columns j (any shape, < S) of elements b: lower, upper, causal (rows [0, j) or none)."""
        causal_hi = j if self.causal else torch.zeros_like(j)
        return (self.lo[b, j], self.hi[b, j], self.up_lo[b, j], self.up_hi[b, j], torch.zeros_like(j), causal_hi)

    @staticmethod
    def hidden(x: torch.Tensor, y: torch.Tensor, intervals: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Rows of [x, y) hidden by the union of three intervals (inclusion-exclusion over their overlaps)."""
        a0, a1, u0, u1, c0, c1 = intervals

        def overlap(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
            return (torch.minimum(hi, y) - torch.maximum(lo, x)).clamp(min=0)

        return (overlap(a0, a1) + overlap(u0, u1) + overlap(c0, c1)
                - overlap(torch.maximum(a0, u0), torch.minimum(a1, u1))
                - overlap(torch.maximum(a0, c0), torch.minimum(a1, c1))
                - overlap(torch.maximum(u0, c0), torch.minimum(u1, c1))
                + overlap(torch.maximum(torch.maximum(a0, u0), c0), torch.minimum(torch.minimum(a1, u1), c1)))

    def allowed(self, b: torch.Tensor, q: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        """Whether query q may attend to key j (broadcasting; positions at or past S: False)."""
        inside = (q < self.S) & (j < self.S)
        q, j = q.clamp(max=self.S - 1), j.clamp(max=self.S - 1)
        lo, hi, up_lo, up_hi = (v[b, j] for v in (self.lo, self.hi, self.up_lo, self.up_hi))
        ok = inside & ~((lo <= q) & (q < hi)) & ~((up_lo <= q) & (q < up_hi))
        return ok & (q >= j) if self.causal else ok

    # -- tiles -----------------------------------------------------------------------------------------------

    def bounds(self, block_n: int) -> dict[str, torch.Tensor]:
        """Per kv-tile [B, nk]: min and max of each vector over the tile's columns (O(S))."""
        nk = -(-self.S // block_n)
        pad = nk * block_n - self.S
        out = {}
        for name, v in (("lo", self.lo), ("hi", self.hi), ("up_lo", self.up_lo), ("up_hi", self.up_hi)):
            low = torch.nn.functional.pad(v, (0, pad), value=self.S).view(self.B, nk, block_n)  # past S: neutral
            high = torch.nn.functional.pad(v, (0, pad), value=0).view(self.B, nk, block_n)
            out[name + "_min"], out[name + "_max"] = low.amin(-1), high.amax(-1)
        return out

    def exact_counts(self, b: torch.Tensor, i: torch.Tensor, jt: torch.Tensor, block_m: int,
                     block_n: int) -> tuple[torch.Tensor, ...]:
        """(allowed, above the diagonal, missing on or below it) of tiles (b, q-tile i, kv-tile jt), each [n]."""
        j = jt[:, None] * block_n + torch.arange(block_n, device=self.device)[None, :]  # [n, block_n]
        real = j < self.S
        jc = j.clamp(max=self.S - 1)
        intervals = self.columns(b[:, None], jc)
        r0 = (i * block_m)[:, None]
        r1 = (r0 + block_m).clamp(max=self.S)

        def visible(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            y = torch.maximum(x, y)
            return (y - x) - self.hidden(x, y, intervals)

        split = jc.clamp(min=r0, max=r1)  # rows [r0, split) are above the diagonal (q < j), [split, r1) on/below
        allowed = torch.where(real, visible(r0, r1), 0).sum(1)
        above = torch.where(real, visible(r0, split), 0).sum(1)
        below_missing = torch.where(real, (r1 - split) - visible(split, r1), 0).sum(1)
        return allowed, above, below_missing

    def plan(self, block_m: int, block_n: int) -> ShapePlan:
        S, B = self.S, self.B
        nq, nk = -(-S // block_m), -(-S // block_n)
        device = self.device
        bound = {name: v[:, None, :] for name, v in self.bounds(block_n).items()}  # [B, 1, nk]
        r0 = (torch.arange(nq, device=device) * block_m)[None, :, None]
        r1 = (r0 + block_m).clamp(max=S)
        c0 = (torch.arange(nk, device=device) * block_n)[None, None, :]
        c_last = (c0 + block_n).clamp(max=S) - 1
        no_lower = (bound["lo_min"] >= r1) | (bound["hi_max"] <= r0)
        no_upper = (bound["up_lo_min"] >= r1) | (bound["up_hi_max"] <= r0)
        on_or_below = c_last <= r0 if self.causal else torch.ones_like(no_lower)
        sure_full = no_lower & no_upper & on_or_below
        sure_empty = (((bound["lo_max"] <= r0) & (bound["hi_min"] >= r1))
                      | ((bound["up_lo_max"] <= r0) & (bound["up_hi_min"] >= r1)))
        if self.causal:
            sure_empty |= r1 - 1 < c0
        kinds = torch.full((B, nq, nk), PARTIAL, dtype=torch.int8, device=device)
        kinds[sure_full] = FULL
        kinds[sure_empty & ~sure_full] = EMPTY
        area = tile_area(S, block_m, block_n, device).expand(B, nq, nk)
        pairs = area[sure_full & ~sure_empty].sum()  # on the device: the host reads it once, below
        open_tiles = (~(sure_full | sure_empty)).nonzero()  # [n, 3]: (b, i, jt)
        step = max(1, CHUNK_ELEMENTS // block_n)
        for first in range(0, open_tiles.shape[0], step):
            b, i, jt = open_tiles[first : first + step].unbind(1)
            allowed, above, missing = self.exact_counts(b, i, jt, block_m, block_n)
            kinds[b, i, jt] = kinds_from_counts(allowed, above, missing, area[b, i, jt])
            pairs = pairs + allowed.sum()
        partial = kinds == PARTIAL
        pairs, count = torch.stack([pairs, partial.sum()]).tolist()  # the one wait after the open tiles'
        return ShapePlan(block_m, block_n, kinds, pairs, [], packed=self._packed(partial, count, block_m, block_n),
                         partial_count=count)

    def _packed(self, partial: torch.Tensor, count: int, block_m: int,
                block_n: int) -> list[tuple[torch.Tensor, ...]]:
        """The partial tiles' blocks evaluated from the vectors a chunk at a time, each packed to both schedules' bits
        right away (ShapePlan.packed): evaluated once, held as bits only."""
        where = positions_of(partial.reshape(-1), count)
        _, nq, nk = partial.shape
        step = max(1, CHUNK_ELEMENTS // (block_m * block_n))
        rows = torch.arange(block_m, device=self.device)[None, :, None]
        cols = torch.arange(block_n, device=self.device)[None, None, :]
        out = []
        for first in range(0, count, step):
            flat = where[first : first + step]
            b, i, j = flat // (nq * nk), flat // nk % nq, flat % nk
            q = i[:, None, None] * block_m + rows
            k = j[:, None, None] * block_n + cols
            blocks = self.allowed(b[:, None, None], q, k)
            out.append((b, i, j, pack(blocks), pack(blocks, transposed=True)))
        return out


def mask_from_intervals(
    lts: torch.Tensor,
    lte: torch.Tensor,
    uts: torch.Tensor | None = None,
    ute: torch.Tensor | None = None,
    *,
    device: torch.device | str | None = None,
    head_dim: int | None = None,
    dtype: torch.dtype | None = None,
    tiles: Iterable[tuple[int, int]] | None = None,
    partial_bits: int | str = "exact",
) -> Mask:
    """A `Mask` from FlashMask's column-wise masked intervals, integer tensors [B, S] (or [S]).

    Key column j is hidden from query rows in [lts[j], lte[j]) and in [uts[j], ute[j]); with uts and ute left out the
    mask is also causal (FlashMask's causal mode). An interval with start == end hides nothing. O(S) memory besides
    the partial tiles' bits; tiles classified exactly. `device` (default: the vectors'), `tiles`, `head_dim`, `dtype`,
    `partial_bits`: as for `omnigen.mask_from_dense`."""
    problems = interval_problems({"lts": lts, "lte": lte, "uts": uts, "ute": ute})
    if problems:
        raise InputError(problems)
    check_capacity_choice(partial_bits)
    device = _check_device(device) if device is not None else lts.device
    intervals = _Intervals(lts, lte, uts, ute, device)
    shapes = tile_shapes(intervals.S, device, tiles, head_dim, dtype)
    plans = [intervals.plan(m, n) for m, n in shapes]
    return ruleless_mask(plans, intervals.B, intervals.S, intervals.batched, device, partial_bits,
                        made_by="mask_from_intervals")
