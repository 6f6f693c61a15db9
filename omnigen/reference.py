"""References: the pair-by-pair mask oracle, float64 attention, and a CPU emulator of the kernels' tile loop.

`allowed_pair` is the mask's definition (docs/semantics.md) read literally, one pair at a time, from
the segments: the oracle the vectorised code is tested against (`omnigen.semantics.tile_predicate`,
the predicate the generated kernels evaluate on partial tiles).
The emulator walks a `Plan`'s schedules exactly as a kernel does (online softmax forward;
dK/dV per kv-tile over the backward schedule, dQ accumulated), so a wrong plan gives a wrong
emulated result.
"""

from __future__ import annotations

import math

import torch

from .errors import InputError, tensor_problem, type_name
from .layout import AnyLayout, Layout, as_layout
from .semantics import CAUSAL, FULL, PARTIAL, SCHEDULE_KINDS, rule_tensors, tile_predicate
from .plan import Plan
from .rules import PAD, Rules

# --------------------------------------------------------------------------------------------
# masks


def allowed_pair(rules: Rules, layout: Layout, q: int, k: int) -> bool:
    """The mask's definition (docs/semantics.md), literally, for one (query, key) pair. Slow; the oracle for tests."""
    starts = layout.starts()
    seg_q = max(i for i, s in enumerate(starts) if s <= q)
    seg_k = max(i for i, s in enumerate(starts) if s <= k)
    a, c = layout.segments[seg_q], layout.segments[seg_k]
    if a.modality == PAD or c.modality == PAD:
        return False
    if rules.documents == "isolated" and a.doc != c.doc:
        return False
    if seg_q == seg_k:
        ok = k <= q if rules.modality(a.modality).self == "causal" else True
    elif seg_k < seg_q:
        ok = rules.see_policy(a.modality, c.modality) in ("earlier", "all")
    else:
        ok = rules.see_policy(a.modality, c.modality) == "all"
    window = rules.modality(a.modality).window
    if ok and window > 0:
        ok = q - k < window
    return ok


# --------------------------------------------------------------------------------------------
# float64 attention


