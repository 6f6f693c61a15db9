"""The FP8 forward (sm90, e4m3 q/k/v, bf16 out) against float64, on a Hopper GPU (skipped elsewhere).

The reference is float64 attention of the dequantised inputs (x8 * descale), so what is measured is the kernel's
own error: P rounded to e4m3 before P V (3 mantissa bits: up to 1/16 relative per probability) and bf16 output. The
bound below is what that rounding allows, with a margin; a wrong fragment layout or key permutation gives errors the
size of the output itself.

    PYTHONPATH=. OMNIGEN_CACHE_DIR=/tmp/og python3 -m pytest -q -m gpu tests/test_fp8_gpu.py
"""

from __future__ import annotations

import pytest
import torch

import omnigen
from omnigen.jit.toolchain import visible_gpu_arch
from omnigen.reference import attention_reference

from kernel_cases import TRANSFUSION

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or visible_gpu_arch() != "sm_90a",
                       reason="the FP8 forward needs a Hopper GPU (sm_90a)"),
]

CAUSAL_DOCUMENTS = omnigen.Rules(name="causal_documents_fp8", modalities={"text": "causal"}, documents="isolated")
E4M3_MAX = 448.0


def quantised(t: torch.Tensor) -> tuple[torch.Tensor, float]:
    """(t8, descale): per-tensor e4m3 with the largest magnitude at 448."""
    descale = float(t.abs().amax()) / E4M3_MAX
    return (t / descale).to(torch.float8_e4m3fn), descale


def inputs(B: int, Hq: int, Hkv: int, S: int, seed: int, spread: float = 1.0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(B, h, S, 128, device="cuda", generator=gen) * spread for h in (Hq, Hkv, Hkv))
    (q8, dq), (k8, dk), (v8, dv) = (quantised(t) for t in (q, k, v))
    return (q8, k8, v8), (dq, dk, dv)


def relative_rms(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())


CASES = [
    # (rules, layouts, heads_q, heads_kv): ragged lengths (a last key group of the permuted V^T cut short), GQA,
    # documents, images (full and partial tiles), several q-tiles per sequence
    (TRANSFUSION, ["text:37 image:256 text:101 image:256 text:50 image:300",
                   "text:500 image:300@1 text:200@1"], 4, 2),
    (CAUSAL_DOCUMENTS, ["text:700 text:300@1", "text:1000"], 2, 2),
    (TRANSFUSION, ["text:5 image:12"], 2, 1),
    (TRANSFUSION, ["text:1500 image:1024 text:200 image:1024 text:348"], 2, 2),
]


@pytest.mark.parametrize("rules,layouts,heads_q,heads_kv", CASES)
def test_the_fp8_forward_matches_float64_of_its_dequantised_inputs(rules, layouts, heads_q, heads_kv):
    layout = omnigen.Layout.batch([omnigen.Layout.parse(text) for text in layouts])
    B, S = layout.batch_size, layout.seq_len
    (q8, k8, v8), descale = inputs(B, heads_q, heads_kv, S, seed=S)
    with torch.no_grad():
        out, lse = omnigen.attention(q8, k8, v8, layout, rules, descale=descale, return_lse=True)
    assert out.dtype == torch.bfloat16 and out.shape == (B, heads_q, S, 128) and lse.dtype == torch.float32
    dq, dk, dv = descale
    ref, ref_lse = attention_reference(q8.double() * dq, k8.double() * dk, v8.double() * dv, layout, rules)
    assert torch.isfinite(out).all()
    error = relative_rms(out, ref)
    worst = float((out.double() - ref).abs().max() / ref.abs().max())
    assert error < 0.04 and worst < 0.12, (error, worst)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    assert float((lse.double() - ref_lse)[finite].abs().max()) < 2e-3


def test_the_fp8_forward_is_as_close_as_bf16_rounding_of_p_allows():
    """The same inputs through the bf16 kernel (its P rounded to bf16, 8 mantissa bits) err about 16x less: the
    FP8 kernel's error is P's e4m3 rounding and nothing else (a fault would not scale with mantissa bits)."""
    layout = omnigen.Layout.parse("text:900 image:256 text:300 image:592")
    (q8, k8, v8), (dq, dk, dv) = inputs(1, 4, 4, layout.seq_len, seed=7)
    q, k, v = (t.to(torch.bfloat16) * d for t, d in ((q8, dq), (k8, dk), (v8, dv)))
    with torch.no_grad():
        out8 = omnigen.attention(q8, k8, v8, layout, TRANSFUSION, descale=(dq, dk, dv))
        out16 = omnigen.attention(q, k, v, layout, TRANSFUSION)
    ref, _ = attention_reference(q.double(), k.double(), v.double(), layout, TRANSFUSION)
    e8, e16 = relative_rms(out8, ref), relative_rms(out16, ref)
    assert e16 < e8 < 0.04, (e8, e16)


