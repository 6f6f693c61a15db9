"""Merging softmax results over disjoint key sets by their log-sum-exp.

A rank's queries meet their keys piece by piece, so each block of queries holds a running (out, lse) and every
rectangle's (part_out, part_lse) is folded into it:

    total = logaddexp(lse, part_lse),  out = out * exp(lse - total) + part_out * exp(part_lse - total)

Rows without keys in either side stay out 0, lse -inf (no NaN). `merge` is the differentiable out-of-place form;
`merge_into` writes into the accumulators. On CUDA with Triton, `merge_into` is one kernel reading each row's two
LSEs once and each element of out and part_out once: the PyTorch form is five small LSE kernels and two passes
over out whose per-row weights broadcast over the head dim, which PyTorch runs as generic strided loops (on two
H100s they were the largest non-attention kernel of a context-parallel step, 14 of 270 ms).
"""

from __future__ import annotations

import torch

try:  # Triton is optional: without it merge_into runs its PyTorch form
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None

ROWS_PER_PROGRAM = 32  # rows of [rows, D] one program merges: 16 KiB of fp32 at D=128


def _weights(lse: torch.Tensor, part_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    total = torch.logaddexp(lse, part_lse)
    finite = torch.where(torch.isfinite(total), total, torch.zeros_like(total))
    return torch.exp(lse - finite), torch.exp(part_lse - finite), total


def merge(out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax results over two disjoint key sets merged into the result over their union (rows without keys in
    either: out 0, lse -inf, no NaN). Differentiable; out [..., rows, D], lse [..., rows]."""
    keep, take, total = _weights(lse, part_lse)
    return out * keep[..., None] + part_out * take[..., None], total


def fused_merge_supported(out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor,
                          part_lse: torch.Tensor) -> bool:
    """Whether `merge_into` runs the fused kernel for these tensors: CUDA, Triton, float32 accumulators, 4-d
    [B, H, rows, D] views whose head dim is contiguous, part_out of a float dtype Triton reads."""
    return (triton is not None and out.is_cuda and out.dtype == torch.float32 and lse.dtype == torch.float32
            and out.dim() == 4 and part_out.shape == out.shape and lse.shape == out.shape[:3]
            and part_lse.shape == lse.shape and out.stride(3) == 1 and part_out.stride(3) == 1
            and part_out.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and part_lse.dtype in (torch.float32, torch.bfloat16, torch.float16))


def merge_into(out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor) -> None:
    """`merge` written into `out` and `lse` (the accumulators, or views of them); part_out may be of a narrower
    dtype (widened as it is read). One fused kernel where `fused_merge_supported`, else two in-place passes over
    `out` with no output-sized temporary."""
    if fused_merge_supported(out, lse, part_out, part_lse):
        _fused_merge(out, lse, part_out, part_lse)
        return
    keep, take, total = _weights(lse, part_lse.to(lse.dtype))
    out.mul_(keep[..., None]).addcmul_(part_out, take[..., None])
    lse.copy_(total)


def _fused_merge(out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor) -> None:
    B, H, rows, D = out.shape
    if out.numel() == 0:
        return
    grid = (triton.cdiv(rows, ROWS_PER_PROGRAM), B * H)
    with torch.cuda.device(out.device):
        _merge_kernel[grid](out, lse, part_out, part_lse, H, rows, *out.stride()[:3], *lse.stride(),
                            *part_out.stride()[:3], *part_lse.stride(), D=D, D_BLOCK=triton.next_power_of_2(D),
                            ROWS=ROWS_PER_PROGRAM, num_warps=4)


if triton is not None:

    @triton.jit
    def _merge_kernel(out, lse, part, part_lse, H, rows,
                      out_b, out_h, out_r, lse_b, lse_h, lse_r, part_b, part_h, part_r, plse_b, plse_h, plse_r,
                      D: tl.constexpr, D_BLOCK: tl.constexpr, ROWS: tl.constexpr):
        """Program (i, b*H + h): rows [i*ROWS, (i+1)*ROWS) of head h of batch b."""
        bh = tl.program_id(1)
        b = (bh // H).to(tl.int64)
        h = (bh % H).to(tl.int64)
        r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        live = r < rows
        r = r.to(tl.int64)
        lse_at = lse + b * lse_b + h * lse_h + r * lse_r
        a = tl.load(lse_at, mask=live, other=float("-inf"))
        c = tl.load(part_lse + b * plse_b + h * plse_h + r * plse_r, mask=live, other=float("-inf")).to(tl.float32)
        # logaddexp with both sides -inf giving -inf and weights 0 (a row no key has reached yet)
        m = tl.maximum(a, c)
        m = tl.where(m == float("-inf"), 0.0, m)
        keep = tl.exp(a - m)
        take = tl.exp(c - m)
        total = keep + take
        inverse = tl.where(total > 0, 1.0 / total, 0.0)
        keep = keep * inverse
        take = take * inverse
        d = tl.arange(0, D_BLOCK)
        inside = live[:, None] & (d < D)[None, :]
        out_at = out + b * out_b + h * out_h + r[:, None] * out_r + d[None, :]
        o = tl.load(out_at, mask=inside, other=0.0)
        p = tl.load(part + b * part_b + h * part_h + r[:, None] * part_r + d[None, :], mask=inside,
                    other=0.0).to(tl.float32)
        tl.store(out_at, o * keep[:, None] + p * take[:, None], mask=inside)
        tl.store(lse_at, m + tl.log(total), mask=live)


__all__ = ["fused_merge_supported", "merge", "merge_into"]
