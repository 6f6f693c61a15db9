"""Token rows gathered by a permutation on a GPU, one Triton program per output token (aiming at the copy rate).

`gather_rows(y, index)` is `take_tokens`' gather (plan/reorder.py) of y [B, S, D] or [B, S, H, D] along dim 1 by an
index [S] (every batch element) or [B, S]. PyTorch's own gathers ran at half the copy rate on an H100 at B = 4:
`index_select` over dim 1 of a strided [B, S, H, D] view and advanced indexing both took 1.77 ms for the 8 gathers
of a reordered call at 4 x 16 x 8192 x 128 (0.83 ms at B = 1), and `index_select` over rows of D elements 2.80 ms
(RESULTS.md, fifteenth session). Here a program reads one source token's H x D values (each head's D contiguous:
16-byte loads) and writes them as one contiguous row of the output, [B, S, H, D] (the kernels' heads-inner layout).

Where it is used is what the H100 measured (RESULTS.md, sixteenth session): per-head tensors [B, S, H, D] with B > 1,
where the 8 gathers of a reordered call at 4 x 16 x 8192 x 128 went from 1.73-1.80 ms to 0.82-0.87 ms. At B = 1
`index_select` over the sequence is as fast (0.83-0.84 against 0.85-0.87 ms), and a [B, S, d_model] activation was
slower this way (its permutation fwd+bwd 0.58-0.68 against 0.71-0.88 ms): both keep PyTorch's gathers.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only torch: the callers' PyTorch gathers
    triton = None

# Elements a program moves per step of its loop over heads (H x D tiles of at most this many).
TILE_ELEMENTS = 4096
# The switch `scripts/bench_reorder.py --pytorch-gathers` turns off, to time PyTorch's gathers against this one.
ENABLED = True


def supported(y: torch.Tensor, index: torch.Tensor) -> bool:
    """Whether the gathers use `gather_rows` for these: when ENABLED, per-head CUDA tensors [B, S, H, D] with B > 1
    and a contiguous last dim, eagerly (compiled, Inductor makes its own gather). `gather_rows` itself also takes
    [B, S, D] and B = 1; the module docstring says why the gathers leave those to PyTorch."""
    return (ENABLED and triton is not None and y.is_cuda and index.device == y.device and y.dim() == 4
            and y.shape[0] > 1 and y.stride(-1) == 1 and index.dim() in (1, 2) and index.shape[-1] == y.shape[1]
            and not torch.compiler.is_compiling())


def gather_rows(y: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """out [B, S, ...] (contiguous, a new tensor) with out[b, s] = y[b, index[s]] (index [S]) or y[b, index[b, s]]
    (index [B, S]). Needs CUDA tensors [B, S, D] or [B, S, H, D] with a contiguous last dim (`supported` says where
    the gathers choose it)."""
    heads = y.dim() == 4
    B, S, D = y.shape[0], y.shape[1], y.shape[-1]
    H = y.shape[2] if heads else 1
    out = torch.empty((B, S, H, D) if heads else (B, S, D), dtype=y.dtype, device=y.device)
    if out.numel() == 0:
        return out
    block_d = triton.next_power_of_2(D)
    block_h = max(1, min(triton.next_power_of_2(H), TILE_ELEMENTS // block_d))
    head_stride = y.stride(2) if heads else 0
    _gather_rows_kernel[(B * S,)](
        y, out, index.contiguous(), S, H, D, y.stride(0), y.stride(1), head_stride, out.stride(0), out.stride(1),
        D if heads else 0, 0 if index.dim() == 1 else S, BLOCK_H=block_h, BLOCK_D=block_d,
        HEAD_STEPS=triton.cdiv(H, block_h), num_warps=4)
    return out


if triton is not None:

    @triton.jit
    def _gather_rows_kernel(src, dst, index, S, H, D, src_b, src_s, src_h, dst_b, dst_s, dst_h, index_b,
                            BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_STEPS: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)  # the output row (b, s)
        b = token // S
        s = token % S
        source = tl.load(index + b * index_b + s).to(tl.int64)
        heads = tl.arange(0, BLOCK_H)[:, None]
        cols = tl.arange(0, BLOCK_D)[None, :]
        src_row = src + b * src_b + source * src_s
        dst_row = dst + b * dst_b + s * dst_s
        for step in tl.static_range(HEAD_STEPS):
            h = step * BLOCK_H + heads
            keep = (h < H) & (cols < D)
            values = tl.load(src_row + h * src_h + cols, mask=keep)
            tl.store(dst_row + h * dst_h + cols, values, mask=keep)
