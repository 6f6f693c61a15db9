"""Merging partial softmax results by log-sum-exp: `merge_into` (the fused Triton kernel on CUDA, two in-place passes
elsewhere) against the out-of-place float64 `merge`, on the views the distributed forward merges into."""

from __future__ import annotations

import pytest
import torch

from omnigen.distributed.lse_merge import fused_merge_supported, merge, merge_into


def _case(device: str, head_dim: int, part_dtype: torch.dtype, seed: int):
    """A heads-inner fp32 accumulator of 300 rows (the kernels' output layout) with rows no key has reached yet,
    and a part for rows 40..290 with rows of its own without keys; one row has none on either side."""
    g = torch.Generator(device=device).manual_seed(seed)
    B, H, S = 2, 3, 300
    out = torch.randn(B, S, H, head_dim, generator=g, device=device).transpose(1, 2)
    lse = torch.randn(B, H, S, generator=g, device=device) * 4
    out[0, 1, 50:70] = 0
    lse[0, 1, 50:70] = float("-inf")
    rows = slice(40, 290)
    part = torch.randn(B, S, H, head_dim, generator=g, device=device).transpose(1, 2)[:, :, rows].to(part_dtype)
    part_lse = torch.randn(B, H, 250, generator=g, device=device) * 4
    part_lse[:, :, 15] = float("-inf")  # row 55: -inf on both sides for (0, 1)
    part_lse[1, 2, 100:] = float("-inf")
    part[:, :, 15] = 0
    part[1, 2, 100:] = 0
    return out, lse, rows, part, part_lse


def _check(device: str, head_dim: int, part_dtype: torch.dtype, seed: int) -> None:
    out, lse, rows, part, part_lse = _case(device, head_dim, part_dtype, seed)
    ref_out, ref_lse = merge(out[:, :, rows].double(), lse[:, :, rows].double(), part.double(), part_lse.double())
    before_out, before_lse = out.clone(), lse.clone()
    merge_into(out[:, :, rows], lse[:, :, rows], part, part_lse)
    torch.testing.assert_close(out[:, :, rows].double(), ref_out, rtol=1e-5, atol=1e-5)
    assert torch.equal(torch.isinf(lse[:, :, rows]), torch.isinf(ref_lse))
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[:, :, rows][finite].double(), ref_lse[finite], rtol=1e-5, atol=1e-5)
    assert not torch.isnan(out).any()
    assert (out[0, 1, 55] == 0).all()  # no keys on either side
    for outside in (slice(0, 40), slice(290, 300)):  # rows of the accumulator the merge must not touch
        assert torch.equal(out[:, :, outside], before_out[:, :, outside])
        assert torch.equal(lse[:, :, outside], before_lse[:, :, outside])


@pytest.mark.parametrize("part_dtype", [torch.float32, torch.float64])
def test_merge_into_matches_merge_on_cpu(part_dtype):
    _check("cpu", 64, part_dtype, seed=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("part_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fused_merge_matches_merge(head_dim, part_dtype):
    out, lse, rows, part, part_lse = _case("cuda", head_dim, part_dtype, seed=1)
    assert fused_merge_supported(out[:, :, rows], lse[:, :, rows], part, part_lse)
    _check("cuda", head_dim, part_dtype, seed=head_dim)