def _expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x.repeat_interleave(heads // x.shape[1], dim=1) if x.shape[1] != heads else x


def attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: "torch.Tensor | AnyLayout | str",
    rules: "Rules | float | None" = None, scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked attention in float64: (out [B, Hq, S, D], lse [B, Hq, S]); rows with no key give 0 and -inf.

    Runs wherever the tensors are (the CPU included). `mask` is a dense boolean mask [S, S] or
    [B, S, S], or a layout (an omnigen Layout, a LayoutBatch or a string like "text:40 image:256")
    together with its `rules`, e.g. `attention_reference(q, k, v, "text:40 image:256", rules)`.
    A number in `rules`' place is taken as `scale` (the older positional form). Differentiable
    (gradients of empty rows are zero, never NaN). Bad arguments: an `InputError` listing every problem.
    """
    if isinstance(rules, (int, float)) and not isinstance(rules, bool):
        rules, scale = None, rules
    mask = _reference_mask(q, k, v, mask, rules, scale)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    q64, k64, v64 = q.double(), _expand_kv(k.double(), q.shape[1]), _expand_kv(v.double(), q.shape[1])
    mask = mask.to(q.device)
    mask = (mask if mask.dim() == 3 else mask[None])[:, None]  # [B or 1, 1, S, S]
    scores = torch.matmul(q64, k64.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    row_max = scores.amax(-1, keepdim=True).detach()
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    p = torch.exp(scores - row_max)
    denom = p.sum(-1, keepdim=True)
    has_key = denom > 0
    out = torch.matmul(p, v64) / torch.where(has_key, denom, torch.ones_like(denom))
    lse = torch.where(has_key, torch.log(torch.where(has_key, denom, torch.ones_like(denom))) + row_max,
                      torch.full_like(denom, float("-inf")))
    return out, lse.squeeze(-1)


def _reference_mask(q, k, v, mask, rules, scale) -> torch.Tensor:
    """The dense boolean mask the reference applies; every problem of the arguments at once (InputError)."""
    problems = [p for p in (tensor_problem(name, t, device="any") for name, t in (("q", q), ("k", k), ("v", v))) if p]
    shapes_ok = not problems
    if shapes_ok:
        B, Hq, S, D = q.shape
        if k.shape != v.shape:
            problems.append(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
        elif k.shape[0] != B or k.shape[2] != S or k.shape[3] != D:
            problems.append(f"k/v shape {tuple(k.shape)} does not match q shape {tuple(q.shape)} in B, S or D")
        elif k.shape[1] < 1 or Hq % k.shape[1]:
            problems.append(f"q heads ({Hq}) must be a multiple of k/v heads ({k.shape[1]})")
    if rules is not None and not isinstance(rules, Rules):
        problems.append(f"rules must be omnigen.Rules (or a number: the scale), not {type_name(rules)}")
        rules = None
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale <= 0):
        problems.append(f"scale must be a positive number (default 1/sqrt(head dim)), got {scale!r}")
    dense = None
    if isinstance(mask, torch.Tensor):
        if mask.dtype != torch.bool or mask.dim() not in (2, 3) or mask.shape[-1] != mask.shape[-2]:
            problems.append(f"mask must be a torch.bool tensor [S, S] or [B, S, S] (or a layout with its rules), "
                            f"got {mask.dtype} of shape {tuple(mask.shape)}")
        else:
            dense = mask
    else:
        try:
            layout = as_layout(mask, name="mask")
        except (TypeError, ValueError) as exc:
            problems.append(f"{exc} (or a dense torch.bool mask [S, S])")
        else:
            if rules is None:
                problems.append("a layout as the mask needs its rules: attention_reference(q, k, v, layout, rules)")
            else:
                missing = layout.modalities - set(rules.modality_names) - {PAD}
                if missing:
                    problems.append(f"layout uses modalities {sorted(missing)} that the rules '{rules.name}' do not "
                                    f"declare (declared: {', '.join(rules.modality_names)})")
                else:
                    dense = rules.dense_mask(layout)
    if dense is not None and shapes_ok:
        B, S = q.shape[0], q.shape[2]
        if dense.shape[-1] != S:
            problems.append(f"the mask covers {dense.shape[-1]} tokens but q/k/v have sequence length {S}")
        elif dense.dim() == 3 and dense.shape[0] not in (1, B):
            problems.append(f"the mask has {dense.shape[0]} batch elements but q has batch {B}")
    if problems:
        raise InputError(problems)
    return dense


def attention_reference_grads(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: "torch.Tensor | AnyLayout | str", d_out: torch.Tensor,
    scale: float | None = None, rules: Rules | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) in float64 for upstream gradient d_out; `mask` as in `attention_reference`."""
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    out, _ = attention_reference(q64, k64, v64, mask, rules, scale)
    return torch.autograd.grad(out, (q64, k64, v64), d_out.double())


# --------------------------------------------------------------------------------------------
# kernel emulator


class _TileMasks:
    """The per-kind masking a kernel applies, for one plan."""

    def __init__(self, rules: Rules, plan: Plan):
        self.rules, self.plan = rules, plan
        self.rule_t = rule_tensors(rules, plan.device)

    def rows(self, tile: int) -> torch.Tensor:
        start = tile * self.plan.block_m
        return torch.arange(start, min(start + self.plan.block_m, self.plan.seq_len), device=self.plan.device)

    def cols(self, tile: int) -> torch.Tensor:
        start = tile * self.plan.block_n
        return torch.arange(start, min(start + self.plan.block_n, self.plan.seq_len), device=self.plan.device)

    def apply(self, scores: torch.Tensor, kind: int, batch: int, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        if kind == FULL:
            return scores  # the full path does no mask work at all
        if kind == CAUSAL:
            allowed = cols[None, :] <= rows[:, None]
        else:
            assert kind == PARTIAL
            allowed = tile_predicate(self.rules, self.plan.tables, batch, rows, cols, self.rule_t)
        return scores.masked_fill(~allowed, float("-inf"))


def _groups(ptr: list[int], row: int):
    for g, kind in enumerate(SCHEDULE_KINDS):
        yield kind, ptr[3 * row + g], ptr[3 * row + g + 1]


def emulate_forward(
    rules: Rules, plan: Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward kernel's tile loop in float32: (out, lse) like `attention_reference`."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    B, H, S, D = q.shape
    masks = _TileMasks(rules, plan)
    qf, kf, vf = q.float(), _expand_kv(k.float(), H), _expand_kv(v.float(), H)
    out = torch.zeros(B, H, S, D, dtype=torch.float32, device=q.device)
    lse = torch.full((B, H, S), float("-inf"), dtype=torch.float32, device=q.device)
    ptr, kv_index = plan.fwd_ptr.tolist(), plan.fwd_kv.tolist()
    nq = plan.num_q_tiles
    for row in range(B * nq):
        b, i = divmod(row, nq)
        rows = masks.rows(i)
        q_tile = qf[b, :, rows]
        acc = torch.zeros(H, rows.numel(), D, device=q.device)
        m = torch.full((H, rows.numel()), float("-inf"), device=q.device)
        l = torch.zeros(H, rows.numel(), device=q.device)
        for kind, begin, end in _groups(ptr, row):
            for j in kv_index[begin:end]:
                cols = masks.cols(j)
                scores = masks.apply(q_tile @ kf[b, :, cols].transpose(-1, -2) * scale, kind, b, rows, cols)
                m_new = torch.maximum(m, scores.amax(-1))
                m_safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
                p = torch.exp(scores - m_safe[..., None])
                alpha = torch.exp(m - m_safe)
                l = l * alpha + p.sum(-1)
                acc = acc * alpha[..., None] + p @ vf[b, :, cols]
                m = m_new
        has_key = l > 0
        out[b, :, rows] = torch.where(has_key[..., None], acc / torch.where(has_key, l, 1)[..., None], 0.0)
        lse[b, :, rows] = torch.where(has_key, m + torch.log(torch.where(has_key, l, 1)), float("-inf"))
    return out, lse


def emulate_backward(
    rules: Rules, plan: Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, d_out: torch.Tensor, scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward kernels' loop in float32: dK/dV per kv-tile over the backward schedule, dQ accumulated."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    B, H, S, D = q.shape
    kv_heads = k.shape[1]
    masks = _TileMasks(rules, plan)
    qf, kf, vf, dof = q.float(), _expand_kv(k.float(), H), _expand_kv(v.float(), H), d_out.float()
    delta = (dof * out.float()).sum(-1)  # the dO . O row sums
    dq = torch.zeros(B, H, S, D, device=q.device)
    dk = torch.zeros(B, H, S, D, device=q.device)
    dv = torch.zeros(B, H, S, D, device=q.device)
    ptr, q_index = plan.bwd_ptr.tolist(), plan.bwd_q.tolist()
    nk = plan.num_kv_tiles
    for column in range(B * nk):
        b, j = divmod(column, nk)
        cols = masks.cols(j)
        k_tile, v_tile = kf[b, :, cols], vf[b, :, cols]
        for kind, begin, end in _groups(ptr, column):
            for i in q_index[begin:end]:
                rows = masks.rows(i)
                row_lse = lse[b, :, rows].float()
                scores = masks.apply(qf[b, :, rows] @ k_tile.transpose(-1, -2) * scale, kind, b, rows, cols)
                finite = torch.isfinite(row_lse)
                p = torch.exp(scores - torch.where(finite, row_lse, 0.0)[..., None])
                p = torch.where(finite[..., None], p, 0.0)
                dv[b, :, cols] += p.transpose(-1, -2) @ dof[b, :, rows]
                dp = dof[b, :, rows] @ v_tile.transpose(-1, -2)
                ds = p * (dp - delta[b, :, rows][..., None])
                dk[b, :, cols] += ds.transpose(-1, -2) @ qf[b, :, rows] * scale
                dq[b, :, rows] += ds @ k_tile * scale
    group = H // kv_heads
    dk = dk.view(B, kv_heads, group, S, D).sum(2)
    dv = dv.view(B, kv_heads, group, S, D).sum(2)
    return dq, dk, dv


def tile_kinds_from_mask(mask: torch.Tensor, block_m: int, block_n: int) -> torch.Tensor:
    """Tile kinds read off a dense [S, S] mask, tile by tile: the definition the planner must match."""
    S = mask.shape[-1]
    nq, nk = -(-S // block_m), -(-S // block_n)
    kinds = torch.zeros(nq, nk, dtype=torch.int8)
    positions = torch.arange(S)
    for i in range(nq):
        rows = positions[i * block_m : (i + 1) * block_m]
        for j in range(nk):
            cols = positions[j * block_n : (j + 1) * block_n]
            tile = mask[rows[0] : rows[-1] + 1, cols[0] : cols[-1] + 1]
            if not tile.any():
                continue
            if tile.all():
                kinds[i, j] = FULL
            elif torch.equal(tile, cols[None, :] <= rows[:, None]):
                kinds[i, j] = CAUSAL
            else:
                kinds[i, j] = PARTIAL
    return kinds
