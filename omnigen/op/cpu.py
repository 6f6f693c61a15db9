"""Attention on the CPU: what `omnigen::attention` and `omnigen::attention_backward` run for CPU tensors.

For tests and debugging (a model that calls omnigen, unit-tested on a laptop or in CPU CI), not for speed:
it is plain PyTorch, a Python loop over q-tiles. It walks a mask's forward schedule the way the kernels do --
empty tiles are never visited, full tiles get no mask work, causal tiles one compare, partial tiles the
rules' predicate (`omnigen.semantics.tile_predicate`), or, for a mask made from data (`plan.ruleless`: no rules
to evaluate), the tile's bits from the mask (`tile_bits.unpack` of the forward schedule's slots) -- and keeps memory at O(S * D) plus a bounded chunk of
scores: per q-tile an online softmax over its kv-tiles, never an S x S tensor. Consecutive kv-tiles of one
kind are taken as one span (up to `CHUNK_ELEMENTS` scores at a time), which suits a CPU best:
fewer, larger matrix products.

Accumulation is in float32 (float64 for float64 inputs); the outputs come back in the inputs' dtype, the
log-sum-exp in float32 as on CUDA. The backward recomputes each span's probabilities from the saved
log-sum-exp, the same q-tile walk (dQ per q-tile, dK and dV accumulated per span), so it too stays at
O(S * D). GQA: a kv head's group of query heads is one matrix of g * block_m rows, so K and V are never
repeated per query head.

`schedules` below is anything with a plan's attributes: `block_m`, `block_n`, `fwd_ptr`, `fwd_kv`, `batch_size`,
`seq_len`, and `tables` (the per-token segment, modality and document tables) -- an `omnigen.plan.Plan` or the
op's `library.Schedules`; for a mask made from data also `partial_slot` and `partial_bits` (the op's Schedules).
The backward reads the forward schedule's bits too (it walks q-tiles, as the forward does).
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from ..kernels import heads_inner
from ..plan.bits import slot_words
from ..plan.ruleless import is_ruleless
from ..plan.tile_bits import unpack
from ..semantics import CAUSAL, FULL, SCHEDULE_KINDS, rule_tensors, tile_predicate

# The dtypes this path takes; the kernels take only the half-precision ones.
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
# The tile shape a plain layout is planned with for this path: 128 query rows keep the Python loop short at
# long S, and full runs of kv-tiles are merged into spans anyway, so block_n matters little.
TILE = (128, 128)
# Scores one span may hold (all query heads of a q-tile times the span's keys): 4 MiB in float32. Spans of
# more kv-tiles are cut; a single tile is never cut, so the bound is max(this, Hq * block_m * block_n).
CHUNK_ELEMENTS = 1 << 20

Span = tuple[int, int, int]  # (tile kind, first key, one past the last key)


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _rows(schedules: Any, heads: int) -> Iterator[tuple[int, int, int, list[Span]]]:
    """(batch element, first query, one past the last, spans) for every q-tile, those that visit nothing included
    (their rows are written too: every output element is written, none is left to an allocation's fill).

    A span is a run of consecutive kv-tiles of one kind in the q-tile's schedule, cut to CHUNK_ELEMENTS scores.
    Found with a few vectorised passes over the schedule, so the Python loop runs per span, not per tile."""
    bm, bn, S = schedules.block_m, schedules.block_n, schedules.seq_len
    nq = -(-S // bm)
    groups = 3 * schedules.batch_size * nq  # (q-tile row, kind) groups of the CSR schedule
    ptr = schedules.fwd_ptr[: groups + 1].long()
    total = int(ptr[-1])
    kv = schedules.fwd_kv[:total].long()  # a mask's buffers may be longer than its plan
    group = torch.repeat_interleave(torch.arange(groups), ptr[1:] - ptr[:-1])
    starts_run = torch.ones(total, dtype=torch.bool)
    starts_run[1:] = (kv[1:] != kv[:-1] + 1) | (group[1:] != group[:-1])
    first = starts_run.nonzero().squeeze(1)
    last = torch.cat([first[1:], torch.tensor([total])]) - 1
    most = max(1, CHUNK_ELEMENTS // (heads * bm * bn))  # kv-tiles per span
    spans: list[list[Span]] = [[] for _ in range(groups // 3)]
    runs = zip(group[first].tolist(), kv[first].tolist(), kv[last].tolist()) if total else ()  # all pad: no runs
    for g, j0, j1 in runs:
        row, kind = divmod(g, 3)
        for a in range(j0, j1 + 1, most):
            spans[row].append((SCHEDULE_KINDS[kind], a * bn, min((min(j1, a + most - 1) + 1) * bn, S)))
    for row, found in enumerate(spans):
        b, i = divmod(row, nq)
        yield b, i * bm, min((i + 1) * bm, S), found


class _Masker:
    """Masks a span's scores in place by its kind: nothing for full, one compare for causal, for partial the rules'
    predicate (from the per-token tables) or, for a mask made from data, its tiles' bits."""

    def __init__(self, rules: Any, schedules: Any) -> None:
        self.rules, self.tables = rules, schedules.tables
        self.from_bits = is_ruleless(rules)
        if self.from_bits:
            self.bits = _PartialBits(schedules)
        else:
            self.rule_t = rule_tensors(rules, "cpu")

    def apply_(self, scores: torch.Tensor, kind: int, b: int, r0: int, r1: int, c0: int, c1: int) -> None:
        if kind == FULL:
            return
        rows = torch.arange(r0, r1)
        cols = torch.arange(c0, c1)
        if kind == CAUSAL:
            allowed = cols[None, :] <= rows[:, None]
        elif self.from_bits:
            allowed = self.bits.span(b, r0, r1, c0, c1)
        else:
            allowed = tile_predicate(self.rules, self.tables, b, rows, cols, self.rule_t)
        heads = scores.shape[0]
        scores.view(heads, -1, r1 - r0, c1 - c0).masked_fill_(~allowed, float("-inf"))


class _PartialBits:
    """The partial tiles of a mask made from data, read back from its forward schedule's bits.

    Slot s holds the s-th partial entry of the forward schedule (`plan.bits`): q-tile row r's partial kv-tiles are
    slots partial_slot[r] onwards, in the (ascending) order of the row's partial group. A span is a run of
    consecutive kv-tiles of that group, so its slots are consecutive too: found by one search in the row's group."""

    def __init__(self, schedules: Any) -> None:
        self.block_m, self.block_n = schedules.block_m, schedules.block_n
        self.nq = -(-schedules.seq_len // self.block_m)
        self.ptr = schedules.fwd_ptr.long()
        self.kv = schedules.fwd_kv.long()
        self.starts = schedules.partial_slot.long()
        self.words = schedules.partial_bits
        self.per_slot = slot_words(self.block_m, self.block_n)
        self.slots = self.words.numel() // self.per_slot

    def span(self, b: int, r0: int, r1: int, c0: int, c1: int) -> torch.Tensor:
        """bool [r1 - r0, c1 - c0]: the mask on queries [r0, r1) x keys [c0, c1), a run of partial tiles of one row."""
        bm, bn = self.block_m, self.block_n
        row = b * self.nq + r0 // bm
        first, last = int(self.ptr[3 * row + 2]), int(self.ptr[3 * row + 3])
        j0, n = c0 // bn, -(-(c1 - c0) // bn)
        at = int(torch.searchsorted(self.kv[first:last], j0))
        slot = int(self.starts[row]) + at
        if slot + n > self.slots:
            raise ValueError(f"omnigen::attention: the mask made from data holds bits for {self.slots} partial tiles "
                             f"but its schedule has more ({bm}x{bn} tiles, q-tile row {row}); make it again with "
                             "partial_bits='exact' (the default)")
        tiles = unpack(self.words[slot * self.per_slot : (slot + n) * self.per_slot], bm, bn)  # [n, bm, bn]
        return tiles.permute(1, 0, 2).reshape(bm, n * bn)[: r1 - r0, : c1 - c0]


def _empty(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    """An output buffer whose every element the walk writes (tests fill it with NaN to prove that). [B, H, S, D]
    ones in the ops' output layout (`heads_inner`), so the op returns them without another copy."""
    if len(shape) == 4:
        return heads_inner(*shape, dtype=dtype, device=torch.device("cpu"))
    return torch.empty(*shape, dtype=dtype)


def _group_rows(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[Hq, m, D] -> [Hkv, g * m, D]: a kv head's query heads stacked, so one product serves the group."""
    return x.reshape(kv_heads, -1, x.shape[-1])


def forward(rules: Any, schedules: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, Hq, S, D] in q's dtype, lse [B, Hq, S] float32): masked attention over the schedule's tiles.

    Rows that see no key (no visited tile, or every visited key masked) give zeros and -inf, never NaN."""
    B, Hq, S, D = q.shape
    Hkv = k.shape[1]
    acc = _accumulator(q.dtype)
    qc, kc, vc = (t.detach().to(acc) for t in (q, k, v))
    out = _empty(B, Hq, S, D, dtype=q.dtype)
    lse = _empty(B, Hq, S, dtype=torch.float32)
    masker = _Masker(rules, schedules)
    with torch.no_grad():
        for b, r0, r1, spans in _rows(schedules, Hq):
            qb = _group_rows(qc[b, :, r0:r1] * scale, Hkv)
            rows = qb.shape[1]
            row_max = torch.full((Hkv, rows), float("-inf"), dtype=acc)
            row_sum = torch.zeros(Hkv, rows, dtype=acc)
            o = torch.zeros(Hkv, rows, D, dtype=acc)
            for kind, c0, c1 in spans:
                s = torch.matmul(qb, kc[b, :, c0:c1].transpose(-1, -2))
                masker.apply_(s, kind, b, r0, r1, c0, c1)
                new_max = torch.maximum(row_max, s.amax(-1))
                # A row every key of which is masked so far keeps max -inf; subtracting 0 leaves exp(-inf) = 0.
                safe = new_max.masked_fill(new_max == float("-inf"), 0.0)
                p = s.sub_(safe.unsqueeze(-1)).exp_()
                alpha = (row_max - safe).exp_()
                row_sum.mul_(alpha).add_(p.sum(-1))
                o.mul_(alpha.unsqueeze(-1)).baddbmm_(p, vc[b, :, c0:c1])
                row_max = new_max
            seen = row_sum > 0
            o.mul_(torch.where(seen, row_sum.reciprocal(), 0.0).unsqueeze(-1))
            out[b, :, r0:r1] = o.view(Hq, r1 - r0, D)
            row_lse = torch.where(seen, row_max + row_sum.log(), float("-inf"))
            lse[b, :, r0:r1] = row_lse.view(Hq, r1 - r0)
    return out, lse


def backward(rules: Any, schedules: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             lse: torch.Tensor, d_out: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) in the inputs' dtypes: the same walk as `forward`, each span's probabilities
    recomputed from `lse` (no stored attention matrix); rows of lse -inf get zero gradients."""
    B, Hq, S, D = q.shape
    Hkv = k.shape[1]
    acc = _accumulator(q.dtype)
    qc, kc, vc = (t.detach().to(acc) for t in (q, k, v))
    dq = _empty(B, Hq, S, D, dtype=acc)
    dk, dv = (_empty(B, Hkv, S, D, dtype=acc).zero_() for _ in range(2))  # accumulated span by span
    masker = _Masker(rules, schedules)
    with torch.no_grad():
        for b, r0, r1, spans in _rows(schedules, Hq):
            qs = _group_rows(qc[b, :, r0:r1] * scale, Hkv)  # scaled once: S = qs K^T and dK = dS^T qs
            dob = _group_rows(d_out[b, :, r0:r1].to(acc), Hkv)
            neg_delta = -(dob * _group_rows(out[b, :, r0:r1].to(acc), Hkv)).sum(-1, keepdim=True)  # -rowsum(dO*O)
            neg_lse = -lse[b, :, r0:r1].to(acc).reshape(Hkv, -1, 1)
            # An empty row (lse -inf) has every visited score masked: -inf, never -inf + inf, so p = 0 and no NaN.
            neg_lse.masked_fill_(neg_lse == float("inf"), float("-inf"))
            dqb = torch.zeros_like(qs)
            for kind, c0, c1 in spans:
                ks, vs = kc[b, :, c0:c1], vc[b, :, c0:c1]
                s = torch.baddbmm(neg_lse, qs, ks.transpose(-1, -2))  # S - lse, the subtraction inside the product
                masker.apply_(s, kind, b, r0, r1, c0, c1)
                p = s.exp_()
                dv[b, :, c0:c1].baddbmm_(p.transpose(-1, -2), dob)
                ds = torch.baddbmm(neg_delta, dob, vs.transpose(-1, -2)).mul_(p)  # P * (dO V^T - delta)
                dk[b, :, c0:c1].baddbmm_(ds.transpose(-1, -2), qs)
                dqb.baddbmm_(ds, ks)
            dq[b, :, r0:r1] = dqb.mul_(scale).view(Hq, r1 - r0, D)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