def test_the_fp8_forward_takes_a_mask_made_once_and_a_mask_from_a_mod():
    """A mask from omnigen.mask and one from a mask_mod (bits only), both planned for the FP8 kernel's tile (dtype=),
    give the same out as a plain layout; a mask planned for bf16's tiles only is refused with the way to make it."""
    S = 1280
    layout = omnigen.Layout.parse(f"text:{S}")
    (q8, k8, v8), descale = inputs(2, 2, 2, S, seed=3)
    mask = omnigen.mask(CAUSAL_DOCUMENTS, layout, "cuda", batch=2, head_dim=128, dtype=torch.float8_e4m3fn)
    from_mod = omnigen.mask_from_mod(lambda b, h, q, kv: kv <= q, 2, S, dtype=torch.float8_e4m3fn)
    bf16_only = omnigen.mask_from_mod(lambda b, h, q, kv: kv <= q, 2, S)
    with torch.no_grad(), pytest.raises(ValueError, match=r"no plan for 128x192 tiles.*mask_from_mod.*dtype="):
        omnigen.attention(q8, k8, v8, bf16_only, descale=descale)
    with torch.no_grad():
        plain = omnigen.attention(q8, k8, v8, layout, CAUSAL_DOCUMENTS, descale=descale)
        made = omnigen.attention(q8, k8, v8, mask, descale=descale)
        modded = omnigen.attention(q8, k8, v8, from_mod, descale=descale)
    assert torch.equal(plain, made)
    assert torch.equal(plain, modded)


def test_the_fp8_forward_refuses_a_gradient():
    (q8, k8, v8), descale = inputs(1, 2, 2, 256, seed=1)
    q8.requires_grad_()
    with pytest.raises(ValueError, match="no backward"):
        omnigen.attention(q8, k8, v8, "text:256", TRANSFUSION, descale=descale)


def test_the_triton_copy_of_v_transposed_equals_torchs():
    from omnigen.op.fp8 import transpose_values, values_transposed

    gen = torch.Generator(device="cuda").manual_seed(5)
    v = torch.randn(2, 40, 3, 128, device="cuda", generator=gen).to(torch.float8_e4m3fn).transpose(1, 2)  # [B, S, H, D]
    for view in (v, v.contiguous(), v[:, :, :37]):
        assert torch.equal(transpose_values(view).view(torch.uint8), values_transposed(view).view(torch.uint8))


def test_the_fp8_grid_of_tiles_gives_the_persistent_grids_output():
    """One CTA per work tile (persistent=False: ping-pong's turns taken per tile, not per CTA) computes every tile
    exactly as the persistent grid does."""
    from omnigen.jit import cache
    from omnigen.op.kernel import Kernel

    from kernel_cases import with_options

    layout = omnigen.Layout.parse("text:900 image:256 text:300 image:592")
    (q8, k8, v8), descale = inputs(2, 4, 2, layout.seq_len, seed=11)
    persistent = omnigen.build(TRANSFUSION, 128, torch.float8_e4m3fn)
    config = with_options(persistent.config, persistent=False)
    grid = Kernel(TRANSFUSION, config, cache.get_module(TRANSFUSION, config))
    with torch.no_grad():
        expected = persistent(q8, k8, v8, layout, descale=descale)
        assert torch.equal(grid(q8, k8, v8, layout, descale=descale), expected)


@pytest.mark.parametrize("block_n,stages", [(64, 4), (128, 2), (192, 2)])
def test_the_fp8_forward_at_every_kv_tile(block_n, stages):
    """block_n 64 and 192 read V^T in boxes of 64 keys (the 64-byte swizzle, in TMA and in P V's descriptors), 128
    in one box of 128 (the 128-byte swizzle): the same error against float64 on ragged lengths and GQA."""
    layout = omnigen.Layout.batch([omnigen.Layout.parse("text:37 image:256 text:101 image:256 text:50 image:300"),
                                   omnigen.Layout.parse("text:500 image:300@1 text:200@1")])
    (q8, k8, v8), descale = inputs(2, 4, 2, layout.seq_len, seed=block_n)
    kernel = omnigen.build(TRANSFUSION, 128, torch.float8_e4m3fn, tile=omnigen.TileConfig(128, block_n, 12, stages))
    with torch.no_grad():
        out = kernel(q8, k8, v8, layout, descale=descale)
    dq, dk, dv = descale
    ref, _ = attention_reference(q8.double() * dq, k8.double() * dk, v8.double() * dv, layout, TRANSFUSION)
    assert relative_rms(out, ref) < 0.04 and float((out.double() - ref).abs().max() / ref.abs().max()) < 0.12


