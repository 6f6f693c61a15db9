"""Masks made from data (`mask_from_dense`, `mask_from_mod`, `mask_from_intervals`) through the kernels on a GPU:
issue 29's catalogue (omnigen.mask_catalogue, the nine masks its acceptance names), each made from its mask_mod, its
dense mask and (where FlashMask can say it) its column intervals, forward and backward in bf16 against a float64
reference on the dense mask; the inputs give identical plans and identical forward outputs. Partial tiles come from
the mask's bits only (plan/ruleless.py); where a kernel cannot read them (off Hopper) the op must refuse.

Cost: two kernel modules per head dim at most (the untuned forward and backward configs; one module serves every
mask made from data, whatever its length), so the whole file builds a handful of modules and runs a few seconds of
kernels; the float64 references dominate the rest.

    PYTHONPATH=. OMNIGEN_CACHE_DIR=/tmp/og python3 -m pytest -q -m gpu tests/test_mask_makers_gpu.py
"""

from __future__ import annotations

import pytest
import torch

import omnigen
from omnigen.mask_catalogue import NAMES, catalogue_mask
from omnigen.reference import attention_reference, attention_reference_grads

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

B = 2
# (heads of q, heads of k/v, S): MHA at a length of whole 128-token tiles, GQA 8/2 at one that ends in a tail tile
# (1000 = 7 * 128 + 104), so each head dim runs both and the tail rows and columns of partial tiles are exercised.
SHAPES = {"mha_s2048": (4, 4, 2048), "gqa8x2_s1000": (8, 2, 1000)}
DIMS = (64, 128)


def _hopper() -> bool:
    return torch.cuda.get_device_capability()[0] == 9


def _sources(made) -> tuple[str, ...]:
    """The inputs the catalogue has for this mask (intervals only where FlashMask's two intervals can say it)."""
    return ("mod", "dense", "intervals") if made.intervals is not None else ("mod", "dense")


def _inputs(Hq: int, Hkv: int, S: int, D: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, Hq, S, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(B, Hkv, S, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    d_out = torch.randn(B, Hq, S, D, device="cuda", dtype=torch.bfloat16, generator=g)
    return q, k, v, d_out


def _run(mask, q, k, v, d_out) -> tuple[torch.Tensor, ...]:
    """(out, lse, dq, dk, dv) of one call through omnigen.attention."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out, lse = omnigen.attention(q, k, v, mask, return_lse=True)
    return (out, lse, *torch.autograd.grad(out, (q, k, v), d_out))


def _assert_grad_close(got: torch.Tensor, want: torch.Tensor, what: str, rel: float) -> None:
    """bf16 keeps 8 bits and the backward rounds P and dS to bf16 before its second GEMMs, so an element's error
    follows the tensor's scale, not the element's: `rel` of the largest magnitude absolute, `rel` relative."""
    scale = float(want.abs().max().clamp(min=1e-3))
    torch.testing.assert_close(got.double(), want.double(), atol=rel * scale, rtol=rel, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("D", DIMS)
@pytest.mark.parametrize("name", NAMES)
def test_catalogue_masks_match_the_dense_reference_from_every_input(name, D, shape):
    if not _hopper():
        pytest.skip("masks made from data run on the sm90 family (Hopper)")
    Hq, Hkv, S = SHAPES[shape]
    made = catalogue_mask(name, B, S, device="cuda", seed=D)
    dense = made.dense()
    masks = {source: made.mask(source, head_dim=D, dtype=torch.bfloat16) for source in _sources(made)}
    # identical plans: the same schedules and the same partial tiles' bits, whichever input made the mask
    for source, mask in masks.items():
        assert mask.tiles == masks["dense"].tiles, source
        for got, want in zip(mask.schedules, masks["dense"].schedules):
            assert torch.equal(got, want), source

    q, k, v, d_out = _inputs(Hq, Hkv, S, D, seed=len(name))
    want, want_lse = attention_reference(q, k, v, dense)
    want_grads = attention_reference_grads(q, k, v, dense, d_out)
    results = {source: _run(mask, q, k, v, d_out) for source, mask in masks.items()}

    out, lse, *grads = results["dense"]
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)
    finite = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse.double()[finite], want_lse[finite], atol=1e-3, rtol=1e-3)
    for label, got, expected in zip("qkv", grads, want_grads):
        _assert_grad_close(got, expected, f"d{label}", 5e-2)
    # rows with no allowed key (qk_sparse's dropped queries, packed_alpaca's padding): zeros, -inf, no gradient
    empty = (~dense.any(-1))[:, None].expand(B, Hq, S)
    assert bool(empty.any()) == (name in ("qk_sparse", "packed_alpaca"))
    assert not out[empty].any() and torch.isneginf(lse[empty]).all() and not grads[0][empty].any()

    for source, (o, l, *g) in results.items():
        assert torch.equal(o, out) and torch.equal(l, lse), f"{source}: the forward differs from the dense mask's"
        for label, got, expected in zip("qkv", g, grads):
            # dQ is accumulated with atomics, in whatever order the blocks finish: a bf16 unit apart at most
            _assert_grad_close(got, expected, f"{source} d{label}", 2.0**-7)


def test_masks_from_data_are_refused_off_hopper():
    """A kernel that cannot read partial tiles' bits (the sm80 family) must refuse a mask made from data, saying
    so, never run it with the all-pad stand-in rules (rows of zeros on its partial tiles)."""
    if _hopper():
        pytest.skip("Hopper runs masks made from data (the test above)")
    made = catalogue_mask("random_eviction", 1, 512, device="cuda")
    mask = made.mask("mod", head_dim=64, dtype=torch.bfloat16)
    q = torch.randn(1, 2, 512, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="made from data.*Hopper"):
        omnigen.attention(q, q, q, mask)
