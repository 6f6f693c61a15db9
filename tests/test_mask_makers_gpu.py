"""Masks made from data (`mask_from_dense`, `mask_from_mod`, `mask_from_intervals`) through the kernels on a GPU:
issue 29's catalogue (omnigen.mask_catalogue, the nine masks its acceptance names), each made from its mask_mod, its
dense mask and (where FlashMask can say it) its column intervals, forward and backward in bf16 against a float64
reference on the dense mask; the inputs give identical plans and identical forward outputs. Partial tiles come from
the mask's bits only (plan/ruleless.py). Both kernel families read them: through omnigen.attention on the GPU's own
family (sm90 on Hopper, sm80 elsewhere), and the sm80 family's kernels explicitly on any GPU (an sm_80 module runs on
Hopper too), forward, atomic and deterministic backward, through kernels.launch as the op calls them.

Cost: two kernel modules per head dim at most (the untuned forward and backward configs; one module serves every
mask made from data, whatever its length), so the whole file builds a handful of modules and runs a few seconds of
kernels; the float64 references dominate the rest.

    PYTHONPATH=. OMNIGEN_CACHE_DIR=/tmp/og python3 -m pytest -q -m gpu tests/test_mask_makers_gpu.py
    PYTHONPATH=. OMNIGEN_CACHE_DIR=/tmp/og python3 -m pytest -q -m gpu tests/test_mask_makers_gpu.py -k sm80
"""

from __future__ import annotations

import pytest
import torch

import omnigen
from omnigen.jit import cache
from omnigen.kernels import launch
from omnigen.kernels.sm80.resources import default_tile
from omnigen.mask_catalogue import NAMES, catalogue_mask
from omnigen.plan.masks import PER_SHAPE, SCHEDULE_TENSORS
from omnigen.plan.ruleless import RULELESS_RULES
from omnigen.targets import CAPABILITY_ARCH, KernelConfig
from omnigen.reference import attention_reference, attention_reference_grads

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

B = 2
# (heads of q, heads of k/v, S): MHA at a length of whole 128-token tiles, GQA 8/2 at one that ends in a tail tile
# (1000 = 7 * 128 + 104), so each head dim runs both and the tail rows and columns of partial tiles are exercised.
SHAPES = {"mha_s2048": (4, 4, 2048), "gqa8x2_s1000": (8, 2, 1000)}
DIMS = (64, 128)


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


class _MaskPlan:
    """What kernels.launch reads of a plan, from a Mask's tensors for one tile shape: the plan's schedules and tables
    and the mask's partial tiles' bits for both schedules (as the op hands them to the launchers)."""

    def __init__(self, mask, block_m: int, block_n: int) -> None:
        self._plan = mask.plan(block_m, block_n)
        first = PER_SHAPE * mask.tiles.index((block_m, block_n))
        for offset, field in enumerate(SCHEDULE_TENSORS):
            if field.startswith("partial_"):
                setattr(self, field, mask.schedules[first + offset])

    def __getattr__(self, name: str):
        return getattr(self._plan, name)


@pytest.mark.parametrize("D", DIMS)
@pytest.mark.parametrize("name", NAMES)
def test_catalogue_masks_on_the_sm80_kernels(name, D):
    """The sm80 family's forward, dK/dV (atomic dQ) and deterministic dQ kernels read a mask made from data's bits
    (include/omnigen/sm80/partial_bits.cuh), on any GPU: an sm80-family module built explicitly, launched as the op does,
    against the float64 reference, from every input; GQA 8/2 at S = 1000 (tail tiles in both directions)."""
    Hq, Hkv, S = SHAPES["gqa8x2_s1000"]
    # The sm80 family built for this GPU's arch (an sm_80 cubin does not run on Hopper): on an H100, sm_90a code of
    # the sm80 templates, as omnigen.build(..., family="sm80") makes it.
    arch = CAPABILITY_ARCH[torch.cuda.get_device_capability()]
    config = KernelConfig(D, "bf16", arch, default_tile(D), kernel_family="" if arch == "sm_80" else "sm80")
    module = cache.get_module(RULELESS_RULES, config)
    assert launch.capabilities(module).partial_bits
    tile = (config.tile.block_m, config.tile.block_n)
    made = catalogue_mask(name, B, S, device="cuda", seed=D)
    dense = made.dense()
    q, k, v, d_out = _inputs(Hq, Hkv, S, D, seed=len(name) + 1)
    want, want_lse = attention_reference(q, k, v, dense)
    want_grads = attention_reference_grads(q, k, v, dense, d_out)
    scale = D ** -0.5
    empty = (~dense.any(-1))[:, None].expand(B, Hq, S)
    for source in _sources(made):
        plan = _MaskPlan(made.mask(source, tiles=[tile]), *tile)
        out, lse = launch.forward_pass(module, plan, q, k, v, scale)
        torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2, msg=lambda m: f"{source} out: {m}")
        finite = torch.isfinite(want_lse)
        assert torch.equal(torch.isfinite(lse), finite), source
        torch.testing.assert_close(lse.double()[finite], want_lse[finite], atol=1e-3, rtol=1e-3)
        assert not out[empty].any() and torch.isneginf(lse[empty]).all()
        for deterministic in (False, True):
            grads = launch.backward_pass(module, plan, q, k, v, out, lse, d_out, scale, deterministic=deterministic)
            for label, got, expected in zip("qkv", grads, want_grads):
                _assert_grad_close(got, expected, f"{source} d{label} (deterministic={deterministic})", 5e-2)
            assert not grads[0][empty].any()


def test_masks_from_data_run_on_the_gpus_own_family():
    """Off Hopper the op picks the sm80 family, which now reads a mask made from data's bits: no refusal."""
    made = catalogue_mask("random_eviction", 1, 512, device="cuda")
    mask = made.mask("mod", head_dim=64, dtype=torch.bfloat16)
    q = torch.randn(1, 2, 512, 64, device="cuda", dtype=torch.bfloat16)
    out = omnigen.attention(q, q, q, mask)
    torch.testing.assert_close(out.double(), attention_reference(q, q, q, made.dense())[0], atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("S", [8192, 32768])
@pytest.mark.parametrize("name", ["longformer", "random_eviction"])
def test_compiled_mods_are_made_in_large_slabs_and_equal_the_dense_mask(name, S):
    """A compiled mod on a GPU is evaluated a COMPILED_SLAB_ELEMENTS slab a call (8K x 4: the whole mask in one call;
    32K x 1: four), and the mask it makes is the dense mask's, schedules and partial tiles' bits alike."""
    from omnigen.plan import from_mod

    batch = 32768 // S
    made = catalogue_mask(name, batch, S, device="cuda", seed=S)
    from_data = made.mask("mod", head_dim=64, dtype=torch.bfloat16)
    dense = made.mask("dense", head_dim=64, dtype=torch.bfloat16)
    assert from_data.tiles == dense.tiles
    for got, want in zip(from_data.schedules, dense.schedules):  # the partial tiles' bits among them
        assert torch.equal(got, want)
    rows = min(S, from_mod.COMPILED_SLAB_ELEMENTS // S)
    per_batch = max(1, from_mod.COMPILED_SLAB_ELEMENTS // (rows * S))
    slab_shapes = ((min(batch, per_batch), 1, 1), (1, rows, 1), (1, 1, S))
    assert (from_mod._code_of(made.mask_mod), slab_shapes) in from_mod._COMPILED, \
        "the mod was not evaluated a whole compiled slab a call"