def test_the_fp8_forward_stores_o_by_tma_with_the_stores_bits():
    """FP8's O (bf16) staged and stored by TMA (the default, output_by_tma): the stores' output, bit for bit."""
    from omnigen.jit import cache
    from omnigen.op.kernel import Kernel

    from kernel_cases import with_options

    layout = omnigen.Layout.batch([omnigen.Layout.parse("text:37 image:256 text:101 image:256 text:50 image:300"),
                                   omnigen.Layout.parse("text:500 image:300@1 text:200@1")])
    (q8, k8, v8), descale = inputs(2, 4, 2, layout.seq_len, seed=5)
    default = omnigen.build(TRANSFUSION, 128, torch.float8_e4m3fn)
    config = with_options(default.config, output_by_tma=0)
    kernel = Kernel(TRANSFUSION, config, cache.get_module(TRANSFUSION, config))
    with torch.no_grad():
        out = kernel(q8, k8, v8, layout, descale=descale)
        expected = default(q8, k8, v8, layout, descale=descale)
    assert not torch.isnan(out).any() and torch.equal(out, expected)


@pytest.mark.parametrize("made_beforehand", [True, False])
def test_the_fp8_forward_compiles_to_one_op_and_equals_eager(made_beforehand):
    """Under torch.compile(fullgraph=True) the FP8 call is one `omnigen::attention_fp8` node (no graph break) and gives
    eager's bits, with a mask made outside the compiled function or with a plain layout (planned while Dynamo
    traces: op/traced_layouts.py)."""
    layout = omnigen.Layout.parse("text:300 image:256 text:200")
    (q8, k8, v8), descale = inputs(2, 4, 2, layout.seq_len, seed=21)
    mask = omnigen.mask(TRANSFUSION, layout, "cuda", batch=2, head_dim=128, dtype=torch.float8_e4m3fn)
    graphs = []

    def capture(gm, _inputs):
        graphs.append(gm)
        return gm.forward

    if made_beforehand:
        def call(q, k, v):
            return omnigen.attention(q, k, v, mask, descale=descale)
    else:
        def call(q, k, v):
            return omnigen.attention(q, k, v, layout, TRANSFUSION, descale=descale)
    torch._dynamo.reset()
    with torch.no_grad():
        eager = call(q8, k8, v8)
        compiled = torch.compile(call, fullgraph=True, backend=capture)(q8, k8, v8)
        inductor = torch.compile(call, fullgraph=True)(q8, k8, v8)
    assert torch.equal(compiled, eager) and torch.equal(inductor, eager)
    nodes = [n for gm in graphs for n in gm.graph.nodes if "attention_fp8" in str(n.target)]
    assert len(nodes) == 1


def test_descales_on_the_device_match_numbers_and_never_recompile():
    """Descales given as one-element float32 tensors: the kernel reads them, so (a) out equals the numbers' call to
    float32 rounding of the factors' product, (b) torch.compile(fullgraph=True) compiles once for any values (numbers
    recompile), and (c) a captured CUDA graph replays the values the tensors hold at replay (numbers beside them
    included)."""
    layout = omnigen.Layout.parse("text:300 image:256 text:200")
    (q8, k8, v8), descale = inputs(2, 4, 2, layout.seq_len, seed=31)
    mask = omnigen.mask(TRANSFUSION, layout, "cuda", batch=2, head_dim=128, dtype=torch.float8_e4m3fn)
    factors = [torch.tensor([d], device="cuda") for d in descale]
    with torch.no_grad():
        numbers = omnigen.attention(q8, k8, v8, mask, descale=descale)
        tensors = omnigen.attention(q8, k8, v8, mask, descale=tuple(factors))
        assert float((tensors.float() - numbers.float()).abs().max()) <= 1e-2 * float(numbers.float().abs().max())
        # Twice the values: the scores double (a different softmax), O doubles with dv.
        doubled = [2 * d for d in descale]
        expected = omnigen.attention(q8, k8, v8, mask, descale=tuple(doubled))

        torch._dynamo.reset()
        frames = []

        def count(gm, _inputs):
            frames.append(gm)
            return gm.forward

        compiled = torch.compile(lambda q, k, v, dq, dk, dv: omnigen.attention(q, k, v, mask, descale=(dq, dk, dv)),
                                 fullgraph=True, backend=count)
        first = compiled(q8, k8, v8, *factors)
        second = compiled(q8, k8, v8, *(f * 2 for f in factors))
        assert len(frames) == 1, f"{len(frames)} compilations for two descale values"
        assert torch.equal(first, tensors)
        assert float((second.float() - expected.float()).abs().max()) <= 1e-2 * float(expected.float().abs().max())

        # Numbers beside tensors: filled into the kernel's [3] on the device (capturable), the same bits.
        mixed = (descale[0], factors[1], factors[2])
        assert torch.equal(omnigen.attention(q8, k8, v8, mask, descale=mixed), tensors)
        later = omnigen.attention(q8, k8, v8, mask, descale=(descale[0], factors[1] * 2, factors[2] * 2))
        graph = torch.cuda.CUDAGraph()
        omnigen.attention(q8, k8, v8, mask, descale=mixed)  # warm-up outside the capture
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            replayed = omnigen.attention(q8, k8, v8, mask, descale=mixed)
        factors[1].mul_(2)
        factors[2].mul_(2)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed, later)
